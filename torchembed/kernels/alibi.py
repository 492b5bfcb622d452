"""ALiBi attention, host side: where each call runs, the fused kernels' plans and launches, their custom ops.

Press et al., "Train Short, Test Long", arXiv:2108.12409 (the bias); Dao, "FlashAttention-2", arXiv:2307.08691 (the
fused kernel's tiling). Device code: :mod:`torchembed.kernels.alibi_triton` (imported with Triton on the first launch);
the PyTorch reference: :func:`torchembed.functional.alibi.alibi_attention_reference`.

:func:`attention_path` decides, once per call and by the :class:`~torchembed.kernels.settings.AlibiPolicy`, where an
attention of ``ALiBiEmbedding.attention`` or a patched BLOOM, MPT or Falcon-ALiBi layer (``layer=True``) runs:

* ``"kernel"``: the fused kernel (:func:`fused_attention`; masks summarised by :func:`mask_rows`, grouped kv heads read
  in place, split-key decode): a layer's decode steps (one query, or up to :data:`DECODE_QUERIES` over a KV cache) and
  its prefills above the policy's bound;
* ``"dense"``: a layer's small CUDA prefill: SDPA with the bias materialised once per forward (:func:`prefill_bias`);
* ``"decode"``: a decode step with ``cudnn_decode`` (or no kernel): SDPA with the decode mask built once per forward;
* ``"reference"``: everything else (the CPU, ``fused=False``): the PyTorch reference.

Eager calls launch the plan kept per call signature (a repeated call skips validation), with gradients through
:class:`_AlibiFlash`; ``torch.compile`` runs the custom ops ``torchembed::alibi_flash``, ``alibi_flash_backward``
and ``alibi_prefill_bias`` (with fake implementations: ``fullgraph=True``, CUDA graphs, no host sync), which compute
the same function by the reference where the kernel cannot run (CPU, no ``TRITON_INTERPRET=1``); there the mask
summary is tensor ops, which inductor fuses into the kernels around it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from torchembed.functional.alibi import (alibi_attention_reference, alibi_decode_bias, alibi_key_bias,
                                         alibi_prefill_bias, causal_keep as _build_causal_keep)
from torchembed.kernels.launch import (FusedUnavailableError, Launch, Launches, interpret_mode, kernel_can_run,
                                       use_kernel)
from torchembed.kernels.per_forward import PerForward, derive
from torchembed.kernels.settings import changed, settings

__all__ = ["DECODE_QUERIES", "DTYPES", "MAX_HEAD_DIM", "alibi_attention", "alibi_flash", "attention_path", "causal_keep",
           "clear_plans", "flash_unsupported", "fused_attention", "mask_rows", "masked_sdpa", "prefill_bias",
           "prefill_path", "repeat_kv"]

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256
DECODE_QUERIES = 16  # a model's decode step, speculative ones included: at most this many new tokens
DECODE_ROWS = 64  # the split-key kernel takes calls of at most this many queries per kv head (GROUP * M)
_MAX_PROGRAMS = 65535  # grid axis 1 holds batch x heads
_LN2 = 0.6931471805599453
LOG2E = 1.4426950408889634
_KERNEL = "the fused ALiBi attention kernel"


# ------------------------------------------------------------------------------------------------
# Where a call runs
# ------------------------------------------------------------------------------------------------


def attention_path(q: Tensor, k: Tensor, v: Tensor, keep: Tensor | None, *, fused: bool | None, dropout_p: float,
                   layer: bool, sdpa_decode: bool = False) -> str:
    """``"kernel"``, ``"dense"``, ``"decode"`` or ``"reference"`` (the module docstring) for the attention of
    ``q (b, h, q, d)`` over ``k, v (b, hk, k, d)`` with ``keep``; ``"kernel"`` only where the kernel runs and takes
    these inputs. ``layer``: a model layer's call, whose forward shares what it derives across its layers; its decode
    steps take the split-key kernel, or with ``sdpa_decode`` (the patch's ``cudnn_decode``) SDPA with the decode mask.

    Raises:
        FusedUnavailableError: ``fused=True`` where the kernel cannot run or take the inputs, naming why.
    """
    kernel = fused is not False and use_kernel(fused, q, _KERNEL) and not dropout_p
    why = flash_unsupported(q, k, v, keep) if kernel else None
    if fused:
        if not kernel or why:
            raise FusedUnavailableError(f"fused=True: {_KERNEL} cannot take these inputs: "
                                        f"{why or 'it has no dropout (dropout_p > 0)'}; pass fused=None to run "
                                        "PyTorch's attention there")
        return "kernel"
    kernel = kernel and why is None
    q_len = q.shape[-2]
    if layer and not dropout_p and (q_len == 1 or DECODE_QUERIES >= q_len < k.shape[-2]):  # a decode step
        if kernel and not sdpa_decode:
            return "kernel"
        if q_len == 1:
            return "decode"
    if fused is None:
        policy = settings().policy
        if layer and _dense(q, k, policy):
            return "dense"
        if kernel and policy.prefill != "dense":
            return "kernel"
        if q_len != 1 and q.device.type in policy.dense_devices and not torch.compiler.is_compiling():
            return "dense"
    return "reference"


def _dense(q: Tensor, k: Tensor, policy) -> bool:
    """A model layer's prefill materialises the bias: a prefill on a dense device (outside ``torch.compile``)
    within the policy's bound (any size under ``prefill="dense"``)."""
    q_len = q.shape[-2]
    if q_len == 1 or q.device.type not in policy.dense_devices or torch.compiler.is_compiling() or policy.prefill == "kernel":
        return False
    if policy.prefill == "dense":
        return True
    elements = q.shape[0] * q.shape[1] * q_len * k.shape[-2]
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad)
    return elements <= (policy.dense_grad_max_elements if grad else policy.dense_max_elements)


