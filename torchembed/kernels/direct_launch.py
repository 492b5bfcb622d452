"""Launching a compiled Triton kernel again without Triton's per-call binding.

``kernel[grid](...)`` re-derives the specialisation of every argument on each call (dtypes, 16-byte
alignment of pointers, ints equal to 1 or divisible by 16): tens of microseconds of host time on a
slow host, more than a small kernel runs. A launch that is kept calls the compiled kernel's launcher
with raw int pointers instead; its caller keys it by everything Triton specialised on. This module
knows how the installed Triton's launcher is called; it imports neither Triton nor a kernel.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, Optional

import torch

__all__ = ["ENABLED", "entry_of", "raw_stream"]

# TORCHEMBED_DIRECT_LAUNCH=0: every launch through kernel[grid]
ENABLED = os.environ.get("TORCHEMBED_DIRECT_LAUNCH", "1") == "1"
# the current CUDA stream of a device index, as the int the launcher takes
raw_stream = torch._C._cuda_getCurrentRawStream if torch.cuda.is_available() else None


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
