"""``alibi_flash``: fused ALiBi attention (one Triton kernel family), its custom ops and its autograd.

Press et al., arXiv:2108.12409 (ALiBi); Dao, arXiv:2307.08691 (FlashAttention-2). The bias is computed
inside the kernel from the per-head slopes (or read from a ``(b or 1, h, k)`` key-only bias); no
``(b, h, q, k)`` tensor of any kind is made. Kernels: :mod:`torchembed.kernels.alibi_flash_triton`.

Routes:

* eager: the launches of a plan kept per call signature (shapes, strides, dtypes, mask form, scale;
  a repeated call skips validation), with gradients through an ``autograd.Function`` whose backward
  plan is kept on the forward plan (no custom-op dispatch: its Python cost exceeds a small attention's);
* ``torch.compile``: the custom ops ``torchembed::alibi_flash(q, k, v, bias, rows?, keep?,
  scale, key_bias) -> (out, lse)`` with the backward ``torchembed::alibi_flash_backward`` registered
  as its autograd, and ``torchembed::alibi_mask_rows(keep) -> rows``; each has a fake implementation
  (``torch.compile(fullgraph=True)``, CUDA graphs: nothing syncs with the host).

Where the kernel cannot run (CPU without ``TRITON_INTERPRET=1``) the ops compute the same function
with PyTorch operations (materialising the scores), so they work on every device.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from torchembed.functional.alibi import causal_keep
from torchembed.kernels.availability import kernel_can_run
from torchembed.kernels.launch import Launches
from torchembed.kernels.availability import triton_disabled as _triton_disabled

__all__ = ["alibi_flash", "attempt", "clear_plans", "flash_unsupported", "mask_rows", "DECODE_QUERIES", "DTYPES",
           "MAX_HEAD_DIM"]

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256
DECODE_QUERIES = 16  # a model's decode step, speculative ones included: at most this many new tokens
_MAX_PROGRAMS = 65535  # grid axis 1 holds batch x heads
_LN2 = 0.6931471805599453

_triton = None


def _kernels():
    """``alibi_flash_triton`` (which imports Triton), imported on the first launch."""
    global _triton
    from torchembed.kernels import alibi_flash_triton

    _triton = alibi_flash_triton
    return _triton


# ------------------------------------------------------------------------------------------------
# What the kernel takes (Python compares only: no tensor op, no sync)
# ------------------------------------------------------------------------------------------------


def flash_unsupported(q: Tensor, k: Tensor, v: Tensor, keep: Optional[Tensor] = None) -> Optional[str]:
    """Why the kernel cannot take these inputs, or None when it can (device aside: see
    :func:`torchembed.kernels.availability.kernel_can_run`)."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return f"it takes 4-D (batch, heads, seq, dim) q, k, v, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
    if q.dtype not in DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"it takes q, k, v of one dtype in float16/bfloat16/float32, got {q.dtype}, {k.dtype}, {v.dtype}"
    batch, heads, q_len, dim = q.shape
    if k.shape[0] != batch or v.shape[0] != batch or k.shape[3] != dim or v.shape[3] != dim or v.shape[:3] != k.shape[:3]:
        return f"it takes k, v (batch, kv_heads, seq_k, dim) matching q {tuple(q.shape)}, got {tuple(k.shape)}, {tuple(v.shape)}"
    kv_heads = k.shape[1]
    if kv_heads == 0 or heads % kv_heads:
        return f"its query heads ({heads}) must be a multiple of the key/value heads ({kv_heads})"
    if not 1 <= dim <= MAX_HEAD_DIM:
        return f"it takes head dims 1..{MAX_HEAD_DIM}, got {dim}"
    if batch * heads > _MAX_PROGRAMS:
        return f"it takes batch x heads <= {_MAX_PROGRAMS}, got {batch * heads}"
    if keep is None:
        if q_len > k.shape[2]:
            return f"causal attention needs seq_q <= seq_k (queries are the last keys), got {q_len} > {k.shape[2]}"
    elif keep.dim() != 4 or keep.shape[1] != 1 or keep.shape[0] not in (1, batch) or keep.shape[2:] != (q_len, k.shape[2]):
        return f"it takes keep (batch or 1, 1, {q_len}, {k.shape[2]}), got {tuple(keep.shape)}"
    elif keep.dtype != torch.bool:
        return f"it takes a bool keep mask, got {keep.dtype}"
    if not (q.device == k.device == v.device) or (keep is not None and keep.device != q.device):
        return "it takes q, k, v (and keep) on one device"
    return None


