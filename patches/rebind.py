"""Run upstream's code with some module-level helpers replaced, for one function object.

HF attention code calls helpers such as ``apply_rotary_pos_emb`` as globals of its modeling module, and every release
may wrap the calling method in decorators (``deprecate_kwarg``, ``can_return_tuple``, ...) whose own globals belong to
another module. Rebinding the module global would change every model of that family in the process; copying only the
inner function would drop what the decorators do (a keyword renamed by ``deprecate_kwarg`` would then fall into
``**kwargs`` and be silently ignored).

:func:`replace_globals` therefore walks the *wrapper chain*: the function and every function held in its closure cells,
recursively (``functools.wraps`` wrappers, wrappers without ``__wrapped__``, stacked decorators alike). Each function of
the chain that loads one of the names as a global is cloned with a namespace in which only those names differ; each
function whose closure holds a cloned function is cloned around it. The clones share code, defaults and the untouched
closure cells with the originals, so upstream behaviour (keyword renames, output handling) is kept.

A namespace is a snapshot of the function's module dict taken when the clone is made, held by a
module registered in ``sys.modules`` under its own name (``torch.compile`` resolves a function's
globals through ``sys.modules[__name__]``, so a clone must not claim the upstream module's name).
Clones are cached per (function, replacements): patching many models makes one clone.
"""

from __future__ import annotations

import dis
import functools
import sys
import types
from collections.abc import Callable, Iterator, Mapping
from typing import Any

__all__ = ["HelperNotFound", "chain", "global_names", "attribute_names", "find_globals", "replace_globals"]


