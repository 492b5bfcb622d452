import math

import pytest
import torch

from torchembed.functional import alibi_bias, alibi_key_bias, alibi_slopes


def test_slopes_power_of_two():
    torch.testing.assert_close(alibi_slopes(8), torch.tensor([2.0 ** -(i + 1) for i in range(8)]))


def paper_slopes(n):
    """The reference implementation's recipe (Press et al., fairseq), written independently."""

    def pow2(m):
        start = 2 ** (-(2 ** -(math.log2(m) - 3)))
        return [start * start**i for i in range(m)]

    if math.log2(n).is_integer():
        return pow2(n)
    closest = 2 ** math.floor(math.log2(n))
    return pow2(closest) + paper_slopes(2 * closest)[0::2][: n - closest]


@pytest.mark.parametrize("heads", [1, 2, 3, 5, 6, 7, 12, 16, 20, 24, 40, 71])
def test_slopes_match_paper_recipe(heads):
    torch.testing.assert_close(alibi_slopes(heads), torch.tensor(paper_slopes(heads), dtype=torch.float32))


def test_slopes_12_heads_explicit():
    expected = [2.0 ** -(i + 1) for i in range(8)] + [2.0 ** -(i + 0.5) for i in range(4)]
    torch.testing.assert_close(alibi_slopes(12), torch.tensor(expected))


@pytest.mark.parametrize("heads", [5, 12, 16])
def test_slopes_match_bloom_and_mpt(heads):
    pytest.importorskip("transformers")
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor
    from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

    bloom = build_alibi_tensor(torch.ones(1, 2), heads, torch.float32)[:, 0, 1]  # slope * position 1
    torch.testing.assert_close(alibi_slopes(heads), bloom)
    mpt = build_mpt_alibi_tensor(heads, 2)[:, 0, 0]  # slope * (1 - 2)
    torch.testing.assert_close(alibi_slopes(heads), -mpt)


@pytest.mark.parametrize("errval", [0, -1, 2.5, True])
def test_slopes_errors(errval):
    with pytest.raises(ValueError, match="positive int"):
        alibi_slopes(errval)


def test_bias_properties():
    slopes = alibi_slopes(4)
    bias = alibi_bias(slopes, 5, 9)
    assert bias.shape == (4, 5, 9)
    assert (bias <= 0).all()
    for i in range(5):
        assert (bias[:, i, 4 + i] == 0).all()  # query i is at absolute position 4 + i
    # linear in the distance with the head's slope
    torch.testing.assert_close(bias[:, 4, 0], -slopes * 8)


def test_key_bias_equals_true_bias_up_to_row_constant():
    slopes = alibi_slopes(3)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    key_bias = alibi_key_bias(slopes, mask)  # (b, h, k)
    for b in range(2):
        valid = mask[b].bool()
        n = int(valid.sum())
        true = alibi_bias(slopes, n, n)  # (h, n, n) over the real tokens
        ours = key_bias[b][:, valid]  # (h, n)
        for i in range(n):
            diff = (ours[:, : i + 1] - true[:, i, : i + 1])  # causal part of row i
            torch.testing.assert_close(diff, diff[:, :1].expand_as(diff))
    assert (key_bias[0][:, :2] == 0).all()


def test_key_bias_is_zero_at_each_rows_last_real_key():
    """Left and right padding: non-positive over real keys, 0 at the last real key and at padding,
    ``slope * (p_j - p_last)`` in between (float32, exact for integer positions)."""
    slopes = alibi_slopes(5)
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    key_bias = alibi_key_bias(slopes, mask)
    assert key_bias.dtype == torch.float32 and key_bias.shape == (3, 5, 5)
    positions = mask.cumsum(-1) - 1
    for b, last in enumerate((4, 2, 4)):
        expected = slopes[:, None] * ((positions[b] - positions[b, last]) * mask[b]).float()
        torch.testing.assert_close(key_bias[b], expected, rtol=0, atol=0)
        assert (key_bias[b][:, last] == 0).all() and (key_bias[b] <= 0).all()


@pytest.mark.parametrize("max_bias", [0, -8.0, math.nan, math.inf, True, "8"])
def test_slopes_reject_bad_max_bias(max_bias):
    with pytest.raises(ValueError, match=r"max_bias must be a finite number > 0, got"):
        alibi_slopes(8, max_bias=max_bias)
