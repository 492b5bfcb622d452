"""ALiBi attention: the fused kernel, and SDPA with the bias where that measured faster.

Press et al., arXiv:2108.12409. :func:`alibi_attention` takes, with ``fused=None`` on CUDA:

* the fused Triton kernel (:func:`torchembed.kernels.alibi_flash.alibi_flash`: the bias computed
  inside from the slopes or read from a ``(b or 1, h, k)`` key bias, any mask summarised per row,
  GQA, forward and backward), for every prefill above the size below and for masks of any kind;
* SDPA with the ``(b, h, q, k)`` bias materialised once per forward (one Triton write,
  :mod:`torchembed.kernels.alibi_bias`) for a model's prefills (``cache`` given: the layers of one
  forward share the bias) of at most ``DENSE_MAX_ELEMENTS`` bias elements (``DENSE_GRAD_MAX_ELEMENTS``
  when gradients are recorded); a call without ``cache`` (``ALiBiEmbedding.attention``) would build
  the bias for itself alone and takes the kernel. Per layer the kernel is the faster one
  at every size on the H200 (``benchmarks/results/alibi-kernel.md``, 1 x 16 x 1024 x 64: 0.025 vs
  0.033 ms), but whole models at these sizes are bound by host time, and there the bias made once
  for all layers measured faster (``alibi-short.md``, the kernel at every prefill: BLOOM 1 x 2048
  8.9 ms against 5.6 ms with the materialised bias, ``alibi.md``);
* SDPA with the per-forward decode mask for the decode steps of a model (``cache`` given; one query,
  bound by host time: within 1.02x of SDPA without bias on the H200).

``fused=True`` takes the kernel always (or raises :class:`FusedUnavailableError`); ``fused=False``
and devices where the kernel cannot run take SDPA with the bias built by PyTorch operations
(:func:`torchembed.functional.alibi.alibi_attention_reference`).
"""

from __future__ import annotations

import contextlib
import os
import weakref
from collections.abc import Callable, Hashable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from torchembed.functional.alibi import alibi_attention_reference, alibi_decode_bias
from torchembed.kernels.alibi_bias import prefill_bias
from torchembed.kernels.alibi_flash import attempt, flash_unsupported, mask_rows
from torchembed.kernels.availability import FusedUnavailableError, use_kernel

__all__ = ["alibi_attention", "causal_keep", "dense_prefill", "prefill_path", "prefill_path_is_auto", "repeat_kv",
           "MaskCache", "DENSE_MAX_ELEMENTS", "DENSE_GRAD_MAX_ELEMENTS"]


_CAUSAL: dict = {}
# Devices whose prefill may take the materialised bias (tests add "cpu" to exercise it).
_FUSED_DEVICES: tuple[str, ...] = ("cuda",)
# "auto": the materialised bias up to the sizes below, else the fused kernel; "kernel": the fused
# kernel for every prefill it takes; "dense": the materialised bias for every prefill.
PREFILL_PATHS = ("auto", "kernel", "dense")
# Bias elements (b * h * q * k) up to which "auto" materialises the bias, once per forward (128 MB
# of bf16), then SDPA with a mask (see the module docstring for the measurements); beyond, the
# kernel (the bias would cost memory quadratic in the length). Training steps: the same bound (per
# layer the kernel's forward + backward is ahead from 4 x 16 x 2048^2 on, 0.51 vs 1.01 ms).
DENSE_MAX_ELEMENTS = 2**26
DENSE_GRAD_MAX_ELEMENTS = 2**26
_PREFILL = os.environ.get("TORCHEMBED_ALIBI_PREFILL", "auto")
if _PREFILL not in PREFILL_PATHS:
    raise ValueError(f"TORCHEMBED_ALIBI_PREFILL must be one of {PREFILL_PATHS}, got {_PREFILL!r}")


@contextlib.contextmanager
def prefill_path(path: str):
    """Within the block, CUDA prefill with ``fused=None`` takes ``path``: ``"auto"`` (the default: the
    materialised bias up to ``DENSE_MAX_ELEMENTS``, else the fused kernel), ``"kernel"`` (the fused
    kernel at every size) or ``"dense"`` (the materialised bias at every size), e.g. to measure one
    against another. The process-wide default comes from ``TORCHEMBED_ALIBI_PREFILL``.

    Raises:
        ValueError: an unknown path.
    """
    global _PREFILL
    if path not in PREFILL_PATHS:
        raise ValueError(f"prefill path must be one of {PREFILL_PATHS}, got {path!r}")
    previous, _PREFILL = _PREFILL, path
    try:
        yield
    finally:
        _PREFILL = previous


def prefill_path_is_auto() -> bool:
    """No :func:`prefill_path` other than ``"auto"`` is in force."""
    return _PREFILL == "auto"


