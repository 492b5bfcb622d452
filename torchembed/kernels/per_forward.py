"""What one forward of a patched model derives once for all its layers, kept for that forward only.

Every layer of an HF model's forward receives the same attention mask, ALiBi bias and rotary ``(cos, sin)`` tables.
What torchembed derives from them (the keep mask and its row summary, the key bias, the decode mask, the tables in the
form the rotation reads) is computed by the first layer that needs it and kept in a :class:`PerForward` for that
forward only (:mod:`torchembed.patches.forward_scope` opens and closes it), where the other layers find it
(:func:`current`); nothing is kept in module-level tables. Per thread, nested (a patched model called inside another's
forward gets its own), never inside a graph ``torch.compile`` traces; without an open forward (a layer called on its
own) :func:`current` is None and every layer derives what it needs itself.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from typing import Any

import torch

__all__ = ["PerForward", "current", "derive", "open_forward", "close_forward"]


class PerForward:
    """The derivations of one forward: ``memo(sources, tag, make)`` computes ``make()`` once per (source tensors,
    tag) and returns the kept value to every later layer of the forward.

    Sources are held (strongly) for the forward's duration, so their identities cannot be reused by other tensors
    while the entry exists; the object is dropped when the forward ends."""

    __slots__ = ("owner", "_memo")

    def __init__(self, owner: int = 0) -> None:
        self.owner = owner  # id of the module whose forward opened it
        self._memo: dict[tuple, tuple[Any, Any]] = {}

    def memo(self, sources: Any, tag: Hashable, make: Callable[..., Any], *args: Any) -> Any:
        """``make(*args)`` once per ``(sources, tag)`` in this forward. ``sources``: a tensor, a tuple of tensors or
        Nones (matched by identity) or None (``tag`` alone identifies the value)."""
        key = (tuple(map(id, sources)) if type(sources) is tuple else id(sources), tag)
        entry = self._memo.get(key)
        if entry is not None:
            return entry[1]
        value = make(*args)
        self._memo[key] = (sources, value)
        return value

    def __len__(self) -> int:
        return len(self._memo)


def derive(scope: PerForward | None, sources: Any, tag: Hashable, make: Callable[..., Any], *args: Any) -> Any:
    """``make(*args)``, kept in ``scope`` (:meth:`PerForward.memo`) for the rest of its forward; computed afresh
    where ``scope`` is None (no forward open, or inside a graph being traced)."""
    return make(*args) if scope is None else scope.memo(sources, tag, make, *args)


class _Open(threading.local):
    """Per thread: the forwards open now, innermost last."""

    def __init__(self) -> None:
        self.stack: list[PerForward] = []


_OPEN = _Open()


def current() -> PerForward | None:
    """The innermost forward open in this thread; None where none is open or ``torch.compile`` traces (the graph
    derives what it needs)."""
    stack = _OPEN.stack
    return stack[-1] if stack and not torch.compiler.is_compiling() else None


def open_forward(owner: object) -> PerForward:
    """Open a forward of ``owner`` (a module) in this thread. A forward of the same module still open below is a
    left-over of one that ended without closing (interrupted outside Python's ``Exception``, which forward hooks do
    not see): it and everything above it are dropped first, since a module's forward does not run inside itself."""
    stack, key = _OPEN.stack, id(owner)
    for i, scope in enumerate(stack):
        if scope.owner == key:
            del stack[i:]
            break
    scope = PerForward(key)
    stack.append(scope)
    return scope


def close_forward(owner: object) -> None:
    """Close the innermost open forward of ``owner`` in this thread (and anything opened above it that did not
    close); nothing when none is open."""
    stack, key = _OPEN.stack, id(owner)
    for i in range(len(stack) - 1, -1, -1):
        if stack[i].owner == key:
            del stack[i:]
            return