def _check_bias(bias: Optional[Tensor], key_bias: bool, q: Tensor, k: Tensor) -> Optional[Tensor]:
    """The bias as the kernel reads it (float32; None: no bias); ValueError naming the shapes that do not fit."""
    if bias is None:
        return None
    heads = q.shape[1]
    if key_bias:
        if bias.dim() != 3 or bias.shape[0] not in (1, q.shape[0]) or bias.shape[1:] != (heads, k.shape[2]):
            raise ValueError(f"alibi_flash: key_bias must be (batch or 1, {heads}, {k.shape[2]}), got {tuple(bias.shape)}")
    elif bias.dim() != 1 or bias.shape[0] != heads:
        raise ValueError(f"alibi_flash: slopes must be ({heads},), got {tuple(bias.shape)}")
    if bias.device != q.device:
        raise ValueError(f"alibi_flash: the bias must be on q's device {q.device}, got {bias.device}")
    return bias if bias.dtype == torch.float32 else bias.float()


def _out_like(q: Tensor) -> Tensor:
    """``(b, h, q, d)`` output over ``(b, q, h, d)`` memory (what the callers reshape to ``(b, q, h * d)``
    next, for free)."""
    b, h, m, d = q.shape
    return torch.empty(b, m, h, d, dtype=q.dtype, device=q.device).transpose(1, 2)


# ------------------------------------------------------------------------------------------------
# PyTorch implementations (CPU without the interpreter): the same function, scores materialised
# ------------------------------------------------------------------------------------------------


def _keep_of(q: Tensor, k: Tensor, rows: Optional[Tensor], keep: Optional[Tensor]) -> Tensor:
    q_len, k_len = q.shape[2], k.shape[2]
    return keep if keep is not None else causal_keep(q_len, k_len, q.device)


def _scores(q: Tensor, k: Tensor, bias: Tensor, rows: Optional[Tensor], keep: Optional[Tensor], scale: float,
            key_bias: bool) -> tuple[Tensor, Tensor]:
    """Natural-log scores ``(b, h, q, k)`` in float32 (float64 stays) with -inf where masked, and keep."""
    compute = torch.promote_types(q.dtype, torch.float32)
    group = q.shape[1] // k.shape[1]
    kk = k.to(compute).repeat_interleave(group, 1)
    s = (q.to(compute) @ kk.transpose(-1, -2)) * scale
    k_len = k.shape[2]
    if bias is None:
        pass
    elif key_bias:
        s = s + bias.to(compute)[:, :, None, :]
    else:
        s = s + bias.to(compute)[None, :, None, None] * torch.arange(k_len, device=q.device, dtype=compute)
    mask = _keep_of(q, k, rows, keep)
    return s.masked_fill(~mask, float("-inf")), mask


def _forward_reference(q, k, v, bias, rows, keep, scale, key_bias) -> tuple[Tensor, Tensor]:
    s, _ = _scores(q, k, bias, rows, keep, scale, key_bias)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)  # rows that keep nothing: 0
    group = q.shape[1] // k.shape[1]
    out = _out_like(q)
    out.copy_(p @ v.to(p.dtype).repeat_interleave(group, 1))
    lse2 = torch.where(torch.isfinite(lse), lse / _LN2, float("inf")).float()  # base 2, as the kernel's
    return out, lse2


def _backward_reference(grad, q, k, v, out, lse, bias, rows, keep, scale, key_bias) -> tuple[Tensor, Tensor, Tensor]:
    s, _ = _scores(q, k, bias, rows, keep, scale, key_bias)
    p = torch.exp(s - (lse.to(s.dtype) * _LN2)[..., None]).nan_to_num(0.0)
    group = q.shape[1] // k.shape[1]
    compute = p.dtype
    g = grad.to(compute)
    vv = v.to(compute).repeat_interleave(group, 1)
    kk = k.to(compute).repeat_interleave(group, 1)
    dv = p.transpose(-1, -2) @ g
    dp = g @ vv.transpose(-1, -2)
    delta = (g * out.to(compute)).sum(-1, keepdim=True)
    ds = p * (dp - delta)
    dq = (ds @ kk) * scale
    dk = (ds.transpose(-1, -2) @ q.to(compute)) * scale

    def fold(x: Tensor, like: Tensor) -> Tensor:  # sum the query heads of each kv head
        b, _, n, d = x.shape
        return x.view(b, like.shape[1], group, n, d).sum(2).to(like.dtype)

    return dq.to(q.dtype), fold(dk, k), fold(dv, v)


