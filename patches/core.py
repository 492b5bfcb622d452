"""``patch`` / ``unpatch`` / ``is_patched`` / ``patched`` / ``find_positional_components``.

A patch touches one model instance: modules are swapped in its tree, methods overridden on its
modules; nothing module-global changes, so an upstream and a patched copy coexist. The undo
record lives on the model (``model._torchembed_patch``, not in ``state_dict``).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

from torch import nn

from torchembed import kernels
from torchembed.kernels.route import check_fused, refuse, use_kernel, why_not
# the families register on import, in this order (the RoPE families also install the registry's fallback)
import torchembed.patches.alibi.families  # noqa: F401
import torchembed.patches.learned.families  # noqa: F401
import torchembed.patches.rope.families  # noqa: F401
from torchembed.patches.actions import Component
from torchembed.patches.forward_scope import ForwardScopeHooks
from torchembed.patches.errors import StructureError, UnsupportedModelError
from torchembed.patches.registry import Family, PatchOptions, family_for, supported_families

__all__ = ["patch", "unpatch", "is_patched", "patched", "find_positional_components", "PatchRecord"]

M = TypeVar("M", bound=nn.Module)
_RECORD = "_torchembed_patch"
_SCOPE = "forward-scope"  # the kind of the per-forward hooks (not a positional component)
_NOT_POSITIONAL = (_SCOPE, "decode-graphs")  # (the graphed forward: torchembed.patches.decode_graphs)


@dataclass
class PatchRecord:
    """What ``patch`` did to a model, in order; ``unpatch`` undoes it in reverse."""

    family: Family
    actions: list[Any] = field(default_factory=list)

    @property
    def components(self) -> list[Component]:
        """The positional components swapped (not the per-forward hooks or the graphed forward)."""
        return [a.component for a in self.actions if a.component.kind not in _NOT_POSITIONAL]


def _base(model: nn.Module) -> nn.Module:
    """The HF model a wrapper holds: a PEFT model's base model, a DDP/FSDP-style wrapper's
    ``.module``; the model itself otherwise. The patch record lives there, so it follows the model
    out of the wrapper (``merge_and_unload``, ``unwrap_model``)."""
    for _ in range(8):
        if hasattr(model, "get_base_model") and callable(model.get_base_model):
            inner = model.get_base_model()
        elif getattr(model, "config", None) is None and isinstance(getattr(model, "module", None), nn.Module):
            inner = model.module
        else:
            return model
        if inner is model:
            return model
        model = inner
    return model


def _family_of(model: nn.Module) -> Family:
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "model_type"):
        raise UnsupportedModelError(
            f"{type(model).__name__} has no HF `config.model_type`; torchembed.patch expects a "
            "transformers PreTrainedModel (e.g. from AutoModelForCausalLM.from_pretrained)"
        )
    family = family_for(config)
    if family is None:
        names = sorted({f.model_type for f in supported_families()})
        raise UnsupportedModelError(
            f"torchembed has no adapter for model_type {config.model_type!r} ({type(model).__name__}); "
            f"supported: {', '.join(names)} and RoPE models found by structure (torchembed list --all)"
        )
    return family


def _check_fused(model: nn.Module, family: Family, fused: bool | None) -> None:
    """``fused`` is None, True or False; True only where the family has a kernel that can run on the
    model's device (FusedUnavailableError naming the fix otherwise)."""
    if not check_fused(fused, "fused"):
        return
    if family.encoding not in ("rope", "alibi"):
        raise refuse(f"a fused kernel for {family.name}", f"{family.name} uses {family.encoding} positions, which have "
                     "no fused kernel")
    param = next(model.parameters(), None)
    if param is None and not kernels.triton_available():
        raise refuse("the fused kernel", why_not())
    if param is not None:
        use_kernel(True, param, "the fused kernel")  # (raises, naming the fix)


def _plan(model: nn.Module, family: Family, fused: bool | None, cudnn_decode: bool = False,
          cuda_graphs: bool = True) -> list[Any]:
    """Every action of every adapter, each adapter having checked the structure it relies on; then the
    hooks that keep one forward's derivations for that forward (:mod:`torchembed.patches.forward_scope`)."""
    options = PatchOptions(fused=fused, cudnn_decode=cudnn_decode, cuda_graphs=cuda_graphs)
    actions = [action for adapter in family.adapters for action in adapter.plan(model, model.config, options, family)]
    if not actions:
        raise StructureError(family.name, type(model).__name__, "at least one positional component",
                             "none (the installed transformers may have restructured this model)")
    base = getattr(model, "base_model", model)  # what every caller's forward reaches (the task model calls it)
    base = base if isinstance(base, nn.Module) else model
    path = next((name for name, module in model.named_modules() if module is base), "")
    component = Component(path, _SCOPE, f"{type(base).__qualname__} forward",
                          "torchembed.patches.forward_scope.ForwardScopeHooks")
    actions.append(ForwardScopeHooks(component, base))
    return actions


def find_positional_components(model: nn.Module) -> list[Component]:
    """Dry run: what ``patch`` would swap (module path, kind, upstream, replacement). Changes nothing.

    Raises:
        UnsupportedModelError: the architecture has no adapter.
    """
    model = _base(model)
    record = getattr(model, _RECORD, None)
    if record is not None:
        return record.components
    family = _family_of(model)
    return [action.component for action in _plan(model, family, None) if action.component.kind not in _NOT_POSITIONAL]


