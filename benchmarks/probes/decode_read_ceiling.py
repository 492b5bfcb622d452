"""What a decode step's attention could reach at batch 1: a kernel that only reads the K and V it must read (no
math, one tiny result per program), against the floor and beside torchembed's split-key decode, device time
replayed from a CUDA graph, at 16k / 64k / 128k keys.

GQA case of ``torchembed bench decode`` (8 kv heads, d 128, bf16, HF's cache layout ``(b, hk, n, d)``); inputs
rotate through copies of more than 200 MB together (more than L2). The read kernel runs under each grid (programs
per kv head) and tile shape; "+ 1 launch" adds a second, trivial launch per call, as the split-key decode's combine
does. The best read is the ceiling of any single-pass decode attention on this machine at that length.

    python benchmarks/probes/decode_read_ceiling.py [--out DIR] [--name NAME]
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

import torch
import triton
import triton.language as tl

from torchembed.tools import bench
from torchembed.tools.bench_decode import _copies, _device_ms, _torchembed


@triton.jit
def _read_kernel(K, V, Out, N, skh, skn, svh, svn, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
                 STAGES: tl.constexpr):
    """Grid ``(parts, Hk)``: part ``p`` of kv head ``h`` reads its share of K and V and stores one float32 sum."""
    part, h = tl.program_id(0), tl.program_id(1).to(tl.int64)
    chunk = tl.cdiv(tl.cdiv(N, tl.num_programs(0)), BLOCK_N) * BLOCK_N
    start = part * chunk
    stop = tl.minimum(start + chunk, N)
    offs_d = tl.arange(0, HEAD_DIM)
    acc = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    for n in tl.range(start, stop, BLOCK_N, num_stages=STAGES):
        offs_n = (n + tl.arange(0, BLOCK_N)).to(tl.int64)
        ok = (offs_n < stop)[:, None]
        k = tl.load(K + h * skh + offs_n[:, None] * skn + offs_d[None, :], mask=ok, other=0.0)
        v = tl.load(V + h * svh + offs_n[:, None] * svn + offs_d[None, :], mask=ok, other=0.0)
        acc += k.to(tl.float32) + v.to(tl.float32)
    tl.store(Out + h * tl.num_programs(0) + part, tl.sum(tl.sum(acc, 1), 0))


@triton.jit
def _touch_kernel(Out):
    tl.store(Out + tl.program_id(0), 0.0)


def _reader(c: dict, parts: int, block_n: int, warps: int, stages: int, second: bool):
    k, v = c["k"], c["v"]
    hk, n = k.shape[1], k.shape[2]
    out = torch.empty(hk * parts, dtype=torch.float32, device=k.device)

    def call() -> None:
        _read_kernel[(parts, hk)](k, v, out, n, k.stride(1), k.stride(2), v.stride(1), v.stride(2),
                                  HEAD_DIM=k.shape[3], BLOCK_N=block_n, STAGES=stages, num_warps=warps)
        if second:
            _touch_kernel[(hk,)](out)
    return call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bandwidth", type=float, default=None, help="copy bandwidth, bytes/s (default: measured)")
    parser.add_argument("--out", default=".")
    parser.add_argument("--name", default="decode-read-ceiling")
    args = parser.parse_args()
    dev = torch.device("cuda")
    args.bandwidth = args.bandwidth or bench.copy_bandwidth(dev)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    rows = []

    def record(keys: int, what: str, us: float, floor: float) -> None:
        rows.append({"keys": keys, "what": what, "us": us, "floor_us": floor, "of_floor": floor / us})
        print(f"| {keys} | {what} | {us:.1f} | {floor:.1f} | {floor / us:.2f} |", flush=True)

    for keys in (16384, 65536, 131072):
        copies = _copies("gqa", keys, dev, torch.bfloat16)
        one = copies[0]
        floor = one["bytes"] / args.bandwidth * 1e6
        hk = one["kv_heads"]
        best = None
        for per_sm in (1, 2, 4):
            parts = max(1, per_sm * sms // hk)
            for block_n, warps, stages in ((64, 4, 3), (64, 4, 4), (128, 4, 3), (32, 4, 4), (64, 8, 3)):
                us = _device_ms(lambda c: _reader(c, parts, block_n, warps, stages, False), copies, dev) * 1e3
                record(keys, f"read, {parts} parts/head, tile {block_n}, {warps} warps, {stages} stages", us, floor)
                if best is None or us < best[0]:
                    best = (us, parts, block_n, warps, stages)
        us, parts, block_n, warps, stages = best
        record(keys, f"best read + 1 launch ({parts} parts/head, tile {block_n})",
               _device_ms(lambda c: _reader(c, parts, block_n, warps, stages, True), copies, dev) * 1e3, floor)
        record(keys, "best read", us, floor)
        record(keys, "torchembed split-key decode", _device_ms(_torchembed, copies, dev) * 1e3, floor)
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "bandwidth": args.bandwidth}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = [f"# Decode at batch 1: the read ceiling ({meta['device']})", "",
             f"- date: {meta['date']}", f"- versions: torch {meta['torch']}, triton {meta['triton']}",
             f"- floor: K and V bytes (8 kv heads, d 128, bf16) over {args.bandwidth / 1e9:.0f} GB/s", "",
             "Device time replayed from a CUDA graph. 'read': a kernel that only reads K and V (no attention math).", "",
             "| keys | kernel | us | floor us | of floor |", "|---:|---|---:|---:|---:|"]
    lines += [f"| {r['keys']} | {r['what']} | {r['us']:.1f} | {r['floor_us']:.1f} | {r['of_floor']:.2f} |"
              for r in rows]
    (out / f"{args.name}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
