"""Sweep the fused RoPE kernel's launch parameters on the GPU at the large benchmark shapes.

For every shape: the copy floor (q and k read + written once at the 1 GiB copy bandwidth), what
``copy_`` of exactly those tensors takes (the floor a copy kernel reaches at this size), the in-place
rotation (float32 and bf16 tables) next to liger-kernel's (in place too, when installed), then the
forward (out of place) per setting -- angle source (per-token float32 or bf16 tables, or computed
from ``inv_freq`` in the kernel), tokens per program (tile), heads per program, warps; with
``--repeats N`` every setting is timed N times in interleaved order and its median kept
-- and forward+backward of the default setting timed three ways (``do_bench``; replayed from a
CUDA graph, i.e. device time only; host wall time per call).

    python benchmarks/probes/tune_rope.py [--json out.json] [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import statistics
import time

import torch
import triton

from torchembed.functional.rope import rope_cos_sin
from torchembed.kernels import rope
from torchembed.kernels.rope import rotary_fused
from torchembed.tools.bench import copy_bandwidth, graph_time
from torchembed.kernels.settings import changed

SHAPES = [(1, 2048, 32, 8, 128), (4, 4096, 32, 8, 128), (1, 32768, 32, 8, 128), (8, 2048, 64, 8, 128)]


@contextlib.contextmanager
def _configured(tile: int, hpp: int, warps: int):
    """Within the block, launches take this setting: ``rope.tuned`` with ``tile`` pairs per program and
    ``hpp`` heads per program at every grid size, ``rope._config`` wrapped to give ``warps`` warps to
    every launch (grouped or not); kept launches are forgotten on entry and exit."""
    original = rope._config

    def config(*a):
        grid, meta, nqg, _ = original(*a)
        return grid, meta, nqg, warps

    with changed(rope=dict(tile_pairs=tile, grouped_min_programs=0, grouped_heads=(hpp,), grouped_warps=warps)):
        rope._config = config
        try:
            yield
        finally:
            rope._config = original


def host_us(fn, calls: int = 50) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()  # enqueue time only (no sync): the host's own cost per call
    torch.cuda.synchronize()
    return (t1 - t0) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=None)
    parser.add_argument("--quick", action="store_true", help="fewer settings")
    parser.add_argument("--shapes", nargs="+", default=None, metavar="B,S,HQ,HK,D")
    parser.add_argument("--no-backward", action="store_true")
    parser.add_argument("--repeats", type=int, default=1,
                        help="time the whole sweep this many times, interleaved; report each setting's median")
    parser.add_argument("--hpp", nargs="+", type=int, default=[1, 2, 4, 8], help="heads per program to sweep")
    parser.add_argument("--sources", nargs="+", default=["table", "inv_freq", "inv_freq+ids"],
                        choices=["table", "table-bf16", "inv_freq", "inv_freq+ids"], help="angle sources to sweep")
    args = parser.parse_args()
    device = torch.device("cuda")
    bandwidth = copy_bandwidth(device)  # bytes/s, read + write
    print(f"copy bandwidth (1 GiB) {bandwidth / 1e9:.0f} GB/s", flush=True)
    out = {"copy_bandwidth_gbs": bandwidth / 1e9, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "triton": triton.__version__, "shapes": []}
    tiles = (1024, 2048) if args.quick else (512, 1024, 2048)  # 4096: register spills (about 43 % of the floor)
    shapes = [tuple(int(x) for x in s.split(",")) for s in args.shapes] if args.shapes else SHAPES
    for B, S, Hq, Hk, D in shapes:
        q = torch.randn(B, S, Hq, D, device=device, dtype=torch.bfloat16).transpose(1, 2)
        k = torch.randn(B, S, Hk, D, device=device, dtype=torch.bfloat16).transpose(1, 2)
        inv = 1.0 / (10000.0 ** (torch.arange(0, D, 2, device=device).float() / D))
        ids = torch.arange(S, device=device)[None]  # (1, S) position ids, as HF passes them
        cos, sin = rope_cos_sin(inv, ids)  # (1, S, D/2) float32
        cos16, sin16 = cos.bfloat16(), sin.bfloat16()
        nbytes = 2 * (q.numel() + k.numel()) * q.element_size()
        floor_ms = nbytes / bandwidth * 1e3
        qo, ko = torch.empty_like(q), torch.empty_like(k)
        copy_ms = triton.testing.do_bench(lambda: (qo.copy_(q), ko.copy_(k)), return_mode="median")
        flat = torch.empty(nbytes // 2, dtype=torch.uint8, device=device)
        flat_out = torch.empty_like(flat)
        flat_ms = triton.testing.do_bench(lambda: flat_out.copy_(flat), return_mode="median")
        del qo, ko, flat, flat_out
        rec = {"shape": [B, S, Hq, Hk, D], "mbytes": nbytes / 1e6, "floor_ms": floor_ms,
               "copy_same_tensors_ms": copy_ms, "copy_one_buffer_ms": flat_ms, "forward": []}
        print(f"\n{B}x{S} h{Hq}/{Hk} d{D}: {nbytes / 1e6:.0f} MB, floor {floor_ms:.4f} ms; copy_ of q,k "
              f"{copy_ms:.4f} ms ({100 * floor_ms / copy_ms:.1f}%), one-buffer copy {flat_ms:.4f} ms "
              f"({100 * floor_ms / flat_ms:.1f}%)", flush=True)

        def rotations(q, k):  # one call per angle source
            return {
                "table": lambda: rotary_fused(q, k, cos, sin),
                "table-bf16": lambda: rotary_fused(q, k, cos16, sin16),  # half the table bytes, coarser angles
                "inv_freq": lambda: rotary_fused(q, k, inv_freq=inv, positions=0),
                "inv_freq+ids": lambda: rotary_fused(q, k, inv_freq=inv, positions=ids),
            }

        sources = rotations(q, k)
        # in place on q and k, as liger-kernel rotates: the same comparison for both
        peers = {"table in place": lambda: rotary_fused(q, k, cos, sin, inplace=True),
                 "table-bf16 in place": lambda: rotary_fused(q, k, cos16, sin16, inplace=True)}
        try:
            from liger_kernel.ops.rope import LigerRopeFunction

            emb = torch.cat((ids[..., None].float() * inv,) * 2, dim=-1)
            cos_full, sin_full = emb.cos().to(q.dtype), emb.sin().to(q.dtype)
            peers["liger (in place)"] = lambda: LigerRopeFunction.apply(q, k, cos_full, sin_full)
        except ImportError:
            pass
        rec["peers"] = {}
        for name, f in peers.items():
            t = rec["peers"][name] = triton.testing.do_bench(f, return_mode="median")
            print(f"  {name}: {t:.4f} ms {100 * floor_ms / t:.1f}% of floor", flush=True)
        space = [(source, tile, hpp, warps) for source, tile, hpp, warps in
                 itertools.product(args.sources, tiles, args.hpp, (2, 4, 8))
                 if not (args.quick and (hpp > 2 or warps == 2 or warps == 8 and tile == 1024))]
        times: dict[tuple, list[float]] = {setting: [] for setting in space}
        for _ in range(args.repeats):  # interleaved: a slow spell of the GPU hits every setting alike
            for source, tile, hpp, warps in space:
                with _configured(tile, hpp, warps):
                    times[source, tile, hpp, warps].append(triton.testing.do_bench(sources[source], return_mode="median"))
        for (source, tile, hpp, warps), runs in times.items():
            ms = statistics.median(runs)
            rec["forward"].append({"source": source, "tile": tile, "hpp": hpp, "warps": warps,
                                   "runs": runs, "ms": ms, "pct_floor": 100 * floor_ms / ms,
                                   "pct_copy": 100 * copy_ms / ms})
        rec["forward"].sort(key=lambda r: r["ms"])
        shown = rec["forward"] if len(rec["forward"]) <= 12 else rec["forward"][:10] + rec["forward"][-2:]
        for r in shown:
            print(f"  {r['source']:12} tile {r['tile']:5} hpp {r['hpp']} warps {r['warps']}: "
                  f"{r['ms']:.4f} ms {r['pct_floor']:5.1f}% of floor {r['pct_copy']:5.1f}% of copy_", flush=True)
        for source in args.sources:
            r = next(r for r in rec["forward"] if r["source"] == source)
            print(f"  best {source:12}: tile {r['tile']} hpp {r['hpp']} warps {r['warps']} {r['ms']:.4f} ms "
                  f"(runs {' '.join(f'{t:.4f}' for t in r['runs'])})", flush=True)
        default = {}
        for source, f in sources.items():
            t = default[f"forward {source}"] = triton.testing.do_bench(f, return_mode="median")
            print(f"  default forward {source}: {t:.4f} ms {100 * floor_ms / t:.1f}%", flush=True)

        if args.no_backward:
            rec["default"] = default
            out["shapes"].append(rec)
            continue
        # forward + backward with the default setting
        qg, kg = q.detach().clone().requires_grad_(), k.detach().clone().requires_grad_()
        gq, gk = torch.randn_like(q), torch.randn_like(k)
        for source, fwd in rotations(qg, kg).items():

            def step(fwd=fwd):
                qg.grad = kg.grad = None  # new gradients each call, never accumulated
                torch.autograd.backward(fwd(), (gq, gk))

            eager = triton.testing.do_bench(step, return_mode="median")
            try:
                graphed = graph_time(step, device)  # the bench's CUDA-graph timing: device time only
            except Exception as exc:  # noqa: BLE001
                graphed = float("nan")
                print("  cudagraph failed:", type(exc).__name__, str(exc)[:200])
            host = host_us(step)
            qg.grad = kg.grad = None
            default[f"fwd+bwd {source} do_bench"] = eager
            default[f"fwd+bwd {source} cudagraph"] = graphed
            default[f"fwd+bwd {source} host_us"] = host
            print(f"  fwd+bwd {source}: do_bench {eager:.4f} ms ({200 * floor_ms / eager:.1f}% of 2x floor), "
                  f"cuda graph {graphed:.4f} ms ({200 * floor_ms / graphed:.1f}%), host {host:.1f} us/call", flush=True)
        rec["default"] = default
        out["shapes"].append(rec)
        del q, k, qg, kg, gq, gk
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
