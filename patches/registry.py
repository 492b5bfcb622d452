"""One registry of model families, keyed by ``config.model_type``.

A family is declarative: which encoding it uses, when it applies to a config (Falcon is rotary or
ALiBi depending on ``config.alibi``), and the adapters that find and replace its positional
components. Adding a model is one ``register(Family(...))`` call with existing or new adapters.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from torch import nn


__all__ = ["Adapter", "Family", "REGISTRY", "register", "resolve", "supported_families"]


class Adapter(Protocol):
    """Finds one kind of positional component in a model and builds the actions that swap it."""

    def plan(self, model: nn.Module, config: Any, options: "PatchOptions") -> list[Any]:
        """Return the actions (``SwapModule``/``OverrideAttribute``) for this model, not yet applied."""
        ...


@dataclass(frozen=True)
class PatchOptions:
    """Choices made once per ``patch`` call and handed to every adapter."""

    fused: bool | None  # None: Triton where it can run; True: always (checked up front); False: never


@dataclass(frozen=True)
class Family:
    model_type: str
    encoding: str  # "rope" | "alibi" | "learned"
    adapters: tuple[Adapter, ...]
    description: str
    applies: Callable[[Any], bool] = field(default=lambda config: True)
    variant: str = ""  # shown in `torchembed list` when a model_type has several families
    # The attn_implementation whose upstream function the patched model computes under every
    # setting, where upstream's implementations disagree ("" = each its own; Falcon-ALiBi: "sdpa").
    reference_attn: str = ""

    @property
    def name(self) -> str:
        return f"{self.model_type}-{self.variant}" if self.variant else self.model_type


REGISTRY: dict[str, list[Family]] = {}


def register(family: Family) -> Family:
    REGISTRY.setdefault(family.model_type, []).append(family)
    return family


def resolve(config: Any) -> Family | None:
    """The family for a config, or None when torchembed has no adapter for it."""
    for family in REGISTRY.get(getattr(config, "model_type", None), []):
        if family.applies(config):
            return family
    return None


def supported_families() -> list[Family]:
    """Every registered family, sorted by model type."""
    return [f for model_type in sorted(REGISTRY) for f in REGISTRY[model_type]]