def causal_keep(q_len: int, k_len: int, device: torch.device, cache: PerForward | None = None) -> Tensor:
    """The causal ``keep`` mask, queries at the last ``q_len`` of ``k_len`` positions: ``(1, 1, q, k)`` bool
    (:func:`torchembed.functional.alibi.causal_keep`), built once per forward given its ``cache``."""
    return derive(cache, None, ("causal", q_len, k_len, device), _build_causal_keep, q_len, k_len, device)


def prefill_path(path: str):
    """Within the block, CUDA prefill with ``fused=None`` takes ``path``: ``"auto"``, ``"kernel"`` or ``"dense"``
    (:class:`~torchembed.kernels.settings.AlibiPolicy`), e.g. to measure one against another.

    Raises:
        ValueError: an unknown path.
    """
    return changed(policy={"prefill": path})


# ------------------------------------------------------------------------------------------------
# The attention
# ------------------------------------------------------------------------------------------------


def alibi_attention(q: Tensor, k: Tensor, v: Tensor, key_bias: Tensor | None = None, keep: Tensor | None = None, *,
                    scale: float, dropout_p: float = 0.0, cache: PerForward | None = None, fused: bool | None = None,
                    slopes: Tensor | None = None, layer: bool = False, sdpa_decode: bool = False) -> Tensor:
    """Attention with ALiBi: ``softmax(scale * q k^T + bias | keep) v``.

    The bias is ``key_bias[b, h, j]`` (a key-only form, as the HF ALiBi models build it) or, given ``slopes``,
    ``slope_h * (j - i)``; either up to a constant per query row, which softmax ignores. Which implementation runs:
    :func:`attention_path` (the module docstring).

    Args:
        q: ``(b, h, q, d)``; k, v: ``(b, hk, k, d)``, ``h`` a multiple of ``hk`` (GQA/MQA).
        key_bias: ``(b or 1, h, k)``, any float dtype (used in float32); or None with ``slopes``.
        keep: ``(b or 1, 1, q, k)`` bool, True where a query may attend (HF's causal + padding mask, static-cache
            slots included). None: causal, queries at the last positions.
        scale: multiplies ``q k^T``.
        dropout_p: attention dropout (the fused kernel has none: SDPA runs it).
        cache: the forward's :class:`~torchembed.kernels.per_forward.PerForward`, where what is derived from ``keep``
            and ``key_bias`` is kept for the forward's other layers; pass the same ``key_bias`` tensor to every layer,
            e.g. via ``cache.memo``. None: nothing is kept.
        fused: None: the fastest measured path, PyTorch where the kernel cannot run; True: the fused kernel or
            :class:`FusedUnavailableError`; False: PyTorch operations only (SDPA with the materialised bias).
        slopes: ``(h,)`` per-head slopes, instead of ``key_bias``.
        layer: a model layer's call (see :func:`attention_path`).
        sdpa_decode: a layer's decode steps take SDPA with the decode mask, not the split-key kernel.

    Returns:
        ``(b, h, q, d)`` in ``q.dtype``. A query row that keeps no key: 0 from the kernel, the mean of ``v``
        (upstream's eager behaviour) from SDPA and the reference.

    Raises:
        FusedUnavailableError: ``fused=True`` where the kernel cannot run or take the inputs, naming why.
        ValueError: neither ``key_bias`` nor ``slopes``; a bias of the wrong shape or device.
    """
    if key_bias is None and slopes is None:
        raise ValueError("alibi_attention needs key_bias (b or 1, h, k) or slopes (h,)")
    path = attention_path(q, k, v, keep, fused=fused, dropout_p=dropout_p, layer=layer, sdpa_decode=sdpa_decode)
    if path == "decode":  # the mask is the same for every layer of the forward
        mask = derive(cache, (key_bias, slopes, keep), ("decode", q.dtype), _decode_mask, key_bias, slopes, keep, q, k)
        return masked_sdpa(q, k, v, mask, scale, dropout_p)
    if path == "dense":  # the materialised bias, once per forward
        if keep is None:
            keep = causal_keep(q.shape[-2], k.shape[-2], q.device, cache)
        tag = ("dense", q.shape[-2], q.dtype)
        mask = derive(cache, (key_bias, slopes, keep), tag, _dense_mask, key_bias, slopes, keep, q, k)
        return masked_sdpa(q, k, v, mask, scale, dropout_p)
    if path == "kernel":
        rows = None if keep is None else derive(cache, keep, "rows", mask_rows, keep)
        bias, is_key_bias = (slopes, False) if slopes is not None else (key_bias, True)
        bias = _check_bias(bias, is_key_bias, q, k)
        return fused_attention(q, k, v, bias, scale=scale, key_bias=is_key_bias, keep=keep, rows=rows)
    if key_bias is None:  # slope * (j - (k - 1)): zero at the newest key, small near it
        key_bias = alibi_key_bias(slopes.to(q.device), key_len=k.shape[-2])
    return alibi_attention_reference(q, k, v, key_bias, keep, scale=scale, dropout_p=dropout_p)