def _causal(q_len: int, k_len: int, device: torch.device) -> tuple[Tensor, "MaskCache"]:
    """The causal ``keep`` mask (queries last) and its cache slot, shared by all layers."""
    key = (q_len, k_len, device)
    entry = _CAUSAL.get(key)
    if entry is None:
        if len(_CAUSAL) >= 8:
            _CAUSAL.clear()
        entry = MaskCache()
        positions = torch.arange(k_len, device=device)
        entry.keep = (positions[None, :] <= positions[k_len - q_len:, None])[None, None]
        _CAUSAL[key] = entry
    return entry.keep, entry


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
) -> Tensor:
    """Attention with ALiBi: ``softmax(scale * q k^T + bias | keep) v``.

    The bias is ``key_bias[b, h, j]`` (a key-only form, as the HF ALiBi models build it) or, given
    ``slopes``, ``slope_h * (j - i)``; either up to a constant per query row, which softmax ignores.
    Which implementation runs: see the module docstring.

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

    Returns:
        ``(b, h, q, d)`` in ``q.dtype``. A query row that keeps no key: 0 from the kernel, the mean of
        ``v`` (upstream's eager behaviour) from SDPA.

    Raises:
        FusedUnavailableError: ``fused=True`` where the kernel cannot run, naming why.
        ValueError: neither ``key_bias`` nor ``slopes``.
    """
    if key_bias is None and slopes is None:
        raise ValueError("alibi_attention needs key_bias (b or 1, h, k) or slopes (h,)")
    q_len = q.shape[-2]
    if fused or (fused is None and _PREFILL != "dense" and not (q_len == 1 and cache is not None)
                 and not (cache is not None and dense_prefill(q, k))):
        why = "it has no dropout (dropout_p > 0)"
        if not dropout_p and use_kernel(fused, q, "the fused ALiBi attention kernel"):
            out = _flash(q, k, v, key_bias, slopes, keep, scale, cache)
            if not isinstance(out, str):
                return out
            why = out
        if fused:
            raise FusedUnavailableError(f"fused=True: the fused ALiBi attention kernel cannot take these inputs: {why}; "
                                        "pass fused=None to run PyTorch's attention there")
    if key_bias is None:  # slope * (j - (k - 1)): zero at the newest key, small near it
        positions = torch.arange(1 - k.shape[-2], 1, device=q.device, dtype=torch.float32)
        key_bias = slopes.to(q.device, torch.float32)[None, :, None] * positions
    heads = q.shape[1]
    k, v = repeat_kv(k, heads), repeat_kv(v, heads)
    if keep is None and q_len > 1:
        keep, cache = _causal(q_len, k.shape[-2], q.device)
    if fused is None and dense_prefill(q, k, any_size=True):  # the materialised bias, once per forward
        make = lambda: prefill_bias(key_bias, keep, q.dtype)  # noqa: E731
        bias = make() if cache is None else cache.memo(key_bias, ("dense", q.dtype), make)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=dropout_p, scale=scale)
    if fused is None and q_len == 1 and cache is not None:  # decode: the mask is the same for every layer
        bias = cache.memo(key_bias, ("decode", q.dtype), lambda: alibi_decode_bias(key_bias, keep, q.dtype))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=dropout_p, scale=scale)
    return alibi_attention_reference(q, k, v, key_bias, keep, scale=scale, dropout_p=dropout_p)


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


def dense_prefill(q: Tensor, k: Tensor, *, any_size: bool = False) -> bool:
    """Whether the prefill of ``q (b, h, q, d)`` over ``k (b, hk, k, d)`` takes SDPA with the
    materialised bias (:func:`torchembed.kernels.alibi_bias.prefill_bias`, one Triton write) with
    ``fused=None``: a CUDA prefill (outside ``torch.compile``) of at most ``DENSE_MAX_ELEMENTS`` bias
    elements (``DENSE_GRAD_MAX_ELEMENTS`` when ``q``, ``k`` need gradients), or any under
    ``prefill_path("dense")`` (or with ``any_size``: wherever the kernel did not run)."""
    q_len = q.shape[-2]
    if q_len == 1 or q.device.type not in _FUSED_DEVICES or torch.compiler.is_compiling():
        return False
    if any_size or _PREFILL == "dense":
        return True
    if _PREFILL != "auto":
        return False
    elements = q.shape[0] * q.shape[1] * q_len * k.shape[-2]
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad)
    return elements <= (DENSE_GRAD_MAX_ELEMENTS if grad else DENSE_MAX_ELEMENTS)


def causal_keep(q_len: int, k_len: int, device: torch.device) -> Tensor:
    """The causal ``keep`` mask, queries at the last ``q_len`` of ``k_len`` positions:
    ``(1, 1, q, k)`` bool, shared (do not modify)."""
    return _causal(q_len, k_len, device)[0]
