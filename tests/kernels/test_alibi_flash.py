"""The fused ALiBi attention kernel (``alibi_flash``) against a float64 oracle: forward and backward.

On CPU the kernels run under TRITON_INTERPRET=1 (this directory's conftest) with 16 x 16 tiles, so
the small shapes here still cross several query and key blocks, their diagonal and their ragged
ends. Tolerances: ``tests.helpers.TOL`` of the dtype, scaled by the largest magnitude of the
compared tensor (the kernel rounds its inputs' products, the probabilities and the result once
each, in the input dtype; the accumulation is float32).
"""

import types

import pytest
import torch

from tests.helpers import TOL
from torchembed.functional.alibi import alibi_slopes
from torchembed.kernels.attention import alibi_flash, mask_rows
from torchembed.kernels.route import flash_unsupported

pytest.importorskip("triton")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(b, h, hk, m, n, d, dtype, *, layout="bshd", seed=0, grad=True):
    """q (b, h, m, d), k, v (b, hk, n, d); ``bshd``: HF's (b, s, h, d) memory viewed as (b, h, s, d)."""
    gen = torch.Generator().manual_seed(seed)

    def make(s, heads):
        x = torch.randn(b, s, heads, d, generator=gen).to(DEV, dtype)
        x = x.transpose(1, 2) if layout == "bshd" else x.transpose(1, 2).contiguous()
        return x.detach().requires_grad_(grad)

    return make(m, h), make(n, hk), make(n, hk)


def _oracle(q, k, v, bias, keep, key_bias, scale):
    """float64 attention; ``bias`` slopes (slope * (j - i)), a key bias or None; rows that keep nothing: 0."""
    group = q.shape[1] // k.shape[1]
    qd, kd, vd = (x.detach().double().requires_grad_() for x in (q, k, v))
    m, n = q.shape[2], k.shape[2]
    s = qd @ kd.repeat_interleave(group, 1).transpose(-1, -2) * scale
    if bias is None:
        pass
    elif key_bias:
        s = s + bias.double()[:, :, None, :]
    else:
        positions = torch.arange(n, device=q.device).double()
        s = s + bias.double()[None, :, None, None] * (positions[None, :] - positions[n - m:, None])
    if keep is None:
        keep = (torch.arange(n, device=q.device)[None, :] <= torch.arange(n - m, n, device=q.device)[:, None])[None, None]
    out = s.masked_fill(~keep, float("-inf")).softmax(-1).nan_to_num(0.0) @ vd.repeat_interleave(group, 1)
    return out, (qd, kd, vd)


def _close(got, want, dtype):
    tol = TOL[dtype]
    scale = max(1.0, want.abs().max().item())
    torch.testing.assert_close(got.double(), want, atol=tol["atol"] * scale, rtol=tol["rtol"])


def _check(q, k, v, bias, *, keep=None, key_bias=False, backward=True):
    dtype, scale = q.dtype, q.shape[-1] ** -0.5
    out = alibi_flash(q, k, v, bias, scale=scale, key_bias=key_bias, keep=keep)
    truth, leaves = _oracle(q, k, v, bias, keep, key_bias, scale)
    assert out.shape == q.shape and out.dtype == dtype
    _close(out, truth.detach(), dtype)
    if backward:
        grad = torch.randn_like(out)
        out.backward(grad)
        truth.backward(grad.double())
        for got, leaf in zip((q, k, v), leaves):
            assert got.grad.shape == got.shape and torch.isfinite(got.grad).all()
            _close(got.grad, leaf.grad, dtype)
    return out


def _left_padded_keep(b, m, n, pads):
    positions = torch.arange(n, device=DEV)
    valid = positions[None, :] >= torch.tensor(pads, device=DEV)[:, None]
    causal = positions[None, :] <= positions[n - m:, None]
    return causal[None, None] & valid[:, None, None, :]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_causal_prefill_forward_and_backward(dtype):
    q, k, v = _inputs(2, 3, 3, 37, 37, 32, dtype, seed=1)  # 37: not a multiple of the tile
    _check(q, k, v, alibi_slopes(3, DEV))


@pytest.mark.parametrize("m, n", [(24, 70), (17, 17), (5, 90)])
def test_queries_at_the_last_key_positions(m, n):
    """Chunked prefill over a cache (q < k): the queries are the last ``m`` of ``n`` positions."""
    q, k, v = _inputs(1, 2, 2, m, n, 32, torch.float32, seed=m)
    _check(q, k, v, alibi_slopes(2, DEV))


@pytest.mark.parametrize("heads, kv_heads", [(4, 2), (6, 1)])
def test_grouped_and_multi_query_heads_read_each_kv_head_in_place(heads, kv_heads):
    q, k, v = _inputs(2, heads, kv_heads, 33, 40, 16, torch.float32, seed=heads)
    _check(q, k, v, alibi_slopes(heads, DEV))


@pytest.mark.parametrize("dim", [80, 64])
def test_head_dims_padded_inside(dim):
    q, k, v = _inputs(1, 2, 2, 20, 20, dim, torch.bfloat16, seed=dim, layout="bhsd")
    _check(q, k, v, alibi_slopes(2, DEV))