def _mask_rows_reference(keep: Tensor) -> Tensor:
    kept = keep[:, 0]
    k_len = kept.shape[-1]
    count = kept.sum(-1, dtype=torch.int32)
    positions = torch.arange(k_len, device=keep.device, dtype=torch.int32)
    first = torch.where(kept, positions, k_len).amin(-1) if k_len else count
    last = torch.where(kept, positions, -1).amax(-1) if k_len else count - 1
    empty = count == 0
    lo = torch.where(empty, 0, first)
    hi = torch.where(empty, 0, last + 1)
    return torch.stack([lo, hi, (count != hi - lo).to(torch.int32)], 1).to(torch.int32)


# ------------------------------------------------------------------------------------------------
# Implementations shared by the eager path and the custom ops
# ------------------------------------------------------------------------------------------------


# Plans (``alibi_flash_triton.ForwardPlan`` / ``BackwardPlan``) by call signature: everything the
# launches were derived from, so a hit needs no validation. Cleared when full (many prefill lengths).
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


def _plan(q, k, v, bias, rows, keep, scale, key_bias, need_lse):
    """The kept :class:`~torchembed.kernels.alibi_flash_triton.ForwardPlan` of this call signature
    (made and kept on a miss); for non-empty inputs the kernel takes (see :func:`_forward`)."""
    key = _signature(q, k, v, bias, rows, keep, scale, key_bias, need_lse)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS.keep(key, (_triton or _kernels()).forward_plan(q, k, v, bias, rows, keep, scale, key_bias, need_lse))
    return plan


def _forward(q, k, v, bias, rows, keep, scale, key_bias,
             need_lse) -> tuple[Tensor, Optional[Tensor], Optional[Tensor]]:
    """``(out, lse, bounds)``; the skip's bounds (None unless the kernel skipped negligible keys: key
    norms and the key bias's running maximum) spare the backward its own pass over the keys."""
    if not kernel_can_run(q):
        return (*_forward_reference(q, k, v, bias, rows, keep, scale, key_bias), None)
    if _empty(q, k):
        lse = torch.full(q.shape[:3], float("inf"), device=q.device) if need_lse else None
        return _out_like(q), lse, None
    return _plan(q, k, v, bias, rows, keep, scale, key_bias, need_lse)(q, k, v, bias, rows, keep)


def _empty(q: Tensor, k: Tensor) -> bool:
    """No query, or no batch or head: nothing to launch (no key: the kernels write empty rows)."""
    return q.shape[2] == 0 or q.shape[0] * q.shape[1] == 0


