from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from torchembed.functional.alibi import alibi_attention_reference, alibi_decode_bias, alibi_key_bias, causal_keep as _build_causal_keep
from torchembed.kernels.alibi_bias import prefill_bias
from torchembed.kernels.alibi_flash import DECODE_QUERIES, attempt, flash_unsupported, mask_rows
from torchembed.kernels.availability import FusedUnavailableError, use_kernel
from torchembed.kernels.per_forward import PerForward

__all__ = ["AlibiPolicy", "alibi_attention", "attention_path", "causal_keep", "fallback_path", "masked_sdpa", "policy",
           "policy_changed", "prefill_path", "repeat_kv"]

PREFILL_PATHS = ("auto", "kernel", "dense")


@dataclass(frozen=True)
class AlibiPolicy:
    """What :func:`attention_path` decides with (:func:`policy`, :func:`policy_changed`).

    ``prefill``: ``"auto"`` (the materialised bias up to the bounds below, else the kernel), ``"kernel"``
    (the kernel at every size) or ``"dense"`` (the materialised bias at every size); the process-wide
    default from ``TORCHEMBED_ALIBI_PREFILL``. ``dense_max_elements``: bias elements (b * h * q * k) up to
    which a model layer's prefill materialises the bias (2**26: 128 MB of bf16; beyond, memory quadratic
    in the length); ``dense_grad_max_elements``: the same with gradients recorded (per layer the kernel's
    forward + backward is ahead from 4 x 16 x 2048^2 on, 0.51 vs 1.01 ms). ``dense_devices``: device
    types whose prefill may take the materialised bias (tests add "cpu" to exercise it). A model layer's
    decode step (at most ``DECODE_QUERIES`` queries) takes the split-key decode kernel wherever it runs."""

    prefill: str = "auto"
    dense_max_elements: int = 2**26
    dense_grad_max_elements: int = 2**26
    dense_devices: tuple[str, ...] = ("cuda",)

    def __post_init__(self) -> None:
        if self.prefill not in PREFILL_PATHS:
            raise ValueError(f"the prefill path must be one of {PREFILL_PATHS}, got {self.prefill!r}")


_policy = AlibiPolicy(prefill=os.environ.get("TORCHEMBED_ALIBI_PREFILL", "auto"))


def policy() -> AlibiPolicy:
    """The policy in force."""
    return _policy


@contextlib.contextmanager
def policy_changed(**changes: Any) -> Iterator[AlibiPolicy]:
    """Within the block, the policy in force with ``changes`` (:class:`AlibiPolicy` fields).

    Raises:
        ValueError: an unknown prefill path; TypeError: a name that is not a field.
    """
    global _policy
    previous, _policy = _policy, dataclasses.replace(_policy, **changes)
    try:
        yield _policy
    finally:
        _policy = previous


def prefill_path(path: str) -> contextlib.AbstractContextManager:
    """Within the block, CUDA prefill with ``fused=None`` takes ``path``: ``"auto"``, ``"kernel"`` or
    ``"dense"`` (:class:`AlibiPolicy`), e.g. to measure one against another.

    Raises:
        ValueError: an unknown path.
    """
    return policy_changed(prefill=path)


# ------------------------------------------------------------------------------------------------
# The decision
# ------------------------------------------------------------------------------------------------


def attention_path(q: Tensor, k: Tensor, *, fused: bool | None, dropout_p: float, layer: bool,
                   sdpa_decode: bool = False) -> str:
    """``"kernel"``, ``"dense"``, ``"decode"`` or ``"reference"`` (the module docstring) for the attention
    of ``q (b, h, q, d)`` over ``k (b, hk, k, d)``: the one place that decides. ``layer``: the call is a
    model layer's, whose forward shares what it derives across its layers (decode steps and small
    prefills are bound by host time there); its decode steps (one query, or up to ``DECODE_QUERIES``
    over a KV cache) take
    the split-key kernel where it runs, or SDPA with the decode mask (``sdpa_decode``: the patch's
    ``cudnn_decode``). ``"kernel"`` may still fall back at run time where the kernel does not take the
    inputs (:func:`fallback_path`)."""
    if fused:
        use_kernel(fused, q, _KERNEL)  # (raises where it cannot run)
        return "kernel"
    q_len = q.shape[-2]
    if layer and (q_len == 1 or DECODE_QUERIES >= q_len < k.shape[-2]) and dropout_p == 0.0:  # over a KV cache
        if fused is None and not sdpa_decode and use_kernel(None, q, _KERNEL):
            return "kernel"
        if q_len == 1:
            return "decode"
    if fused is None:
        if layer and _dense(q, k):
            return "dense"
        if _policy.prefill != "dense" and not dropout_p and use_kernel(fused, q, _KERNEL):
            return "kernel"
    return fallback_path(q, fused)


