"""torchembed: positional encodings for PyTorch and one-call patching of HuggingFace models.

Layers (each uses only the ones above it):
    torchembed.functional   pure-PyTorch reference math (RoPE, ALiBi, sinusoidal)
    torchembed.kernels      fused Triton kernels registered as torch custom ops (optional)
    torchembed.positional   RotaryEmbedding, ALiBiEmbedding, SinusoidalEmbedding, LearnedPositionalEmbedding
    torchembed.patches      swap them into loaded HF Transformers models, reversibly
    torchembed.tools        compare (numerics vs upstream) and bench (speed), the CLI
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# Everything is imported on first use: `import torchembed` imports neither torch nor transformers (the
# command line answers --help without them).
_SUBMODULES = ("functional", "kernels", "positional", "patches", "tools")
_POSITIONAL = ("ALiBiEmbedding", "LearnedPositionalEmbedding", "RotaryEmbedding", "SinusoidalEmbedding")
_PATCH_API = ("patch", "unpatch", "is_patched", "patched", "find_positional_components", "from_pretrained", "supported_families",
              "PatchError", "UnsupportedModelError", "StructureError", "FusedUnavailableError")
_TOOLS_API = ("compare",)

__all__ = [
    "ALiBiEmbedding",
    "LearnedPositionalEmbedding",
    "RotaryEmbedding",
    "SinusoidalEmbedding",
    "functional",
    *_PATCH_API,
    *_TOOLS_API,
]


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"torchembed.{name}")
    if name in _POSITIONAL:
        from torchembed import positional

        return getattr(positional, name)
    if name in _PATCH_API:
        from torchembed import patches

        return getattr(patches, name)
    if name in _TOOLS_API:
        from torchembed.tools import compare

        return getattr(compare, name)
    raise AttributeError(f"module 'torchembed' has no attribute {name!r}")
