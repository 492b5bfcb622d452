"""What a patch does to a model, as plain data: each action can apply itself and undo itself.

Everything here survives ``copy.deepcopy``, ``pickle`` / ``torch.save`` and ``multiprocessing``
hand-offs: undo information is plain attributes (no closures), the "nothing was there" marker is
a module-level singleton, and an instance method torchembed installs (:class:`InstanceMethod`)
rebuilds itself from importable parts when it is copied or loaded.
"""

from __future__ import annotations

import copy
import inspect
import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from torchembed.patches.kv_cache import CACHE_KEYWORDS, grow_in_place
from torchembed.patches.rebind import replace_globals

__all__ = ["Component", "InstanceMethod", "MISSING", "OverrideAttribute", "AddForwardPreHook", "SwapModule"]


class _Missing:
    """The value of an attribute that was not set on the instance (one object, also after copies)."""

    def __repr__(self) -> str:
        return "MISSING"

    def __reduce__(self) -> str:
        return "MISSING"  # pickled as a reference to this module's global (and copied as itself)


MISSING = _Missing()


@dataclass(frozen=True)
class Component:
    """One positional component found in a model (what ``find_positional_components`` lists)."""

    path: str  # dotted module path, "" for the root
    kind: str  # "rope-apply", "alibi", "alibi-attention", "learned", "device-copies"
    upstream: str  # qualified name of what is there now
    replacement: str  # qualified name of what torchembed puts there

    def __str__(self) -> str:
        return f"{self.path or '<root>'}: {self.upstream} -> {self.replacement} ({self.kind})"


class InstanceMethod:
    """A method installed on one module instance: ``function`` bound to ``module``, with the
    module-level names in ``replacements`` swapped inside it (see :mod:`torchembed.patches.rebind`).

    Behaves as a bound method (``__self__``, ``__func__``, ``__wrapped__``, the upstream signature) and, unlike a bound
    method of a cloned function, can be deep-copied and pickled: it is rebuilt from ``(module, function, replacements,
    grow_cache)``, each importable or picklable. ``grow_cache``: an attention forward whose ``DynamicCache`` (passed by
    keyword) grows in place for each call (:func:`torchembed.patches.kv_cache.grow_in_place`).
    """

    __slots__ = ("__self__", "__func__", "function", "replacements", "grow_cache")

    def __init__(self, module: nn.Module, function: Any, replacements: Mapping[str, Any] | None = None,
                 grow_cache: bool = False) -> None:
        self.__self__ = module
        self.function = function
        self.replacements = dict(replacements or {})
        self.grow_cache = grow_cache
        self.__func__ = replace_globals(function, self.replacements) if self.replacements else function

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.grow_cache:
            for name in CACHE_KEYWORDS:
                if kwargs.get(name) is not None:
                    kwargs[name] = grow_in_place(kwargs[name])
        return self.__func__(self.__self__, *args, **kwargs)

    def __reduce__(self) -> tuple:
        return (type(self), (self.__self__, self.function, self.replacements, self.grow_cache))

    @property
    def __wrapped__(self) -> types.MethodType:
        return types.MethodType(self.function, self.__self__)

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.signature(types.MethodType(self.function, self.__self__))

    def __getattr__(self, name: str) -> Any:  # __name__, __qualname__, ...: the function's
        if name in ("__name__", "__qualname__", "__doc__", "__annotations__"):
            return getattr(self.function, name)
        raise AttributeError(name)

    def __repr__(self) -> str:
        swapped = ", ".join(self.replacements) or "replaced"
        return f"<torchembed method {self.function.__qualname__} ({swapped}) of {type(self.__self__).__name__}>"


_REPLICATE = "_replicate_for_data_parallel"


def replicate_rebinding(module: nn.Module) -> nn.Module:
    """``module._replicate_for_data_parallel()`` with every :class:`InstanceMethod` bound to
    ``module`` rebound to the replica (this one included, for replicas of replicas)."""
    replica = getattr(type(module), _REPLICATE)(module)
    attrs = vars(replica)
    for name, value in list(attrs.items()):
        if isinstance(value, InstanceMethod) and value.__self__ is module:
            attrs[name] = type(value)(replica, value.function, value.replacements, value.grow_cache)
    return replica


