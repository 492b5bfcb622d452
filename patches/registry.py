"""One registry of model families, keyed by ``config.model_type``.

A family is declarative: which encoding it uses, when it applies to a config (Falcon is rotary or ALiBi depending on
``config.alibi``), and the adapters that find and replace its positional components; adding a model is one
``register(Family(...))`` call. A ``model_type`` with no registered family falls back to the discovered-RoPE family of
that type (:func:`set_fallback`, installed by :mod:`torchembed.patches.rope.families`), whose adapter finds rotating
attention modules by structure or answers ``UnsupportedModelError`` with the reason.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from torch import nn

__all__ = ["Adapter", "Family", "PatchOptions", "REGISTRY", "register", "resolve", "family_for", "family_named",
           "set_fallback", "supported_families"]


@dataclass(frozen=True)
class PatchOptions:
    """Choices made once per ``patch`` call and handed to every adapter."""

    fused: bool | None  # None: Triton where it can run; True: always (checked up front); False: never
    cudnn_decode: bool = False  # decode steps' attention left to upstream (SDPA's backend choice)
    cuda_graphs: bool = True  # CUDA decode steps replayed from a graph (torchembed.patches.decode_graphs)


class Adapter(Protocol):
    """Finds one kind of positional component in a model and builds the actions that swap it."""

    def plan(self, model: nn.Module, config: Any, options: PatchOptions, family: "Family") -> list[Any]:
        """Check the structure it relies on (``StructureError`` naming what differs) and return the
        actions (``SwapModule``/``OverrideAttribute``/...) for this model, not yet applied."""
        ...


def always(config: Any) -> bool:
    return True


@dataclass(frozen=True)
class Family:
    model_type: str
    encoding: str  # "rope" | "alibi" | "learned"
    adapters: tuple[Adapter, ...]
    description: str
    applies: Callable[[Any], bool] = field(default=always)  # a module-level function (families pickle by name)
    variant: str = ""  # shown in `torchembed list` when a model_type has several families
    # The attn_implementation whose upstream function the patched model computes under every
    # setting, where upstream's implementations disagree ("" = each its own; Falcon-ALiBi: "sdpa").
    reference_attn: str = ""
    discovered: bool = False  # found by structure (no registered adapter for this model_type)

    @property
    def name(self) -> str:
        return f"{self.model_type}-{self.variant}" if self.variant else self.model_type

    def __reduce__(self) -> tuple:
        return (family_named, (self.model_type, self.variant, self.discovered))


REGISTRY: dict[str, list[Family]] = {}
_FALLBACK: list[Callable[[str], Family]] = []


def register(family: Family) -> Family:
    REGISTRY.setdefault(family.model_type, []).append(family)
    return family


def set_fallback(make: Callable[[str], Family]) -> None:
    """The family of a model_type nobody registered (discovery by structure)."""
    _FALLBACK[:] = [make]


def resolve(config: Any) -> Family | None:
    """The registered family for a config, or None when none is registered for it."""
    for family in REGISTRY.get(getattr(config, "model_type", None), []):
        if family.applies(config):
            return family
    return None


def family_for(config: Any) -> Family | None:
    """The registered family for a config, else the discovered-RoPE family of its model_type."""
    family = resolve(config)
    if family is None and _FALLBACK and getattr(config, "model_type", None):
        family = _FALLBACK[0](config.model_type)
    return family


def family_named(model_type: str, variant: str = "", discovered: bool = False) -> Family:
    """The family with this model_type and variant (how families are unpickled)."""
    if discovered:
        return _FALLBACK[0](model_type)
    for family in REGISTRY.get(model_type, []):
        if family.variant == variant:
            return family
    raise LookupError(f"no registered family {model_type!r} (variant {variant!r})")


def supported_families() -> list[Family]:
    """Every registered family, sorted by model type."""
    return [f for model_type in sorted(REGISTRY) for f in REGISTRY[model_type]]