def is_patched(model: nn.Module) -> bool:
    """Whether ``model`` currently carries torchembed's components."""
    return getattr(_base(model), _RECORD, None) is not None


def patch(model: M, fused: bool | None = None, *, strict: bool = True, cudnn_decode: bool = False,
          cuda_graphs: bool = True) -> M:
    """Swap torchembed's positional components into a loaded HF model, in place.

    Args:
        model: a transformers model of a supported family (``torchembed list``).
        fused: for every component the patch installs (the rotation, the ALiBi attention, a RoPE model's decode
            steps' attention): ``None`` the Triton kernels where they run and take the call, PyTorch elsewhere;
            ``True`` the kernel for every call the component computes, or ``FusedUnavailableError`` naming why;
            ``False`` never (:mod:`torchembed.kernels.route`).
        strict: if False, an unsupported model (or one whose transformers code is not structured as
            torchembed expects) is returned untouched with a warning.
        cudnn_decode: leave a CUDA decode step's attention to what upstream calls (SDPA, which picks its
            backend, cuDNN on recent GPUs: a plan built for every new key length). By default a decode
            step (:func:`torchembed.kernels.route.decode_step`: at most 16 new tokens over a KV cache) runs
            torchembed's split-key decode kernel, decided per call for this model only
            (:mod:`torchembed.patches.rope.decode_attention`).
        cuda_graphs: a CUDA decode step of one token (what ``generate`` runs) of a LLaMA, Mistral, Qwen2/3, Gemma,
            Phi-3, Granite, OLMo-2 or (with transformers 5.21 or later) BLOOM or MPT model is replayed from a CUDA graph captured by this model
            (:mod:`torchembed.patches.decode_graphs`); False runs every step eagerly.

    Returns:
        The same model object. Patching a patched model is a no-op. A patched model inside
        ``model`` (a base model patched before a task model was built around it) is taken over:
        ``model``'s patch then covers it, and ``unpatch(model)`` restores all of it.

    Raises:
        UnsupportedModelError: unsupported architecture (and ``strict=True``).
        StructureError: the installed transformers differs from what the family's adapters rely
            on (and ``strict=True``); nothing was changed.
        FusedUnavailableError: ``fused=True`` where the kernel cannot run (at patch time: the model's device,
            Triton, sectioned rotations; later, per call: an input the kernel does not take).
    """
    if is_patched(model):
        return model
    wrapper, model = model, _base(model)
    try:
        family = _family_of(model)
        _check_fused(model, family, fused)
    except (UnsupportedModelError, StructureError) as err:
        return _unpatched(wrapper, err, strict)
    inner = _take_over_inner_patches(model)
    record = PatchRecord(family)
    try:
        actions = _plan(model, family, fused, cudnn_decode, cuda_graphs)
        for action in actions:
            action.apply()
            record.actions.append(action)
    except BaseException as err:
        for action in reversed(record.actions):
            action.undo()
        for module, previous in inner:  # as they were: their own actions again
            for action in previous.actions:
                action.apply()
            setattr(module, _RECORD, previous)
        if isinstance(err, (UnsupportedModelError, StructureError)):
            return _unpatched(wrapper, err, strict)
        raise
    setattr(model, _RECORD, record)
    return wrapper


def _unpatched(wrapper: M, err: Exception, strict: bool) -> M:
    if strict:
        raise err
    what = str(err).partition(". torchembed left the model unpatched")[0]  # (StructureError's advice: not here)
    warnings.warn(f"torchembed.patch(strict=False): {what}; the model is left unpatched.", stacklevel=3)
    return wrapper


def _take_over_inner_patches(model: nn.Module) -> list[tuple[nn.Module, PatchRecord]]:
    """Unpatch the patched models inside ``model`` (e.g. a base model patched before a task model
    was built around it), so that ``model``'s patch covers them with one record and its ``unpatch``
    restores all of upstream; returns them with their records (re-applied if the patch fails)."""
    inner = [(module, vars(module)[_RECORD]) for module in model.modules()
             if module is not model and _RECORD in vars(module)]
    for module, _ in inner:
        unpatch(module)
    return inner


def unpatch(model: M) -> M:
    """Restore the upstream components exactly (outputs bit for bit). No-op on an unpatched model."""
    base = _base(model)
    record = getattr(base, _RECORD, None)
    if record is None:
        return model
    for action in reversed(record.actions):
        action.undo()
    delattr(base, _RECORD)
    return model


@contextlib.contextmanager
def patched(model: M, fused: bool | None = None, *, cudnn_decode: bool = False,
            cuda_graphs: bool = True) -> Iterator[M]:
    """``with torchembed.patched(model): ...`` patches for the block, then restores.

    A model that was already patched on entry stays patched on exit.
    """
    was_patched = is_patched(model)
    patch(model, fused=fused, cudnn_decode=cudnn_decode, cuda_graphs=cuda_graphs)
    try:
        yield model
    finally:
        if not was_patched:
            unpatch(model)
