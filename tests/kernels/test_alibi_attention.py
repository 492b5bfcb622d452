"""The ALiBi attention path: FlexAttention on CUDA prefill, SDPA elsewhere, against float64."""

import pytest
import torch

from torchembed.functional.alibi import alibi_key_bias, alibi_slopes
from torchembed.kernels.alibi_attention import MaskCache, alibi_attention

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _case(b, h, q_len, k_len, d, dtype, pad=2):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, h, n, d, generator=gen).to(DEV, dtype) for n in (q_len, k_len, k_len))
    mask = torch.ones(b, k_len, dtype=torch.long, device=DEV)
    mask[0, :pad] = 0
    key_bias = alibi_key_bias(alibi_slopes(h, DEV), mask)
    positions = torch.arange(k_len, device=DEV)
    keep = (positions[None, :] <= positions[k_len - q_len :, None])[None, None] & mask.bool()[:, None, None, :]
    return q, k, v, key_bias, keep


def _truth(q, k, v, key_bias, keep, scale):
    s = (q.double() @ k.double().transpose(-1, -2)) * scale + key_bias.double()[:, :, None, :]
    return s.masked_fill(~keep, float("-inf")).softmax(-1) @ v.double()


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("q_len, k_len", [(64, 64), (1, 80), (16, 80)])
def test_matches_float64(dtype, tol, q_len, k_len):
    q, k, v, key_bias, keep = _case(2, 4, q_len, k_len, 32, dtype)
    cache = MaskCache().store(keep, keep)
    out = alibi_attention(q, k, v, key_bias, keep, scale=32**-0.5, cache=cache)
    again = alibi_attention(q, k, v, key_bias, keep, scale=32**-0.5, cache=cache)  # cached block mask
    truth = _truth(q, k, v, key_bias, keep, 32**-0.5)
    rows = keep.expand(2, 4, q_len, k_len).any(-1)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.double()[rows], truth[rows], atol=tol, rtol=tol)
    assert torch.equal(out, again)


def test_causal_default_equals_explicit_mask():
    q, k, v, key_bias, _ = _case(1, 2, 8, 8, 16, torch.float32, pad=0)
    torch.testing.assert_close(
        alibi_attention(q, k, v, key_bias, scale=0.25),
        alibi_attention(q, k, v, key_bias, torch.ones(8, 8, dtype=torch.bool, device=DEV).tril()[None, None], scale=0.25),
    )
