"""A patched RoPE model's decode steps: torchembed's split-key attention kernel, decided per call.

Upstream's SDPA attention hands a decode step (a few new queries over the KV cache) to PyTorch's
``scaled_dot_product_attention``, which on recent GPUs picks cuDNN for half precision; cuDNN builds a new execution plan
for every new key length, which a decode loop meets at every step (20-90 ms of host time per call on an H200), and with
a padding mask HF repeats the key/value heads and SDPA falls back to slower kernels. A patched model's attention code
sees :class:`AttentionFunctions` in place of transformers' ``ALL_ATTENTION_FUNCTIONS`` (rebound in that instance's
rebuilt forward only: :mod:`torchembed.patches.rebind`), whose ``"sdpa"`` entry, a :class:`DecodeAttention`, runs the
calls :func:`torchembed.kernels.route.decode_attention_on_kernel` gives the kernel on
:func:`torchembed.kernels.attention.fused_attention` (no bias; grouped key/value heads and HF's cache layout read in
place; the mask summarised once per forward, so padding and a static cache's empty slots are never read) and every
other call on upstream's SDPA function. Nothing process-wide changes (no backend flags).
``torchembed.patch(model, cudnn_decode=True)`` leaves the decode steps to upstream.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, Callable

from torch import Tensor

from torchembed.kernels.attention import fused_attention, mask_rows
from torchembed.kernels.per_forward import current, derive
from torchembed.kernels.route import decode_attention_on_kernel

__all__ = ["AttentionFunctions", "DecodeAttention"]


class DecodeAttention:
    """The ``"sdpa"`` attention function of a patched model: the calls
    :func:`~torchembed.kernels.route.decode_attention_on_kernel` gives the kernel (decode steps; ``fused``: the
    patch's, with its one meaning) on the split-key kernel, every other call to ``upstream`` (transformers'
    ``sdpa_attention_forward``) unchanged. Returns upstream's ``(output (b, q, h, d), None)``."""

    def __init__(self, upstream: Callable[..., Any], fused: bool | None) -> None:
        self.upstream, self.fused = upstream, fused
        self.__name__ = self.__qualname__ = "torchembed_sdpa_attention"

    def __call__(self, module: Any, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                 dropout: float = 0.0, scaling: float | None = None, **kwargs: Any) -> tuple[Tensor, None]:
        if decode_attention_on_kernel(self.fused, query, key, value, attention_mask, dropout, kwargs):
            scale = query.shape[-1] ** -0.5 if scaling is None else scaling
            rows = None if attention_mask is None else derive(current(), attention_mask, "rows", mask_rows, attention_mask)
            out = fused_attention(query, key, value, None, scale=scale, keep=attention_mask, rows=rows)
            return out.transpose(1, 2), None  # (b, q, h, d), contiguous
        return self.upstream(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)

    def __repr__(self) -> str:
        return f"<torchembed decode attention over {getattr(self.upstream, '__qualname__', self.upstream)}, fused={self.fused}>"


class AttentionFunctions(Mapping):
    """Stands in for transformers' ``ALL_ATTENTION_FUNCTIONS`` in a patched attention's code: the same entries,
    upstream's SDPA function served by a :class:`DecodeAttention` (looked up on every call, so a function registered
    later is seen). One per (upstream mapping, fused) (:meth:`get_for`)."""

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

    def get_interface(self, name: str, default: Any) -> Any:  # (transformers 5.x; 4.57 indexes the table)
        getter = getattr(self.upstream, "get_interface", None)
        return self._serve(getter(name, default) if getter is not None else self.upstream.get(name, default))

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
