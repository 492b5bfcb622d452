"""Declarative adapters shared by the families (:class:`OverrideMethod`, :class:`ReplaceForward`,
:class:`ReplaceGlobals`, :class:`KeepGenerationCache`): each states what it expects of upstream and checks it in
``plan`` (before anything changes), raising :class:`StructureError` naming what differs. Classes are matched by name
along each module's MRO, so a subclass of a declared class (a user's, or a renamed upstream class that keeps the old one
as a base) is patched as its base would be.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Iterator
from typing import Any

from torch import nn

from torchembed.patches.actions import Component, InstanceMethod, OverrideAttribute
from torchembed.patches.errors import StructureError
from torchembed.patches.rebind import HelperNotFound, chain, global_names
from torchembed.patches.registry import Family, PatchOptions

__all__ = ["KeepGenerationCache", "OverrideMethod", "ReplaceForward", "ReplaceGlobals", "modules_of", "qualname",
           "require_params"]


def qualname(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', type(obj).__qualname__)}"


def modules_of(model: nn.Module, class_name: str) -> Iterator[tuple[str, nn.Module]]:
    """``(path, module)`` for each module whose class, or one of its bases, is named ``class_name``."""
    for path, module in model.named_modules():
        if any(cls.__name__ == class_name for cls in type(module).__mro__):
            yield path, module


def require_params(family: Family, where: str, fn: Any, params: tuple[str, ...], *, any_of: tuple[str, ...] = ()) -> None:
    """``fn`` accepts every name in ``params`` (and at least one of ``any_of``, if given)."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError) as err:
        raise StructureError(family.name, where, f"a function taking {', '.join(params)}", f"no signature ({err})") from None
    names = [p.name for p in signature.parameters.values() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    missing = [p for p in params if p not in names]
    if missing or (any_of and not set(any_of) & set(names)):
        expected = ", ".join(params) + (f" and one of {'/'.join(any_of)}" if any_of else "")
        raise StructureError(family.name, where, f"parameters {expected}", f"({', '.join(names)})")


def _require_modules(family: Family, model: nn.Module, class_name: str) -> list[tuple[str, nn.Module]]:
    found = list(modules_of(model, class_name))
    if not found:
        present = sorted({type(m).__name__ for m in model.modules() if type(m).__module__.startswith("transformers.models")})
        raise StructureError(family.name, type(model).__name__, f"modules of class {class_name}",
                             f"classes {', '.join(present[:12])}{' ...' if len(present) > 12 else ''}")
    return found


class OverrideMethod:
    """Set ``method`` on every module of ``class_name`` to a torchembed function (instance only).

    The function is stored as a plain instance attribute, so it is called without ``self``; the upstream method must
    take ``params``.
    """

    def __init__(self, class_name: str, method: str, replacement: Any, params: tuple[str, ...], kind: str = "alibi") -> None:
        self.class_name, self.method, self.replacement, self.params, self.kind = class_name, method, replacement, params, kind

    def plan(self, model: nn.Module, config: Any, options: PatchOptions, family: Family) -> list[OverrideAttribute]:
        actions = []
        for path, module in _require_modules(family, model, self.class_name):
            upstream = getattr(type(module), self.method, None)
            where = f"{type(module).__qualname__}.{self.method}"
            if upstream is None:
                raise StructureError(family.name, where, f"a method {self.method}", "no such attribute")
            require_params(family, where, upstream, ("self", *self.params))
            component = Component(path, self.kind, qualname(upstream), qualname(self.replacement))
            actions.append(OverrideAttribute(component, module, self.method, self.replacement))
        return actions


class ReplaceForward:
    """Replace ``forward`` of every module of ``class_name`` by ``forward`` (bound per instance).

    ``requires``: parameters upstream's forward must have (what the replacement relies on being passed);
    ``cache_any_of``: the cache parameter's possible names (one must be present).
    """

    def __init__(self, class_name: str, forward: Any, requires: tuple[str, ...], cache_any_of: tuple[str, ...] = (),
                 kind: str = "alibi-attention") -> None:
        self.class_name, self.forward, self.requires, self.cache_any_of, self.kind = class_name, forward, requires, cache_any_of, kind

    def plan(self, model: nn.Module, config: Any, options: PatchOptions, family: Family) -> list[OverrideAttribute]:
        actions = []
        for path, module in _require_modules(family, model, self.class_name):
            upstream = type(module).forward
            require_params(family, f"{type(module).__qualname__}.forward", upstream, self.requires, any_of=self.cache_any_of)
            component = Component(path, self.kind, qualname(upstream), qualname(self.forward))
            actions.append(OverrideAttribute(component, module, "forward", InstanceMethod(module, self.forward)))
        return actions


class ReplaceGlobals:
    """Run ``forward`` of every module of ``class_name`` with module-level names replaced.

    ``required`` names must be called by upstream's forward (through any decorators); ``optional`` ones are replaced
    where the installed release calls them (only some BLOOM releases build the bias inline with ``_get_alibi_slopes``).
    """

    def __init__(self, class_name: str, required: dict[str, Any], optional: dict[str, Any] | None = None,
                 kind: str = "alibi") -> None:
        self.class_name, self.required, self.optional, self.kind = class_name, required, optional or {}, kind

    def plan(self, model: nn.Module, config: Any, options: PatchOptions, family: Family) -> list[OverrideAttribute]:
        actions = []
        for path, module in _require_modules(family, model, self.class_name):
            forward = type(module).forward
            loaded = {name for f in chain(forward) for name in global_names(f) if name in f.__globals__}
            used = {**self.required, **{name: fn for name, fn in self.optional.items() if name in loaded}}
            if not used:  # no optional name called, none required: nothing to do for this module
                continue
            where = f"{type(module).__qualname__}.forward"
            try:
                method = InstanceMethod(module, forward, used)
            except HelperNotFound as err:
                raise StructureError(family.name, where, f"calls to the module-level {', '.join(self.required)}",
                                     str(err)) from None
            except TypeError as err:
                raise StructureError(family.name, where, "a Python function (to rebuild with replaced helpers)",
                                     str(err)) from None
            component = Component(path, self.kind, f"{qualname(forward)} calling {', '.join(sorted(used))}",
                                  ", ".join(qualname(fn) for fn in used.values()))
            actions.append(OverrideAttribute(component, module, "forward", method))
        return actions


class KeepGenerationCache:
    """``generate`` keeps a KV cache: where the model's generation config has ``use_cache=False`` (``MptConfig``'s
    default, MPT-7B's config.json too), the patched instance gets a copy of it with ``use_cache=True``; otherwise every
    generated token re-runs the whole prefix (at 65k tokens, seconds per token). Per instance: the copy is this
    model's attribute, undone by ``unpatch``; a ``use_cache`` the caller passes to ``generate`` still wins."""

    def plan(self, model: nn.Module, config: Any, options: PatchOptions, family: Family) -> list[OverrideAttribute]:
        generation = getattr(model, "generation_config", None)
        if generation is None or getattr(generation, "use_cache", True) is not False:
            return []
        kept = copy.deepcopy(generation)
        kept.use_cache = True
        component = Component("", "generation", "generation_config.use_cache=False (the prefix re-run per token)",
                              "torchembed KeepGenerationCache: generation_config.use_cache=True (a KV cache; unpatch "
                              "restores the config)")
        return [OverrideAttribute(component, model, "generation_config", kept)]
