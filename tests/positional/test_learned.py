import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from torchembed.positional import LearnedPositionalEmbedding


def test_state_dict_has_only_weight():
    emb = LearnedPositionalEmbedding(max_seq_len=16, dim=4)
    assert list(emb.state_dict()) == ["weight"]
    assert emb.weight.shape == (16, 4)


@settings(max_examples=20, deadline=None)
@given(seq=st.integers(1, 10), offset=st.integers(0, 6))
def test_offset_equals_slicing(seq, offset):
    emb = LearnedPositionalEmbedding(max_seq_len=16, dim=4)
    x = torch.randn(2, seq, 4)
    torch.testing.assert_close(emb(x, offset=offset), x + emb.weight[offset : offset + seq])


def test_padding_idx_gets_no_gradient():
    emb = LearnedPositionalEmbedding(max_seq_len=8, dim=4, padding_idx=0)
    assert torch.equal(emb.weight[0], torch.zeros(4))
    emb(torch.randn(2, 5, 4)).sum().backward()
    assert torch.equal(emb.weight.grad[0], torch.zeros(4))
    assert (emb.weight.grad[1:5] != 0).all() and torch.equal(emb.weight.grad[5:], torch.zeros(3, 4))


def test_dropout():
    emb = LearnedPositionalEmbedding(max_seq_len=64, dim=8, dropout=0.5).train()
    assert (emb(torch.randn(4, 64, 8)) == 0).any()


def test_gradcheck():
    emb = LearnedPositionalEmbedding(max_seq_len=6, dim=3).double()
    x = torch.randn(1, 4, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: emb(t, offset=1), (x,))


def test_from_embedding_shares_weight():
    table = torch.nn.Embedding(10, 4)
    emb = LearnedPositionalEmbedding.from_embedding(table)
    assert emb.weight is table.weight
    ids = torch.tensor([[0, 3, 9]])
    torch.testing.assert_close(emb.lookup(ids), table(ids))


def test_lookup_out_of_range():
    emb = LearnedPositionalEmbedding(max_seq_len=4, dim=2)
    with pytest.raises(ValueError, match="outside the learned table of 4"):
        emb.lookup(torch.tensor([1, 4]))
    with pytest.raises(TypeError, match="integer"):
        emb.lookup(torch.tensor([1.0]))


@pytest.mark.parametrize(
    "x, offset, match",
    [
        (torch.randn(1, 5, 4), 0, "exceeds max_seq_len=4"),
        (torch.randn(1, 2, 4), 3, "exceeds max_seq_len=4"),
        (torch.randn(1, 2, 4), -1, "non-negative"),
        (torch.randn(2, 4), 0, r"\(batch, seq_len, 4\)"),
        (torch.randn(1, 2, 5), 0, r"\(batch, seq_len, 4\)"),
    ],
)
def test_forward_errors(x, offset, match):
    with pytest.raises(ValueError, match=match):
        LearnedPositionalEmbedding(max_seq_len=4, dim=4)(x, offset=offset)


@pytest.mark.parametrize(
    "kwargs", [dict(max_seq_len=0, dim=4), dict(max_seq_len=4, dim=-1), dict(max_seq_len=4, dim=4, padding_idx=4), dict(max_seq_len=4, dim=4, dropout=-0.1)]
)
def test_constructor_errors(kwargs):
    with pytest.raises(ValueError):
        LearnedPositionalEmbedding(**kwargs)
