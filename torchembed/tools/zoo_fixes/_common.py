"""What the zoo-fix modules share: the type of a config fix and how a dict fix is merged."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Union

__all__ = ["ConfigFix", "merge"]

#: a dict merged into the generic config kwargs, or ``fix(default_config, kwargs)`` editing them in place
ConfigFix = Union[dict[str, Any], Callable[[Any, dict[str, Any]], None]]


def merge(into: dict[str, Any], values: dict[str, Any]) -> None:
    """``values`` into ``into``, in place; a dict value into a dict there, recursively (a sub-config)."""
    for key, value in values.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            merge(into[key], value)
        else:
            into[key] = value
