"""The attention kernel's plans: block shapes, launches, the split-key decode's split, the skip of negligible keys,
tensor descriptors (TMA). Dao, "FlashAttention-2", arXiv:2307.08691 (the tiling); the split-key decode ("flash
decoding") cuts the keys into parts, one program each, then combines their partial softmaxes. A plan is made once per
call signature (:func:`kept_plan`) and launched with each call's tensors; device code:
:mod:`torchembed.kernels.attention_triton`, imported with Triton on the first launch.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Optional

import torch
from torch import Tensor

from torchembed.kernels.launch import Launch, Launches, interpret_mode
from torchembed.kernels.route import decode_step
from torchembed.kernels.settings import settings

__all__ = ["BackwardPlan", "ForwardPlan", "NormPlan", "backward_plan", "block_d", "clear_plans", "config_for",
           "forward_plan", "key_norms", "kept_backward_plan", "kept_plan", "rows_launch", "running_max",
           "skips_negligible"]

DECODE_ROWS = 64  # the split-key kernel takes calls of at most this many queries per kv head (GROUP * M)
LOG2E = 1.4426950408889634


# --- Kept plans ---------------------------------------------------------------------------------

# Plans (:class:`ForwardPlan` / :class:`BackwardPlan`) by call signature: everything the launches were derived from,
# so a hit needs no validation. Cleared when full (many prefill lengths).
_PLANS = Launches(1024)


def _signature(q: Tensor, k: Tensor, v: Tensor, bias: Tensor, rows: Optional[Tensor], keep: Optional[Tensor],
               scale: float, key_bias: bool, need_lse: bool) -> tuple:
    mask = None if keep is None else (keep.shape, keep.stride(), keep.dtype, keep.device,
                                      None if rows is None else (rows.shape, rows.stride()))
    bias_key = None if bias is None else (bias.shape, bias.stride(), bias.dtype, bias.device)
    return (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, k.dtype, v.dtype, q.device,
            k.device, v.device, bias_key, key_bias, mask, scale, need_lse)


def clear_plans() -> None:
    """Forget every kept plan."""
    _PLANS.clear()


def kept_plan(q, k, v, bias, rows, keep, scale, key_bias, need_lse) -> "ForwardPlan":
    """The kept :class:`ForwardPlan` of this call signature (made on a miss), for non-empty inputs the kernel takes."""
    key = _signature(q, k, v, bias, rows, keep, scale, key_bias, need_lse)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS.keep(key, forward_plan(q, k, v, bias, rows, keep, scale, key_bias, need_lse))
    return plan


def kept_backward_plan(grad, q, k, v, out, bias, rows, keep, scale, key_bias, plan=None) -> "BackwardPlan":
    """The :class:`BackwardPlan` of a call: kept by the forward's ``plan`` under the output gradient's strides, else
    in the table of plans under the whole signature."""
    if plan is not None:
        backward = plan.backwards.get(grad.stride())
        if backward is None:
            backward = plan.backwards[grad.stride()] = backward_plan(grad, q, k, v, out, bias, rows, keep, scale,
                                                                     key_bias)
        return backward
    key = ("backward", grad.shape, grad.stride(), out.stride(), *_signature(q, k, v, bias, rows, keep, scale, key_bias,
                                                                            True))
    backward = _PLANS.get(key)
    if backward is None:
        backward = _PLANS.keep(key, backward_plan(grad, q, k, v, out, bias, rows, keep, scale, key_bias))
    return backward


# --- Block shapes, launches ---------------------------------------------------------------------


_FP32_CONFIG = {"fwd": (64, 32, 4, 2), "dq": (64, 32, 4, 2), "dkdv": (32, 64, 4, 2), "decode": (16, 32, 4, 2)}
_INTERPRET_CONFIG = {"fwd": (16, 16, 4, 1), "dq": (16, 16, 4, 1), "dkdv": (16, 16, 4, 1), "decode": (16, 16, 4, 1)}


@functools.cache
def _device():
    """:mod:`torchembed.kernels.attention_triton` (which imports Triton), imported on the first launch."""
    from torchembed.kernels import attention_triton

    return attention_triton


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for n <= 1)."""
    return 1 << max(0, n - 1).bit_length()


def block_d(head_dim: int) -> int:
    return max(16, _pow2(head_dim))