def test_key_bias_form_equals_slopes_form():
    """The ``(b, h, k)`` key bias ``slope * (j - (k - 1))`` gives the slopes' attention."""
    q, k, v = _inputs(2, 4, 2, 30, 30, 32, torch.float32, seed=5)
    slopes = alibi_slopes(4, DEV)
    key_bias = (slopes[None, :, None] * torch.arange(-29, 1, device=DEV).float()).expand(2, -1, -1)
    out = _check(q, k, v, key_bias, key_bias=True)
    with torch.no_grad():
        torch.testing.assert_close(out, alibi_flash(q, k, v, slopes, scale=32**-0.5), **TOL[torch.float32])


@pytest.mark.parametrize("key_bias", [False, True])
def test_left_padding_and_rows_that_keep_nothing(key_bias):
    """Left padding as HF's 4-D mask: padded query rows keep no key and give 0 (gradients 0 too)."""
    b, m, n, h = 3, 26, 26, 2
    keep = _left_padded_keep(b, m, n, [0, 5, 19])
    q, k, v = _inputs(b, h, h, m, n, 32, torch.float32, seed=7)
    slopes = alibi_slopes(h, DEV)
    bias = (slopes[None, :, None] * torch.arange(n, device=DEV).float()).expand(b, -1, -1) if key_bias else slopes
    out = _check(q, k, v, bias, keep=keep, key_bias=key_bias)
    assert torch.equal(out[2, :, :19], torch.zeros_like(out[2, :, :19]))


def test_mask_with_holes_reads_the_mask():
    """A row that skips keys inside its range (a hole) is masked exactly (the tile reads ``keep``)."""
    b, m, n, h = 2, 30, 45, 2
    keep = _left_padded_keep(b, m, n, [0, 3]).clone()
    keep[1, 0, 10:, 20:23] = False
    keep[0, 0, 4, 16] = False
    rows = mask_rows(keep)
    assert rows[1, 2, 10:].tolist() == [1] * 20 and rows[1, 2, :10].tolist() == [0] * 10
    q, k, v = _inputs(b, h, h, m, n, 32, torch.float32, seed=9)
    _check(q, k, v, alibi_slopes(h, DEV), keep=keep)


@pytest.mark.parametrize("case", ["causal", "chunked", "grouped", "padded_dim", "key_bias_padding", "holes"])
def test_tensor_descriptor_loads_compute_the_same(case, monkeypatch):
    """Keys and values read through tensor descriptors (the TMA path of Hopper GPUs; on CPU the
    interpreter models them): ragged key ends and padded head dims read as zeros, like the masked
    pointer loads."""
    import dataclasses

    from torchembed.kernels import attention_plan as flash
    from torchembed.kernels import attention_plan as kernels

    monkeypatch.setattr(kernels, "_tma_device", lambda device: True)
    shipped = kernels.settings()
    monkeypatch.setattr(kernels, "settings", lambda: dataclasses.replace(shipped, tma=True))
    flash.clear_plans()
    launched = []
    call = kernels._TmaLaunch.__call__
    monkeypatch.setattr(kernels._TmaLaunch, "__call__", lambda self, t: launched.append(1) or call(self, t))
    keep, key_bias = None, False
    if case == "causal":
        q, k, v = _inputs(2, 3, 3, 37, 37, 32, torch.bfloat16, seed=11)
    elif case == "chunked":
        q, k, v = _inputs(1, 2, 2, 24, 70, 32, torch.float32, seed=12)
    elif case == "grouped":
        q, k, v = _inputs(2, 4, 2, 33, 40, 16, torch.float32, seed=13)
    elif case == "padded_dim":
        q, k, v = _inputs(1, 2, 2, 20, 20, 80, torch.bfloat16, seed=14, layout="bhsd")
    else:
        b, m, n, h = 2, 30, 45, 2
        keep = _left_padded_keep(b, m, n, [0, 3]).clone()
        if case == "holes":
            keep[1, 0, 10:, 20:23] = False
        q, k, v = _inputs(b, h, h, m, n, 32, torch.float32, seed=15)
        key_bias = case == "key_bias_padding"
    h = q.shape[1]
    bias = alibi_slopes(h, DEV)
    if key_bias:
        bias = (bias[None, :, None] * torch.arange(k.shape[2], device=DEV).float()).expand(q.shape[0], -1, -1)
    try:
        _check(q, k, v, bias, keep=keep, key_bias=key_bias)
    finally:
        flash.clear_plans()
    assert launched  # the forward went through the descriptor launch


def test_mask_rows_summary():
    keep = torch.zeros(2, 1, 4, 9, dtype=torch.bool, device=DEV)
    keep[0, 0, 0, 2:5] = True  # a range
    keep[0, 0, 1, [1, 3]] = True  # a hole
    keep[1, 0, 3, 8] = True  # the last key only; rows 0-2 of batch 1 keep nothing
    rows = mask_rows(keep).cpu()
    assert rows.dtype == torch.int32 and rows.shape == (2, 3, 4)
    assert rows[0, :, 0].tolist() == [2, 5, 0]
    assert rows[0, :, 1].tolist() == [1, 4, 1]
    assert rows[1, :, 0].tolist() == [0, 0, 0] and rows[1, :, 3].tolist() == [8, 9, 0]


@pytest.mark.parametrize("keys, heads, kv_heads", [(200, 4, 4), (150, 8, 2), (20, 2, 1)])
def test_decode_splits_the_keys(keys, heads, kv_heads):
    """One query over a long cache: the keys are split over programs and the parts combined (150,
    200 keys); a short cache takes one program (20)."""
    q, k, v = _inputs(2, heads, kv_heads, 1, keys, 32, torch.float32, seed=keys)
    _check(q, k, v, alibi_slopes(heads, DEV))


