"""Per-model-type fixes to the zoo's generic tiny models (:mod:`torchembed.tools.zoo`).

The zoo makes a tiny config of every model type from its config class by generic rules. Where a
class's defaults cannot be shrunk by those rules, or a model's forward takes inputs the generic
builder does not make, one entry says what differs, and why, in the module of its kind of model:

* ``CONFIG``: ``model_type -> overrides``. A dict is merged into the generic keyword arguments
  (a dict value into a sub-config's dict, recursively); a callable ``fix(default, kwargs)`` edits
  them in place (``default``: the class-default config, for reading what this release has).
* ``INPUTS``: ``model_type -> inputs(model)``, the tiny inputs to run the built model on
  (:func:`torchembed.tools.zoo.tiny_inputs` takes it instead of the generic choice,
  :func:`torchembed.tools.zoo_inputs.generic_inputs`, whose pieces the fixes may use).
* ``RUNS``: ``model_type -> run(model, inputs)``, the model's main output on those inputs, where its
  forward takes more than tensors (a video tracker's inference session): replaces ``model(**inputs)``
  in :func:`torchembed.tools.zoo.outputs_of`.

Each module keeps its entries in alphabetical order, each with a comment naming the upstream rule
it satisfies; a model type has an entry in one module only.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

from torch import nn

from torchembed.tools.zoo_fixes import audio, text, vision, vision_language
from torchembed.tools.zoo_fixes._common import ConfigFix, merge

__all__ = ["CONFIG", "INPUTS", "MODULES", "RUNS", "apply_config_fix"]

MODULES: tuple[ModuleType, ...] = (audio, text, vision, vision_language)


def _union(name: str) -> dict[str, Any]:
    table: dict[str, Any] = {}
    for module in MODULES:
        entries = getattr(module, name, {})
        twice = sorted(set(table) & set(entries))
        if twice:
            raise RuntimeError(f"zoo fixes: {twice} in {module.__name__} and in an earlier module")
        table.update(entries)
    return table


CONFIG: dict[str, ConfigFix] = _union("CONFIG")
INPUTS: dict[str, Callable[[nn.Module], Any]] = _union("INPUTS")  # tensors by name (or a dataclass of them)
RUNS: dict[str, Callable[[nn.Module, dict[str, Any]], Any]] = _union("RUNS")


def apply_config_fix(model_type: str, default: Any, kwargs: dict[str, Any]) -> None:
    """Apply :data:`CONFIG`'s entry for ``model_type`` (if any) to ``kwargs``, in place."""
    fix = CONFIG.get(model_type)
    if fix is None:
        return
    if callable(fix):
        fix(default, kwargs)
    else:
        merge(kwargs, fix)
