"""ALiBi families (BLOOM, MPT, Falcon with ``alibi=True``): torchembed's slopes and bias.

Upstream builds the bias in key-only form (``slope * position_of_key``), which differs from the
paper's ``-slope * |i - j|`` by a constant per query row, which softmax ignores. torchembed's
builders keep that form (the attention code consumes it as is) but compute it in float32 from
:func:`torchembed.functional.alibi_slopes` (the slopes of ``ALiBiEmbedding``), zero at the
newest key and non-positive, so the values that matter most for a causal row are the smallest
and round least in low precision.

* BLOOM: ``BloomModel.build_alibi_tensor`` (instance method) and, where transformers builds the
  bias inline without a mask, the slopes it uses (``_get_alibi_slopes``, rebound for the instance).
* MPT: ``MptModel.build_mpt_alibi_tensor`` (instance method).
* Falcon: ``build_alibi_tensor`` as called by ``FalconModel.forward`` (rebound for the instance).
  Upstream rounds Falcon's slopes to bfloat16 even in float32 models; torchembed does not, so for
  head counts whose slopes are not powers of two the two differ by that rounding.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from torchembed.functional.alibi import alibi_key_bias, alibi_slopes
from torchembed.patches.actions import Component, OverrideAttribute, bind
from torchembed.patches.rebind import rebind_globals
from torchembed.patches.registry import Family, PatchOptions, register

__all__ = ["bloom_alibi_tensor", "mpt_alibi_tensor", "alibi_slopes_for"]


def bloom_alibi_tensor(attention_mask: Tensor, num_heads: int, dtype: torch.dtype) -> Tensor:
    """BLOOM/Falcon's bias from a ``(b, k)`` mask: ``(b * h, 1, k)`` in ``dtype`` (computed in float32)."""
    batch, length = attention_mask.shape
    bias = alibi_key_bias(alibi_slopes(num_heads, attention_mask.device), attention_mask)
    return bias.reshape(batch * num_heads, 1, length).to(dtype)


def mpt_alibi_tensor(num_heads: int, sequence_length: int, alibi_bias_max: float = 8, device=None) -> Tensor:
    """MPT's bias ``(h, 1, L)`` float32: ``slope * (j - (L - 1))`` for keys ``j < L``."""
    slopes = alibi_slopes(num_heads, device, max_bias=float(alibi_bias_max))
    distance = torch.arange(1 - sequence_length, 1, device=device, dtype=torch.float32)
    return slopes[:, None, None] * distance[None, None, :]


def alibi_slopes_for(num_heads: int, device: torch.device | None = None) -> Tensor:
    """Drop-in for BLOOM's ``_get_alibi_slopes(num_heads, device)``."""
    return alibi_slopes(num_heads, device)


def _qualname(fn: Any) -> str:
    return f"{fn.__module__}.{fn.__qualname__}"


class OverrideMethod:
    """Set ``method`` on every module of ``class_name`` to a torchembed function (instance only).

    The function is stored as a plain instance attribute, so it is called without ``self``.
    """

    def __init__(self, class_name: str, method: str, replacement: Any) -> None:
        self.class_name, self.method, self.replacement = class_name, method, replacement

    def plan(self, model: nn.Module, config: Any, options: PatchOptions) -> list[OverrideAttribute]:
        actions = []
        for path, module in model.named_modules():
            if type(module).__name__ == self.class_name:
                upstream = getattr(type(module), self.method)
                component = Component(path, "alibi", _qualname(upstream), _qualname(self.replacement))
                actions.append(OverrideAttribute(component, module, self.method, self.replacement))
        return actions


class RebindForwardGlobals:
    """Rebind module-level names inside ``forward`` of every module of ``class_name``.

    Names the installed transformers does not use are skipped (e.g. BLOOM builds the bias inline
    only in recent versions); a module whose forward uses none of them is left alone.
    """

    def __init__(self, class_name: str, overrides: dict[str, Any]) -> None:
        self.class_name, self.overrides = class_name, overrides

    def plan(self, model: nn.Module, config: Any, options: PatchOptions) -> list[OverrideAttribute]:
        actions = []
        for path, module in model.named_modules():
            cls = type(module)
            if cls.__name__ != self.class_name:
                continue
            forward = cls.forward
            used = {name: fn for name, fn in self.overrides.items() if name in _referenced_names(forward)}
            if used:
                upstream = ", ".join(_qualname(forward.__globals__[name]) for name in used)
                replacement = ", ".join(_qualname(fn) for fn in used.values())
                component = Component(path, "alibi", upstream, replacement)
                actions.append(OverrideAttribute(component, module, "forward", bind(rebind_globals(forward, used), module)))
        return actions


def _referenced_names(fn: Any) -> set[str]:
    while getattr(fn, "__wrapped__", None) is not None and fn.__closure__:
        fn = fn.__wrapped__
    return set(fn.__code__.co_names)


register(
    Family(
        model_type="bloom",
        encoding="alibi",
        adapters=(
            OverrideMethod("BloomModel", "build_alibi_tensor", bloom_alibi_tensor),
            RebindForwardGlobals("BloomModel", {"_get_alibi_slopes": alibi_slopes_for}),
        ),
        description="build_alibi_tensor / ALiBi slopes -> torchembed ALiBi (float32, paper slopes)",
    )
)
register(
    Family(
        model_type="mpt",
        encoding="alibi",
        adapters=(OverrideMethod("MptModel", "build_mpt_alibi_tensor", mpt_alibi_tensor),),
        description="build_mpt_alibi_tensor -> torchembed ALiBi (float32, paper slopes)",
    )
)
register(
    Family(
        model_type="falcon",
        encoding="alibi",
        variant="alibi",
        applies=lambda config: bool(getattr(config, "alibi", False)),
        adapters=(RebindForwardGlobals("FalconModel", {"build_alibi_tensor": bloom_alibi_tensor}),),
        description="build_alibi_tensor -> torchembed ALiBi (float32 slopes; upstream rounds them to bf16)",
    )
)