def config_for(kind: str, head_dim: int, dtype: torch.dtype, masked: bool) -> tuple[int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` of one kernel at this head dim and dtype, masked or causal."""
    if interpret_mode():
        return _INTERPRET_CONFIG[kind]
    if dtype == torch.float32:
        return _FP32_CONFIG[kind]
    return settings().alibi.blocks[(kind, block_d(head_dim), masked)]


def _strides4(t: Tensor) -> tuple[int, int, int, int]:
    """Strides of a ``(B, heads, S, D)`` tensor, 0 along a batch of 1."""
    s = t.stride()
    return (0 if t.shape[0] == 1 else s[0], s[1], s[2], s[3])


def _shapes(q: Tensor, k: Tensor, rows: Tensor | None) -> tuple:
    """What a plan is made from: ``(B, H, M, D, Hk, N, GROUP, BLOCK_D, PREC, masked)``; ``PREC``: 1 for float32
    operands at full precision, 2 for half ones upcast on the interpreter, else 0."""
    batch, heads, q_len, head_dim = q.shape
    kv_heads, k_len = k.shape[1], k.shape[2]
    prec = 1 if q.dtype == torch.float32 else (2 if interpret_mode() else 0)
    return batch, heads, q_len, head_dim, kv_heads, k_len, heads // kv_heads, block_d(head_dim), prec, rows is not None


def _bias_mode(bias: Tensor | None, key_bias: bool) -> int:
    """The kernels' ``BIAS``: 0 slopes, 1 a key bias, 2 none."""
    return 2 if bias is None else int(key_bias)


def _bias_strides(bias: Tensor | None, key_bias: bool) -> tuple[int, int, int]:
    if bias is None:
        return 0, 0, 0
    if not key_bias:  # slopes (H,)
        return 0, bias.stride(0), 0
    s = bias.stride()
    return (0 if bias.shape[0] == 1 else s[0], s[1], s[2])


def _mask_strides(rows: Tensor | None, keep: Tensor | None) -> tuple[int, int, int, int]:
    if rows is None:
        return 0, 0, 0, 0
    s = keep.stride()
    return (0 if rows.shape[0] == 1 else rows.stride(0), 0 if keep.shape[0] == 1 else s[0], s[2], s[3])


_ROWS_LAUNCHES = Launches(256)


def rows_launch(keep: Tensor) -> Tensor:
    """``rows (B or 1, 3, M)`` int32 of a bool ``keep (B or 1, 1, M, N)``: ``[lo, hi, irregular]`` by the kernel."""
    batch, _, q_len, k_len = keep.shape
    rows = torch.empty(batch, 3, q_len, dtype=torch.int32, device=keep.device)
    if q_len == 0:
        return rows
    key = (keep.shape, keep.stride(), keep.device)
    launch = _ROWS_LAUNCHES.get(key)
    if launch is None:
        # decode-shaped masks (a few rows, many keys): one program scans a row, so wide key blocks (a 65k-key row:
        # 8 blocks of 8192 instead of 256 of 256)
        block_q = min(32, _pow2(q_len))
        block_q, block_k = (16, 32) if interpret_mode() else (block_q, max(256, 8192 // block_q))
        s = keep.stride()
        launch = _ROWS_LAUNCHES.keep(key, Launch(
            _device()._rows_kernel, (_cdiv(q_len, block_q), batch, 1),
            (q_len, k_len, 0 if batch == 1 else s[0], s[2], s[3], rows.stride(0)),
            {"BLOCK_Q": block_q, "BLOCK_K": block_k}, num_warps=4, num_stages=1))
    launch((keep.view(torch.uint8), rows))
    return rows


# Keys of negligible weight: ALiBi's bias falls linearly with distance, so far enough back every score is provably
# below the row's largest by more than skip_margin_bits + log2(keys) bits (Cauchy-Schwarz on q.k with the head's
# largest key norm): the kernels do not visit those keys (the position from the slope, or with a key bias, not
# monotone under padding, from its running_max). What they leave out is under 2**-skip_margin_bits of each row's
# softmax mass, below float32 rounding. TORCHEMBED_ALIBI_SKIP=0 visits every key. skip_min_keys: shorter calls are not
# worth the key-norm pass (H200, 2026-12-02, benchmarks/probes/alibi_skip_probe.py: 4 x 16 x 2048 x 64 forward 0.107 +
# 0.011 ms for the norms against 0.131 without the skip; 1 x 16 x 1024 x 64 0.0228 + 0.006 against 0.0225).


def skips_negligible(k_len: int) -> bool:
    """Whether a prefill of ``k_len`` keys leaves out the keys of negligible weight."""
    tuning = settings().alibi
    return tuning.skip and k_len >= tuning.skip_min_keys


def running_max(key_bias: Tensor) -> Tensor:
    """``(B or 1, H, N)`` float32, contiguous: ``out[..., j] = max(key_bias[..., :j + 1])`` with NaN as +inf (a NaN
    bias then keeps every key after it), the bound the skip takes in key-bias mode."""
    inf = float("inf")
    return torch.cummax(key_bias.nan_to_num(nan=inf, posinf=inf, neginf=-inf), dim=-1).values.contiguous()


def _reach_strides(bias: Tensor | None, key_bias: bool) -> tuple[int, int]:
    """The batch and head strides of :func:`running_max` of ``bias`` (0, 0: slopes mode or none, unread)."""
    if bias is None or not key_bias:
        return 0, 0
    heads, k_len = bias.shape[1], bias.shape[2]
    return (0 if bias.shape[0] == 1 else heads * k_len), k_len


def skip_log2(k_len: int) -> float:
    """The base-2 margin below a row's largest score past which a key is left out."""
    return settings().alibi.skip_margin_bits + math.log2(max(k_len, 1))


class NormPlan:
    """The skip's bounds for one key signature: ``plan(k, bias) -> (norms, reach)``. ``norms (B, Hk, NORM_PARTS)``
    float32: the largest key norm of each slice of the keys of ``k (B, Hk, N, D)`` (inf where a key has a NaN: the
    kernels then skip nothing), one launch of ``NORM_PARTS`` programs per (batch, kv head), the kernels taking the
    maximum over the slices; ``reach``: :func:`running_max` of a key bias (``key_bias``), else ``bias`` (unread)."""

    __slots__ = ("shape", "device", "launch", "key_bias")

    def __init__(self, k: Tensor, key_bias: bool = False) -> None:
        batch, kv_heads, k_len, head_dim = k.shape
        parts = _device().NORM_PARTS
        self.shape, self.device, self.key_bias = (batch, kv_heads, parts), k.device, key_bias
        chunk = _cdiv(k_len, parts)
        block_k = 16 if interpret_mode() else min(64, max(16, _pow2(chunk)))
        self.launch = Launch(_device()._key_norm_kernel, (parts, batch * kv_heads, 1),
                             (kv_heads, k_len, chunk, *_strides4(k)),
                             {"HEAD_DIM": head_dim, "BLOCK_K": block_k, "BLOCK_D": block_d(head_dim), "PARTS": parts},
                             num_warps=4, num_stages=1)

    def __call__(self, k: Tensor, bias: Tensor) -> tuple[Tensor, Tensor]:
        out = torch.empty(self.shape, dtype=torch.float32, device=self.device)
        self.launch((k, out))
        return out, running_max(bias) if self.key_bias else bias


def key_norms(k: Tensor) -> Tensor:
    """The key norms of :class:`NormPlan` of ``k``, run once (the plans keep theirs)."""
    return NormPlan(k)(k, k)[0]


def _sms(device: torch.device) -> int:
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _sm_count(index: int) -> int:
    """The multiprocessor count of CUDA device ``index`` (read once)."""
    return torch.cuda.get_device_properties(index).multi_processor_count


class ForwardPlan:
    """The forward of one call signature (shapes, strides, dtypes, device, mask form, scale): its launches (the
    prefill kernel, or the split-key decode kernel and its combine) and the buffers each call allocates;
    ``backwards``: its :class:`BackwardPlan` by the output gradient's strides (kept by the caller)."""

    __slots__ = ("out_shape", "out_stride", "dtype", "device", "need_lse", "part", "main", "combine", "prefill",
                 "norms", "backwards")

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, rows: Tensor | None,
                 keep: Tensor | None) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """``(out, lse or None, the skip's bounds or None)`` (the bounds: what the skip's backward reuses)."""
        bias = q if bias is None else bias  # (no bias: unread)
        out = torch.empty_strided(self.out_shape, self.out_stride, dtype=self.dtype, device=self.device)
        lse = torch.empty(self.out_shape[:3], dtype=torch.float32, device=self.device) if self.need_lse else None
        lse_t = out if lse is None else lse
        rows_t = bias if rows is None else rows  # (unread without a mask: any pointer will do)
        keep_t = bias if keep is None else keep.view(torch.uint8)
        bounds = None if self.norms is None else self.norms(k, bias)  # (norms: the skip's NormPlan, prefill only)
        if self.prefill:
            self.main((q, k, v, out, lse_t, bias, rows_t, keep_t, *(bounds or (bias, bias))))
        else:  # (a single split has no workspace: out stands in for its pointer)
            part = torch.empty(self.part, dtype=torch.float32, device=self.device) if self.part else out
            self.main((q, k, v, out, lse_t, part, bias, rows_t, keep_t))
            if self.combine is not None:
                self.combine((out, lse_t, part))
        return out, lse, bounds


def _decode_splits(device: torch.device, programs: int, k_len: int, block_n: int, masked: bool) -> int:
    """How many parts the split-key decode cuts the keys into, each two key blocks or more: at least ``least``
    programs per multiprocessor (``AlibiTuning.decode_programs_per_sm``), more while each part keeps
    ``decode_split_keys`` keys, never over ``most`` per multiprocessor. A masked call, whose kept keys (a static
    cache's filled part) are known on the device only, goes up to ``decode_masked_programs_per_sm`` instead."""
    tuning = settings().alibi
    least, most = tuning.decode_programs_per_sm
    sms = _sms(device) if device.type == "cuda" else 16  # (the interpreter: several splits at small shapes)
    fewest = _cdiv(least * sms, programs)
    if masked:
        parts = min(_cdiv(tuning.decode_masked_programs_per_sm * sms, programs),
                    max(fewest, k_len // tuning.decode_split_keys))
    else:
        parts = max(fewest, min(k_len // tuning.decode_split_keys, most * sms // programs))
    return max(1, min(parts, _cdiv(k_len, 2 * block_n)))


def forward_plan(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, rows: Tensor | None, keep: Tensor | None,
                 scale: float, key_bias: bool, need_lse: bool) -> ForwardPlan:
    """The :class:`ForwardPlan` of attention of ``q (B, H, M, D)`` over ``k, v (B, Hk, N, D)``: output ``(B, H, M, D)``
    over ``(B, M, H, D)`` memory and, with ``need_lse``, ``lse (B, H, M)`` float32 (base 2). ``bias``: slopes
    ``(H,)``, a key bias ``(B or 1, H, N)`` (``key_bias``), float32, or None. ``rows``/``keep``: the mask summary and
    the mask, or None (causal, queries last). Inputs checked by the caller."""
    batch, heads, q_len, head_dim, kv_heads, k_len, group, bd, prec, masked = _shapes(q, k, rows)
    out_stride = (q_len * heads * head_dim, head_dim, heads * head_dim, 1)  # (B, H, M, D) over (B, M, H, D) memory
    out4 = (0 if batch == 1 else out_stride[0], *out_stride[1:])
    strides = (*_strides4(q), *_strides4(k), *_strides4(v), *out4, *_bias_strides(bias, key_bias),
               *_mask_strides(rows, keep))
    qk_scale = float(scale) * LOG2E
    plan = ForwardPlan()
    plan.out_shape, plan.out_stride, plan.dtype, plan.device = (batch, heads, q_len, head_dim), out_stride, q.dtype, q.device
    plan.need_lse, plan.part, plan.combine, plan.prefill, plan.norms = need_lse, 0, None, False, None
    plan.backwards = {}
    if group * q_len <= DECODE_ROWS and decode_step(q_len, k_len):  # the split-key decode kernel
        block_r, block_n, warps, stages = config_for("decode", head_dim, q.dtype, masked)
        block_r = max(block_r, _pow2(group * q_len))
        programs = batch * kv_heads
        splits = _decode_splits(q.device, programs, k_len, block_n, masked)
        single = splits == 1
        plan.part = 0 if single else splits * programs * block_r * (bd + 2)
        plan.main = Launch(_device()._decode_kernel, (splits, programs, 1), (*strides, heads, group, q_len, k_len, splits, qk_scale),
                           {"HEAD_DIM": head_dim, "BLOCK_R": block_r, "BLOCK_N": block_n, "BLOCK_D": bd,
                            "BIAS": _bias_mode(bias, key_bias), "MASK": int(masked), "PREC": prec, "SINGLE": single,
                            "STORE_LSE": need_lse}, num_warps=warps, num_stages=stages)
        if not single:
            parts, features = settings().alibi.decode_combine
            chunk = min(bd, features)
            plan.combine = Launch(_device()._combine_kernel, (programs, group * q_len, bd // chunk),
                                  (*out4, heads, group, q_len, splits),
                                  {"HEAD_DIM": head_dim, "BLOCK_R": block_r, "BLOCK_D": bd, "BLOCK_C": chunk,
                                   "BLOCK_S": parts, "STORE_LSE": need_lse, "PREC": prec},
                                  num_warps=2, num_stages=1)
        return plan
    block_m, block_n, warps, stages = config_for("fwd", head_dim, q.dtype, masked)
    skip = skips_negligible(k_len) and bias is not None
    plan.prefill, plan.norms = True, NormPlan(k, key_bias) if skip else None

    def launch(tma: bool) -> Launch:
        return Launch(_device()._fwd_kernel, (_cdiv(q_len, block_m), batch * heads, 1),
                      (*strides, *_reach_strides(bias, key_bias), heads, group, q_len, k_len, k_len.bit_length(),
                       qk_scale, skip_log2(k_len)),
                      {"HEAD_DIM": head_dim, "BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_D": bd,
                       "BIAS": _bias_mode(bias, key_bias), "MASK": int(masked), "PREC": prec, "STORE_LSE": need_lse,
                       "TMA": tma, "SKIP": skip}, num_warps=warps, num_stages=stages)

    plan.main = launch(False)
    if _tma_layout(k, v):  # keys and values through the tensor memory accelerator where aligned
        plan.main = _TmaLaunch(launch(True), plan.main)
    return plan


def _tma_layout(k: Tensor, v: Tensor) -> bool:
    """Keys and values can be read through tensor descriptors: a CUDA device of compute capability 9 or later, a
    Triton that makes them, unit last strides and 16-byte strides."""
    if not (settings().tma and hasattr(_device().tl, "make_tensor_descriptor") and _tma_device(k.device)):
        return False
    size = k.element_size()
    return all(t.stride(3) == 1 and all(t.stride(i) * size % 16 == 0 for i in range(3)) for t in (k, v))


def _tma_device(device: torch.device) -> bool:
    """A CUDA device with a tensor memory accelerator (compute capability 9 or later); tests stand in the interpreter
    (which models descriptors) for one."""
    return device.type == "cuda" and not interpret_mode() and torch.cuda.get_device_capability(device)[0] >= 9


def _allocate(size: int, alignment: int, stream: Optional[int]) -> Tensor:
    return torch.empty(size, dtype=torch.int8, device="cuda")


class _TmaLaunch:
    """The TMA launch where the key and value pointers are 16-byte aligned (what a descriptor needs), else the pointer
    launch. Triton allocates the descriptors' workspace through the calling context's allocator: where none is set,
    PyTorch's caching allocator is set for this launch only and the previous one restored after it."""

    __slots__ = ("tma", "plain")

    def __init__(self, tma: Launch, plain: Launch) -> None:
        self.tma, self.plain = tma, plain

    def __call__(self, tensors: Sequence[Tensor]) -> None:
        if (tensors[1].data_ptr() | tensors[2].data_ptr()) & 15:
            self.plain(tensors)
            return
        from triton.runtime import _allocation

        allocator = _allocation._allocator
        previous = allocator.get()
        if not isinstance(previous, _allocation.NullAllocator):
            self.tma(tensors)
            return
        allocator.set(_allocate)
        try:
            self.tma(tensors)
        finally:
            allocator.set(previous)


class BackwardPlan:
    """The backward of one call signature: ``delta = rowsum(dO * O)``, then the dk/dv and dq kernels. ``bounds``: the
    forward's where it skipped (else made here by ``norms``, the skip's :class:`NormPlan`, None without the skip)."""

    __slots__ = ("delta_shape", "device", "delta", "dkdv", "dq", "norms", "horizon_shape")

    def __call__(self, grad, q, k, v, out, lse, bias, rows, keep, bounds=None) -> tuple[Tensor, Tensor, Tensor]:
        bias = q if bias is None else bias  # (no bias: unread)
        # (each buffer allocated just before the first launch that needs it: the launches start sooner)
        delta = torch.empty(self.delta_shape, dtype=torch.float32, device=self.device)
        rows_t = bias if rows is None else rows
        if self.norms is not None:
            norms, reach = bounds or self.norms(k, bias)
            horizon = torch.empty(self.horizon_shape, dtype=torch.float32, device=self.device)
        else:
            norms = horizon = reach = bias  # (unread)
        self.delta((out, grad, delta, q, lse, bias, rows_t, norms, horizon))
        keep_t = bias if keep is None else keep.view(torch.uint8)
        dk, dv = torch.empty_like(k), torch.empty_like(v)
        self.dkdv((q, k, v, grad, lse, delta, dk, dv, bias, rows_t, keep_t, horizon, reach))
        dq = torch.empty_like(q)
        self.dq((q, k, v, grad, lse, delta, dq, bias, rows_t, keep_t, norms, reach))
        return dq, dk, dv


def backward_plan(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, bias: Tensor | None, rows: Tensor | None,
                  keep: Tensor | None, scale: float, key_bias: bool) -> BackwardPlan:
    """The :class:`BackwardPlan` of :func:`forward_plan`'s attention (dq, dk, dv like q, k, v)."""
    batch, heads, q_len, head_dim, kv_heads, k_len, group, bd, prec, masked = _shapes(q, k, rows)
    srb, smb, smm, smn = _mask_strides(rows, keep)
    sbb, sbh, sbn = _bias_strides(bias, key_bias)
    tail = (sbb, sbh, sbn, srb, smb, smm, smn, *_reach_strides(bias, key_bias))
    qk_scale = float(scale) * LOG2E
    like = lambda t: _strides4(torch.empty_like(t, device="meta"))  # noqa: E731  (empty_like's strides)
    plan = BackwardPlan()
    skip = skips_negligible(k_len) and bias is not None
    plan.delta_shape, plan.device, plan.norms = (batch, heads, q_len), q.device, NormPlan(k, key_bias) if skip else None
    floats = (qk_scale, float(scale), skip_log2(k_len))
    block = 16 if interpret_mode() else 64
    n_horizon = _cdiv(q_len, block)
    plan.horizon_shape = (batch, heads, n_horizon)
    consts = {"HEAD_DIM": head_dim, "BLOCK_D": bd, "BIAS": _bias_mode(bias, key_bias), "MASK": int(masked),
              "SKIP": skip}
    plan.delta = Launch(_device()._bwd_delta_kernel, (n_horizon, batch * heads, 1),
                        (*_strides4(out), *_strides4(grad), *_strides4(q), sbb, sbh, sbn, srb, heads, group, q_len,
                         k_len, qk_scale, skip_log2(k_len)), {**consts, "BLOCK_M": block}, num_warps=4, num_stages=1)
    common = (*_strides4(q), *_strides4(k), *_strides4(v), *_strides4(grad))
    consts["PREC"] = prec
    block_m, block_n, warps, stages = config_for("dkdv", head_dim, q.dtype, masked)
    plan.dkdv = Launch(_device()._bwd_dkdv_kernel, (_cdiv(k_len, block_n), batch * kv_heads, 1),
                       (*common, *like(k), *like(v), *tail, heads, group, q_len, k_len, n_horizon, *floats[:2]),
                       {**consts, "BLOCK_M": block_m, "BLOCK_N": block_n, "HBLOCK": block},
                       num_warps=warps, num_stages=stages)
    block_m, block_n, warps, stages = config_for("dq", head_dim, q.dtype, masked)
    plan.dq = Launch(_device()._bwd_dq_kernel, (_cdiv(q_len, block_m), batch * heads, 1),
                     (*common, *like(q), *tail, heads, group, q_len, k_len, k_len.bit_length(), *floats),
                     {**consts, "BLOCK_M": block_m, "BLOCK_N": block_n}, num_warps=warps, num_stages=stages)
    return plan
