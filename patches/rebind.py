"""Rebind module-level names for one function, leaving the module and every other caller alone.

HF attention code calls helpers such as ``apply_rotary_pos_emb`` through its module's globals.
Rebinding the module global would change every model of that family in the process. Instead we
clone the method's function with a globals namespace in which only the given names differ, and
install the clone on one instance. The clone shares code, defaults and closure with the
original; the namespace is a snapshot of the module's taken at patch time.

The namespace is the ``__dict__`` of a real module registered in ``sys.modules`` under its own
name: ``torch.compile`` resolves a function's globals through ``sys.modules[__name__]``, so the
clone must not claim the upstream module's name. Clones are cached per (function, overrides).
"""

from __future__ import annotations

import functools
import sys
import types
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["rebind_globals"]


def rebind_globals(fn: Callable[..., Any], overrides: Mapping[str, Any]) -> Callable[..., Any]:
    """Return a copy of ``fn`` that sees ``overrides`` in place of its module globals.

    Decorators that keep the wrapped function in ``__wrapped__`` and in a closure cell (the
    ``functools.wraps`` pattern) are followed, so the innermost function is the one rebound.

    Raises:
        ValueError: a name in ``overrides`` is not a global of the function being rebound
            (the upstream code changed; patching would silently do nothing).
    """
    inner = getattr(fn, "__wrapped__", None)
    if inner is not None and fn.__closure__:
        new_inner = rebind_globals(inner, overrides)
        cells = tuple(
            types.CellType(new_inner) if cell.cell_contents is inner else cell for cell in fn.__closure__
        )
        return _clone(fn, fn.__globals__, cells, wrapped=new_inner)
    missing = [name for name in overrides if name not in fn.__code__.co_names]
    if missing:
        raise ValueError(f"{fn.__qualname__} does not reference {missing}; the upstream code changed")
    key = (fn, tuple(sorted((name, id(value)) for name, value in overrides.items())))
    if key not in _CACHE:
        _CACHE[key] = _clone(fn, _namespace(fn, overrides), fn.__closure__)
    return _CACHE[key]


_CACHE: dict[tuple, Callable[..., Any]] = {}


def _namespace(fn: Callable[..., Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """A snapshot of ``fn``'s module namespace with ``overrides``, as a registered module."""
    upstream = fn.__globals__.get("__name__", "module")
    name = f"torchembed._rebound.{upstream}.{len(_CACHE)}"
    module = types.ModuleType(name)
    module.__dict__.update(fn.__globals__)
    module.__dict__.update(overrides)
    module.__name__, module.__spec__, module.__package__ = name, None, None
    sys.modules[name] = module
    return module.__dict__


def _clone(fn, globals_: dict, closure, wrapped=None):
    new = types.FunctionType(fn.__code__, globals_, fn.__name__, fn.__defaults__, closure)
    new.__kwdefaults__ = fn.__kwdefaults__
    functools.update_wrapper(new, fn)
    if wrapped is not None:
        new.__wrapped__ = wrapped
    else:
        new.__dict__.pop("__wrapped__", None)
    new.__torchembed_original__ = fn
    return new
