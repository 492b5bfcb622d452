"""A patched RoPE model's decode steps: torchembed's split-key attention kernel, decided per call.

Upstream's SDPA attention hands a decode step (a few new queries over the KV cache) to PyTorch's
``scaled_dot_product_attention``, which on recent GPUs picks cuDNN for half precision; cuDNN builds a new
execution plan for every new key length, which a decode loop meets at every step (20-90 ms of host time
per call on an H200), and with a padding mask HF repeats the key/value heads and SDPA falls back to
slower kernels. A patched model's attention code sees :class:`AttentionFunctions` in place of
transformers' ``ALL_ATTENTION_FUNCTIONS`` (the name is rebound in that instance's rebuilt forward only,
with its rotation helper: :mod:`torchembed.patches.rebind`), whose ``"sdpa"`` entry is a
:class:`DecodeAttention`: for each call it decides (:func:`decode_step`) whether the call is a decode
step the kernel takes, and runs either the kernel (:func:`torchembed.kernels.alibi_flash.attempt` without
a bias: grouped key/value heads and HF's cache layout read in place, the mask summarised once per forward
into per-row key ranges, so padding and a static cache's empty slots are never read) or upstream's SDPA
function with the same arguments. Nothing process-wide changes (no backend flags): other models and
other threads see upstream's functions. ``torchembed.patch(model, cudnn_decode=True)`` leaves the
decode steps to upstream.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, Callable

import torch
from torch import Tensor

from torchembed.kernels.alibi_flash import DECODE_QUERIES, DTYPES, MAX_HEAD_DIM, attempt, mask_rows
from torchembed.kernels.availability import use_kernel
from torchembed.kernels.per_forward import current

__all__ = ["DECODE_QUERIES", "AttentionFunctions", "DecodeAttention", "decode_step"]

# Keyword arguments of upstream's SDPA function that do not change what it computes (it ignores them, or
# the mask already carries them); a call with any other non-None keyword goes to upstream.
_IGNORED_KWARGS = frozenset({
    "position_ids", "cache_position", "output_attentions", "use_cache", "sliding_window", "layer_idx",
    "past_key_values", "past_key_value", "token_type_ids", "is_causal",
})


def decode_step(query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None, dropout: float,
                kwargs: Mapping[str, Any]) -> bool:
    """Whether an SDPA call of HF's attention convention (``query (b, h, q, d)``, ``key``/``value``
    ``(b, hk, k, d)``, a bool keep mask ``(b or 1, 1, q, k)`` or None) is a decode step the split-key
    kernel computes exactly as upstream does: at most :data:`DECODE_QUERIES` queries (one without a
    mask), no dropout, one floating dtype, equal head dims up to 256, grouped heads, and no keyword
    that changes upstream's function (soft-capping, a position bias, a paged cache, ...)."""
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        return False
    batch, heads, q_len, dim = query.shape
    if q_len > DECODE_QUERIES or dropout or key.shape[-1] != dim or value.shape[-1] != dim or dim > MAX_HEAD_DIM:
        return False
    if query.dtype not in DTYPES or key.dtype != query.dtype or value.dtype != query.dtype:
        return False
    kv_heads = key.shape[1]
    if kv_heads == 0 or heads % kv_heads or key.shape[0] != batch or value.shape[:3] != key.shape[:3]:
        return False
    if attention_mask is None:
        if q_len != 1:
            return False  # (upstream's is_causal aligns the queries to the first keys there)
    elif (attention_mask.dtype != torch.bool or attention_mask.dim() != 4 or attention_mask.shape[1] != 1
          or attention_mask.shape[0] not in (1, batch) or attention_mask.shape[2:] != (q_len, key.shape[2])):
        return False
    return all(value is None or name in _IGNORED_KWARGS for name, value in kwargs.items())