_KERNEL = "the fused ALiBi attention kernel"


def fallback_path(q: Tensor, fused: bool | None) -> str:
    """Where a call goes that the kernel does not take: the materialised bias for a CUDA prefill with
    ``fused=None`` (outside ``torch.compile``), else the PyTorch reference."""
    if fused is None and q.shape[-2] != 1 and q.device.type in _policy.dense_devices and not torch.compiler.is_compiling():
        return "dense"
    return "reference"


def _dense(q: Tensor, k: Tensor) -> bool:
    """A model layer's prefill materialises the bias: a prefill on a dense device (outside
    ``torch.compile``) within the policy's bound (any size under ``prefill="dense"``)."""
    p = _policy
    q_len = q.shape[-2]
    if q_len == 1 or q.device.type not in p.dense_devices or torch.compiler.is_compiling() or p.prefill == "kernel":
        return False
    if p.prefill == "dense":
        return True
    elements = q.shape[0] * q.shape[1] * q_len * k.shape[-2]
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad)
    return elements <= (p.dense_grad_max_elements if grad else p.dense_max_elements)


def causal_keep(q_len: int, k_len: int, device: torch.device, cache: PerForward | None = None) -> Tensor:
    """The causal ``keep`` mask, queries at the last ``q_len`` of ``k_len`` positions: ``(1, 1, q, k)``
    bool (:func:`torchembed.functional.alibi.causal_keep`), built once per forward given its ``cache``."""
    make = lambda: _build_causal_keep(q_len, k_len, device)  # noqa: E731
    return make() if cache is None else cache.memo(None, ("causal", q_len, k_len, device), make)


# ------------------------------------------------------------------------------------------------
# The attention
# ------------------------------------------------------------------------------------------------