def test_decode_split_count_follows_the_tuning():
    """At least ``least`` programs per multiprocessor, more (up to ``most``) while each part keeps
    ``decode_split_keys`` keys, never a part under two key blocks; a masked call (a static cache's
    filled part unknown on the host) goes up to ``decode_masked_programs_per_sm``; a bad tuning is refused."""
    from torchembed.kernels.attention_plan import _decode_splits
    from torchembed.kernels.settings import AlibiTuning, changed

    cpu = torch.device("cpu")  # (16 multiprocessors are assumed off CUDA)
    tuning = {"decode_programs_per_sm": (1, 2), "decode_masked_programs_per_sm": 3, "decode_split_keys": 2048}
    with changed(alibi=tuning):
        assert _decode_splits(cpu, 8, 16384, 64, False) == 4  # 16384 / 2048 = 8 parts wanted; the most: 2 x 16 / 8
        assert _decode_splits(cpu, 8, 2048, 64, False) == 2  # the least: 16 / 8
        assert _decode_splits(cpu, 1, 16384, 64, False) == 16  # the least for one program
        assert _decode_splits(cpu, 1, 65536, 64, False) == 32  # the most: 2 x 16
        assert _decode_splits(cpu, 1, 40000, 64, False) == 19  # between: 40000 // 2048
        assert _decode_splits(cpu, 1, 300, 64, False) == 3  # parts of two blocks at least
        assert _decode_splits(cpu, 64, 100, 64, False) == 1
        assert _decode_splits(cpu, 12, 65536, 64, False) == 2  # the most rounds down: 32 // 12 (no third wave of programs)
        assert _decode_splits(cpu, 24, 65536, 64, False) == 1  # already more than one program per multiprocessor
        assert _decode_splits(cpu, 2, 65536, 64, True) == 24  # masked: its own, 3 x 16 / 2
        assert _decode_splits(cpu, 8, 16384, 64, True) == 6
        assert _decode_splits(cpu, 1, 65536, 64, True) == 32  # up to 48 while parts of the cache keep 2048 keys
        assert _decode_splits(cpu, 8, 2000, 64, True) == 2  # a cache under 2048 keys: the least
    for bad in ({"decode_programs_per_sm": (2, 1)}, {"decode_programs_per_sm": (0, 1)}, {"decode_split_keys": 0},
                {"decode_masked_programs_per_sm": 0},
                {"decode_combine": (48, 32)}, {"decode_combine": (64, 0)}):
        with pytest.raises(ValueError, match="decode_"):
            AlibiTuning(**bad)


@pytest.mark.parametrize("combine", [(64, 32), (4, 16)])
def test_decode_with_many_parts_matches_the_oracle(combine):
    """The most parts the tuning allows (short parts of many splits) still combine to the reference, the combine
    taking all parts in one step or in several (4 per step) over one feature block or several (16 of 64)."""
    from torchembed.kernels.settings import changed

    with changed(alibi={"decode_programs_per_sm": (1, 4), "decode_split_keys": 16, "decode_combine": combine}):
        q, k, v = _inputs(2, 4, 2, 1, 200, 32, torch.float32, seed=5)
        _check(q, k, v, alibi_slopes(4, DEV))
        q, k, v = _inputs(1, 8, 2, 1, 300, 64, torch.float32, seed=6)
        _check(q, k, v, None)


@pytest.mark.parametrize("split_keys", [512, 32])
def test_decode_with_padding_and_a_few_queries(split_keys):
    """A masked decode in one part, and in several (parts of 32 keys at least: a masked call's split)."""
    from torchembed.kernels.settings import changed

    keep = _left_padded_keep(2, 3, 120, [0, 50])
    q, k, v = _inputs(2, 4, 2, 3, 120, 32, torch.bfloat16, seed=11)
    with changed(alibi={"decode_split_keys": split_keys}):
        _check(q, k, v, alibi_slopes(4, DEV), keep=keep)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_plain_attention_without_a_bias(dtype):
    """``bias=None``: attention with no bias (a RoPE model's decode step), through the split-key decode
    kernel (one query; a few over a padded cache) and the prefill kernel with its backward."""
    q, k, v = _inputs(2, 8, 2, 1, 150, 32, dtype, seed=21)
    _check(q, k, v, None)
    keep = _left_padded_keep(2, 3, 120, [0, 50])
    q, k, v = _inputs(2, 4, 2, 3, 120, 32, dtype, seed=22)
    _check(q, k, v, None, keep=keep)
    q, k, v = _inputs(1, 2, 1, 37, 37, 32, dtype, seed=23)
    _check(q, k, v, None)


