"""RoPE families: every attention that calls a rotation helper gets torchembed's rotation.

Discovery is by structure, not by class names. For each module of the model, the forward its class provides is
followed through its decorators (:mod:`torchembed.patches.rebind`); each module-level callable it loads whose name
speaks of rotary/rope is probed once (:func:`torchembed.patches.rope.recognition.recognize`). A module whose forward
calls at least one recognised helper is a rotating attention: its forward is rebuilt, for that instance only, with each
helper replaced by a :class:`~torchembed.patches.rope.helper.RotaryHelper` (the fused Triton kernel where it can run,
the float32 reference elsewhere) and installed as an instance method.

The model's rotary module stays as it is: it builds upstream's ``cos``/``sin`` tables from its own ``inv_freq`` for
every rope type (default, linear, dynamic, yarn, longrope, llama3, per-layer types ...), and torchembed rotates with
them. So HF's own machinery (``_init_weights``, dynamic frequency updates, ``rope_parameters`` handling) keeps working
on a patched model, and a patched model can never pair torchembed's tables with upstream's rotation or the reverse.

Checked before anything changes (:meth:`ReplaceRotationHelpers._check`, a
:class:`~torchembed.patches.errors.StructureError` otherwise): no half-recognised model, no rotating forward hidden
behind ``super().forward``, and what a family declares (:class:`RopeExpectation`).
"""

from __future__ import annotations

import functools
import inspect
import types
import weakref
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from torchembed.kernels.route import refuse
from torchembed.patches.actions import Component, InstanceMethod, OverrideAttribute
from torchembed.patches.rope.decode_attention import AttentionFunctions
from torchembed.patches.adapters import qualname
from torchembed.patches.decode_graphs import ReplayDecodeSteps
from torchembed.patches.errors import StructureError, UnsupportedModelError
from torchembed.patches.rebind import attribute_names, chain, find_globals, global_names
from torchembed.patches.registry import Family, PatchOptions, register, set_fallback
from torchembed.patches.rope.recognition import Rotation, explain, is_rotation_name, recognize, upstream_function
from torchembed.patches.rope.helper import RotaryHelper

__all__ = ["ClassRotations", "RopeExpectation", "ReplaceRotationHelpers", "RopeDiscovery", "discover", "class_rotations", "discovered_family"]


@dataclass(frozen=True)
class ClassRotations:
    """What the forward of one attention class calls: ``{global name: (upstream helper, rotation)}`` for the
    recognised helpers, ``{name: why}`` for rope-named callables that are not.

    ``methods``: the functions to rebuild per instance, by attribute name: ``forward`` and each method of the class that
    the forward reaches as ``self.<name>(...)`` (directly or through such methods) and that calls a rotation helper
    itself (Qwen4-Exp's indexer rotates its keys in ``_select_tokens``)."""

    forward: Any
    recognized: dict[str, tuple[Any, Rotation]]
    unrecognized: dict[str, str]
    calls_super_forward: bool
    via_attribute: frozenset[str] = frozenset()  # apply-like rotation names loaded as ``x.name``
    methods: dict[str, Any] = field(default_factory=dict)


_CLASS_CACHE: "weakref.WeakKeyDictionary[type, ClassRotations]" = weakref.WeakKeyDictionary()


def _is_candidate(name: str, value: Any) -> bool:
    return is_rotation_name(name) and callable(value) and not isinstance(value, (type, types.ModuleType))


def _rotating_methods(cls: type, forward: Any) -> dict[str, Any]:
    """``forward`` and the plain methods of ``cls`` it reaches by attribute name (transitively) that load a
    rotation-named global, by name."""
    methods, seen, todo = {"forward": forward}, {"forward"}, [forward]
    while todo:
        for name in sorted({n for f in chain(todo.pop()) for n in attribute_names(f)} - seen):
            seen.add(name)
            method = inspect.getattr_static(cls, name, None)
            if isinstance(method, types.FunctionType) and not method.__module__.startswith("torch."):
                todo.append(method)
                if find_globals(method, _is_candidate):
                    methods[name] = method
    return methods