class HelperNotFound(LookupError):
    """No function of the wrapper chain loads the name as a global (``.attribute_uses`` says where
    it is reached through an attribute instead, if anywhere)."""

    def __init__(self, message: str, attribute_uses: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.attribute_uses = attribute_uses


def chain(fn: Any) -> Iterator[types.FunctionType]:
    """``fn`` and every function reachable through closure cells, depth first, each once.

    Non-function callables in the chain (a decorator implemented as a class instance) are not
    entered: their code cannot be cloned.
    """
    seen: set[int] = set()
    stack = [fn]
    while stack:
        f = stack.pop()
        if not isinstance(f, types.FunctionType) or id(f) in seen:
            continue
        seen.add(id(f))
        yield f
        for cell in reversed(f.__closure__ or ()):
            content = _cell_contents(cell)
            if isinstance(content, types.FunctionType):
                stack.append(content)


def global_names(fn: types.FunctionType) -> frozenset[str]:
    """Names ``fn`` loads as globals (its nested code objects included: lambdas, comprehensions)."""
    return _names(fn.__code__)[0]


def attribute_names(fn: types.FunctionType) -> frozenset[str]:
    """Names ``fn`` loads as attributes (``x.name``)."""
    return _names(fn.__code__)[1]


def find_globals(fn: Any, accept: Callable[[str, Any], bool]) -> dict[str, list[tuple[types.FunctionType, Any]]]:
    """``{name: [(function of the chain, value), ...]}`` for every global a function of ``fn``'s
    chain loads and defines in its module, where ``accept(name, value)`` holds."""
    found: dict[str, list[tuple[types.FunctionType, Any]]] = {}
    for f in chain(fn):
        for name in global_names(f):
            if name in f.__globals__:
                value = f.__globals__[name]
                if accept(name, value):
                    found.setdefault(name, []).append((f, value))
    return found


def replace_globals(fn: Any, replacements: Mapping[str, Any]) -> types.FunctionType:
    """A copy of ``fn`` (and of its wrapper chain) that sees ``replacements`` in place of globals.

    Raises:
        TypeError: ``fn`` is not a Python function (nothing to clone).
        HelperNotFound: a name is loaded as a global by no function of the chain (upstream changed: patching would
            silently do nothing); ``attribute_uses`` names functions that reach it through an attribute instead.
    """
    if not isinstance(fn, types.FunctionType):
        raise TypeError(f"{fn!r} is a {type(fn).__name__}, not a Python function; its code cannot be rebound")
    functions = list(chain(fn))
    for name in replacements:
        if not any(name in global_names(f) and name in f.__globals__ for f in functions):
            via_attribute = tuple(f.__qualname__ for f in functions if name in attribute_names(f))
            where = f"; it is reached through an attribute in {', '.join(via_attribute)}" if via_attribute else ""
            raise HelperNotFound(
                f"{fn.__module__}.{fn.__qualname__} does not call {name!r} as a module-level name{where}", via_attribute
            )
    key = (fn, tuple(sorted((name, id(value)) for name, value in replacements.items())))
    hit = _CACHE.get(key)
    if hit is None:
        clone, _ = _rebuild(fn, dict(replacements), {})
        hit = _CACHE[key] = (clone, tuple(replacements.values()))  # values kept alive with their ids
    return hit[0]


# -- internals ---------------------------------------------------------------------------------

_CACHE: dict[tuple, tuple[types.FunctionType, tuple]] = {}
_GLOBAL_OPS = frozenset({"LOAD_GLOBAL", "LOAD_NAME"})
_ATTR_OPS = frozenset({"LOAD_ATTR", "LOAD_METHOD", "LOAD_SUPER_ATTR"})


@functools.lru_cache(maxsize=4096)
def _names(code: types.CodeType) -> tuple[frozenset[str], frozenset[str]]:
    globals_, attrs = set(), set()
    for ins in dis.get_instructions(code):
        if ins.opname in _GLOBAL_OPS:
            globals_.add(ins.argval)
        elif ins.opname in _ATTR_OPS:
            attrs.add(ins.argval)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            inner_globals, inner_attrs = _names(const)
            globals_ |= inner_globals
            attrs |= inner_attrs
    return frozenset(globals_), frozenset(attrs)


def _cell_contents(cell: types.CellType) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return None


def _rebuild(fn: types.FunctionType, replacements: dict[str, Any], memo: dict[int, types.FunctionType | None]) -> tuple[types.FunctionType, bool]:
    """Clone ``fn`` if it or a function in its closure loads a replaced global; (fn, False) if not."""
    if id(fn) in memo:
        done = memo[id(fn)]
        return (fn, False) if done is None else (done, True)
    memo[id(fn)] = None  # a cycle back to fn leaves it as is
    own = {name: value for name, value in replacements.items() if name in global_names(fn) and name in fn.__globals__}
    cells = fn.__closure__
    new_cells = None
    rebuilt: dict[int, types.FunctionType] = {}
    for i, cell in enumerate(cells or ()):
        content = _cell_contents(cell)
        if isinstance(content, types.FunctionType):
            new, changed = _rebuild(content, replacements, memo)
            if changed:
                new_cells = new_cells or list(cells)
                new_cells[i] = types.CellType(new)
                rebuilt[id(content)] = new
    if not own and new_cells is None:
        return fn, False
    namespace = _namespace(fn, own) if own else fn.__globals__
    clone = types.FunctionType(fn.__code__, namespace, fn.__name__, fn.__defaults__,
                               tuple(new_cells) if new_cells is not None else cells)
    clone.__kwdefaults__ = fn.__kwdefaults__
    clone.__dict__.update(fn.__dict__)
    for attr in ("__module__", "__qualname__", "__doc__", "__annotations__"):
        setattr(clone, attr, getattr(fn, attr))
    wrapped = fn.__dict__.get("__wrapped__")
    if wrapped is not None:
        clone.__wrapped__ = rebuilt.get(id(wrapped), wrapped)
    memo[id(fn)] = clone
    return clone, True


def _namespace(fn: types.FunctionType, replacements: Mapping[str, Any]) -> dict[str, Any]:
    """A snapshot of ``fn``'s module namespace with ``replacements``, as a registered module."""
    upstream = fn.__globals__.get("__name__", "module")
    name = f"torchembed._rebound.{upstream}.{len(_CACHE)}.{len(sys.modules)}"
    module = types.ModuleType(name)
    module.__dict__.update(fn.__globals__)
    module.__dict__.update(replacements)
    module.__name__, module.__spec__, module.__package__ = name, None, None
    sys.modules[name] = module
    return module.__dict__