def _backward_kernel(grad, q, k, v, out, lse, bias, rows, keep, scale, key_bias,
                     bounds: Optional[tuple[Tensor, Tensor]] = None, plan=None) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` by the kernels; ``plan``: the forward's, which keeps its backward plans by the
    output gradient's strides (else the backward plan is looked up by the whole signature)."""
    if q.shape[2] == 0 or k.shape[2] == 0 or q.shape[0] * q.shape[1] == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    if plan is not None:
        backward = plan.backwards.get(grad.stride())
        if backward is None:
            backward = plan.backwards[grad.stride()] = _triton.backward_plan(grad, q, k, v, out, bias, rows, keep,
                                                                            scale, key_bias)
        return backward(grad, q, k, v, out, lse, bias, rows, keep, bounds)
    key = ("backward", grad.shape, grad.stride(), out.stride(), *_signature(q, k, v, bias, rows, keep, scale,
                                                                           key_bias, True))
    backward = _PLANS.get(key)
    if backward is None:
        backward = _PLANS.keep(key, (_triton or _kernels()).backward_plan(grad, q, k, v, out, bias, rows, keep, scale,
                                                                     key_bias))
    return backward(grad, q, k, v, out, lse, bias, rows, keep, bounds)


def _mask_rows(keep: Tensor) -> Tensor:
    if not kernel_can_run(keep):
        return _mask_rows_reference(keep)
    return (_triton or _kernels()).mask_rows(keep)


@torch.library.custom_op("torchembed::alibi_mask_rows", mutates_args=())
def _mask_rows_op(keep: Tensor) -> Tensor:
    return _mask_rows(keep)


@_mask_rows_op.register_fake
def _mask_rows_fake(keep):
    return keep.new_empty((keep.shape[0], 3, keep.shape[2]), dtype=torch.int32)


@torch.library.custom_op("torchembed::alibi_flash", mutates_args=())
def _flash_op(q: Tensor, k: Tensor, v: Tensor, bias: Optional[Tensor], rows: Optional[Tensor], keep: Optional[Tensor],
              scale: float, key_bias: bool) -> tuple[Tensor, Tensor]:
    out, lse, _ = _forward(q, k, v, bias, rows, keep, scale, key_bias, True)
    return out, lse


@_flash_op.register_fake
def _flash_fake(q, k, v, bias, rows, keep, scale, key_bias):
    return _out_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("torchembed::alibi_flash_backward", mutates_args=())
def _flash_backward_op(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, bias: Optional[Tensor],
                       rows: Optional[Tensor], keep: Optional[Tensor], scale: float,
                       key_bias: bool) -> tuple[Tensor, Tensor, Tensor]:
    if not kernel_can_run(q):
        return _backward_reference(grad, q, k, v, out, lse, bias, rows, keep, scale, key_bias)
    return _backward_kernel(grad, q, k, v, out, lse, bias, rows, keep, scale, key_bias)


@_flash_backward_op.register_fake
def _flash_backward_fake(grad, q, k, v, out, lse, bias, rows, keep, scale, key_bias):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, bias, rows, keep, scale, key_bias = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, bias, rows, keep)
    ctx.scale, ctx.key_bias = scale, key_bias
    ctx.mark_non_differentiable(lse)


def _backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse, bias, rows, keep = ctx.saved_tensors
    dq, dk, dv = torch.ops.torchembed.alibi_flash_backward(grad_out, q, k, v, out, lse, bias, rows, keep, ctx.scale,
                                                           ctx.key_bias)
    return dq, dk, dv, None, None, None, None, None


_flash_op.register_autograd(_backward, setup_context=_setup_context)


class _AlibiFlash(torch.autograd.Function):
    """Eager autograd of :func:`alibi_flash` (no custom-op dispatch, whose Python cost exceeds a small
    attention's); the op ``torchembed::alibi_flash`` registers the same backward for torch.compile.

    ``apply(q, k, v, call)`` with ``call = (bias, rows, keep, scale, key_bias, plan)``: what takes no
    gradient travels in one tuple (each argument of ``apply`` costs host time) and is kept on the
    context, as are the kernel's own lse and the skip's bounds; ``plan``: the kept forward plan (None: the
    PyTorch implementation, or nothing to launch)."""

    @staticmethod
    def forward(ctx, q, k, v, call):
        bias, rows, keep, scale, key_bias, plan = call
        if plan is None:
            out, lse, bounds = _forward(q, k, v, bias, rows, keep, scale, key_bias, True)
        else:
            out, lse, bounds = plan(q, k, v, bias, rows, keep)
        ctx.save_for_backward(q, k, v, out)
        ctx.call, ctx.lse, ctx.bounds = call, lse, bounds
        return out

    @staticmethod
    def backward(ctx, grad_out):
        if torch.is_grad_enabled():  # create_graph=True: gradients that say they cannot be differentiated
            return _AlibiFlash._backward_once(ctx, grad_out)
        return (*_AlibiFlash._gradients(ctx, grad_out), None)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def _backward_once(ctx, grad_out):
        return (*_AlibiFlash._gradients(ctx, grad_out), None)

    @staticmethod
    def _gradients(ctx, grad_out) -> tuple[Tensor, Tensor, Tensor]:
        q, k, v, out = ctx.saved_tensors
        bias, rows, keep, scale, key_bias, plan = ctx.call
        if plan is None and not kernel_can_run(q):
            return _backward_reference(grad_out, q, k, v, out, ctx.lse, bias, rows, keep, scale, key_bias)
        return _backward_kernel(grad_out, q, k, v, out, ctx.lse, bias, rows, keep, scale, key_bias, ctx.bounds, plan)


# ------------------------------------------------------------------------------------------------
# Public entry points
# ------------------------------------------------------------------------------------------------


def mask_rows(keep: Tensor) -> Tensor:
    """The kernel's summary of a bool ``keep (b or 1, 1, q, k)`` mask (True = attend): ``(b or 1, 3, q)``
    int32, per query row its first kept key, one past its last (0, 0 for a row that keeps none) and
    whether it keeps every key in between (0) or has holes (1). One pass over ``keep``; compute it once
    per mask and hand it to every layer."""
    if torch.compiler.is_compiling():
        return torch.ops.torchembed.alibi_mask_rows(keep)
    return _mask_rows(keep)


def alibi_flash(q: Tensor, k: Tensor, v: Tensor, bias: Optional[Tensor], *, scale: float, key_bias: bool = False,
                keep: Optional[Tensor] = None, rows: Optional[Tensor] = None) -> Tensor:
    """Causal or masked attention with ALiBi computed inside one fused kernel.

    ``softmax(scale * q k^T + bias) v`` where the bias of query ``i`` and key ``j`` is
    ``slope_h * (j - i)`` (``bias`` = slopes) or ``key_bias[b, h, j]`` (``key_bias=True``), up to a
    constant per query row (which softmax ignores). With slopes and at least
    ``AlibiTuning.skip_min_keys`` keys, keys whose weight is provably below
    ``2**-(32 + log2 keys)`` of their row's largest are not visited (``TORCHEMBED_ALIBI_SKIP=0``: every
    key); what they would add is below float32 rounding.

    Args:
        q: ``(b, h, q, d)``; k, v: ``(b, hk, k, d)`` with ``h`` a multiple of ``hk`` (GQA/MQA: each kv
            head serves ``h / hk`` query heads, nothing repeated). float16/bfloat16/float32, any
            strides (HF's ``(b, s, h, d)`` memory viewed as ``(b, h, s, d)`` is read in place),
            ``d <= 256``.
        bias: slopes ``(h,)`` or (``key_bias=True``) a key-only bias ``(b or 1, h, k)``; used in float32.
            None: no bias (plain attention: what a patched RoPE model's decode steps run).
        scale: multiplies ``q k^T``.
        keep: ``(b or 1, 1, q, k)`` bool, True where a query may attend (padding, KV cache slots, any
            mask); None: causal with the queries at the last ``q`` of the ``k`` positions (``q <= k``).
        rows: :func:`mask_rows` of ``keep`` (computed here when not given).

    Returns:
        ``(b, h, q, d)`` in ``q.dtype`` (over ``(b, q, h, d)`` memory). A row that keeps no key is 0.
        float32 accumulation and softmax; gradients flow to q, k, v (none to the bias or the mask).

    Raises:
        ValueError: inputs the kernel does not take (:func:`flash_unsupported` says why), a bias of
            the wrong shape or device.
    """
    out = attempt(q, k, v, bias, scale=scale, key_bias=key_bias, keep=keep, rows=rows)
    if isinstance(out, str):
        raise ValueError(f"alibi_flash: {out}")
    return out


def attempt(q: Tensor, k: Tensor, v: Tensor, bias: Optional[Tensor], *, scale: float, key_bias: bool = False,
            keep: Optional[Tensor] = None, rows: Optional[Tensor] = None) -> Tensor | str:
    """:func:`alibi_flash`, or the reason it does not take these inputs (:func:`flash_unsupported`)
    instead of a ValueError: what a dispatcher calls, validating once."""
    compiling = torch.compiler.is_compiling()
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    if not compiling and (keep is None or rows is not None) and not _triton_disabled():
        # a call like one made before: its plan, no validation (the signature implies it)
        plan = _PLANS.get(_signature(q, k, v, bias, rows, keep, scale, key_bias, grad))
        if (plan is not None and type(q) is Tensor and type(k) is Tensor and type(v) is Tensor
                and (q.is_cuda or kernel_can_run(q))):
            if grad:
                return _AlibiFlash.apply(q, k, v, (bias, rows, keep, scale, key_bias, plan))
            return plan(q, k, v, bias, rows, keep)[0]
    why = flash_unsupported(q, k, v, keep)
    if why is not None:
        return why
    bias = _check_bias(bias, key_bias, q, k)
    if keep is not None and rows is None:
        rows = mask_rows(keep)
    scale = float(scale)
    key_bias = bool(key_bias)
    if compiling:
        return torch.ops.torchembed.alibi_flash(q, k, v, bias, rows, keep, scale, key_bias)[0]
    if grad:
        plan = None
        if kernel_can_run(q) and not _empty(q, k):
            plan = _plan(q, k, v, bias, rows, keep, scale, key_bias, True)
        return _AlibiFlash.apply(q, k, v, (bias, rows, keep, scale, key_bias, plan))
    return _forward(q, k, v, bias, rows, keep, scale, key_bias, False)[0]
