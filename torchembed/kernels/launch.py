"""Where the library's Triton kernels can run, and how they are launched.

:func:`kernel_can_run` is the device question (Triton importable, a CUDA tensor; a CPU tensor under
``TRITON_INTERPRET=1``; ``TORCHEMBED_DISABLE_TRITON=1`` makes every kernel unavailable). Those two variables are read
on every call (well under a microsecond), so a switch takes effect at once; Triton is imported on the first question
only. What ``fused`` means, and every kernel-or-PyTorch decision, is :mod:`torchembed.kernels.route`'s.

Launching: ``kernel[grid](...)`` re-derives the specialisation of every argument on each call (dtypes, 16-byte
alignment of pointers, ints equal to 1 or divisible by 16): tens of microseconds of host time on a slow host, more
than a decode-sized kernel runs. Every kernel of the library launches through a :class:`Launch`, set up once (kept in a
bounded :class:`Launches` table) and called with its tensors and per-call scalars: on CUDA through the compiled
kernel's launcher with raw pointers (``KernelSettings.direct_launch``), elsewhere (the interpreter, or a Triton whose
launcher is called differently) through ``kernel[grid]``. This module imports neither Triton nor a kernel.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any, Optional

import torch
from torch import Tensor

from torchembed.kernels.settings import keep_launches_in, settings

__all__ = ["Launch", "Launches", "direct", "entry_of", "interpret_mode", "kernel_can_run", "triton_available",
           "triton_disabled"]


# --- Where the kernels run ----------------------------------------------------------------------


def _env_flag(name: str, value: str = "1") -> Callable[[], bool]:
    """A reader of ``os.environ.get(name) == value`` for switches read on every call.

    ``os.environ.get`` pays for a KeyError on a missing name (about 1 us); CPython's ``os.environ`` keeps its entries
    in a dict of encoded names and values, read here directly (the same dict, so changes show at once)."""
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
# Triton's interpreter (TRITON_INTERPRET=1) swaps the functions of triton.language for interpreted ones while a kernel
# runs and puts them back after, for the whole process: kernels interpreted on two threads at once break each other
# (Triton 3.8 and 3.9). Interpreted launches take turns on this lock; compiled launches never touch it.
_INTERPRETER_TURN = threading.Lock()
_NO_TURN = contextlib.nullcontext()


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
    """Whether a Triton kernel can run on ``t``: Triton available and ``t`` on CUDA (or on the CPU under
    ``TRITON_INTERPRET=1``); ``TORCHEMBED_DISABLE_TRITON=1`` forces False."""
    if triton_disabled() or not (_TRITON_OK or triton_available()):
        return False
    return t.is_cuda or (_interpreting() and t.device.type == "cpu")


# --- Launching ----------------------------------------------------------------------------------

# the current CUDA stream of a device index, as the int the launcher takes
raw_stream = torch._C._cuda_getCurrentRawStream if torch.cuda.is_available() else None
_launcher_fails = False  # the installed Triton's launcher failed once: kernel[grid] from then on


def direct() -> bool:
    """Whether kept launches call the compiled kernel's launcher directly now (the settings say so and the installed
    Triton's launcher has not failed)."""
    return settings().direct_launch and not _launcher_fails


def _on_gpu(t: Tensor) -> bool:  # (a function, so that tests can stand in a GPU)
    return t.is_cuda


def entry_of(compiled: Any) -> Optional[tuple[Callable[..., Any], tuple]]:
    """``(entry, head)`` for a compiled kernel (what ``kernel[grid](...)`` returned): launch it with
    ``entry(grid_x, grid_y, grid_z, stream, *head, *arguments, *constexprs)``, every pointer an int. None where the
    compiled kernel lacks the expected attributes.

    The launcher's C entry point where the installed Triton exposes it with the kernel arguments flat after a fixed
    head (as Triton 3.6's) and there are no scratch buffers to allocate; otherwise (3.9 packs the arguments with their
    annotations) its Python wrapper, called as Triton's own launch calls it."""
    run, function, metadata = (getattr(compiled, name, None) for name in ("run", "function", "packed_metadata"))
    if run is None or function is None or metadata is None:
        return None
    entry = getattr(run, "launch", None)
    if (callable(entry) and getattr(run, "global_scratch_size", 1) == 0 and getattr(run, "profile_scratch_size", 1) == 0
            and hasattr(run, "launch_cooperative_grid") and hasattr(run, "launch_pdl")
            and not hasattr(run, "kernel_signature") and not hasattr(run, "arg_annotations")):
        return entry, (function, run.launch_cooperative_grid, run.launch_pdl, None, None, metadata, None, None, None)
    return run, (function, metadata, None, None, None)


class Launch:
    """One kernel launch set up once: ``launch(tensors, *varying)`` runs
    ``kernel[grid](*tensors, *fixed, *varying, **constexprs)``.

    The caller keys a kept launch by everything Triton specialises on except the tensors' alignment (shapes,
    strides, dtypes, devices, the ints in ``fixed`` and the facts of ``varying`` ints that Triton specialises on:
    equal to 1, divisible by 16); the alignment is checked here, per call."""

    __slots__ = ("kernel", "grid", "fixed", "kwargs", "tail", "entry", "head", "aligned", "index")

    def __init__(self, kernel: Any, grid: tuple[int, int, int], fixed: tuple, constexprs: dict, *,
                 num_warps: int, num_stages: Optional[int] = None) -> None:
        self.kernel, self.grid, self.fixed = kernel, grid, fixed
        self.kwargs = dict(constexprs, num_warps=num_warps)
        if num_stages is not None:
            self.kwargs["num_stages"] = num_stages
        order = getattr(kernel, "arg_names", None) or list(constexprs)  # the launcher takes them in signature order
        self.tail = tuple(constexprs[name] for name in order if name in constexprs)
        self.entry = self.head = self.aligned = self.index = None

    def __call__(self, tensors: Sequence[Tensor], *varying: Any) -> None:
        is_direct = direct()
        if self.entry is not None and is_direct:
            pointers = [t.data_ptr() for t in tensors]
            if [p & 15 == 0 for p in pointers] == self.aligned:
                try:
                    self.entry(*self.grid, raw_stream(self.index), *self.head, *pointers, *self.fixed, *varying, *self.tail)
                    return
                except Exception:  # the installed Triton launches differently: kernel[grid] from now on
                    _switch_direct_off()
        with _INTERPRETER_TURN if _interpreting() else _NO_TURN:  # (the interpreter: one kernel at a time)
            compiled = self.kernel[self.grid](*tensors, *self.fixed, *varying, **self.kwargs)
        if self.entry is None and is_direct and _on_gpu(tensors[0]):
            found = entry_of(compiled)
            if found is not None:
                self.entry, self.head = found
                self.aligned = [t.data_ptr() & 15 == 0 for t in tensors]
                self.index = tensors[0].device.index


def _switch_direct_off() -> None:
    global _launcher_fails
    _launcher_fails = True


class Launches:
    """The kept launches (or plans of several launches) of one kernel's host code: ``key -> value``, at most
    ``limit`` (cleared when full: prefill at many lengths)."""

    def __init__(self, limit: int) -> None:
        self.limit, self.table = limit, {}
        keep_launches_in(self)

    def get(self, key: Hashable) -> Any:
        return self.table.get(key)

    def keep(self, key: Hashable, value: Any) -> Any:
        if len(self.table) >= self.limit:
            self.table.clear()
        self.table[key] = value
        return value

    def clear(self) -> None:
        self.table.clear()

    def __len__(self) -> int:
        return len(self.table)

    def __iter__(self) -> Iterator[Hashable]:
        return iter(self.table)
