import math

import pytest
import torch

from torchembed.positional import SinusoidalEmbedding


def test_adds_paper_formula():
    emb = SinusoidalEmbedding(dim=8)
    x = torch.zeros(1, 6, 8)
    out = emb(x)
    for pos in range(6):
        for i in range(4):
            angle = pos / 10000 ** (2 * i / 8)
            assert out[0, pos, 2 * i].item() == pytest.approx(math.sin(angle), abs=1e-6)
            assert out[0, pos, 2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-6)


def test_state_and_learned_scale():
    assert SinusoidalEmbedding(dim=8).state_dict() == {}
    emb = SinusoidalEmbedding(dim=8, learned_scale=True)
    assert [n for n, _ in emb.named_parameters()] == ["scale"]
    x = torch.randn(2, 5, 8)
    out = emb(x)
    out.sum().backward()
    assert emb.scale.grad is not None and emb.scale.grad.abs() > 0
    with torch.no_grad():
        emb.scale.fill_(0.0)
    torch.testing.assert_close(emb(x), x)


def test_dropout_applied_in_training_only():
    emb = SinusoidalEmbedding(dim=8, dropout=0.5)
    x = torch.randn(4, 32, 8)
    emb.eval()
    torch.testing.assert_close(emb(x), x + emb.pe[:32])
    emb.train()
    assert (emb(x) == 0).any()


def test_longer_than_table_and_offset():
    emb = SinusoidalEmbedding(dim=8, max_seq_len=4)
    long = SinusoidalEmbedding(dim=8, max_seq_len=64)
    x = torch.randn(1, 10, 8)
    torch.testing.assert_close(emb(x), long(x))
    torch.testing.assert_close(emb(x[:, :2], offset=5), long(x)[:, :2] - x[:, :2] + x[:, :2] + (long.pe[5:7] - long.pe[:2]))


def test_keeps_dtype():
    emb = SinusoidalEmbedding(dim=8)
    x = torch.randn(2, 3, 8, dtype=torch.bfloat16)
    assert emb(x).dtype == torch.bfloat16


@pytest.mark.parametrize(
    "kwargs, match", [(dict(dim=7), "even"), (dict(dim=8, max_seq_len=0), "max_seq_len"), (dict(dim=8, dropout=1.5), "dropout")]
)
def test_constructor_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SinusoidalEmbedding(**kwargs)


@pytest.mark.parametrize("x, match", [(torch.zeros(3, 8), "batch, seq_len, 8"), (torch.zeros(1, 3, 6), "batch, seq_len, 8")])
def test_forward_errors(x, match):
    with pytest.raises(ValueError, match=match):
        SinusoidalEmbedding(dim=8)(x)
