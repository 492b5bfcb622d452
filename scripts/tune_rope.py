"""Sweep the fused RoPE kernel's launch parameters on the GPU at the large benchmark shapes:
head tiling (tokens per program, heads per program, grid order, warps) and token tiling (lanes
per program, warps); prints ms and % of the copy floor per setting, best first.

    python scripts/tune_rope.py            # bf16, HF layout, per-token float32 tables, out of place
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import torch
import triton

from torchembed.functional.rope import rope_cos_sin
from torchembed.kernels import rope_triton
from torchembed.kernels.rope_op import rotary_fused
from torchembed.tools.bench import copy_bandwidth

SHAPES = [(4, 4096, 32, 8, 128), (1, 32768, 32, 8, 128), (8, 2048, 64, 8, 128)]
KNOBS = ("_TILE_PAIRS", "_HPP_MIN_PROGRAMS", "_HPP_CANDIDATES", "_HEADS_FAST", "_TOKEN_MAJOR_MIN_TOKENS",
         "_TOKEN_TILE_PAIRS", "_TOKEN_WARPS")


def settings() -> Iterator[tuple[str, dict[str, Any], int | None]]:
    """(label, module knobs, warps override for the head tiling)."""
    off = 2**62
    for tile, hpps, heads_fast, warps in itertools.product((1024, 2048), ((4, 2), ()), (True,), (4, 8)):
        yield (f"head tile {tile} hpp<={max(hpps, default=1)} warps {warps}",
               dict(_TILE_PAIRS=tile, _HPP_MIN_PROGRAMS=0, _HPP_CANDIDATES=hpps, _HEADS_FAST=heads_fast,
                    _TOKEN_MAJOR_MIN_TOKENS=off), warps)
    for tile, warps in itertools.product((2048, 4096, 8192, 16384), (4, 8, 16)):
        yield f"token tile {tile} warps {warps}", dict(_TOKEN_MAJOR_MIN_TOKENS=0, _TOKEN_TILE_PAIRS=tile,
                                                         _TOKEN_WARPS=warps), None


def main() -> None:
    device = torch.device("cuda")
    bandwidth = copy_bandwidth(device)  # bytes/s, read + write
    defaults = {name: getattr(rope_triton, name) for name in KNOBS}
    original = rope_triton._make_config
    print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    for B, S, Hq, Hk, D in SHAPES:
        q = torch.randn(B, S, Hq, D, device=device, dtype=torch.bfloat16).transpose(1, 2)
        k = torch.randn(B, S, Hk, D, device=device, dtype=torch.bfloat16).transpose(1, 2)
        inv = 1.0 / (10000.0 ** (torch.arange(0, D, 2, device=device).float() / D))
        cos, sin = rope_cos_sin(inv, torch.arange(S, device=device).expand(B, S))
        floor_ms = 2 * (q.numel() + k.numel()) * 2 / bandwidth * 1e3
        results = []
        for label, knobs, warps in settings():
            def config(*a, _warps=warps):
                kernel, grid, meta, nqg, constexprs = original(*a)
                if _warps is not None:
                    meta = dict(meta, num_warps=_warps)
                return kernel, grid, meta, nqg, constexprs

            for name, value in {**defaults, **knobs}.items():
                setattr(rope_triton, name, value)
            rope_triton._make_config = config
            rope_triton._CFG.clear()
            rope_triton._COMPILED.clear()
            ms = triton.testing.do_bench(lambda: rotary_fused(q, k, cos, sin), return_mode="median")
            results.append((ms, label))
        rope_triton._make_config = original
        for name, value in defaults.items():
            setattr(rope_triton, name, value)
        rope_triton._CFG.clear()
        rope_triton._COMPILED.clear()
        ms = triton.testing.do_bench(lambda: rotary_fused(q, k, cos, sin), return_mode="median")
        results.sort()
        print(f"\n{B}x{S} h{Hq}/{Hk} d{D}: floor {floor_ms:.4f} ms; defaults {ms:.4f} ms "
              f"({100 * floor_ms / ms:.1f}%)")
        for ms, label in results[:8] + results[-2:]:
            print(f"  {label:36} {ms:.4f} ms  {100 * floor_ms / ms:5.1f}% of floor")


if __name__ == "__main__":
    main()
