"""The ALiBi attention paths (CUDA prefill: bias columns + SDPA or FlexAttention; SDPA elsewhere) against float64."""

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
    monkeypatch.setattr(module, "_FUSED_DEVICES", ("cpu",))
    monkeypatch.setattr(module, "DENSE_MAX_ELEMENTS", 0)  # the fused paths at any size
    monkeypatch.setattr(module, "_compiled", lambda: (compiled, lambda *a, _compile=True, **kw: create_block_mask(*a, **kw)))
    # config.patch, not monkeypatch: on torch 2.8 monkeypatch's undo deleted the option
    with torch._dynamo.config.patch(recompile_limit=2):
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


def test_bias_columns_carry_the_bias_to_float32_accuracy():
    """``scale * q_cols[i] . k_cols[j] = key_bias[j] - key_bias[i]``: the bf16 columns (3 + 2
    parts) reproduce the float32 bias difference to ~1e-6 of its size, at 16k positions."""
    from torchembed.kernels.alibi_attention import bias_columns

    h, k_len, q_len, scale = 12, 16384, 64, 80**-0.5  # non-power-of-2 heads: inexact slopes
    mask = torch.ones(2, k_len, dtype=torch.long)
    mask[1, :100] = 0
    key_bias = alibi_key_bias(alibi_slopes(h), mask)
    q_cols, k_cols = bias_columns(key_bias, q_len, scale, torch.bfloat16)
    assert q_cols.dtype == k_cols.dtype == torch.bfloat16
    assert q_cols.shape == (2, h, q_len, 8) and k_cols.shape == (2, h, k_len, 8)
    carried = scale * (q_cols.double() @ k_cols.double().transpose(-1, -2))
    kb = key_bias.double()
    truth = kb[:, :, None, :] - kb[:, :, k_len - q_len :, None]
    assert (carried - truth).abs().max() <= 1e-6 * kb.abs().max()


def _causal_case(b, h, n, d, dtype, bias_batch):
    gen = torch.Generator().manual_seed(n + h)
    q, k, v = (torch.randn(b, h, n, d, generator=gen).to(DEV, dtype) for _ in range(3))
    key_bias = alibi_key_bias(alibi_slopes(h, DEV), torch.ones(bias_batch, n, dtype=torch.long, device=DEV))
    keep = torch.ones(n, n, dtype=torch.bool, device=DEV).tril()[None, None].expand(b, 1, n, n).clone()  # HF's (b, 1, q, k)
    return q, k, v, key_bias, keep


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("b, h, n, d, bias_batch", [(2, 4, 64, 32, 2), (1, 5, 200, 64, 1), (3, 3, 33, 16, 1)])
def test_bias_columns_path_matches_float64(monkeypatch, dtype, tol, b, h, n, d, bias_batch):
    """Causal prefill without padding takes the bias-columns + SDPA path (forced on CPU), once per
    mask its causality is checked, and the result matches float64 (non-power-of-2 heads, a
    per-batch or shared bias, HF's materialised causal mask or none)."""
    import torchembed.kernels.alibi_attention as module

    monkeypatch.setattr(module, "_FUSED_DEVICES", (torch.device(DEV).type,))

    monkeypatch.setattr(module, "DENSE_MAX_ELEMENTS", 0)  # the fused paths at any size
    taken, flex = [], []
    original = module._sdpa_with_columns
    monkeypatch.setattr(module, "_sdpa_with_columns", lambda *a, **kw: taken.append(1) or original(*a, **kw))
    monkeypatch.setattr(module, "_flex_attention", lambda *a, **kw: flex.append(1))
    q, k, v, key_bias, keep = _causal_case(b, h, n, d, dtype, bias_batch)
    cache = MaskCache().store(keep, keep)
    truth = _truth(q, k, v, key_bias, keep, d**-0.5)
    for mask, c in ((keep, cache), (keep, cache), (None, None)):
        out = alibi_attention(q, k, v, key_bias, mask, scale=d**-0.5, cache=c)
        assert out.dtype == dtype and out.shape == q.shape
        torch.testing.assert_close(out.double(), truth, atol=tol, rtol=tol)
    assert len(taken) == 3 and not flex
    assert len([key for key in cache._memo if key[1] == "plain-causal"]) == 1


