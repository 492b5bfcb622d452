"""Sweep the fused RoPE kernel's launch parameters on the GPU (tokens per program, heads per
program, warps) at the large benchmark shapes; prints ms and % of the copy floor per setting.

    python scripts/tune_rope.py            # bf16, HF layout, per-token float32 tables
"""

from __future__ import annotations

import itertools

import torch
import triton

from torchembed.functional.rope import rope_cos_sin
from torchembed.kernels import rope_triton
from torchembed.kernels.rope_op import rotary_fused
from torchembed.tools.bench import copy_bandwidth

SHAPES = [(4, 4096, 32, 8, 128), (1, 32768, 32, 8, 128), (8, 2048, 64, 8, 128)]


def main() -> None:
    device = torch.device("cuda")
    bandwidth = copy_bandwidth(device)  # bytes/s, read + write
    original = rope_triton._make_config
    print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    for B, S, Hq, Hk, D in SHAPES:
        q = torch.randn(B, S, Hq, D, device=device, dtype=torch.bfloat16).transpose(1, 2)
        k = torch.randn(B, S, Hk, D, device=device, dtype=torch.bfloat16).transpose(1, 2)
        inv = 1.0 / (10000.0 ** (torch.arange(0, D, 2, device=device).float() / D))
        cos, sin = rope_cos_sin(inv, torch.arange(S, device=device).expand(B, S))
        floor_ms = 2 * (q.numel() + k.numel()) * 2 / bandwidth * 1e3
        results = []
        grid_space = itertools.product((512, 1024, 2048), ((8, 4, 2), (4, 2), (2,), ()), (False, True), (4, 8))
        for tile, hpps, heads_fast, warps in grid_space:
            def config(*a, _tile=tile, _hpps=hpps, _fast=heads_fast, _warps=warps):
                rope_triton._TILE_PAIRS, rope_triton._HPP_MIN_PROGRAMS = _tile, 0
                rope_triton._HPP_CANDIDATES, rope_triton._HEADS_FAST = _hpps, _fast
                grid, meta, nqg, constexprs = original(*a)
                meta = dict(meta, num_warps=_warps)
                return grid, meta, nqg, constexprs
            rope_triton._make_config = config
            rope_triton._CFG.clear()
            rope_triton._COMPILED.clear()
            ms = triton.testing.do_bench(lambda: rotary_fused(q, k, cos, sin, inplace=True), return_mode="median")
            results.append((ms, tile, f"hpp<={max(hpps, default=1)}", "heads-fast" if heads_fast else "tokens-fast", warps))
        rope_triton._make_config = original
        rope_triton._CFG.clear()
        rope_triton._COMPILED.clear()
        results.sort()
        print(f"\n{B}x{S} h{Hq}/{Hk} d{D}: floor {floor_ms:.4f} ms")
        for ms, tile, hpp, order, warps in results[:8] + results[-2:]:
            print(f"  tile {tile:5} {hpp:7} {order:11} warps {warps}: {ms:.4f} ms  {100 * floor_ms / ms:5.1f}% of floor")


if __name__ == "__main__":
    main()