def _key_bias(key_bias: Tensor | None, slopes: Tensor | None, q: Tensor, k: Tensor) -> Tensor:
    """The ``(b or 1, h, k)`` key bias: ``key_bias``, else ``slope * (j - (k - 1))`` (0 at the newest key)."""
    return key_bias if key_bias is not None else alibi_key_bias(slopes.to(q.device), key_len=k.shape[-2])


def _decode_mask(key_bias: Tensor | None, slopes: Tensor | None, keep: Tensor | None, q: Tensor, k: Tensor) -> Tensor:
    """The SDPA mask of a decode step (:func:`torchembed.functional.alibi.alibi_decode_bias`)."""
    return alibi_decode_bias(_key_bias(key_bias, slopes, q, k), keep, q.dtype)


def _dense_mask(key_bias: Tensor | None, slopes: Tensor | None, keep: Tensor, q: Tensor, k: Tensor) -> Tensor:
    """The SDPA mask of a prefill, the bias materialised (:func:`prefill_bias`)."""
    return prefill_bias(_key_bias(key_bias, slopes, q, k), keep, q.dtype)


def masked_sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float, dropout_p: float) -> Tensor:
    """SDPA with an additive mask; a decode step broadcasts a multi-query kv head (as upstream's SDPA does) and reads
    grouped kv heads in place (``enable_gqa``), a prefill gets them repeated."""
    heads, kv_heads = q.shape[1], k.shape[1]
    if q.shape[-2] != 1 and kv_heads != heads:
        k, v = repeat_kv(k, heads), repeat_kv(v, heads)
    grouped = kv_heads not in (1, heads)  # a decode step: SDPA reads grouped kv heads in place
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale, enable_gqa=grouped)