def alibi_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    key_bias: Tensor | None = None,
    keep: Tensor | None = None,
    *,
    scale: float,
    dropout_p: float = 0.0,
    cache: PerForward | None = None,
    fused: bool | None = None,
    slopes: Tensor | None = None,
    layer: bool = False,
    sdpa_decode: bool = False,
) -> Tensor:
    """Attention with ALiBi: ``softmax(scale * q k^T + bias | keep) v``.

    The bias is ``key_bias[b, h, j]`` (a key-only form, as the HF ALiBi models build it) or, given
    ``slopes``, ``slope_h * (j - i)``; either up to a constant per query row, which softmax ignores.
    Which implementation runs: :func:`attention_path` (the module docstring).

    Args:
        q: ``(b, h, q, d)``; k, v: ``(b, hk, k, d)``, ``h`` a multiple of ``hk`` (GQA/MQA).
        key_bias: ``(b or 1, h, k)``, any float dtype (used in float32); or None with ``slopes``.
        keep: ``(b or 1, 1, q, k)`` bool, True where a query may attend (HF's causal + padding
            mask, static-cache slots included). None: causal, queries at the last positions.
        scale: multiplies ``q k^T``.
        dropout_p: attention dropout (the fused kernel has none: SDPA runs it).
        cache: the forward's :class:`~torchembed.kernels.per_forward.PerForward`, where what is derived
            from ``keep`` and ``key_bias`` is kept for the other layers of the forward; pass the same
            ``key_bias`` tensor to every layer, e.g. via ``cache.memo``. None: nothing is kept.
        fused: None: the fastest measured path (module docstring), PyTorch where the kernel cannot
            run; True: the fused kernel or :class:`FusedUnavailableError`; False: PyTorch operations
            only (SDPA with the materialised bias).
        slopes: ``(h,)`` per-head slopes, instead of ``key_bias``.
        layer: a model layer's call (see :func:`attention_path`).
        sdpa_decode: a layer's decode steps take SDPA with the decode mask, not the split-key kernel.

    Returns:
        ``(b, h, q, d)`` in ``q.dtype``. A query row that keeps no key: 0 from the kernel, the mean of
        ``v`` (upstream's eager behaviour) from SDPA.

    Raises:
        FusedUnavailableError: ``fused=True`` where the kernel cannot run, naming why.
        ValueError: neither ``key_bias`` nor ``slopes``.
    """
    if key_bias is None and slopes is None:
        raise ValueError("alibi_attention needs key_bias (b or 1, h, k) or slopes (h,)")
    path = attention_path(q, k, fused=fused, dropout_p=dropout_p, layer=layer, sdpa_decode=sdpa_decode)
    if path == "kernel":
        why = "it has no dropout (dropout_p > 0)"
        if not dropout_p:
            out = _flash(q, k, v, key_bias, slopes, keep, scale, cache)
            if not isinstance(out, str):
                return out
            why = out
        if fused:
            raise FusedUnavailableError(f"fused=True: the fused ALiBi attention kernel cannot take these inputs: {why}; "
                                        "pass fused=None to run PyTorch's attention there")
        path = "decode" if layer and q.shape[-2] == 1 and not dropout_p else fallback_path(q, fused)
    if key_bias is None:  # slope * (j - (k - 1)): zero at the newest key, small near it
        key_bias = alibi_key_bias(slopes.to(q.device), key_len=k.shape[-2])
    q_len = q.shape[-2]
    if path == "decode":  # the mask is the same for every layer of the forward
        make = lambda: alibi_decode_bias(key_bias, keep, q.dtype)  # noqa: E731
        mask = make() if cache is None else cache.memo((key_bias, keep), ("decode", q.dtype), make)
        return masked_sdpa(q, k, v, mask, scale, dropout_p)
    if path == "dense":  # the materialised bias, once per forward
        if keep is None:
            keep = causal_keep(q_len, k.shape[-2], q.device, cache)
        make = lambda: prefill_bias(key_bias, keep, q.dtype)  # noqa: E731
        mask = make() if cache is None else cache.memo((key_bias, keep), ("dense", q_len, q.dtype), make)
        return masked_sdpa(q, k, v, mask, scale, dropout_p)
    heads = q.shape[1]
    if keep is None and q_len > 1:
        keep = causal_keep(q_len, k.shape[-2], q.device, cache)
    return alibi_attention_reference(q, repeat_kv(k, heads), repeat_kv(v, heads), key_bias, keep, scale=scale,
                                     dropout_p=dropout_p)


def masked_sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float, dropout_p: float) -> Tensor:
    """SDPA with an additive mask; a decode step broadcasts a multi-query kv head (as upstream's
    SDPA does) and reads grouped kv heads in place (``enable_gqa``), a prefill gets them repeated."""
    heads, kv_heads = q.shape[1], k.shape[1]
    if q.shape[-2] != 1 and kv_heads != heads:
        k, v = repeat_kv(k, heads), repeat_kv(v, heads)
    grouped = kv_heads not in (1, heads)  # a decode step: SDPA reads grouped kv heads in place
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale, enable_gqa=grouped)


def _flash(q: Tensor, k: Tensor, v: Tensor, key_bias: Tensor | None, slopes: Tensor | None, keep: Tensor | None,
           scale: float, cache: PerForward | None) -> Tensor | str:
    """The fused kernel, or why it does not take these inputs; the mask's row summary derived once
    per mask tensor (``cache``)."""
    rows = None
    if keep is not None:
        why = flash_unsupported(q, k, v, keep)
        if why is not None:  # (before summarising a mask it cannot use)
            return why
        rows = mask_rows(keep) if cache is None else cache.memo(keep, "rows", lambda: mask_rows(keep))
    if slopes is not None:
        return attempt(q, k, v, slopes, scale=scale, keep=keep, rows=rows)
    return attempt(q, k, v, key_bias, scale=scale, key_bias=True, keep=keep, rows=rows)


def repeat_kv(x: Tensor, heads: int) -> Tensor:
    """``(b, hk, s, d) -> (b, heads, s, d)``, each kv head shared by ``heads / hk`` query heads, for SDPA
    with a bias (a stride-0 view for multi-query, ``hk = 1``; SDPA's own GQA broadcasts the same way)."""
    batch, kv, length, dim = x.shape
    if kv == heads:
        return x
    if kv == 1:
        return x.expand(batch, heads, length, dim)
    if heads % kv:
        raise ValueError(f"{heads} query heads are not a multiple of {kv} key/value heads")
    return x[:, :, None].expand(batch, kv, heads // kv, length, dim).reshape(batch, heads, length, dim)