@pytest.mark.parametrize("split_keys", [512, 32])
@pytest.mark.parametrize("key_bias", [None, False, True])
def test_decode_reads_only_the_keys_some_row_keeps(key_bias, split_keys):
    """A static cache (300 slots, the first 100 filled, padding before 20 in one sequence) whose empty
    slots and padding hold NaN: the decode kernel never reads them, in one part or in several (parts of 32 keys
    at least, most of them over empty slots)."""
    from torchembed.kernels.settings import changed

    b, h, hk, n, filled, d = 2, 4, 2, 300, 100, 32
    q, k, v = _inputs(b, h, hk, 1, n, d, torch.float32, seed=31, grad=False)
    keep = torch.zeros(b, 1, 1, n, dtype=torch.bool, device=DEV)
    keep[..., :filled] = True
    keep[1, ..., :20] = False
    k, v = k.clone(), v.clone()
    for t in (k, v):
        t.masked_fill_(~keep[:, :, 0, :, None].expand_as(t), float("nan"))
    slopes = alibi_slopes(h, DEV)
    bias = None if key_bias is None else slopes if not key_bias else torch.randn(b, h, n, device=DEV)
    with changed(alibi={"decode_split_keys": split_keys}):
        out = alibi_flash(q, k, v, bias, scale=d**-0.5, key_bias=bool(key_bias), keep=keep)
    assert torch.isfinite(out).all()
    sub = keep[..., :filled]
    truth, _ = _oracle(q, k[:, :, :filled].nan_to_num(), v[:, :, :filled].nan_to_num(),
                       None if bias is None else bias[..., :filled] if key_bias else bias, sub, bool(key_bias), d**-0.5)
    _close(out, truth.detach(), torch.float32)


def test_strided_views_are_read_in_place():
    """HF's (b, s, h, d) memory viewed as (b, h, s, d), and a v narrowed from a wider tensor."""
    q, k, _ = _inputs(2, 2, 2, 19, 19, 16, torch.float32, seed=13)
    wide = torch.randn(2, 19, 2, 48, device=DEV)
    v = wide[..., 8:24].transpose(1, 2).detach().requires_grad_()
    assert not v.is_contiguous()
    _check(q, k, v, alibi_slopes(2, DEV))


def test_output_memory_is_batch_seq_heads():
    """The result is a view of (b, q, h, d) memory: the caller's transpose + reshape is free."""
    q, k, v = _inputs(1, 2, 2, 8, 8, 16, torch.float32, grad=False)
    out = alibi_flash(q, k, v, alibi_slopes(2, DEV), scale=0.25)
    assert out.transpose(1, 2).is_contiguous()


def test_unsupported_inputs_are_clear_errors():
    q, k, v = _inputs(1, 3, 2, 4, 4, 16, torch.float32, grad=False)
    assert "multiple" in flash_unsupported(q, k, v)
    q, k, v = _inputs(1, 2, 2, 5, 4, 16, torch.float32, grad=False)
    with pytest.raises(ValueError, match="seq_q <= seq_k"):
        alibi_flash(q, k, v, alibi_slopes(2, DEV), scale=1.0)
    q, k, v = _inputs(1, 2, 2, 4, 4, 16, torch.float32, grad=False)
    with pytest.raises(ValueError, match=r"slopes must be \(2,\)"):
        alibi_flash(q, k, v, alibi_slopes(3, DEV), scale=1.0)
    with pytest.raises(ValueError, match="key_bias must be"):
        alibi_flash(q, k, v, torch.zeros(1, 2, 5, device=DEV), scale=1.0, key_bias=True)
    assert "float16/bfloat16/float32" in flash_unsupported(q.double(), k.double(), v.double())
    assert "head dims" in flash_unsupported(*(torch.zeros(1, 1, 2, 300, device=DEV) for _ in range(3)))


def test_custom_ops_pass_opcheck():
    from torchembed.kernels.attention import _flash_op

    q, k, v = _inputs(1, 2, 1, 20, 20, 16, torch.float32, seed=3)
    keep = _left_padded_keep(1, 20, 20, [4])
    rows = mask_rows(keep)
    torch.library.opcheck(_flash_op, (q, k, v, alibi_slopes(2, DEV), None, None, 0.25, False))
    torch.library.opcheck(_flash_op, (q, k, v, alibi_slopes(2, DEV), rows, keep, 0.25, False))


def test_compiles_into_one_graph():
    """``torch.compile(fullgraph=True)`` traces the ops (fake implementations), forward and backward."""
    q, k, v = _inputs(1, 2, 2, 18, 18, 16, torch.float32, seed=4)
    slopes = alibi_slopes(2, DEV)
    keep = _left_padded_keep(1, 18, 18, [3])

    def f(q, k, v):
        return alibi_flash(q, k, v, slopes, scale=0.25, keep=keep).square().sum()

    torch._dynamo.reset()
    loss = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v)
    loss.backward()
    grads = [x.grad.clone() for x in (q, k, v)]
    for x in (q, k, v):
        x.grad = None
    eager = f(q, k, v)
    eager.backward()
    torch.testing.assert_close(loss, eager)
    for got, x in zip(grads, (q, k, v)):
        torch.testing.assert_close(got, x.grad)


def test_eager_calls_skip_the_custom_op_dispatch(monkeypatch):
    """Eager calls launch the kernel directly (inference) or through an autograd.Function (training):
    the custom op's Python dispatch costs more host time than a small attention takes."""
    import torchembed.kernels.attention as module

    calls = []
    original = module._flash_op
    monkeypatch.setattr(torch.ops.torchembed, "alibi_flash", lambda *a: calls.append(1) or original(*a), raising=False)
    q, k, v = _inputs(1, 2, 2, 8, 8, 16, torch.float32)
    with torch.no_grad():
        alibi_flash(q, k, v, alibi_slopes(2, DEV), scale=0.25)
        alibi_flash(q, k, v, alibi_slopes(2, DEV), scale=0.25)  # the kept plan
    out = alibi_flash(q, k, v, alibi_slopes(2, DEV), scale=0.25)
    out.sum().backward()
    assert not calls and "AlibiFlash" in type(out.grad_fn).__name__ and q.grad is not None


