"""ALiBi attention (host side), Press et al., "Train Short, Test Long", arXiv:2108.12409: :func:`alibi_attention`
runs :func:`torchembed.kernels.route.alibi_path`'s answer (the fused attention kernel, SDPA with the decode mask or the
materialised prefill bias, or the PyTorch reference); the masks SDPA takes; the prefill bias in one write (custom op
``torchembed::alibi_prefill_bias``; device code :mod:`torchembed.kernels.alibi_triton`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from torchembed.functional.alibi import (alibi_attention_reference, alibi_decode_bias, alibi_key_bias,
                                         alibi_prefill_bias, causal_keep as _build_causal_keep)
from torchembed.kernels.attention import check_bias, fused_attention, mask_rows
from torchembed.kernels.launch import Launch, Launches, interpret_mode, kernel_can_run
from torchembed.kernels.per_forward import PerForward, derive
from torchembed.kernels.route import alibi_path, bias_on_kernel
from torchembed.kernels.settings import changed

__all__ = ["alibi_attention", "causal_keep", "masked_sdpa", "prefill_bias", "prefill_path", "repeat_kv"]


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


def alibi_attention(q: Tensor, k: Tensor, v: Tensor, key_bias: Tensor | None = None, keep: Tensor | None = None, *,
                    scale: float, dropout_p: float = 0.0, cache: PerForward | None = None, fused: bool | None = None,
                    slopes: Tensor | None = None, layer: bool = False, sdpa_decode: bool = False) -> Tensor:
    """Attention with ALiBi: ``softmax(scale * q k^T + bias | keep) v``.

    The bias is ``key_bias[b, h, j]`` (a key-only form, as the HF ALiBi models build it) or, given ``slopes``,
    ``slope_h * (j - i)``; either up to a constant per query row, which softmax ignores. Which implementation runs:
    :func:`torchembed.kernels.route.alibi_path`.

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
        layer: a model layer's call (see :func:`~torchembed.kernels.route.alibi_path`).
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
    args = (q, k, v, key_bias, slopes, keep, fused, dropout_p, layer, sdpa_decode, cache)
    if cache is None:
        path, prepared = _route(*args)
    else:  # every layer of the forward asks the same: decided and prepared once (keyed by what the answer reads)
        grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
        tag = ("route", q.shape, k.shape, v.shape, q.dtype, q.device, fused, dropout_p, layer, sdpa_decode, grad)
        path, prepared = cache.memo((key_bias, slopes, keep), tag, _route, *args)
    if path == "kernel":
        bias, is_key_bias, rows = prepared
        return fused_attention(q, k, v, bias, scale=scale, key_bias=is_key_bias, keep=keep, rows=rows)
    if path != "reference":
        return masked_sdpa(q, k, v, prepared, scale, dropout_p)
    return alibi_attention_reference(q, k, v, _key_bias(key_bias, slopes, q, k), keep, scale=scale, dropout_p=dropout_p)


def _route(q: Tensor, k: Tensor, v: Tensor, key_bias: Tensor | None, slopes: Tensor | None, keep: Tensor | None,
           fused: bool | None, dropout_p: float, layer: bool, sdpa_decode: bool, cache: PerForward | None) -> tuple:
    """:func:`~torchembed.kernels.route.alibi_path`'s answer and what it runs with: the SDPA mask (``"decode"``,
    ``"dense"``), the kernel's float32 bias, its kind and the mask's row summary (``"kernel"``), or nothing."""
    path = alibi_path(q, k, v, keep, fused=fused, dropout_p=dropout_p, layer=layer, sdpa_decode=sdpa_decode)
    if path == "decode" or path == "dense":  # dense: the materialised bias
        if keep is None and path == "dense":
            keep = causal_keep(q.shape[-2], k.shape[-2], q.device, cache)
        return path, _sdpa_mask(path, key_bias, slopes, keep, q, k)
    if path == "kernel":
        rows = None if keep is None else mask_rows(keep)  # (once per forward: the route is kept whole)
        bias, is_key_bias = (slopes, False) if slopes is not None else (key_bias, True)
        return path, (check_bias(bias, is_key_bias, q, k), is_key_bias, rows)
    return path, None


def _key_bias(key_bias: Tensor | None, slopes: Tensor | None, q: Tensor, k: Tensor) -> Tensor:
    """The ``(b or 1, h, k)`` key bias: ``key_bias``, else ``slope * (j - (k - 1))`` (0 at the newest key)."""
    return key_bias if key_bias is not None else alibi_key_bias(slopes.to(q.device), key_len=k.shape[-2])


def _sdpa_mask(path: str, key_bias: Tensor | None, slopes: Tensor | None, keep: Tensor | None, q: Tensor,
               k: Tensor) -> Tensor:
    """The SDPA mask of a decode step (:func:`torchembed.functional.alibi.alibi_decode_bias`) or of a prefill, the
    bias materialised (:func:`prefill_bias`)."""
    return (alibi_decode_bias if path == "decode" else prefill_bias)(_key_bias(key_bias, slopes, q, k), keep, q.dtype)


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


# --- The prefill bias in one write --------------------------------------------------------------


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
    if not kernel_can_run(key_bias):  # (a custom op's body defends itself: the reference where no kernel runs)
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
    if keep is None or not bias_on_kernel(key_bias, keep, dtype):
        return alibi_prefill_bias(key_bias, keep, dtype)
    shape = _shape(key_bias, keep)  # (ValueError naming the shapes that do not fit)
    if torch.compiler.is_compiling():
        return torch.ops.torchembed.alibi_prefill_bias(key_bias, keep, dtype)
    return _write_bias(key_bias, keep, torch.empty(shape, dtype=dtype, device=key_bias.device))


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
        from torchembed.kernels import alibi_triton  # (imports Triton)

        block_q, block_k = _BIAS_BLOCKS
        emulate = interpret_mode() and out.dtype == torch.bfloat16  # the interpreter's cast truncates
        grid = (-(-k_len // block_k), -(-q_len // block_q), batch * heads)
        kept = _BIAS_LAUNCHES.keep(key, Launch(
            alibi_triton.prefill_bias_kernel, grid, (*ints, torch.finfo(out.dtype).min),
            {"BLOCK_Q": block_q, "BLOCK_K": block_k, "EMULATE_RTNE": emulate}, num_warps=4))
    kept((key_bias, keep.view(torch.uint8), out))
    return out
