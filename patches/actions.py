"""What a patch does to a model, as plain data: each action can apply itself and undo itself.

Undo information is stored as plain attributes (no closures), so a deep copy of a patched model
is a consistently patched copy that can be unpatched on its own.
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field
from typing import Any

from torch import nn

__all__ = ["Component", "SwapModule", "OverrideAttribute"]

_MISSING = object()


@dataclass(frozen=True)
class Component:
    """One positional component found in a model (what ``find_positional_components`` lists)."""

    path: str  # dotted module path, "" for the root
    kind: str  # "rope", "rope-apply", "alibi", "alibi-attention", "learned", "device-copies"
    upstream: str  # qualified name of what is there now
    replacement: str  # qualified name of what torchembed puts there

    def __str__(self) -> str:
        return f"{self.path or '<root>'}: {self.upstream} -> {self.replacement} ({self.kind})"


@dataclass
class SwapModule:
    """Replace the child ``name`` of ``parent`` by ``new``."""

    component: Component
    parent: nn.Module
    name: str
    new: nn.Module
    old: nn.Module | None = None

    def apply(self) -> None:
        self.old = getattr(self.parent, self.name)
        setattr(self.parent, self.name, self.new)

    def undo(self) -> None:
        setattr(self.parent, self.name, self.old)


@dataclass
class OverrideAttribute:
    """Set an instance attribute (e.g. a bound method) on ``obj``; undo restores or deletes it.

    Methods wrapped by accelerate's hooks (``_hf_hook``/``_old_forward``) are overridden beneath
    the hook, so device placement keeps working.
    """

    component: Component
    obj: Any
    name: str
    value: Any
    previous: Any = field(default=_MISSING)
    target: str = ""

    def apply(self) -> None:
        self.target = self.name
        if self.name == "forward" and hasattr(self.obj, "_hf_hook") and "_old_forward" in vars(self.obj):
            self.target = "_old_forward"
        self.previous = vars(self.obj).get(self.target, _MISSING)
        setattr(self.obj, self.target, self.value)

    def undo(self) -> None:
        if self.previous is _MISSING:
            delattr(self.obj, self.target)
        else:
            setattr(self.obj, self.target, self.previous)


def bind(fn: Any, obj: Any) -> types.MethodType:
    return types.MethodType(fn, obj)