def test_padded_or_cached_prefill_does_not_take_the_bias_columns(monkeypatch):
    """Masks other than the plain causal one (left padding), a KV cache (``q < k``) and float16
    go to FlexAttention, never to the causal-only columns path."""
    import torchembed.kernels.alibi_attention as module

    monkeypatch.setattr(module, "_FUSED_DEVICES", (torch.device(DEV).type,))

    monkeypatch.setattr(module, "DENSE_MAX_ELEMENTS", 0)  # the fused paths at any size
    monkeypatch.setattr(module, "_sdpa_with_columns", lambda *a, **kw: pytest.fail("bias columns taken"))
    flex = []
    monkeypatch.setattr(module, "_flex_attention", lambda q, *a, **kw: flex.append(1) or q)
    q, k, v, key_bias, keep = _case(2, 4, 64, 64, 32, torch.float32)  # batch 0 left-padded
    alibi_attention(q, k, v, key_bias, keep, scale=0.2, cache=MaskCache().store(keep, keep))
    q, k, v, key_bias, keep = _case(2, 4, 16, 80, 32, torch.float32, pad=0)  # queries after a cache
    alibi_attention(q, k, v, key_bias, keep, scale=0.2)
    q, k, v, key_bias, keep = _causal_case(1, 2, 32, 16, torch.float16, 1)
    alibi_attention(q, k, v, key_bias, keep, scale=0.2)
    assert len(flex) == 3


def test_bias_columns_path_backward_matches_float64(monkeypatch):
    """Gradients through the columns path (training) equal float64 autograd of the definition."""
    import torchembed.kernels.alibi_attention as module

    monkeypatch.setattr(module, "_FUSED_DEVICES", (torch.device(DEV).type,))

    monkeypatch.setattr(module, "DENSE_MAX_ELEMENTS", 0)  # the fused paths at any size
    q, k, v, key_bias, keep = _causal_case(2, 3, 40, 16, torch.float32, 1)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    leaves64 = [t.double().requires_grad_() for t in (q, k, v)]
    grad = torch.randn_like(q)
    alibi_attention(*leaves, key_bias, keep, scale=0.25).backward(grad)
    _truth(*leaves64, key_bias, keep, 0.25).backward(grad.double())
    for got, want in zip(leaves, leaves64):
        torch.testing.assert_close(got.grad.double(), want.grad, atol=2e-5, rtol=2e-5)


def test_prefill_path_flex_turns_the_bias_columns_off(monkeypatch):
    """``prefill_path("flex")`` sends a plain causal prefill to FlexAttention for the block only;
    unknown paths are refused."""
    import torchembed.kernels.alibi_attention as module
    from torchembed.kernels.alibi_attention import prefill_path

    monkeypatch.setattr(module, "_FUSED_DEVICES", (torch.device(DEV).type,))

    monkeypatch.setattr(module, "DENSE_MAX_ELEMENTS", 0)  # the fused paths at any size
    taken = []
    monkeypatch.setattr(module, "_sdpa_with_columns", lambda q, *a, **kw: taken.append("columns") or q)
    monkeypatch.setattr(module, "_flex_attention", lambda q, *a, **kw: taken.append("flex") or q)
    q, k, v, key_bias, keep = _causal_case(1, 2, 32, 16, torch.float32, 1)
    with prefill_path("flex"):
        alibi_attention(q, k, v, key_bias, keep, scale=0.25)
    alibi_attention(q, k, v, key_bias, keep, scale=0.25)
    assert taken == ["flex", "columns"]
    with pytest.raises(ValueError, match="prefill path"):
        with prefill_path("cudnn"):
            pass


@pytest.mark.parametrize("where", ["none", "first-row", "middle", "last-row", "above-diagonal"])
def test_plain_causal_check_in_row_blocks(monkeypatch, where):
    """The plain-causal check compares the mask block by block (here 3 rows per block, so a
    difference in any block, the last partial one included, must be found)."""
    import torchembed.kernels.alibi_attention as module

    monkeypatch.setattr(module, "_CHECK_ELEMENTS", 3 * 20)
    monkeypatch.setattr(module, "_CACHED_CAUSAL_ELEMENTS", 0)  # (the cached comparison: the test below)
    q_len, k_len = 11, 20
    positions = torch.arange(k_len, device=DEV)
    keep = (positions[None, :] <= positions[k_len - q_len :, None])[None, None].expand(2, 1, q_len, k_len).clone()
    row, col = {"none": (None, None), "first-row": (0, 0), "middle": (5, 3), "last-row": (10, 19),
                "above-diagonal": (4, 15)}[where]
    if row is not None:
        keep[1, 0, row, col] = not keep[1, 0, row, col]
    assert module._plain_causal(keep, None) is (where == "none")
    assert module._plain_causal(None, None)


