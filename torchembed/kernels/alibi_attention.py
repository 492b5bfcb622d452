from __future__ import annotations

import contextlib
import dataclasses
import os
import weakref
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from torchembed.functional.alibi import alibi_attention_reference, alibi_decode_bias, alibi_key_bias, causal_keep as _build_causal_keep
from torchembed.kernels.alibi_bias import prefill_bias
from torchembed.kernels.alibi_flash import attempt, flash_unsupported, mask_rows
from torchembed.kernels.availability import FusedUnavailableError, use_kernel

__all__ = ["AlibiPolicy", "MaskCache", "alibi_attention", "attention_path", "causal_keep", "fallback_path", "forward_cache",
           "masked_sdpa", "policy", "policy_changed", "prefill_path", "repeat_kv"]

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
    types whose prefill may take the materialised bias (tests add "cpu" to exercise it).
    ``decode_kernel_min_keys``: from this many keys a model layer's decode step takes the split-key decode
    kernel instead of SDPA with the decode mask (H200, MPT-7B shape, 32k keys, 2 layers: 3.0 ms per step
    against 4.6 ms for SDPA without cuDNN, whose one-query attention has a program per head only, and 40 ms
    with cuDNN, which builds a plan per key length; below, decode steps are bound by host time, where SDPA
    with the mask measured within 1.02x of SDPA without bias; the crossover between is not measured)."""

    prefill: str = "auto"
    dense_max_elements: int = 2**26
    dense_grad_max_elements: int = 2**26
    dense_devices: tuple[str, ...] = ("cuda",)
    decode_kernel_min_keys: int = 16384

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


def attention_path(q: Tensor, k: Tensor, *, fused: bool | None, dropout_p: float, layer: bool) -> str:
    """``"kernel"``, ``"dense"``, ``"decode"`` or ``"reference"`` (the module docstring) for the attention
    of ``q (b, h, q, d)`` over ``k (b, hk, k, d)``: the one place that decides. ``layer``: the call is a
    model layer's, whose forward shares what it derives across its layers (decode steps and small
    prefills are bound by host time there). ``"kernel"`` may still fall back at run time where the kernel
    does not take the inputs (:func:`fallback_path`)."""
    if fused:
        use_kernel(fused, q, _KERNEL)  # (raises where it cannot run)
        return "kernel"
    q_len = q.shape[-2]
    if layer and q_len == 1 and dropout_p == 0.0:
        if fused is None and k.shape[-2] >= _policy.decode_kernel_min_keys and use_kernel(None, q, _KERNEL):
            return "kernel"  # long context: the split-key decode kernel
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


# ------------------------------------------------------------------------------------------------
# Masks and what a forward derives once
# ------------------------------------------------------------------------------------------------

_CAUSAL: dict = {}


def _causal(q_len: int, k_len: int, device: torch.device) -> tuple[Tensor, "MaskCache"]:
    """The causal ``keep`` mask (queries last) and its cache slot, shared by all layers."""
    key = (q_len, k_len, device)
    entry = _CAUSAL.get(key)
    if entry is None:
        if len(_CAUSAL) >= 8:
            _CAUSAL.clear()
        entry = MaskCache()
        entry.keep = _build_causal_keep(q_len, k_len, device)
        _CAUSAL[key] = entry
    return entry.keep, entry


def causal_keep(q_len: int, k_len: int, device: torch.device) -> Tensor:
    """The causal ``keep`` mask, queries at the last ``q_len`` of ``k_len`` positions:
    ``(1, 1, q, k)`` bool, kept for the last few shapes and shared (do not modify)."""
    return _causal(q_len, k_len, device)[0]


class MaskCache:
    """The ``keep`` mask derived from one HF mask tensor and (:meth:`memo`) what else a forward
    derives once for all its layers (the kernel's row summary of the mask, the key bias, the
    materialised bias).

    HF passes the same attention-mask tensor to every layer of a forward. Keyed by the identity of
    the source tensor through a weak reference, so a new forward (a new mask tensor) always recomputes.
    """

    def __init__(self) -> None:
        self._source: weakref.ref | None = None
        self.keep: Tensor | None = None
        self._memo: dict = {}

    def alive(self) -> bool:
        """The source tensor still exists (its forward may still be running)."""
        return self._source is not None and self._source() is not None

    def lookup(self, source: Tensor) -> "MaskCache | None":
        return self if self._source is not None and self._source() is source else None

    def store(self, source: Tensor, keep: Tensor | None) -> "MaskCache":
        # When the source mask dies (the forward is over), drop what was derived from it.
        self._source, self.keep = weakref.ref(source, self._clear), keep
        self._memo = {}
        return self

    def memo(self, source: Tensor, tag: Hashable, make: Callable[[], Any]) -> Any:
        """``make()`` computed once per ``(source, tag)`` while this mask lives: per-forward
        derivations of tensors every layer receives (the ALiBi bias), shared by the layers.
        ``source`` is held weakly and checked by identity, so a new tensor never hits an old entry."""
        entry = self._memo.get((id(source), tag))
        if entry is not None and entry[0]() is source:
            return entry[1]
        value = make()
        self._memo = {key: e for key, e in self._memo.items() if e[0]() is not None}  # drop dead sources
        self._memo[(id(source), tag)] = (weakref.ref(source), value)
        return value

    def _clear(self, ref: weakref.ref) -> None:
        if ref is self._source:
            self._source, self.keep, self._memo = None, None, {}


# One MaskCache per live HF mask tensor: a forward has one per device of a split model
# (torchembed.patches.devices). Entries whose mask died are dropped when the table is full.
_MASKS: dict[int, MaskCache] = {}
_MASKS_MAX = 8


def forward_cache(attention_mask: Tensor | None, to_keep: Callable[[Tensor], Tensor],
                  anchor: Tensor | None) -> tuple[Tensor | None, MaskCache | None]:
    """``keep`` (True = attend) for a model's mask and the :class:`MaskCache` of this forward, shared by
    its layers.

    The cache is keyed by the mask tensor or, when there is none (sdpa masks are skipped for unpadded
    batches), by ``anchor``: a tensor every layer of the forward receives and no other forward does (a
    bias built per forward; a constant would keep its cache growing). ``to_keep`` makes the model's mask
    a ``(b or 1, 1, q, k)`` bool keep mask. None for the cache under ``torch.compile`` (no Python-side
    caches in a graph) or without mask and anchor."""
    if torch.compiler.is_compiling():
        return (None if attention_mask is None else to_keep(attention_mask)), None
    source = attention_mask if attention_mask is not None else anchor
    if source is None:
        return None, None
    cache = _MASKS.get(id(source))
    if cache is None or cache.lookup(source) is None:
        if len(_MASKS) >= _MASKS_MAX:
            for key in [key for key, entry in _MASKS.items() if not entry.alive()]:  # forward over
                del _MASKS[key]
            if len(_MASKS) >= _MASKS_MAX:
                _MASKS.clear()
        keep = None if attention_mask is None else to_keep(attention_mask)
        cache = _MASKS[id(source)] = MaskCache().store(source, keep)
    return cache.keep, cache


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
    cache: MaskCache | None = None,
    fused: bool | None = None,
    slopes: Tensor | None = None,
    layer: bool = False,
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
        cache: where what is derived from ``keep`` and ``key_bias`` is kept across the layers of
            one forward; pass the same ``key_bias`` tensor to every layer, e.g. via ``cache.memo``.
        fused: None: the fastest measured path (module docstring), PyTorch where the kernel cannot
            run; True: the fused kernel or :class:`FusedUnavailableError`; False: PyTorch operations
            only (SDPA with the materialised bias).
        slopes: ``(h,)`` per-head slopes, instead of ``key_bias``.
        layer: a model layer's call (see :func:`attention_path`); its masks are kept in ``cache``.

    Returns:
        ``(b, h, q, d)`` in ``q.dtype``. A query row that keeps no key: 0 from the kernel, the mean of
        ``v`` (upstream's eager behaviour) from SDPA.

    Raises:
        FusedUnavailableError: ``fused=True`` where the kernel cannot run, naming why.
        ValueError: neither ``key_bias`` nor ``slopes``.
    """
    if key_bias is None and slopes is None:
        raise ValueError("alibi_attention needs key_bias (b or 1, h, k) or slopes (h,)")
    path = attention_path(q, k, fused=fused, dropout_p=dropout_p, layer=layer)
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
        path = fallback_path(q, fused)
    if key_bias is None:  # slope * (j - (k - 1)): zero at the newest key, small near it
        key_bias = alibi_key_bias(slopes.to(q.device), key_len=k.shape[-2])
    q_len = q.shape[-2]
    if path == "decode":  # the mask is the same for every layer of the forward
        make = lambda: alibi_decode_bias(key_bias, keep, q.dtype)  # noqa: E731
        mask = make() if cache is None else cache.memo(key_bias, ("decode", q.dtype), make)
        return masked_sdpa(q, k, v, mask, scale, dropout_p)
    if path == "dense":  # the materialised bias, once per forward
        if keep is None:
            keep = causal_keep(q_len, k.shape[-2], q.device)
        make = lambda: prefill_bias(key_bias, keep, q.dtype)  # noqa: E731
        mask = make() if cache is None else cache.memo(key_bias, ("dense", q_len, q.dtype), make)
        return masked_sdpa(q, k, v, mask, scale, dropout_p)
    heads = q.shape[1]
    if keep is None and q_len > 1:
        keep = causal_keep(q_len, k.shape[-2], q.device)
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
           scale: float, cache: MaskCache | None) -> Tensor | str:
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