def test_training_calls_reuse_the_forward_plan_and_its_backward_plan(monkeypatch):
    """A training call like one before takes the kept forward plan and the backward plan kept on it (none
    is made again), and still computes the oracle's gradients."""
    from torchembed.kernels import attention_plan as module

    module.clear_plans()
    q, k, v = _inputs(2, 4, 2, 24, 40, 16, torch.float32, seed=1)
    _check(q, k, v, alibi_slopes(4, DEV))  # makes both plans
    made = []
    for name in ("forward_plan", "backward_plan"):
        original = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _o=original, _n=name: made.append(_n) or _o(*a))
    q, k, v = _inputs(2, 4, 2, 24, 40, 16, torch.float32, seed=2)  # fresh inputs, same signature
    _check(q, k, v, alibi_slopes(4, DEV))
    assert made == []
    module.clear_plans()


def test_gradients_with_create_graph_cannot_be_differentiated_again():
    """``create_graph=True``: the first-order gradients are the oracle's; differentiating them again
    raises instead of silently dropping this layer's second-order terms."""
    q, k, v = _inputs(1, 2, 2, 16, 16, 16, torch.float32, seed=3)
    slopes = alibi_slopes(2, DEV)
    out = alibi_flash(q, k, v, slopes, scale=0.25)
    truth, leaves = _oracle(q, k, v, slopes, None, False, 0.25)
    loss = (out * out).sum()  # its gradient 2 out itself records a graph under create_graph=True
    dq, dk, dv = torch.autograd.grad(loss, (q, k, v), create_graph=True)
    (truth * truth).sum().backward()
    for got, leaf in zip((dq, dk, dv), leaves):
        _close(got.detach(), leaf.grad, torch.float32)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        dq.sum().backward()


# ------------------------------------------------------------------------------------------------
# Keys of negligible weight are not visited (slopes; the key bias of the patched BLOOM, MPT, Falcon)
# ------------------------------------------------------------------------------------------------

_STEEP = (1.0, 4.0, 0.5)  # slopes steep enough that, 256 keys long, most tiles are provably negligible


def _padded_key_bias(slopes, pads, n):
    """BLOOM's key bias: ``slope * (cumsum(mask) - 1) * mask`` per batch row of left padding ``pads``
    (0 on the padding), ``(B, H, N)`` float32."""
    positions = torch.arange(n, device=DEV)
    valid = positions[None, :] >= torch.tensor(pads, device=DEV)[:, None]
    counted = (valid.cumsum(-1) - 1).clamp_min(0) * valid
    return slopes[None, :, None] * counted[:, None, :].float()


@pytest.fixture
def skipping(monkeypatch):
    """The skip from the first key on (the shipped ``AlibiTuning.skip_min_keys`` keeps it for long
    prefills only), through ``settings.changed``: plans made before are forgotten so that the next call
    makes its plan with it. Yields ``tuned(**alibi_changes)`` for more changes inside. The interpreter's
    prefill tiles are 32 x 32 here (nearer the GPU's, larger than the 16 of the short cases): these inputs
    are 256 keys long, and the interpreter's time grows with the count of tiles."""
    from torchembed.kernels import attention_plan as flash
    from torchembed.kernels.settings import changed

    for kind in ("fwd", "dq", "dkdv"):
        monkeypatch.setitem(flash._INTERPRET_CONFIG, kind, (32, 32, 4, 1))
    with changed(alibi={"skip": True, "skip_min_keys": 0}):  # (changed forgets the kept plans on entry and exit)
        assert not len(flash._PLANS)
        yield types.SimpleNamespace(tuned=lambda **more: changed(alibi=more))
    assert not len(flash._PLANS)


def _every_key(skipping):
    """The skip off for the calls inside (plans made afresh on the way in and out)."""
    return skipping.tuned(skip=False)


def _far_keys_poisoned(v, first_row, margin):
    """v with NaN at every key at least ``margin`` before ``first_row`` (positions of the keys)."""
    poisoned = v.detach().clone()
    poisoned[:, :, : first_row - margin] = float("nan")
    return poisoned


# dtype x padded x key bias: every combination on CUDA; under the interpreter (tens of seconds each) the four in which
# every pair of values of any two of the three occurs (a covering array of strength 2)
_SKIP_CASES = ([(dtype, padded, key_bias) for dtype in (torch.float32, torch.bfloat16) for padded in (False, True)
                for key_bias in (False, True)] if DEV == "cuda" else
               [(torch.float32, False, False), (torch.float32, True, True), (torch.bfloat16, False, True),
                (torch.bfloat16, True, False)])


def test_the_interpreters_skip_cases_cover_every_pair_of_values():
    for i, j in ((0, 1), (0, 2), (1, 2)):
        pairs = {(case[i], case[j]) for case in _SKIP_CASES}
        assert len(pairs) == 4, (i, j, pairs)