class DecodeAttention:
    """The ``"sdpa"`` attention function of a patched model: decode steps (:func:`decode_step`) on the
    split-key kernel where it runs (``fused``: the patch's choice; False: never), every other call to
    ``upstream`` (transformers' ``sdpa_attention_forward``) unchanged. Returns upstream's
    ``(output (b, q, h, d), None)``."""

    def __init__(self, upstream: Callable[..., Any], fused: bool | None) -> None:
        self.upstream, self.fused = upstream, fused
        self.__name__ = self.__qualname__ = "torchembed_sdpa_attention"

    def __call__(self, module: Any, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                 dropout: float = 0.0, scaling: float | None = None, **kwargs: Any) -> tuple[Tensor, None]:
        if self.fused is not False and decode_step(query, key, value, attention_mask, dropout, kwargs) \
                and use_kernel(None, query):
            scale = query.shape[-1] ** -0.5 if scaling is None else scaling
            rows = None
            if attention_mask is not None:
                scope = None if torch.compiler.is_compiling() else current()
                make = lambda: mask_rows(attention_mask)  # noqa: E731
                rows = make() if scope is None else scope.memo(attention_mask, "rows", make)
            out = attempt(query, key, value, None, scale=scale, keep=attention_mask, rows=rows)
            if not isinstance(out, str):
                return out.transpose(1, 2), None  # (b, q, h, d), contiguous
        return self.upstream(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)

    def __repr__(self) -> str:
        return f"<torchembed decode attention over {getattr(self.upstream, '__qualname__', self.upstream)}, fused={self.fused}>"


class AttentionFunctions(Mapping):
    """Stands in for transformers' ``ALL_ATTENTION_FUNCTIONS`` in a patched attention's code: the same
    entries, upstream's SDPA function served by a :class:`DecodeAttention` (looked up on every call, so a
    function registered later is seen). One per (upstream mapping, fused) (:meth:`get_for`)."""

    _KEPT: dict[tuple[int, Any], "AttentionFunctions"] = {}

    def __init__(self, upstream: Any, fused: bool | None) -> None:
        self.upstream, self.fused = upstream, fused
        self._sdpa = _upstream_sdpa()
        self._decode = DecodeAttention(self._sdpa, fused)

    @classmethod
    def get_for(cls, upstream: Any, fused: bool | None) -> "AttentionFunctions":
        key = (id(upstream), fused)
        kept = cls._KEPT.get(key)
        if kept is None or kept.upstream is not upstream:
            kept = cls._KEPT[key] = cls(upstream, fused)
        return kept

    def _serve(self, function: Any) -> Any:
        return self._decode if function is self._sdpa and function is not None else function

    def __getitem__(self, name: str) -> Any:
        return self._serve(self.upstream[name])

    def get(self, name: str, default: Any = None) -> Any:
        return self._serve(self.upstream.get(name, default))

    def get_interface(self, name: str, default: Any) -> Any:
        return self._serve(self.upstream.get_interface(name, default))

    def __contains__(self, name: object) -> bool:
        return name in self.upstream

    def __iter__(self) -> Iterator[str]:
        return iter(self.upstream)

    def __len__(self) -> int:
        return len(self.upstream)

    def __getattr__(self, name: str) -> Any:  # valid_keys, register, ...: upstream's
        if name.startswith("__") or name in ("upstream", "fused", "_sdpa", "_decode"):
            raise AttributeError(name)
        return getattr(self.upstream, name)

    def __reduce__(self) -> tuple:
        return (_restore, (self.fused,))

    def __repr__(self) -> str:
        return f"<torchembed attention functions (sdpa decode steps on the split-key kernel), fused={self.fused}>"


def _upstream_sdpa() -> Any:
    """transformers' SDPA attention function (None where this release has none)."""
    try:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
    except ImportError:
        return None
    return sdpa_attention_forward


def _restore(fused: bool | None) -> AttentionFunctions:
    """The :class:`AttentionFunctions` over transformers' global mapping (how one is unpickled)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return AttentionFunctions.get_for(ALL_ATTENTION_FUNCTIONS, fused)
