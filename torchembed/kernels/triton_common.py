"""Triton helpers shared by the library's kernels (device code only)."""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["round_f32_to_bf16_rtne"]


@triton.jit
def round_f32_to_bf16_rtne(y):
    # Round-to-nearest-even onto the bf16 grid, staying in float32 (the later .to(bf16) is then exact). Only used
    # under TRITON_INTERPRET, whose fp32->bf16 cast truncates; the GPU cast already rounds to nearest even.
    bits = y.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)
