import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from torchembed.functional import alibi_slopes
from torchembed.positional import ALiBiEmbedding


def test_no_parameters_and_empty_state_dict():
    alibi = ALiBiEmbedding(num_heads=8)
    assert list(alibi.parameters()) == [] and alibi.state_dict() == {}


def test_slopes_8_heads():
    torch.testing.assert_close(ALiBiEmbedding(8).slopes, torch.tensor([2.0 ** -(i + 1) for i in range(8)]))


def test_bias_is_nonpositive_with_zero_diagonal_and_linear():
    alibi = ALiBiEmbedding(num_heads=12, max_seq_len=16)
    scores = torch.zeros(2, 12, 10, 10)
    bias = alibi(scores)
    assert (bias <= 0).all()
    assert (torch.diagonal(bias, dim1=-2, dim2=-1) == 0).all()
    slopes = alibi_slopes(12)
    i, j = torch.meshgrid(torch.arange(10), torch.arange(10), indexing="ij")
    expected = -slopes[:, None, None] * (i - j).abs()
    torch.testing.assert_close(bias[1], expected)


def test_seq_q_shorter_than_seq_k_uses_last_positions():
    alibi = ALiBiEmbedding(num_heads=4)
    out = alibi(torch.zeros(1, 4, 1, 6))  # one decode step after 5 cached tokens
    torch.testing.assert_close(out[0, :, 0], -alibi.slopes[:, None] * torch.arange(5, -1, -1).float())


def test_extends_past_max_seq_len():
    alibi = ALiBiEmbedding(num_heads=2, max_seq_len=4)
    out = alibi(torch.zeros(1, 2, 9, 9))
    assert out[0, 0, 8, 0].item() == pytest.approx(-0.0625 * 8)


def test_adds_to_scores_and_keeps_dtype():
    alibi = ALiBiEmbedding(num_heads=4)
    scores = torch.randn(2, 4, 5, 5, dtype=torch.bfloat16)
    out = alibi(scores)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), scores.float() + alibi.bias(5, 5), atol=3e-2, rtol=1.6e-2)


def test_gradient_passes_through():
    alibi = ALiBiEmbedding(num_heads=3)
    scores = torch.randn(1, 3, 4, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(alibi, (scores,))


@pytest.mark.parametrize(
    "scores, exc, match",
    [
        (torch.zeros(1, 3, 4, 4), ValueError, "num_heads=4"),
        (torch.zeros(4, 4, 4), ValueError, "batch, heads, seq_q, seq_k"),
        (torch.zeros(1, 4, 5, 4), ValueError, "must not exceed"),
        (torch.zeros(1, 4, 4, 4, dtype=torch.long), TypeError, "floating-point"),
    ],
)
def test_forward_errors(scores, exc, match):
    with pytest.raises(exc, match=match):
        ALiBiEmbedding(num_heads=4)(scores)


@pytest.mark.parametrize("kwargs", [dict(num_heads=0), dict(num_heads=4, max_seq_len=0)])
def test_constructor_errors(kwargs):
    with pytest.raises(ValueError):
        ALiBiEmbedding(**kwargs)


@settings(max_examples=20, deadline=None)
@given(heads=st.integers(1, 20), sq=st.integers(1, 12), extra=st.integers(0, 12))
def test_property_matches_definition(heads, sq, extra):
    sk = sq + extra
    alibi = ALiBiEmbedding(num_heads=heads, max_seq_len=8)
    out = alibi(torch.zeros(1, heads, sq, sk))
    qpos = torch.arange(sk - sq, sk)[:, None]
    expected = -alibi_slopes(heads)[:, None, None] * (qpos - torch.arange(sk)[None]).abs()
    torch.testing.assert_close(out[0], expected)
