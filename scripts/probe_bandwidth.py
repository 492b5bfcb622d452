"""What a memory-bound kernel can reach on this GPU at the RoPE benchmark's sizes (CUDA only).

For each size, the same bytes are moved by ``copy_`` of one flat buffer (PyTorch's copy kernel)
and by the fused RoPE kernel on q and k (HF layout; per-batch float32 tables, one shared table
row per token, angles computed in the kernel from position ids or an int offset). Group ``copy``
adds Triton copy kernels (one tile per program; persistent programs looping over tiles, with and
without software pipelining) and an experimental persistent RoPE kernel; group ``rope`` adds the
RoPE kernel with one head per program (``RopeTuning.grouped_heads`` empty) against the library's default.
Every variant is timed as device time (replayed from a CUDA graph of 10 calls) in ``--repeats``
interleaved rounds, so a slow spell of the GPU hits all of them alike; ``copy_`` is also timed with
``do_bench`` (how the floor bandwidth is measured).

    python scripts/probe_bandwidth.py [--json out.json] [--repeats 5] [--groups copy rope]

The floor is the bytes over the 1 GiB ``copy_`` bandwidth (``torchembed.tools.bench``).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import triton
import triton.language as tl

from torchembed.functional.rope import rope_cos_sin
from torchembed.kernels import rope, rope_triton
from torchembed.kernels.rope import rotary_fused
from torchembed.tools.bench import copy_bandwidth, graph_time
from torchembed.kernels.settings import changed

SHAPES = [(4, 4096, 32, 8, 128), (1, 32768, 32, 8, 128), (8, 2048, 64, 8, 128)]


@triton.jit
def _copy(x, y, n, BLOCK: tl.constexpr):
    off = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = off < n
    tl.store(y + off, tl.load(x + off, mask=m), mask=m)


@triton.jit
def _copy_persistent(x, y, n, BLOCK: tl.constexpr, STAGES: tl.constexpr):
    tiles = tl.cdiv(n, BLOCK)
    for t in tl.range(tl.program_id(0), tiles, tl.num_programs(0), num_stages=STAGES):
        off = t * BLOCK + tl.arange(0, BLOCK)  # int32: the buffers here hold < 2**31 elements
        m = off < n
        tl.store(y + off, tl.load(x + off, mask=m), mask=m)


@triton.jit
def _rope_tile(x, o, cos, sin, t, H, n_s, S, sx_b, sx_h, sx_s, so_b, so_h, so_s, sc_b, sc_s,
               HALF: tl.constexpr, BLOCK_S: tl.constexpr):
    h = (t % H).to(tl.int64)
    r = t // H
    b = (r // n_s).to(tl.int64)
    s = (r % n_s) * BLOCK_S + tl.arange(0, BLOCK_S)
    m = (s < S)[:, None]
    s = s.to(tl.int64)
    j = tl.arange(0, HALF)[None, :]
    c_off = (b * sc_b + s * sc_s)[:, None] + j
    c = tl.load(cos + c_off, mask=m, other=0.0)
    sn = tl.load(sin + c_off, mask=m, other=0.0)
    xi = x + (b * sx_b + h * sx_h + s * sx_s)[:, None] + j
    oi = o + (b * so_b + h * so_h + s * so_s)[:, None] + j
    x1 = tl.load(xi, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(xi + HALF, mask=m, other=0.0).to(tl.float32)
    tl.store(oi, (x1 * c - x2 * sn).to(o.dtype.element_ty), mask=m)
    tl.store(oi + HALF, (x2 * c + x1 * sn).to(o.dtype.element_ty), mask=m)


@triton.jit
def _rope_persistent(q, k, qo, ko, cos, sin, S, HQ, HK, n_s, B,
                     sq_b, sq_h, sq_s, sk_b, sk_h, sk_s, sqo_b, sqo_h, sqo_s, sko_b, sko_h, sko_s, sc_b, sc_s,
                     HALF: tl.constexpr, BLOCK_S: tl.constexpr, STAGES: tl.constexpr):
    pid, nprog = tl.program_id(0), tl.num_programs(0)
    for t in tl.range(pid, B * n_s * HQ, nprog, num_stages=STAGES):
        _rope_tile(q, qo, cos, sin, t, HQ, n_s, S, sq_b, sq_h, sq_s, sqo_b, sqo_h, sqo_s, sc_b, sc_s, HALF, BLOCK_S)
    for t in tl.range(pid, B * n_s * HK, nprog, num_stages=STAGES):
        _rope_tile(k, ko, cos, sin, t, HK, n_s, S, sk_b, sk_h, sk_s, sko_b, sko_h, sko_s, sc_b, sc_s, HALF, BLOCK_S)


def rope_persistent(q, k, cos, sin, programs: int, block_s: int, warps: int, stages: int):
    qo, ko = torch.empty_like(q), torch.empty_like(k)
    B, HQ, S, D = q.shape
    n_s = triton.cdiv(S, block_s)
    sc_b = cos.stride(0) if cos.shape[0] != 1 else 0
    _rope_persistent[(programs,)](q, k, qo, ko, cos, sin, S, HQ, k.shape[1], n_s, B, *q.stride()[:3], *k.stride()[:3],
                                  *qo.stride()[:3], *ko.stride()[:3], sc_b, cos.stride(1), HALF=D // 2,
                                  BLOCK_S=block_s, STAGES=stages, num_warps=warps)
    return qo, ko


def library_settings(values: dict):
    """The RoPE kernel's launch configuration for one variant: ``values`` maps fields of
    :class:`~torchembed.kernels.rope.RopeTuning` to their values (``rope.tuned``: kept launches
    cleared before and after, the configuration restored after)."""
    return changed(rope=dict(**values))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=None)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--groups", nargs="+", default=["copy", "rope"], choices=["copy", "rope"],
                        help="copy: PyTorch and Triton copies, persistent kernels; rope: the kernel's load order "
                             "and heads per program (the plain rope rows always run)")
    args = parser.parse_args()
    device = torch.device("cuda")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    bandwidth = copy_bandwidth(device)
    print(f"copy bandwidth (1 GiB, do_bench) {bandwidth / 1e9:.0f} GB/s; {sms} SMs", flush=True)
    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "copy_bandwidth_gbs": bandwidth / 1e9, "sms": sms, "shapes": []}
    for B, S, HQ, HK, D in SHAPES:
        q = torch.randn(B, S, HQ, D, device=device, dtype=torch.bfloat16).transpose(1, 2)
        k = torch.randn(B, S, HK, D, device=device, dtype=torch.bfloat16).transpose(1, 2)
        nbytes = 2 * (q.numel() + k.numel()) * 2  # read + written
        floor = nbytes / bandwidth * 1e3
        flat = torch.empty(nbytes // 2, dtype=torch.uint8, device=device)
        flat_out = torch.empty_like(flat)
        x, y = flat.view(torch.int32), flat_out.view(torch.int32)  # 4-byte elements
        n = x.numel()
        inv = 1.0 / (10000.0 ** (torch.arange(0, D, 2, device=device).float() / D))
        ids_b = torch.arange(S, device=device).expand(B, S)  # per-batch ids: (B, S, D/2) tables
        ids_1 = torch.arange(S, device=device)[None]  # (1, S): one table row per token
        cos_b, sin_b = rope_cos_sin(inv, ids_b)
        cos_1, sin_1 = rope_cos_sin(inv, ids_1)
        variants = {"copy_ flat": lambda: flat_out.copy_(flat)}
        settings: dict[str, dict] = {}  # RopeTuning changes per variant (the library's defaults otherwise)
        if "copy" in args.groups:
            for block in (2048, 8192):
                for warps in (4, 8):
                    variants[f"triton copy block {block} warps {warps}"] = (
                        lambda block=block, warps=warps: _copy[(triton.cdiv(n, block),)](x, y, n, BLOCK=block,
                                                                                          num_warps=warps))
            for per_sm in (4, 8):
                for stages in (1, 3):
                    variants[f"triton copy persistent {per_sm}/SM block 4096 stages {stages}"] = (
                        lambda per_sm=per_sm, stages=stages: _copy_persistent[(sms * per_sm,)](
                            x, y, n, BLOCK=4096, STAGES=stages, num_warps=4))
            for per_sm in (8, 16):
                for stages in (1, 3):
                    variants[f"rope persistent {per_sm}/SM tile 16 stages {stages} (B,S) tables"] = (
                        lambda per_sm=per_sm, stages=stages: rope_persistent(q, k, cos_b, sin_b, sms * per_sm, 16, 4,
                                                                             stages))
        sources = {"(B,S) tables": lambda: rotary_fused(q, k, cos_b, sin_b),
                   "(1,S) tables": lambda: rotary_fused(q, k, cos_1, sin_1),
                   "angles, (B,S) ids": lambda: rotary_fused(q, k, inv_freq=inv, positions=ids_b),
                   "angles, int offset": lambda: rotary_fused(q, k, inv_freq=inv, positions=0)}
        for source, fn in sources.items():
            variants[f"rope {source}"] = fn
            if "rope" in args.groups:  # against the library's default of two heads per program
                variants[f"rope {source} one head per program"] = fn
                settings[f"rope {source} one head per program"] = {"grouped_heads": ()}
        if "copy" in args.groups:
            ref = rotary_fused(q, k, cos_b, sin_b)
            pers = rope_persistent(q, k, cos_b, sin_b, sms * 8, 16, 4, 1)
            for a, b in zip(ref, pers):  # same float32 math; allow one bf16 rounding step of difference
                torch.testing.assert_close(b.float(), a.float(), rtol=2**-7, atol=2**-7)
            del ref, pers
        times: dict[str, list[float]] = {name: [] for name in variants}
        copy_do_bench = []
        for _ in range(args.repeats):
            copy_do_bench.append(triton.testing.do_bench(variants["copy_ flat"], return_mode="median"))
            for name, fn in variants.items():
                try:
                    with library_settings(settings.get(name, {})):
                        times[name].append(graph_time(fn, device))
                except Exception as exc:  # noqa: BLE001  a variant that does not compile or capture
                    print(f"  {name}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                    times[name].append(float("nan"))
        rec = {"shape": [B, S, HQ, HK, D], "mbytes": nbytes / 1e6, "floor_ms": floor,
               "copy_do_bench_ms": statistics.median(copy_do_bench), "graph_ms": times}
        out["shapes"].append(rec)
        print(f"\n{B}x{S} h{HQ}/{HK} d{D}: {nbytes / 1e6:.0f} MB moved, floor {floor:.4f} ms; copy_ do_bench "
              f"{rec['copy_do_bench_ms']:.4f} ms ({100 * floor / rec['copy_do_bench_ms']:.1f}%)", flush=True)
        for name, runs in sorted(times.items(), key=lambda kv: statistics.median(kv[1])):
            ms = statistics.median(runs)
            print(f"  {name:58} {ms:.4f} ms {100 * floor / ms:5.1f}% of floor  [{min(runs):.4f}-{max(runs):.4f}]",
                  flush=True)
        del q, k, flat, flat_out, x, y
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
