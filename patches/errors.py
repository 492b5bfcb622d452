"""The exceptions of the patches layer; each message names the fix."""

from __future__ import annotations


class PatchError(RuntimeError):
    """Base class: a model could not be patched (or unpatched) as asked."""


class UnsupportedModelError(PatchError, ValueError):
    """The model's architecture has no adapter (pass ``strict=False`` to leave it unpatched)."""


class FusedUnavailableError(PatchError):
    """``fused=True`` was asked for where the Triton kernel cannot run."""
