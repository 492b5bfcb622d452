"""torchembed.patches: swap torchembed's positional encodings into loaded HF Transformers models.

    model = torchembed.patch(model)          # in place, reversible, idempotent
    torchembed.unpatch(model)                # exact restore
    with torchembed.patched(model): ...      # patched for the block
    torchembed.find_positional_components(model)   # dry run

One registry keyed by ``config.model_type`` (:mod:`torchembed.patches.registry`); per family a
few declarative adapters, in one folder per encoding (:mod:`torchembed.patches.rope`,
:mod:`torchembed.patches.alibi`, :mod:`torchembed.patches.learned`); the machinery they share at the top level.
"""

from torchembed.patches.actions import Component
from torchembed.patches.core import find_positional_components, is_patched, patch, patched, unpatch
from torchembed.patches.errors import FusedUnavailableError, PatchError, StructureError, UnsupportedModelError
from torchembed.patches.loading import from_pretrained
from torchembed.patches.registry import Family, register, supported_families

__all__ = ["Component", "Family", "FusedUnavailableError", "PatchError", "StructureError", "UnsupportedModelError",
           "find_positional_components", "from_pretrained", "is_patched", "patch", "patched", "register",
           "supported_families", "unpatch"]
