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


def test_mask_cache_memo_is_per_source_and_dies_with_the_mask():
    keep = torch.ones(1, 1, 1, 4, dtype=torch.bool)
    cache = MaskCache().store(keep, keep)
    a, b = torch.zeros(3), torch.zeros(3)
    calls = []

    def make(x):
        return lambda: calls.append(x) or x + 1

    first = cache.memo(a, "t", make(a))
    assert cache.memo(a, "t", make(a)) is first and len(calls) == 1  # same source: cached
    cache.memo(b, "t", make(b))  # equal values, another tensor: computed again
    cache.memo(a, "other", make(a))  # another tag: computed again
    assert len(calls) == 3
    del keep  # the forward is over
    fresh = torch.ones(1, 1, 1, 4, dtype=torch.bool)
    assert cache.lookup(fresh) is None
    cache.store(fresh, fresh)
    cache.memo(a, "t", make(a))
    assert len(calls) == 4, "a new mask must not see the previous forward's entries"


def test_decode_mask_is_built_once_per_forward_and_matches_per_layer(monkeypatch):
    """At decode every layer gets the same key bias and mask: the SDPA mask is derived once
    (cached on the mask) and gives the same result as deriving it per call."""
    import torchembed.kernels.alibi_attention as module

    q, k, v, key_bias, keep = _case(2, 4, 1, 80, 32, torch.float32)
    built = []
    original = module.alibi_decode_bias
    monkeypatch.setattr(module, "alibi_decode_bias", lambda *a: built.append(1) or original(*a))
    cache = MaskCache().store(keep, keep)
    outs = [alibi_attention(q, k, v, key_bias, keep, scale=32**-0.5, cache=cache) for _ in range(3)]
    uncached = alibi_attention(q, k, v, key_bias, keep, scale=32**-0.5)
    assert len(built) == 1
    for out in outs:
        torch.testing.assert_close(out, uncached, atol=0, rtol=0)


def test_flex_path_keeps_compiling_past_dynamo_recompile_limit(monkeypatch):
    """The FlexAttention path (forced on CPU with dynamo's eager backend) matches float64 for
    several dtypes, batch sizes and lengths in one process, and keeps compiling past dynamo's
    per-function recompile limit rather than falling back to unfused flex_attention, which
    materialises the scores (seen on the GPU: a third ALiBi model ran prefill 10x slower)."""
    import torch._dynamo
    from torch._dynamo.utils import counters
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    import torchembed.kernels.alibi_attention as module

    compiled = torch.compile(flex_attention, backend="eager")
    monkeypatch.setattr(module, "_FLEX_DEVICES", ("cpu",))
    monkeypatch.setattr(module, "_compiled", lambda: (compiled, lambda *a, _compile=True, **kw: create_block_mask(*a, **kw)))
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 2)
    torch._dynamo.reset()
    def limit_hits():
        return sum(n for reason, n in counters["unimplemented"].items() if "recompile limit" in reason.lower())

    before, hits = counters["frames"]["ok"], limit_hits()
    gen = torch.Generator().manual_seed(0)
    cases = [(torch.float32, 1, 32), (torch.float64, 2, 48), (torch.bfloat16, 2, 32), (torch.float16, 1, 64)]
    for dtype, b, n in cases:  # a dtype is always a new graph: 4 graphs > the limit of 2
        q, k, v = (torch.randn(b, 2, n, 16, generator=gen).to(dtype) for _ in range(3))
        mask = torch.ones(b, n, dtype=torch.long)
        mask[0, :3] = 0
        key_bias = alibi_key_bias(alibi_slopes(2), mask)
        positions = torch.arange(n)
        keep = (positions[None, :] <= positions[:, None])[None, None] & mask.bool()[:, None, None, :]
        out = alibi_attention(q, k, v, key_bias, keep, scale=0.25, cache=MaskCache().store(keep, keep))
        truth = _truth(q, k, v, key_bias, keep, 0.25)
        tol = 2e-5 if dtype in (torch.float32, torch.float64) else 2e-2
        rows = keep.expand(b, 2, n, n).any(-1)  # padded queries attend to nothing: no truth
        torch.testing.assert_close(out.double()[rows], truth[rows], atol=tol, rtol=tol)
    assert limit_hits() == hits, "dynamo hit its recompile limit and ran flex_attention unfused"
    assert counters["frames"]["ok"] - before >= len(cases), "dynamo stopped compiling flex_attention"
    assert torch._dynamo.config.recompile_limit == 2, "the limit must be restored after each call"