@dataclass
class SwapModule:
    """Replace the child ``name`` of ``parent`` by ``new``.

    An accelerate hook on the module taken out (``device_map`` placement, CPU or disk offload: the hook moves inputs and
    loads offloaded weights on each call) is given, as a copy, to the module put in, both ways: a model dispatched
    before the patch keeps working patched, and one dispatched while patched keeps working after ``unpatch``.
    """

    component: Component
    parent: nn.Module
    name: str
    new: nn.Module
    old: nn.Module | None = None

    def apply(self) -> None:
        self.old = getattr(self.parent, self.name)
        _carry_accelerate_hook(self.old, self.new)
        setattr(self.parent, self.name, self.new)

    def undo(self) -> None:
        _carry_accelerate_hook(self.new, self.old)
        setattr(self.parent, self.name, self.old)


def _carry_accelerate_hook(source: nn.Module, target: nn.Module) -> None:
    """Give ``target`` a copy of ``source``'s accelerate hook, where it has one and ``target`` none.

    A copy (the hook's state, e.g. the devices it restores on removal, is per module), sharing
    what it was given at dispatch (execution device, the offloaded weights' map)."""
    hook = getattr(source, "_hf_hook", None)
    if hook is None or getattr(target, "_hf_hook", None) is not None:
        return
    from accelerate.hooks import SequentialHook, add_hook_to_module

    if isinstance(hook, SequentialHook):
        copied = SequentialHook(*(copy.copy(h) for h in hook.hooks))
    else:
        copied = copy.copy(hook)
    add_hook_to_module(target, copied)


@dataclass
class OverrideAttribute:
    """Set an instance attribute (e.g. an :class:`InstanceMethod`) on ``obj``; undo restores or deletes it.

    A ``forward`` wrapped by accelerate's hooks (``_hf_hook``/``_old_forward``) is overridden beneath the hook, so
    device placement keeps working; one that accelerate wrapped after the patch is found there on undo.

    An :class:`InstanceMethod` value also gives the module a ``_replicate_for_data_parallel`` that
    rebinds it to each replica (``nn.DataParallel`` copies a module's ``__dict__``, so a replica
    would otherwise run the method on the original module's weights); undo removes it.
    """

    component: Component
    obj: Any
    name: str
    value: Any
    previous: Any = field(default=MISSING)
    target: str = ""
    rebinds_replicas: bool = False

    def apply(self) -> None:
        self.target = self.name
        if self.name == "forward" and hasattr(self.obj, "_hf_hook") and "_old_forward" in vars(self.obj):
            self.target = "_old_forward"
        self.previous = vars(self.obj).get(self.target, MISSING)
        setattr(self.obj, self.target, self.value)
        if isinstance(self.value, InstanceMethod) and _REPLICATE not in vars(self.obj):
            setattr(self.obj, _REPLICATE, InstanceMethod(self.obj, replicate_rebinding))
            self.rebinds_replicas = True

    def undo(self) -> None:
        if self.rebinds_replicas:
            vars(self.obj).pop(_REPLICATE, None)
            self.rebinds_replicas = False
        attrs = vars(self.obj)
        target = self.target
        if attrs.get(target, MISSING) is not self.value and attrs.get("_old_forward", MISSING) is self.value:
            target = "_old_forward"  # accelerate dispatched the patched model: it keeps ours there
        if target == "_old_forward" and self.previous is MISSING:
            setattr(self.obj, target, types.MethodType(getattr(type(self.obj), self.name), self.obj))
        elif self.previous is MISSING:
            attrs.pop(target, None)
        else:
            setattr(self.obj, target, self.previous)


@dataclass
class AddForwardPreHook:
    """Register ``hook`` as a forward pre-hook (with kwargs) of ``module``; undo removes it.

    The hook's id is kept as plain data (not a handle), so a deep copy of a patched model
    removes the hook from its own module."""

    component: Component
    module: nn.Module
    hook: Any
    hook_id: int | None = None

    def apply(self) -> None:
        self.hook_id = self.module.register_forward_pre_hook(self.hook, with_kwargs=True, prepend=True).id

    def undo(self) -> None:
        self.module._forward_pre_hooks.pop(self.hook_id, None)
        self.module._forward_pre_hooks_with_kwargs.pop(self.hook_id, None)