def class_rotations(cls: type) -> ClassRotations:
    """The rotation helpers ``cls.forward`` calls, itself or through methods of ``cls`` (cached per class)."""
    hit = _CLASS_CACHE.get(cls)
    if hit is not None:
        return hit
    forward = inspect.getattr_static(cls, "forward", None)
    if isinstance(forward, staticmethod | classmethod) or not callable(forward):
        result = ClassRotations(forward, {}, {}, False)
    else:
        methods = _rotating_methods(cls, forward)
        recognized, unrecognized = {}, {}
        uses: dict[str, list] = {}
        for method in methods.values():
            for name, found in find_globals(method, _is_candidate).items():
                uses.setdefault(name, []).extend(found)
        for name, found in uses.items():
            values = {id(value): value for value in (upstream_function(v) for _, v in found)}
            if len(values) > 1:
                unrecognized[name] = "bound to different objects in different functions of the forward's decorator chain"
                continue
            helper = next(iter(values.values()))
            rotation = recognize(helper)
            if rotation is None:
                unrecognized[name] = explain(helper)
            else:
                recognized[name] = (helper, rotation)
        functions = [f for method in methods.values() for f in chain(method)]
        calls_super = any("super" in global_names(f) and "forward" in attribute_names(f) for f in chain(forward))
        via_attribute = frozenset(name for f in functions for name in attribute_names(f)
                                  if "apply" in name and "rotary" in name)  # not self.rotary_pos_emb(...), self.apply_interleaved_mrope(...)
        result = ClassRotations(forward, recognized, unrecognized, calls_super, via_attribute, methods)
    _CLASS_CACHE[cls] = result
    return result


def _is_attention_table(name: str, value: Any) -> bool:
    """transformers' table of attention functions, as an attention's code loads it."""
    return name == "ALL_ATTENTION_FUNCTIONS" and hasattr(value, "get")


def _is_apply_like(name: str) -> bool:
    return is_rotation_name(name) and ("apply" in name or "rotary_pos" in name)


@dataclass
class RopeDiscovery:
    """What :func:`discover` found in a model."""

    attentions: list[tuple[str, nn.Module, ClassRotations]] = field(default_factory=list)
    mixed: list[tuple[str, ClassRotations]] = field(default_factory=list)  # recognised and unrecognised helpers
    shadowed: list[tuple[str, type]] = field(default_factory=list)  # super().forward of a rotating class
    unrecognized: dict[str, str] = field(default_factory=dict)  # rope-named callables not recognised
    via_attribute: set[str] = field(default_factory=set)  # apply-like names reached as attributes

    def reason_unsupported(self) -> str:
        """Why no attention can be patched, in one sentence."""
        calls = {name: why for name, why in self.unrecognized.items() if _is_apply_like(name)}
        if calls:
            return "its attention rotates with " + "; ".join(f"{name} ({why})" for name, why in sorted(calls.items()))
        if self.via_attribute:
            names = ", ".join(sorted(self.via_attribute))
            return (f"its attention reaches {names} through an attribute (x.{names.split(', ')[0]}), not as a "
                    "module-level function, which torchembed cannot replace for one instance")
        return "no attention module calls a rotary-embedding helper (no RoPE, or RoPE written inline)"


def discover(model: nn.Module) -> RopeDiscovery:
    """Find the rotating attention modules of ``model`` (changes nothing)."""
    found = RopeDiscovery()
    for path, module in model.named_modules():
        rotations = class_rotations(type(module))
        found.unrecognized.update(rotations.unrecognized)
        found.via_attribute.update(rotations.via_attribute)
        if rotations.recognized:
            if rotations.unrecognized:
                found.mixed.append((path, rotations))
            else:
                found.attentions.append((path, module, rotations))
        elif rotations.calls_super_forward and any(
            class_rotations(base).recognized for base in type(module).__mro__[1:] if "forward" in vars(base)
        ):
            found.shadowed.append((path, type(module)))
    return found


@dataclass(frozen=True)
class RopeExpectation:
    """What a declared family relies on: the helper names its attention calls, and whether each decoder layer
    (``config.num_hidden_layers``) has exactly one rotating attention."""

    helpers: tuple[str, ...] = ("apply_rotary_pos_emb",)
    one_per_layer: bool = True


