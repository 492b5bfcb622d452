"""The exceptions of the patches layer; each message names the fix."""

from __future__ import annotations

from torchembed.kernels.route import FusedUnavailableError  # one class for every fused=True

__all__ = ["PatchError", "UnsupportedModelError", "FusedUnavailableError", "StructureError", "transformers_version"]


class PatchError(RuntimeError):
    """Base class: a model could not be patched (or unpatched) as asked."""


class UnsupportedModelError(PatchError, ValueError):
    """The model's architecture has no adapter (pass ``strict=False`` to leave it unpatched)."""


class StructureError(PatchError):
    """The installed transformers does not have the structure an adapter relies on.

    Raised by ``patch`` before anything is changed. The message names the family, the class,
    what was expected, what was found and the installed transformers version.
    """

    def __init__(self, family: str, where: str, expected: str, found: str) -> None:
        self.family, self.where, self.expected, self.found = family, where, expected, found
        super().__init__(
            f"{family}: {where}: expected {expected}; found {found} (transformers {transformers_version()}). "
            "torchembed left the model unpatched; pass strict=False to skip it with a warning, "
            "or install a transformers version listed as supported in torchembed's README"
        )

    def __reduce__(self) -> tuple:
        return (type(self), (self.family, self.where, self.expected, self.found))


def transformers_version() -> str:
    try:
        import transformers
    except ImportError:
        return "not installed"
    return transformers.__version__