@pytest.mark.parametrize("dtype, padded, key_bias", _SKIP_CASES)
def test_negligible_keys_are_not_visited_and_the_result_is_exact(dtype, padded, key_bias, skipping):
    """Far keys are left out: with NaN in their values the late rows stay finite and equal the float64
    attention of the clean values (whose far weights are below 2**-32 of each row's mass); with the
    skip off the same NaN reaches them (the check can fail). Slopes, and the key bias the patched
    models pass (padding: 0 on the padded keys)."""
    b, h, n, d = 2, len(_STEEP), 256, 16
    slopes = torch.tensor(_STEEP, device=DEV)
    pads = [0, 7] if padded else [0, 0]
    keep = _left_padded_keep(b, n, n, pads) if padded else None
    bias = _padded_key_bias(slopes, pads, n) if key_bias else slopes
    q, k, v = _inputs(b, h, 1, n, n, d, dtype, seed=31 if key_bias else 21, grad=False)
    truth, _ = _oracle(q, k, v, bias, keep, key_bias, d**-0.5)
    late = slice(192, n)  # rows whose every needed key is within 128 positions (GPU tiles included)
    poisoned = _far_keys_poisoned(v, 192, 128)
    with torch.no_grad():
        out = alibi_flash(q, k, poisoned, bias, scale=d**-0.5, keep=keep, key_bias=key_bias)
        assert torch.isfinite(out[:, :, late]).all()
        _close(out[:, :, late], truth.detach()[:, :, late], dtype)
        _close(alibi_flash(q, k, v, bias, scale=d**-0.5, keep=keep, key_bias=key_bias), truth.detach(), dtype)
        with _every_key(skipping):
            unskipped = alibi_flash(q, k, poisoned, bias, scale=d**-0.5, keep=keep, key_bias=key_bias)
    assert torch.isnan(unskipped[:, :, late]).any()


def test_a_skip_bound_too_loose_is_caught(skipping):
    """Fault injection: a margin of -40 bits leaves out keys that carry weight, and the comparison with
    the float64 attention fails; the shipped margin passes it."""
    b, h, n, d = 1, len(_STEEP), 256, 16
    slopes = torch.tensor(_STEEP, device=DEV) / 8  # gentler: the wrong bound cuts into real weight
    q, k, v = _inputs(b, h, h, n, n, d, torch.float32, seed=22, grad=False)
    truth, _ = _oracle(q, k, v, slopes, None, False, d**-0.5)
    with torch.no_grad():
        _close(alibi_flash(q, k, v, slopes, scale=d**-0.5), truth.detach(), torch.float32)
        with skipping.tuned(skip_margin_bits=-40.0), pytest.raises(AssertionError):
            _close(alibi_flash(q, k, v, slopes, scale=d**-0.5), truth.detach(), torch.float32)


@pytest.mark.parametrize("margin", [None, -40.0])
def test_a_skip_bound_too_loose_is_caught_in_the_backward(margin, skipping):
    """Fault injection for the backward's cuts (dq's first key, dk/dv's last query block): the forward
    with the shipped margin, the backward with -40 bits: its gradients leave the float64 ones (the
    shipped margin, the control, matches them)."""
    b, h, n, d = 1, len(_STEEP), 256, 16
    slopes = torch.tensor(_STEEP, device=DEV) / 8
    q, k, v = _inputs(b, h, h, n, n, d, torch.float32, seed=28)
    out = alibi_flash(q, k, v, slopes, scale=d**-0.5)
    truth, leaves = _oracle(q, k, v, slopes, None, False, d**-0.5)
    _close(out, truth.detach(), torch.float32)
    grad = torch.randn_like(out)
    # the backward plan is made when the backward runs: with the margin of the block it runs in
    with skipping.tuned() if margin is None else skipping.tuned(skip_margin_bits=margin):
        out.backward(grad)
    truth.backward(grad.double())
    wrong = []
    for name, got, leaf in zip("qkv", (q, k, v), leaves):
        try:
            _close(got.grad, leaf.grad, torch.float32)
        except AssertionError:
            wrong.append(name)
    assert wrong == ([] if margin is None else ["q", "k", "v"])


@pytest.mark.parametrize("dtype, padded, key_bias", _SKIP_CASES)
def test_skipping_backward_is_exact(dtype, padded, key_bias, skipping):
    """Gradients with the skip on equal the float64 attention's (dq leaves out far key tiles, dk/dv far
    query blocks), slopes and key bias (padded: right after 7 keys of padding), grouped kv heads."""
    b, h, n, d = 2, 6, 256, 16
    pads = [0, 7] if padded else [0, 0]
    keep = _left_padded_keep(b, n, n, pads) if padded else None
    q, k, v = _inputs(b, h, 3, n, n, d, dtype, seed=34 if key_bias else 23)
    slopes = torch.tensor(_STEEP * 2, device=DEV)
    _check(q, k, v, _padded_key_bias(slopes, pads, n) if key_bias else slopes, keep=keep, key_bias=key_bias)