class ReplaceRotationHelpers:
    """Adapter: replace the rotation helpers of every rotating attention, per instance."""

    def __init__(self, expect: RopeExpectation | None = None) -> None:
        self.expect = expect

    def plan(self, model: nn.Module, config: Any, options: PatchOptions, family: Family) -> list[OverrideAttribute]:
        found = discover(model)
        self._check(found, model, config, family)
        if options.fused:
            sectioned = sorted({name for _, _, r in found.attentions for name, (_, rot) in r.recognized.items()
                                if rot.source.kind == "sections"})
            if sectioned:
                raise refuse("the fused RoPE kernel", f"{', '.join(sectioned)} rotates per feature section "
                             "(multidimensional RoPE), which the kernel does not")
        actions = []
        for path, module, rotations in found.attentions:
            replacements = {name: RotaryHelper.get(rotation, helper, options.fused)
                            for name, (helper, rotation) in rotations.recognized.items()}
            upstream = ", ".join(qualname(helper) for helper, _ in rotations.recognized.values())
            described = "; ".join(f"{name}: {rotation.describe()}" for name, (_, rotation) in rotations.recognized.items())
            for name, method in rotations.methods.items():
                used = {helper: replacements[helper] for helper in find_globals(method, _is_candidate)}
                if not used:  # a forward that rotates only through its methods
                    continue
                where = upstream if name == "forward" else f"{qualname(method)} calling {', '.join(sorted(used))}"
                replacement = f"torchembed RotaryHelper ({described})"
                if not options.cudnn_decode:  # its SDPA decode steps: torchembed's split-key kernel, per call
                    for table, found in find_globals(method, _is_attention_table).items():
                        used[table] = AttentionFunctions.get_for(found[0][1], options.fused)
                        replacement += "; SDPA decode steps -> torchembed DecodeAttention"
                component = Component(path, "rope-apply", where, replacement)
                method = InstanceMethod(module, method, used, grow_cache=name == "forward")
                actions.append(OverrideAttribute(component, module, name, method))
        return actions

    def _check(self, found: RopeDiscovery, model: nn.Module, config: Any, family: Family) -> None:
        refusal = f"torchembed cannot patch model_type {getattr(config, 'model_type', '?')!r} ({type(model).__name__})"
        for path, rotations in found.mixed:
            cls = type(dict(model.named_modules())[path])
            raise StructureError(
                family.name, f"{cls.__qualname__}.forward",
                "every rotary helper it calls to compute a rotation torchembed knows",
                "; ".join(f"{name}: {why}" for name, why in rotations.unrecognized.items()))
        for path, cls in found.shadowed:
            raise StructureError(
                family.name, f"{cls.__qualname__} ({path})", "a forward that calls its rotation helper itself",
                "a forward that calls super().forward of a rotating attention class, whose helper cannot be "
                "replaced for one instance")
        if not found.attentions:
            if self.expect is None:
                raise UnsupportedModelError(f"{refusal}: {found.reason_unsupported()}")
            raise StructureError(
                family.name, type(model).__name__,
                f"attention modules whose forward calls {' or '.join(self.expect.helpers)} as a module-level function",
                found.reason_unsupported())
        unserved = {name: why for name, why in found.unrecognized.items() if _is_apply_like(name)}
        if unserved or found.via_attribute:  # some rotations recognised, others not: never half-patched
            what = "; ".join(f"{name} ({why})" for name, why in sorted(unserved.items()))
            if found.via_attribute:
                what = "; ".join(filter(None, (what, f"{', '.join(sorted(found.via_attribute))} reached through an attribute")))
            if self.expect is None:
                raise UnsupportedModelError(f"{refusal} whole: it also rotates with {what}")
            raise StructureError(family.name, type(model).__name__, "every rotation helper of the model recognised", what)
        if self.expect is None:
            return
        names = {name for _, _, rotations in found.attentions for name in rotations.recognized}
        missing = [name for name in self.expect.helpers if name not in names]
        if missing:
            raise StructureError(family.name, "attention forward", f"calls to {', '.join(missing)}",
                                 f"calls to {', '.join(sorted(names))}")
        layers = getattr(config, "num_hidden_layers", None)
        if self.expect.one_per_layer and layers is not None and len(found.attentions) != layers:
            classes = sorted({type(module).__qualname__ for _, module, _ in found.attentions})
            raise StructureError(
                family.name, type(model).__name__, f"one rotating attention per layer ({layers} layers)",
                f"{len(found.attentions)} modules ({', '.join(classes)}) whose forward calls a rotation helper")


def _falcon_rotary(config: Any) -> bool:
    return not getattr(config, "alibi", False)


_DECLARED = RopeExpectation()
_DESCRIPTION = "apply_rotary_pos_emb of each attention -> torchembed rotation (fused RoPE kernel)"
for _model_type in ("llama", "mistral"):
    register(Family(model_type=_model_type, encoding="rope",
                    adapters=(ReplaceRotationHelpers(_DECLARED), ReplayDecodeSteps()), description=_DESCRIPTION))
register(Family(model_type="falcon", encoding="rope", variant="rotary", applies=_falcon_rotary,
                adapters=(ReplaceRotationHelpers(_DECLARED),), description=_DESCRIPTION))


@functools.lru_cache(maxsize=None)
def discovered_family(model_type: str) -> Family:
    """The family of a RoPE model_type with no registered adapter: found by structure."""
    return Family(model_type=model_type, encoding="rope", adapters=(ReplaceRotationHelpers(), ReplayDecodeSteps()),
                  discovered=True,
                  description="rotation helpers found by structure -> torchembed rotation (fused RoPE kernel)")


set_fallback(discovered_family)
