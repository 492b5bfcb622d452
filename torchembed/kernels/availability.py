"""Where the Triton kernels run, and the one meaning of ``fused``.

Every API that can use a kernel takes ``fused: bool | None`` and decides with :func:`use_kernel`:

* ``None`` (auto): the kernel where it can run (CUDA tensors, Triton importable; CPU tensors under
  ``TRITON_INTERPRET=1``), PyTorch ops elsewhere -- quietly;
* ``True``: the kernel, or :class:`FusedUnavailableError` saying what is missing;
* ``False``: PyTorch ops only.

``TORCHEMBED_DISABLE_TRITON=1`` makes every kernel unavailable (``fused=None`` then runs PyTorch ops,
``fused=True`` raises). The environment is read on every call (well under a microsecond), so a switch
takes effect at once. Triton is imported on the first question only; this module never imports it
at import time.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, Optional

from torch import Tensor

__all__ = ["FusedUnavailableError", "check_fused", "interpret_mode", "kernel_can_run", "triton_available", "use_kernel",
           "why_not"]


class FusedUnavailableError(RuntimeError):
    """``fused=True`` was asked for where the Triton kernel cannot run."""


def _env_flag(name: str, value: str = "1") -> Callable[[], bool]:
    """A reader of ``os.environ.get(name) == value`` for switches read on every call.

    ``os.environ.get`` pays for a KeyError on a missing name (about 1 us); CPython's ``os.environ``
    keeps its entries in a dict of encoded names and values, read here directly (the same dict, so
    changes show at once)."""
    environ = os.environ
    data = getattr(environ, "_data", None)
    try:
        key, expected = environ.encodekey(name), environ.encodevalue(value)
    except AttributeError:
        data = None
    if not isinstance(data, dict):
        return lambda: environ.get(name) == value
    return lambda: data.get(key) == expected


triton_disabled = _env_flag("TORCHEMBED_DISABLE_TRITON")
_interpreting = _env_flag("TRITON_INTERPRET")
_TRITON_OK: Optional[bool] = None


def triton_available() -> bool:
    """Whether Triton is importable (imported on the first call only; the answer is cached)."""
    global _TRITON_OK
    if _TRITON_OK is None:
        try:
            import triton  # noqa: F401
            import triton.language  # noqa: F401

            _TRITON_OK = True
        except Exception:  # ImportError, or a broken install failing on import
            _TRITON_OK = False
    return _TRITON_OK


def interpret_mode() -> bool:
    """``TRITON_INTERPRET=1``: Triton kernels run (slowly) on CPU tensors."""
    return _interpreting()


def kernel_can_run(t: Tensor) -> bool:
    """Whether a Triton kernel can run on ``t``: Triton available and ``t`` on CUDA (or on the CPU
    under ``TRITON_INTERPRET=1``); ``TORCHEMBED_DISABLE_TRITON=1`` forces False."""
    if triton_disabled() or not (_TRITON_OK or triton_available()):
        return False
    return t.is_cuda or (_interpreting() and t.device.type == "cpu")


def check_fused(fused: Any, where: str = "fused") -> Optional[bool]:
    """``fused`` if it is None, True or False; else a TypeError naming ``where``."""
    if fused is None or fused is True or fused is False:
        return fused
    raise TypeError(f"{where} must be None (the kernel where it can run), True (require it) or False (never), "
                    f"got {fused!r}")


def why_not(t: Optional[Tensor] = None) -> str:
    """What keeps the kernel from running (on ``t``), as the fix to make."""
    if triton_disabled():
        return "TORCHEMBED_DISABLE_TRITON=1 switches the Triton kernels off (unset it)"
    if not triton_available():
        return "it needs Triton: pip install triton"
    if t is not None and not kernel_can_run(t):
        return f"it runs on CUDA tensors (these are on {t.device}): move them with .to('cuda')"
    return "it cannot run here"


def use_kernel(fused: Optional[bool], t: Tensor, what: str = "the fused kernel") -> bool:
    """Whether to run the kernel on ``t`` for this ``fused`` (see the module docstring).

    Raises:
        FusedUnavailableError: ``fused=True`` where the kernel cannot run, naming the fix.
    """
    if fused is False:
        return False
    if kernel_can_run(t):
        return True
    if fused:
        raise FusedUnavailableError(f"fused=True: {what} cannot run: {why_not(t)}; or pass fused=None "
                                    "(the kernel where it can run, PyTorch elsewhere)")
    return False