@pytest.mark.parametrize("where", ["none", "first-row", "last-row", "above-diagonal"])
def test_plain_causal_check_against_the_cached_mask(where):
    """Short masks are compared with the cached causal mask in one go."""
    import torchembed.kernels.alibi_attention as module

    q_len = k_len = 12
    keep = torch.ones(q_len, k_len, dtype=torch.bool, device=DEV).tril()[None, None].expand(3, 1, q_len, k_len).clone()
    row, col = {"none": (None, None), "first-row": (0, 0), "last-row": (11, 5), "above-diagonal": (2, 9)}[where]
    if row is not None:
        keep[2, 0, row, col] = not keep[2, 0, row, col]
    assert module._plain_causal(keep, None) is (where == "none")


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("pad", [0, 3])
def test_small_prefill_materialises_the_bias_once_per_forward(monkeypatch, dtype, tol, pad):
    """Prefills of at most ``DENSE_MAX_ELEMENTS`` bias elements (``b * h * q * k``) take SDPA with the
    bias materialised, once per forward for all layers (where the H200 measured it faster than the
    fused paths); larger ones the fused paths. Plain causal and left-padded batches match float64."""
    import torchembed.kernels.alibi_attention as module

    monkeypatch.setattr(module, "_FUSED_DEVICES", (torch.device(DEV).type,))
    built, fused = [], []
    original = module.prefill_bias
    monkeypatch.setattr(module, "prefill_bias", lambda *a: built.append(1) or original(*a))
    monkeypatch.setattr(module, "_sdpa_with_columns", lambda q, *a, **kw: fused.append("columns") or q)
    monkeypatch.setattr(module, "_flex_attention", lambda q, *a, **kw: fused.append("flex") or q)
    b, h, n, d = 2, 3, 40, 16
    q, k, v, key_bias, keep = _case(b, h, n, n, d, dtype, pad=pad)
    truth = _truth(q, k, v, key_bias, keep, d**-0.5)
    rows = keep.expand(b, h, n, n).any(-1)  # a left-padded query attends to nothing: no truth
    monkeypatch.setattr(module, "DENSE_MAX_ELEMENTS", b * h * n * n)
    cache = MaskCache().store(keep, keep)
    for _ in range(3):  # three layers of one forward
        out = alibi_attention(q, k, v, key_bias, keep, scale=d**-0.5, cache=cache)
        assert out.dtype == dtype and out.shape == q.shape
        torch.testing.assert_close(out.double()[rows], truth[rows], atol=tol, rtol=tol)
    assert len(built) == 1 and not fused
    if not pad:  # no mask at all (causal): built without a cache, on each call
        torch.testing.assert_close(alibi_attention(q, k, v, key_bias, scale=d**-0.5).double(), truth, atol=tol, rtol=tol)
    monkeypatch.setattr(module, "DENSE_MAX_ELEMENTS", b * h * n * n - 1)  # one element more: the fused paths
    alibi_attention(q, k, v, key_bias, keep, scale=d**-0.5, cache=MaskCache().store(keep, keep))
    assert fused == (["flex"] if pad else ["columns"])


def test_prefill_path_dense_materialises_at_any_size(monkeypatch):
    """``prefill_path("dense")`` takes the materialised bias whatever the size (to measure it)."""
    import torchembed.kernels.alibi_attention as module
    from torchembed.kernels.alibi_attention import prefill_path

    monkeypatch.setattr(module, "_FUSED_DEVICES", (torch.device(DEV).type,))
    monkeypatch.setattr(module, "DENSE_MAX_ELEMENTS", 0)
    monkeypatch.setattr(module, "_sdpa_with_columns", lambda *a, **kw: pytest.fail("bias columns taken"))
    q, k, v, key_bias, keep = _causal_case(1, 2, 32, 16, torch.float32, 1)
    with prefill_path("dense"):
        out = alibi_attention(q, k, v, key_bias, keep, scale=0.25)
    torch.testing.assert_close(out.double(), _truth(q, k, v, key_bias, keep, 0.25), atol=2e-5, rtol=2e-5)