@pytest.mark.parametrize("key_bias", [False, True])
def test_skipping_backward_does_not_visit_far_pairs(key_bias, skipping):
    """NaN in the output gradient of the late rows does not reach dk/dv of the first keys, and NaN in
    the first keys' values does not reach dq of the late rows, with the skip on; with it off both do.
    Slopes and key bias."""
    b, h, n, d = 1, len(_STEEP), 256, 16
    slopes = torch.tensor(_STEEP, device=DEV)
    bias = _padded_key_bias(slopes, [0], n) if key_bias else slopes

    def grads(poison_v: bool) -> tuple:
        q, k, v = _inputs(b, h, h, n, n, d, torch.float32, seed=35 if key_bias else 24)
        v_in = _far_keys_poisoned(v, 192, 128).requires_grad_() if poison_v else v
        out = alibi_flash(q, k, v_in, bias, scale=d**-0.5, key_bias=key_bias)
        grad = torch.randn_like(out)
        if not poison_v:
            grad[:, :, 192:] = float("nan")
        out.backward(grad)
        return q.grad, k.grad, (v_in.grad if poison_v else v.grad)

    dq, _, _ = grads(poison_v=True)
    assert torch.isfinite(dq[:, :, 192:]).all()
    _, dk, dv = grads(poison_v=False)
    assert torch.isfinite(dk[:, :, :64]).all() and torch.isfinite(dv[:, :, :64]).all()
    with _every_key(skipping):
        dq, _, _ = grads(poison_v=True)
        _, dk, dv = grads(poison_v=False)
    assert torch.isnan(dq[:, :, 192:]).any() and torch.isnan(dk[:, :, :64]).any()


@pytest.mark.parametrize("k_len", [1, 37, 100])
def test_key_norms_by_slice(k_len):
    """The largest key norm per (batch, kv head), as slices the kernels take the maximum of, on strided
    keys, fewer keys than slices included; a NaN key makes its slice inf (so the skip keeps every key
    and NaN reaches the output as without it)."""
    from torchembed.kernels.attention_plan import key_norms
    from torchembed.kernels.attention_triton import NORM_PARTS

    _, k, _ = _inputs(2, 2, 3, 5, k_len, 24, torch.bfloat16, seed=25, grad=False)
    got = key_norms(k)
    assert got.shape == (2, 3, NORM_PARTS)
    want = torch.linalg.vector_norm(k.float(), dim=-1).amax(-1)
    torch.testing.assert_close(got.amax(-1), want, rtol=1e-5, atol=1e-5)
    k = k.clone()
    k[1, 2, k_len - 1, 3] = float("nan")
    got = key_norms(k).amax(-1)
    assert got[1, 2] == float("inf") and torch.isfinite(got[0]).all() and torch.isfinite(got[1, :2]).all()


def test_a_nan_key_far_back_is_not_skipped(skipping):
    """A NaN among the keys makes the head's key norm NaN: nothing is skipped, and NaN reaches the same
    outputs as with the skip off."""
    q, k, v = _inputs(1, len(_STEEP), len(_STEEP), 256, 256, 16, torch.float32, seed=26, grad=False)
    k = k.clone()
    k[:, :, 5, 0] = float("nan")
    slopes = torch.tensor(_STEEP, device=DEV)
    with torch.no_grad():
        skipped = alibi_flash(q, k, v, slopes, scale=0.25)
        with _every_key(skipping):
            visited = alibi_flash(q, k, v, slopes, scale=0.25)
    assert torch.isnan(visited[:, :, 192:]).any()
    assert torch.equal(torch.isnan(skipped), torch.isnan(visited))

    def grads() -> list:
        inputs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = alibi_flash(*inputs, slopes, scale=0.25)
        out.backward(torch.ones_like(out))
        return [t.grad for t in inputs]

    skipped = grads()
    with _every_key(skipping):
        visited = grads()
    for got, want in zip(skipped, visited):  # the backward's cuts keep every key and query too
        assert torch.isnan(want).any() and torch.equal(torch.isnan(got), torch.isnan(want))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_skipping_prefill_after_a_cache_is_exact(dtype, skipping):
    """Queries at the last 100 of 300 key positions (a prefill after a KV cache), grouped kv heads: with
    the skip on, outputs and gradients equal the float64 attention, and the first 64 keys (136 or more
    positions before every query) are not visited (NaN in their values stays out)."""
    q, k, v = _inputs(2, 6, 3, 100, 300, 16, dtype, seed=27)
    slopes = torch.tensor(_STEEP * 2, device=DEV)
    _check(q, k, v, slopes)
    with torch.no_grad():
        assert torch.isfinite(alibi_flash(q, k, _far_keys_poisoned(v, 200, 136), slopes, scale=0.25)).all()


# ------------------------------------------------------------------------------------------------
# Keys of negligible weight are not visited (key-bias mode: the patched BLOOM, MPT and Falcon)
# ------------------------------------------------------------------------------------------------


def _sink_bias(n):
    """Steep ALiBi key biases with one far key (position 3) as high as the newest: a bias that is not
    monotone, where the far key carries weight in every row."""
    bias = _padded_key_bias(torch.tensor(_STEEP, device=DEV), [0], n)
    bias[:, :, 3] = bias[:, :, -1]
    return bias


