"""The fused attention kernel's entries (host side): :func:`alibi_flash` and :func:`fused_attention`, the mask summary,
the custom ops ``torchembed::alibi_flash`` / ``torchembed::alibi_flash_backward`` and the autograd.

Press et al., "Train Short, Test Long", arXiv:2108.12409 (the bias); Dao, "FlashAttention-2", arXiv:2307.08691 (the
tiling). :mod:`torchembed.kernels.route` decides which calls come here; the plans are
:mod:`torchembed.kernels.attention_plan`'s, the device code :mod:`torchembed.kernels.attention_triton`'s, the oracle
:func:`torchembed.functional.alibi.alibi_attention_reference`. Eager calls launch the plan kept per call signature,
with gradients through :class:`_AlibiFlash`; ``torch.compile`` runs the custom ops (fake implementations:
``fullgraph=True``, CUDA graphs, no host sync), which compute the same function by the reference where the kernel cannot
run.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from torchembed.functional.alibi import alibi_attention_reference
from torchembed.kernels.attention_plan import kept_backward_plan, kept_plan, rows_launch
from torchembed.kernels.launch import kernel_can_run
from torchembed.kernels.route import flash_unsupported, mask_summary_on_kernel

__all__ = ["alibi_flash", "check_bias", "fused_attention", "mask_rows"]

_LN2 = 0.6931471805599453


def check_bias(bias: Optional[Tensor], key_bias: bool, q: Tensor, k: Tensor) -> Optional[Tensor]:
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
    """``(b, h, q, d)`` output over ``(b, q, h, d)`` memory (what the callers reshape to ``(b, q, h * d)`` next)."""
    b, h, m, d = q.shape
    return torch.empty(b, m, h, d, dtype=q.dtype, device=q.device).transpose(1, 2)


def mask_rows(keep: Tensor) -> Tensor:
    """The kernel's summary of a bool ``keep (b or 1, 1, q, k)`` mask (True = attend): ``(b or 1, 3, q)`` int32, per
    query row its first kept key, one past its last (0, 0 for a row that keeps none) and whether it keeps every key in
    between (0) or has holes (1). One pass over ``keep``; compute it once per mask and hand it to every layer (inside
    ``torch.compile``, where each layer computes it: tensor ops, which inductor fuses into the kernels around it)."""
    return rows_launch(keep) if mask_summary_on_kernel(keep) else _mask_rows_reference(keep)


def alibi_flash(q: Tensor, k: Tensor, v: Tensor, bias: Optional[Tensor], *, scale: float, key_bias: bool = False,
                keep: Optional[Tensor] = None, rows: Optional[Tensor] = None) -> Tensor:
    """Causal or masked attention with ALiBi computed inside one fused kernel.

    ``softmax(scale * q k^T + bias) v`` where the bias of query ``i`` and key ``j`` is ``slope_h * (j - i)``
    (``bias`` = slopes) or ``key_bias[b, h, j]`` (``key_bias=True``), up to a constant per query row (which softmax
    ignores). With slopes and at least ``AlibiTuning.skip_min_keys`` keys, keys whose weight is provably below
    ``2**-(32 + log2 keys)`` of their row's largest are not visited (``TORCHEMBED_ALIBI_SKIP=0``: every key); what
    they would add is below float32 rounding.

    Args:
        q: ``(b, h, q, d)``; k, v: ``(b, hk, k, d)`` with ``h`` a multiple of ``hk`` (GQA/MQA: each kv head serves
            ``h / hk`` query heads, nothing repeated). float16/bfloat16/float32, any strides (HF's ``(b, s, h, d)``
            memory viewed as ``(b, h, s, d)`` is read in place), ``d <= 256``.
        bias: slopes ``(h,)`` or (``key_bias=True``) a key-only bias ``(b or 1, h, k)``; used in float32.
            None: no bias (plain attention: what a patched RoPE model's decode steps run).
        scale: multiplies ``q k^T``.
        keep: ``(b or 1, 1, q, k)`` bool, True where a query may attend (padding, KV cache slots, any mask); None:
            causal with the queries at the last ``q`` of the ``k`` positions (``q <= k``).
        rows: :func:`mask_rows` of ``keep`` (computed here when not given).

    Returns:
        ``(b, h, q, d)`` in ``q.dtype`` (over ``(b, q, h, d)`` memory). A row that keeps no key is 0. float32
        accumulation and softmax; gradients flow to q, k, v (none to the bias or the mask).

    Raises:
        ValueError: inputs the kernel does not take (:func:`flash_unsupported` says why); a bias's wrong shape/device.
    """
    why = flash_unsupported(q, k, v, keep)
    if why is not None:
        raise ValueError(f"alibi_flash: {why}")
    return fused_attention(q, k, v, check_bias(bias, key_bias, q, k), scale=scale, key_bias=key_bias, keep=keep,
                           rows=rows)


def fused_attention(q: Tensor, k: Tensor, v: Tensor, bias: Optional[Tensor], *, scale: float, key_bias: bool = False,
                    keep: Optional[Tensor] = None, rows: Optional[Tensor] = None) -> Tensor:
    """:func:`alibi_flash` for inputs the caller checked (:func:`flash_unsupported` found nothing, the bias is
    :func:`check_bias`'s): the kept plan of a call like one made before, else a new plan, the custom op under
    ``torch.compile``, the autograd function where gradients are recorded."""
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    if keep is not None and rows is None:
        rows = mask_rows(keep)
    if torch.compiler.is_compiling():
        return torch.ops.torchembed.alibi_flash(q, k, v, bias, rows, keep, float(scale), bool(key_bias))[0]
    # (the one check below the route: alibi_flash is public, and computes by the reference where the kernel cannot run)
    plan = kept_plan(q, k, v, bias, rows, keep, scale, key_bias, grad) if kernel_can_run(q) and not _empty(q, k) else None
    if grad:
        return _AlibiFlash.apply(q, k, v, (bias, rows, keep, float(scale), bool(key_bias), plan))
    if plan is None:
        return _forward(q, k, v, bias, rows, keep, float(scale), bool(key_bias), False)[0]
    return plan(q, k, v, bias, rows, keep)[0]


def _forward(q, k, v, bias, rows, keep, scale, key_bias, need_lse) -> tuple[Tensor, Optional[Tensor], Optional[Tensor]]:
    """``(out, lse, bounds)``; the skip's bounds (None unless the kernel skipped negligible keys: key norms and the key
    bias's running maximum) spare the backward its own pass over the keys."""
    if kernel_can_run(q):  # (a custom op's body: the op runs wherever it is called, the reference where no kernel)
        if _empty(q, k):
            lse = torch.full(q.shape[:3], float("inf"), device=q.device) if need_lse else None
            return _out_like(q), lse, None
        return kept_plan(q, k, v, bias, rows, keep, scale, key_bias, need_lse)(q, k, v, bias, rows, keep)
    return (*_forward_reference(q, k, v, bias, rows, keep, scale, key_bias), None)


def _forward_reference(q, k, v, bias, rows, keep, scale, key_bias) -> tuple[Tensor, Tensor]:
    """The kernel's function by the reference (rows that keep nothing: 0), its log-sum-exp in base 2."""
    result = _out_like(q)
    out, lse = alibi_attention_reference(q, k, v, bias, keep, scale=scale, key_bias=key_bias, empty_rows="zero",
                                         return_lse=True)
    return result.copy_(out), torch.where(torch.isfinite(lse), lse / _LN2, float("inf"))


def _backward_reference(grad, q, k, v, bias, keep, scale, key_bias) -> tuple[Tensor, Tensor, Tensor]:
    """The kernel's gradients by the reference (autograd through it, in its float32 arithmetic)."""
    with torch.enable_grad():
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        out = alibi_attention_reference(*leaves, bias, keep, scale=scale, key_bias=key_bias, empty_rows="zero")
        return torch.autograd.grad(out, leaves, grad)


def _empty(q: Tensor, k: Tensor) -> bool:
    """No query, or no batch or head: nothing to launch (no key: the kernels write empty rows)."""
    return q.shape[2] == 0 or q.shape[0] * q.shape[1] == 0


def _backward_kernel(grad, q, k, v, out, lse, bias, rows, keep, scale, key_bias,
                     bounds: Optional[tuple[Tensor, Tensor]] = None, plan=None) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` by the kernels; ``plan``: the forward's, which keeps its backward plans by the output
    gradient's strides (else the backward plan is looked up by the whole signature)."""
    if _empty(q, k) or k.shape[2] == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    backward = kept_backward_plan(grad, q, k, v, out, bias, rows, keep, scale, key_bias, plan)
    return backward(grad, q, k, v, out, lse, bias, rows, keep, bounds)


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


@torch.library.custom_op("torchembed::alibi_flash", mutates_args=())
def _flash_op(q: Tensor, k: Tensor, v: Tensor, bias: Optional[Tensor], rows: Optional[Tensor], keep: Optional[Tensor],
              scale: float, key_bias: bool) -> tuple[Tensor, Tensor]:
    return _forward(q, k, v, bias, rows, keep, scale, key_bias, True)[:2]  # (out, lse)


@_flash_op.register_fake
def _flash_fake(q, k, v, bias, rows, keep, scale, key_bias):
    return _out_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("torchembed::alibi_flash_backward", mutates_args=())
def _flash_backward_op(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, bias: Optional[Tensor],
                       rows: Optional[Tensor], keep: Optional[Tensor], scale: float,
                       key_bias: bool) -> tuple[Tensor, Tensor, Tensor]:
    if not kernel_can_run(q):  # (a custom op's body defends itself: the reference where no kernel runs)
        return _backward_reference(grad, q, k, v, bias, keep, scale, key_bias)
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
    """Eager autograd of :func:`alibi_flash` (no custom-op dispatch, whose Python cost exceeds a small attention's);
    the op ``torchembed::alibi_flash`` registers the same backward for torch.compile.

    ``apply(q, k, v, call)`` with ``call = (bias, rows, keep, scale, key_bias, plan)``: what takes no gradient travels
    in one tuple (each argument of ``apply`` costs host time) and is kept on the context, as are the kernel's lse and
    the skip's bounds; ``plan``: the kept forward plan (None: the PyTorch implementation, or nothing to launch)."""

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
        if plan is None and not kernel_can_run(q):  # (the forward ran the reference: its backward too)
            return _backward_reference(grad_out, q, k, v, bias, keep, scale, key_bias)
        return _backward_kernel(grad_out, q, k, v, out, ctx.lse, bias, rows, keep, scale, key_bias, ctx.bounds, plan)