def repeat_kv(x: Tensor, heads: int) -> Tensor:
    """``(b, hk, s, d) -> (b, heads, s, d)``, each kv head shared by ``heads / hk`` query heads, for SDPA with a bias
    (a stride-0 view for multi-query, ``hk = 1``; SDPA's own GQA broadcasts the same way)."""
    batch, kv, length, dim = x.shape
    if kv == heads:
        return x
    if kv == 1:
        return x.expand(batch, heads, length, dim)
    if heads % kv:
        raise ValueError(f"{heads} query heads are not a multiple of {kv} key/value heads")
    return x[:, :, None].expand(batch, kv, heads // kv, length, dim).reshape(batch, heads, length, dim)


# ------------------------------------------------------------------------------------------------
# The fused kernel: what it takes, its entries
# ------------------------------------------------------------------------------------------------


def flash_unsupported(q: Tensor, k: Tensor, v: Tensor, keep: Optional[Tensor] = None) -> Optional[str]:
    """Why the kernel cannot take these inputs, or None when it can (device aside: see
    :func:`torchembed.kernels.launch.kernel_can_run`). Python compares only (no tensor op, no sync)."""
    qs, ks, vs = q.shape, k.shape, v.shape
    if len(qs) != 4 or len(ks) != 4 or len(vs) != 4:
        return f"it takes 4-D (batch, heads, seq, dim) q, k, v, got {tuple(qs)}, {tuple(ks)}, {tuple(vs)}"
    dtype = q.dtype
    if dtype not in DTYPES or k.dtype != dtype or v.dtype != dtype:
        return f"it takes q, k, v of one dtype in float16/bfloat16/float32, got {dtype}, {k.dtype}, {v.dtype}"
    batch, heads, q_len, dim = qs
    kv_batch, kv_heads, k_len, kv_dim = ks
    if kv_batch != batch or kv_dim != dim or vs != ks:
        return f"it takes k, v (batch, kv_heads, seq_k, dim) matching q {tuple(qs)}, got {tuple(ks)}, {tuple(vs)}"
    if kv_heads == 0 or heads % kv_heads:
        return f"its query heads ({heads}) must be a multiple of the key/value heads ({kv_heads})"
    if not 1 <= dim <= MAX_HEAD_DIM:
        return f"it takes head dims 1..{MAX_HEAD_DIM}, got {dim}"
    if batch * heads > _MAX_PROGRAMS:
        return f"it takes batch x heads <= {_MAX_PROGRAMS}, got {batch * heads}"
    device = q.device
    if keep is None:
        if q_len > k_len:
            return f"causal attention needs seq_q <= seq_k (queries are the last keys), got {q_len} > {k_len}"
    else:
        ms = keep.shape
        if len(ms) != 4 or ms[1] != 1 or (ms[0] != 1 and ms[0] != batch) or ms[2] != q_len or ms[3] != k_len:
            return f"it takes keep (batch or 1, 1, {q_len}, {k_len}), got {tuple(ms)}"
        if keep.dtype != torch.bool:
            return f"it takes a bool keep mask, got {keep.dtype}"
    if k.device != device or v.device != device or (keep is not None and keep.device != device):
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
    """``(b, h, q, d)`` output over ``(b, q, h, d)`` memory (what the callers reshape to ``(b, q, h * d)`` next)."""
    b, h, m, d = q.shape
    return torch.empty(b, m, h, d, dtype=q.dtype, device=q.device).transpose(1, 2)


def mask_rows(keep: Tensor) -> Tensor:
    """The kernel's summary of a bool ``keep (b or 1, 1, q, k)`` mask (True = attend): ``(b or 1, 3, q)`` int32, per
    query row its first kept key, one past its last (0, 0 for a row that keeps none) and whether it keeps every key in
    between (0) or has holes (1). One pass over ``keep``; compute it once per mask and hand it to every layer (inside
    ``torch.compile``, where each layer computes it: tensor ops, which inductor fuses into the kernels around it)."""
    if torch.compiler.is_compiling() or not kernel_can_run(keep):
        return _mask_rows_reference(keep)
    return _rows_launch(keep)


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
    return fused_attention(q, k, v, _check_bias(bias, key_bias, q, k), scale=scale, key_bias=key_bias, keep=keep,
                           rows=rows)


def fused_attention(q: Tensor, k: Tensor, v: Tensor, bias: Optional[Tensor], *, scale: float, key_bias: bool = False,
                    keep: Optional[Tensor] = None, rows: Optional[Tensor] = None) -> Tensor:
    """:func:`alibi_flash` for inputs the caller checked (:func:`flash_unsupported` found nothing, the bias is
    :func:`_check_bias`'s): the kept plan of a call like one made before, else a new plan, the custom op under
    ``torch.compile``, the autograd function where gradients are recorded."""
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    if keep is not None and rows is None:
        rows = mask_rows(keep)
    if torch.compiler.is_compiling():
        return torch.ops.torchembed.alibi_flash(q, k, v, bias, rows, keep, float(scale), bool(key_bias))[0]
    plan = _plan(q, k, v, bias, rows, keep, scale, key_bias, grad) if kernel_can_run(q) and not _empty(q, k) else None
    if grad:
        return _AlibiFlash.apply(q, k, v, (bias, rows, keep, float(scale), bool(key_bias), plan))
    if plan is None:
        return _forward(q, k, v, bias, rows, keep, float(scale), bool(key_bias), False)[0]
    return plan(q, k, v, bias, rows, keep)[0]


# ------------------------------------------------------------------------------------------------
# Implementations shared by the eager path and the custom ops
# ------------------------------------------------------------------------------------------------


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


def _plan(q, k, v, bias, rows, keep, scale, key_bias, need_lse):
    """The kept :class:`ForwardPlan` of this call signature (made on a miss), for non-empty inputs the kernel takes."""
    key = _signature(q, k, v, bias, rows, keep, scale, key_bias, need_lse)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS.keep(key, forward_plan(q, k, v, bias, rows, keep, scale, key_bias, need_lse))
    return plan


def _forward(q, k, v, bias, rows, keep, scale, key_bias, need_lse) -> tuple[Tensor, Optional[Tensor], Optional[Tensor]]:
    """``(out, lse, bounds)``; the skip's bounds (None unless the kernel skipped negligible keys: key norms and the key
    bias's running maximum) spare the backward its own pass over the keys."""
    if kernel_can_run(q):
        if _empty(q, k):
            lse = torch.full(q.shape[:3], float("inf"), device=q.device) if need_lse else None
            return _out_like(q), lse, None
        return _plan(q, k, v, bias, rows, keep, scale, key_bias, need_lse)(q, k, v, bias, rows, keep)
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
    if plan is not None:
        backward = plan.backwards.get(grad.stride())
        if backward is None:
            backward = plan.backwards[grad.stride()] = backward_plan(grad, q, k, v, out, bias, rows, keep, scale,
                                                                     key_bias)
    else:
        key = ("backward", grad.shape, grad.stride(), out.stride(),
               *_signature(q, k, v, bias, rows, keep, scale, key_bias, True))
        backward = _PLANS.get(key)
        if backward is None:
            backward = _PLANS.keep(key, backward_plan(grad, q, k, v, out, bias, rows, keep, scale, key_bias))
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
        if plan is None and not kernel_can_run(q):
            return _backward_reference(grad_out, q, k, v, bias, keep, scale, key_bias)
        return _backward_kernel(grad_out, q, k, v, out, ctx.lse, bias, rows, keep, scale, key_bias, ctx.bounds, plan)


# ----------------------------------------------------------------------------------------------
# Block shapes, launches
# ----------------------------------------------------------------------------------------------

_FP32_CONFIG = {"fwd": (64, 32, 4, 2), "dq": (64, 32, 4, 2), "dkdv": (32, 64, 4, 2), "decode": (16, 32, 4, 2)}
_INTERPRET_CONFIG = {"fwd": (16, 16, 4, 1), "dq": (16, 16, 4, 1), "dkdv": (16, 16, 4, 1), "decode": (16, 16, 4, 1)}


@functools.cache
def _device():
    """:mod:`torchembed.kernels.alibi_triton` (which imports Triton), imported on the first launch."""
    from torchembed.kernels import alibi_triton

    return alibi_triton


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


def _out_strides(batch: int, heads: int, q_len: int, dim: int) -> tuple[int, int, int, int]:
    """``(B, H, M, D)`` strides over ``(B, M, H, D)`` memory (the output's layout)."""
    return (q_len * heads * dim, dim, heads * dim, 1)


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


def _rows_launch(keep: Tensor) -> Tensor:
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
        elif self.combine is None and not self.part:
            self.main((q, k, v, out, lse_t, bias, rows_t, keep_t))
        else:
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
    out_stride = _out_strides(batch, heads, q_len, head_dim)
    out4 = (0 if batch == 1 else out_stride[0], *out_stride[1:])
    strides = (*_strides4(q), *_strides4(k), *_strides4(v), *out4, *_bias_strides(bias, key_bias),
               *_mask_strides(rows, keep))
    qk_scale = float(scale) * LOG2E
    plan = ForwardPlan()
    plan.out_shape, plan.out_stride, plan.dtype, plan.device = (batch, heads, q_len, head_dim), out_stride, q.dtype, q.device
    plan.need_lse, plan.part, plan.combine, plan.prefill, plan.norms = need_lse, 0, None, False, None
    plan.backwards = {}
    if group * q_len <= DECODE_ROWS and (q_len < 16 or k_len >= 8 * q_len):
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
        if single:  # the decode kernel's signature has the workspace pointer: pass out in its place
            main = plan.main
            plan.main = lambda t, main=main: main((t[0], t[1], t[2], t[3], t[4], t[3], t[5], t[6], t[7]))
        else:
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


# ------------------------------------------------------------------------------------------------
# The prefill bias in one write
# ------------------------------------------------------------------------------------------------

_MAX_PROGRAMS_Z = 65535  # grid axis 2 of the kernel is b * h


def _shape(key_bias: Tensor, keep: Tensor) -> tuple[int, int, int, int]:
    """``(b, h, q, k)`` of the bias; ValueError naming the shapes that do not fit."""
    if key_bias.dim() != 3 or keep.dim() != 4 or keep.shape[1] != 1:
        raise ValueError(f"prefill_bias: key_bias must be (b or 1, h, k) and keep (b or 1, 1, q, k), got "
                         f"{tuple(key_bias.shape)} and {tuple(keep.shape)}")
    kb, heads, k_len = key_bias.shape
    mb, _, q_len, mk = keep.shape
    if mk != k_len or q_len > k_len or (kb != mb and 1 not in (kb, mb)):
        raise ValueError(f"prefill_bias: keep (b or 1, 1, q, k) must match key_bias (b or 1, h, k) with q <= k, got "
                         f"{tuple(keep.shape)} and {tuple(key_bias.shape)}")
    return max(kb, mb), heads, q_len, k_len


@torch.library.custom_op("torchembed::alibi_prefill_bias", mutates_args=())
def _bias_op(key_bias: Tensor, keep: Tensor, dtype: torch.dtype) -> Tensor:
    shape = _shape(key_bias, keep)
    if not kernel_can_run(key_bias):
        return alibi_prefill_bias(key_bias, keep, dtype)  # (b, h, q, k) already: keep is given
    return _write_bias(key_bias, keep, torch.empty(shape, dtype=dtype, device=key_bias.device))


@_bias_op.register_fake
def _bias_fake(key_bias: Tensor, keep: Tensor, dtype: torch.dtype) -> Tensor:
    return key_bias.new_empty(_shape(key_bias, keep), dtype=dtype)


def prefill_bias(key_bias: Tensor, keep: Tensor | None, dtype: torch.dtype) -> Tensor:
    """The SDPA mask of an ALiBi prefill, as :func:`torchembed.functional.alibi.alibi_prefill_bias`.

    Args:
        key_bias: ``(b or 1, h, k)`` float.
        keep: ``(b or 1, 1, q, k)`` bool (True = attend), or None (the reference's one-row form).
        dtype: of the result.

    Returns:
        ``(b, h, q, k)`` in ``dtype``: ``key_bias[j] - key_bias[k - q + i]`` where ``keep``, the finite minimum of
        ``dtype`` elsewhere; the subtraction in float32, rounded once. The Triton kernel where it can run (CUDA, or
        CPU under ``TRITON_INTERPRET=1``; float16/bfloat16/float32 results), else the PyTorch reference, with equal
        results. No gradient (ALiBi learns nothing).
    """
    if keep is not None and dtype in DTYPES and kernel_can_run(key_bias):
        shape = _shape(key_bias, keep)
        if (keep.dtype == torch.bool and keep.device == key_bias.device and key_bias.is_floating_point()
                and shape[0] * shape[1] <= _MAX_PROGRAMS_Z):
            if not torch.compiler.is_compiling():  # (eager: no op dispatch)
                return _write_bias(key_bias, keep, torch.empty(shape, dtype=dtype, device=key_bias.device))
            return torch.ops.torchembed.alibi_prefill_bias(key_bias, keep, dtype)
    return alibi_prefill_bias(key_bias, keep, dtype)


_BIAS_LAUNCHES = Launches(1024)  # prefill lengths are many: cleared when full
_BIAS_BLOCKS = (16, 256)  # (BLOCK_Q, BLOCK_K)


def _write_bias(key_bias: Tensor, keep: Tensor, out: Tensor) -> Tensor:
    """Write the bias into ``out`` ``(B, H, Q, K)`` (unit last-dim stride) from ``key_bias`` ``(B or 1, H, K)``
    and ``keep`` ``(B or 1, 1, Q, K)`` bool (checked by the caller), by the kernel; the launch is kept."""
    batch, heads, q_len, k_len = out.shape
    ints = (heads, q_len, k_len,
            key_bias.stride(0) if key_bias.shape[0] != 1 else 0, key_bias.stride(1), key_bias.stride(2),
            keep.stride(0) if keep.shape[0] != 1 else 0, keep.stride(2), keep.stride(3),
            out.stride(0), out.stride(1), out.stride(2))
    key = (key_bias.dtype, out.dtype, out.device, batch, ints)
    kept = _BIAS_LAUNCHES.get(key)
    if kept is None:
        block_q, block_k = _BIAS_BLOCKS
        emulate = interpret_mode() and out.dtype == torch.bfloat16  # the interpreter's cast truncates
        grid = (_cdiv(k_len, block_k), _cdiv(q_len, block_q), batch * heads)
        kept = _BIAS_LAUNCHES.keep(key, Launch(
            _device()._prefill_bias_kernel, grid, (*ints, torch.finfo(out.dtype).min),
            {"BLOCK_Q": block_q, "BLOCK_K": block_k, "EMULATE_RTNE": emulate}, num_warps=4))
    kept((key_bias, keep.view(torch.uint8), out))
    return out