def test_a_far_key_of_high_bias_is_visited(skipping, monkeypatch):
    """The bound is the running maximum of the key bias, not the bias at the position: a far key as
    high as the newest is visited (outputs and gradients equal the float64 attention). Fault injection:
    with the bias itself as its own running maximum the search skips past it and the comparison
    fails. Queries at the last 40 positions (a prefill). Gradients to 1e-4: the sink's probability (near 1 in every
    row) comes from base-2 scores and log-sum-exps of magnitude up to ~180 (slope 4 over 40 rows), each
    rounded to 2**-24 of that in float32, and dv of the sink sums 40 such rows."""
    n, d = 256, 16
    bias = _sink_bias(n)
    q, k, v = _inputs(1, len(_STEEP), len(_STEEP), 40, n, d, torch.float32, seed=32)
    out = alibi_flash(q, k, v, bias, scale=d**-0.5, key_bias=True)
    truth, leaves = _oracle(q, k, v, bias, None, True, d**-0.5)
    _close(out, truth.detach(), torch.float32)
    grad = torch.randn_like(out)
    out.backward(grad)
    truth.backward(grad.double())
    for got, leaf in zip((q, k, v), leaves):
        torch.testing.assert_close(got.grad.double(), leaf.grad, rtol=1e-4, atol=1e-4 * leaf.grad.abs().max().item())
    from torchembed.kernels import attention_plan

    monkeypatch.setattr(attention_plan, "running_max", lambda key_bias: key_bias.contiguous())
    with skipping.tuned(), torch.no_grad(), pytest.raises(AssertionError):  # (plans made afresh)
        _close(alibi_flash(q, k, v, bias, scale=d**-0.5, key_bias=True), truth.detach(), torch.float32)


@pytest.mark.parametrize("margin", [None, -40.0])
def test_key_bias_skip_bound_too_loose_is_caught(margin, skipping):
    """Fault injection in key-bias mode, forward and backward: -40 bits leaves out keys with weight
    and the outputs and every gradient leave the float64 attention's; the shipped margin matches."""
    b, h, n, d = 1, len(_STEEP), 256, 16
    bias = _padded_key_bias(torch.tensor(_STEEP, device=DEV) / 8, [0], n)
    q, k, v = _inputs(b, h, h, n, n, d, torch.float32, seed=33)
    truth, leaves = _oracle(q, k, v, bias, None, True, d**-0.5)
    with skipping.tuned() if margin is None else skipping.tuned(skip_margin_bits=margin):
        out = alibi_flash(q, k, v, bias, scale=d**-0.5, key_bias=True)
        grad = torch.randn_like(out)
        out.backward(grad)
    truth.backward(grad.double())
    wrong = []
    for name, got, want in zip("oqkv", (out, q.grad, k.grad, v.grad), (truth, *(t.grad for t in leaves))):
        try:
            _close(got, want.detach(), torch.float32)
        except AssertionError:
            wrong.append(name)
    assert wrong == ([] if margin is None else ["o", "q", "k", "v"])


def test_a_nan_key_bias_far_back_is_not_skipped(skipping):
    """A NaN in the key bias counts as +inf in its running maximum: no key after it is skipped, and
    NaN reaches the same outputs and gradients as with the skip off."""
    n = 256
    bias = _padded_key_bias(torch.tensor(_STEEP, device=DEV), [0], n)
    bias[:, :, 5] = float("nan")
    q, k, v = _inputs(1, len(_STEEP), len(_STEEP), n, n, 16, torch.float32, seed=36, grad=False)

    def run() -> list:
        inputs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = alibi_flash(*inputs, bias, scale=0.25, key_bias=True)
        out.backward(torch.ones_like(out))
        return [out.detach(), *(t.grad for t in inputs)]

    skipped = run()
    with _every_key(skipping):
        visited = run()
    assert torch.isnan(visited[0][:, :, 192:]).any()
    for got, want in zip(skipped, visited):
        assert torch.isnan(want).any() and torch.equal(torch.isnan(got), torch.isnan(want))


def test_running_max_of_the_key_bias():
    """The skip's bound in key-bias mode: a running maximum along the keys, NaN as +inf, -inf kept."""
    from torchembed.kernels.attention_plan import running_max

    bias = torch.tensor([[[0.0, -1.0, 2.0, float("-inf"), 1.0], [float("-inf"), float("nan"), 0.0, -5.0, 1.0]]])
    want = torch.tensor([[[0.0, 0.0, 2.0, 2.0, 2.0], [float("-inf"), float("inf"), float("inf"), float("inf"), float("inf")]]])
    torch.testing.assert_close(running_max(bias.expand(2, -1, -1)), want.expand(2, -1, -1))


def _compiled_variants(kernel) -> int:
    caches = getattr(kernel, "device_caches", None)
    if not isinstance(caches, dict):
        pytest.skip("this Triton keeps its compiled kernels elsewhere")
    return sum(len(entry[0]) for entry in caches.values())


@pytest.mark.skipif(DEV != "cuda", reason="counts Triton compiles on CUDA")
def test_decode_compiles_once_across_context_lengths():
    """A decode loop (one query over a growing cache, slopes and a key bias with a padding mask) compiles
    the split-key kernel once per configuration, not whenever the key count changes its divisibility."""
    from torchembed.kernels import attention_triton as K

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 1, 64, generator=gen).to(DEV, torch.bfloat16)
    slopes = torch.rand(4).to(DEV)
    for n in (300, 301):  # warm: whatever the first call compiles
        k = torch.randn(1, 4, n, 64).to(DEV, torch.bfloat16)
        alibi_flash(q, k, k, slopes, scale=0.125)
    before = (_compiled_variants(K._decode_kernel), _compiled_variants(K._combine_kernel))
    for n in range(302, 340):  # every residue mod 16, twice
        k = torch.randn(1, 4, n, 64).to(DEV, torch.bfloat16)
        out = alibi_flash(q, k, k, slopes, scale=0.125)
    assert torch.isfinite(out).all()
    assert (_compiled_variants(K._decode_kernel), _compiled_variants(K._combine_kernel)) == before
