"""One way to launch the library's Triton kernels, and to launch them again cheaply.

``kernel[grid](...)`` re-derives the specialisation of every argument on each call (dtypes, 16-byte
alignment of pointers, ints equal to 1 or divisible by 16): tens of microseconds of host time on a
slow host, more than a decode-sized kernel runs. A :class:`Launch` is one launch set up once (grid,
fixed scalars, constexprs, warps, stages) and then called with its tensors (and the scalars that vary
per call). On CUDA it keeps the compiled kernel's launcher after its first call and calls it with raw
pointers while their alignment is what Triton specialised on; elsewhere (the interpreter), or where
the installed Triton's launcher is called differently, through ``kernel[grid]``. :class:`Launches` is
the bounded table in which a kernel's host code keeps its launches, under a key it builds from what
Triton specialises on. Every kernel of the library launches through here.

``TORCHEMBED_DIRECT_LAUNCH=0``: every launch through ``kernel[grid]``. This module imports neither
Triton nor a kernel.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any, Optional

import torch
from torch import Tensor

__all__ = ["Launch", "Launches", "clear_all", "direct", "direct_launches", "entry_of"]

# switched off for good when the installed Triton's launcher fails
_direct = os.environ.get("TORCHEMBED_DIRECT_LAUNCH", "1") == "1"
# the current CUDA stream of a device index, as the int the launcher takes
raw_stream = torch._C._cuda_getCurrentRawStream if torch.cuda.is_available() else None
_TABLES: list["Launches"] = []


def direct() -> bool:
    """Whether kept launches call the compiled kernel's launcher directly."""
    return _direct


@contextlib.contextmanager
def direct_launches(on: bool) -> Iterator[None]:
    """Within the block, kept launches call the launcher directly (``on``) or go through
    ``kernel[grid]``; the previous setting after it."""
    global _direct
    previous, _direct = _direct, bool(on)
    try:
        yield
    finally:
        _direct = previous


def _on_gpu(t: Tensor) -> bool:  # (a function, so that tests can stand in a GPU)
    return t.is_cuda


def entry_of(compiled: Any) -> Optional[tuple[Callable[..., Any], tuple]]:
    """``(entry, head)`` for a compiled kernel (what ``kernel[grid](...)`` returned): launch it with
    ``entry(grid_x, grid_y, grid_z, stream, *head, *arguments, *constexprs)``, every pointer an int.
    None where the compiled kernel lacks the expected attributes.

    The launcher's C entry point where the installed Triton exposes it with the kernel arguments flat
    after a fixed head (as Triton 3.6's) and there are no scratch buffers to allocate; otherwise (3.9
    packs the arguments with their annotations) its Python wrapper, called as Triton's own launch
    calls it."""
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

    The caller keys a kept launch by everything Triton specialises on except the tensors' alignment
    (shapes, strides, dtypes, devices, the ints in ``fixed`` and the facts of ``varying`` ints that
    Triton specialises on: equal to 1, divisible by 16); the alignment is checked here, per call."""

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
        if self.entry is not None and _direct:
            pointers = [t.data_ptr() for t in tensors]
            if [p & 15 == 0 for p in pointers] == self.aligned:
                try:
                    self.entry(*self.grid, raw_stream(self.index), *self.head, *pointers, *self.fixed, *varying, *self.tail)
                    return
                except Exception:  # the installed Triton launches differently: kernel[grid] from now on
                    _switch_direct_off()
        compiled = self.kernel[self.grid](*tensors, *self.fixed, *varying, **self.kwargs)
        if self.entry is None and _direct and _on_gpu(tensors[0]):
            found = entry_of(compiled)
            if found is not None:
                self.entry, self.head = found
                self.aligned = [t.data_ptr() & 15 == 0 for t in tensors]
                self.index = tensors[0].device.index


def _switch_direct_off() -> None:
    global _direct
    _direct = False


class Launches:
    """The kept launches (or plans of several launches) of one kernel's host code: ``key -> value``,
    at most ``limit`` (cleared when full: prefill at many lengths)."""

    def __init__(self, limit: int) -> None:
        self.limit, self.table = limit, {}
        _TABLES.append(self)

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


def clear_all() -> None:
    """Forget every kept launch of every kernel (after changing a tuning)."""
    for table in _TABLES:
        table.clear()
