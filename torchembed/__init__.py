"""torchembed: positional encodings for PyTorch and one-call patching of HuggingFace models.

Layers (each uses only the ones above it):
    torchembed.functional   pure-PyTorch reference math (RoPE, ALiBi, sinusoidal)
    torchembed.kernels      fused Triton kernels registered as torch custom ops (optional)
    torchembed.positional   RotaryEmbedding, ALiBiEmbedding, SinusoidalEmbedding, LearnedPositionalEmbedding
    torchembed.patches      swap them into loaded HF Transformers models, reversibly
    torchembed.tools        compare (numerics vs upstream) and bench (speed), the CLI

Every name of ``__all__`` is imported on first use: ``import torchembed`` imports neither torch nor
transformers. The names that load or patch HF models need transformers (``pip install 'torchembed[hf]'``);
without it they raise an ImportError saying so.
"""

from __future__ import annotations

import functools as _functools
import importlib as _importlib

__version__ = "0.1.0"

_SUBMODULES = ("functional", "kernels", "positional", "patches", "tools")
_POSITIONAL = ("ALiBiEmbedding", "LearnedPositionalEmbedding", "RotaryEmbedding", "SinusoidalEmbedding")
_PATCH_API = ("patch", "unpatch", "is_patched", "patched", "find_positional_components", "from_pretrained", "supported_families",
              "PatchError", "UnsupportedModelError", "StructureError", "FusedUnavailableError")
_LOADING_API = ("CheckpointNotFoundError",)
_TOOLS_API = ("compare",)
#: the callables that build, load or patch HF models: without transformers they raise ImportError naming the fix
_NEED_TRANSFORMERS = ("patch", "patched", "from_pretrained", "compare")
#: what to install when transformers is missing (the ``hf`` extra: transformers, accelerate, rich)
HF_EXTRA_HINT = "pip install 'torchembed[hf]' (from a source checkout: pip install '.[hf]')"

__all__ = [
    "ALiBiEmbedding",
    "LearnedPositionalEmbedding",
    "RotaryEmbedding",
    "SinusoidalEmbedding",
    "functional",
    *_PATCH_API,
    *_LOADING_API,
    *_TOOLS_API,
]


def transformers_missing() -> str | None:
    """Why transformers cannot be imported (``"No module named 'transformers'"``, ...), or None when it can."""
    try:
        import transformers  # noqa: F401
    except ImportError as exc:
        return str(exc) or type(exc).__name__
    return None


def _needs_transformers(name: str, function):
    """``function``, or where transformers cannot be imported a stand-in that raises one ImportError naming the fix."""
    why = transformers_missing()
    if why is None:
        return function

    @_functools.wraps(function)
    def missing(*args, **kwargs):
        raise ImportError(f"torchembed.{name} needs transformers ({why}): {HF_EXTRA_HINT}") from None

    return missing


def __getattr__(name: str):
    if name in _SUBMODULES:
        return _importlib.import_module(f"torchembed.{name}")
    if name in _POSITIONAL:
        from torchembed import positional

        return getattr(positional, name)
    if name in _PATCH_API:
        from torchembed import patches

        value = getattr(patches, name)
    elif name in _LOADING_API:
        from torchembed.patches import loading

        value = getattr(loading, name)
    elif name in _TOOLS_API:
        from torchembed.tools import compare

        value = getattr(compare, name)
    else:
        raise AttributeError(f"module 'torchembed' has no attribute {name!r}")
    return _needs_transformers(name, value) if name in _NEED_TRANSFORMERS else value


def __dir__() -> list[str]:
    """The public names (``__all__``), the subpackages and the module's own dunders, not its helpers."""
    return sorted({*__all__, *_SUBMODULES, *(n for n in globals() if n.startswith("__") and n.endswith("__"))})
