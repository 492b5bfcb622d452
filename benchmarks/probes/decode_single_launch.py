"""A split-key decode in one launch, against torchembed's two (the split pass, then the combine): each program
reads its share of the keys, stores its partial ``(acc, m, l)`` and takes a ticket from a per-(batch, kv head)
counter; the program holding the last ticket merges that head's parts and writes the output, then zeroes the counter
for the next call. Device time replayed from a CUDA graph, GQA case of ``torchembed bench decode`` (batch 1, 32
query / 8 kv heads, d 128, bf16), 16k / 64k / 128k keys, as fractions of the K/V read floor; the outputs of both
are compared.

The question it answers: how much of the gap to the floor at 16k is the second launch (the read ceiling probe,
``decode_read_ceiling.py``, puts a second launch at about 1.4 us on the H200). The answer on an H100
(``benchmarks/results/decode-single-launch-h100.md``): none; one launch is slower at every length (34.8 against
31.3 us at 16k, 101.5 against 96.3 at 64k), since the last program's merge runs after every other program has ended,
where the combine's 128 programs merge in parallel. The library's own one-launch path (all query rows of a kv head
merged at once, commit b48f6f2) was slower too, and was not kept.

    python benchmarks/probes/decode_single_launch.py [--bandwidth BYTES_PER_S] [--out DIR]
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

import torch
import triton
import triton.language as tl

from torchembed.kernels import attention_plan as A
from torchembed.kernels.attention_triton import _decode_tile, merge_parts


@triton.jit
def single_launch_decode(Q, K, V, Out, Part, Count, sqb, sqh, skb, skh, skn, svb, svh, svn, sob, soh, Hk, GROUP, N,
                         SPLITS, qk_scale, HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_S: tl.constexpr, PREC: tl.constexpr):
    """Grid ``(SPLITS, B * Hk)``; q ``(B, H, 1, D)``, k/v ``(B, Hk, N, D)`` (unit stride in D), no bias, no mask;
    ``Count``: ``B * Hk`` int32 zeros (left zeroed); ``Part``: ``(SPLITS, B * Hk, BLOCK_R, D + 2)`` float32."""
    split = tl.program_id(0)
    bk = tl.program_id(1).to(tl.int64)
    b, hk = bk // Hk, bk % Hk
    r = tl.arange(0, BLOCK_R)
    r_ok = r < GROUP
    h = (hk * GROUP + r).to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + b * sqb + h[:, None] * sqh + offs_d[None, :], mask=r_ok[:, None], other=0.0)
    chunk = tl.cdiv(tl.cdiv(N, SPLITS), BLOCK_N) * BLOCK_N
    start = split * chunk
    stop = tl.minimum(start + chunk, N)
    bulk = tl.maximum(stop // BLOCK_N * BLOCK_N, start)
    lo = tl.zeros([BLOCK_R], dtype=tl.int32)
    hi = tl.full([BLOCK_R], N, dtype=tl.int32)
    acc = tl.zeros([BLOCK_R, HEAD_DIM], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_R], dtype=tl.float32)
    m_i = tl.full([BLOCK_R], -1.0e30, dtype=tl.float32)
    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh
    for start_n in range(start, bulk, BLOCK_N):  # the library's tile, unmasked, then the last part tile masked
        start_n = tl.multiple_of(start_n, BLOCK_N)
        acc, l_i, m_i = _decode_tile(acc, l_i, m_i, q, lo, hi, k_base, v_base, K, K, 0.0, lo, 0.0, start_n, start,
                                     stop, skn, 1, svn, 1, 0, 0, r_ok, qk_scale, HEAD_DIM, BLOCK_N, HEAD_DIM, 2, False,
                                     False, PREC)
    for start_n in range(bulk, stop, BLOCK_N):
        acc, l_i, m_i = _decode_tile(acc, l_i, m_i, q, lo, hi, k_base, v_base, K, K, 0.0, lo, 0.0, start_n, start,
                                     stop, skn, 1, svn, 1, 0, 0, r_ok, qk_scale, HEAD_DIM, BLOCK_N, HEAD_DIM, 2, True,
                                     False, PREC)
    row = HEAD_DIM + 2
    part = Part + ((split * tl.num_programs(1) + bk) * BLOCK_R + r.to(tl.int64)) * row
    tl.store(part[:, None] + offs_d[None, :], acc, mask=r_ok[:, None])
    tl.store(part + HEAD_DIM, m_i, mask=r_ok)
    tl.store(part + HEAD_DIM + 1, l_i, mask=r_ok)
    ticket = tl.atomic_add(Count + bk, 1, sem="acq_rel")  # (releases the stores above; the last one acquires all)
    if ticket == SPLITS - 1:
        stride = tl.num_programs(1).to(tl.int64) * BLOCK_R * row
        offs_d = tl.arange(0, HEAD_DIM)
        for g in range(0, GROUP):  # each query row of this kv head: all parts at once, BLOCK_S per step
            out, l_g, m_g = merge_parts(Part + (bk * BLOCK_R + g) * row, stride, offs_d, SPLITS, HEAD_DIM, HEAD_DIM,
                                        BLOCK_S)
            out = out / tl.where(l_g > 0.0, l_g, 1.0)
            tl.store(Out + b * sob + (hk * GROUP + g).to(tl.int64) * soh + offs_d, out.to(Out.dtype.element_ty))
        tl.atomic_xchg(Count + bk, 0)


def single_launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, splits: int, block_n: int = 64,
                  warps: int = 4, stages: int = 3, zero_each_call: bool = False):
    """A callable running :func:`single_launch_decode` on ``q (B, H, 1, D)`` over ``k, v (B, Hk, N, D)``; it returns
    the output ``(B, H, 1, D)`` (buffers made once, the counter left zeroed by each call). ``zero_each_call``: zero
    the counter before each launch too (a memset, what a counter made per forward costs)."""
    batch, heads, _, dim = q.shape
    kv_heads, keys = k.shape[1], k.shape[2]
    group = heads // kv_heads
    block_r = max(16, triton.next_power_of_2(group))
    out = torch.empty(batch, heads, 1, dim, dtype=q.dtype, device=q.device)
    part = torch.empty(splits * batch * kv_heads * block_r * (dim + 2), dtype=torch.float32, device=q.device)
    count = torch.zeros(batch * kv_heads, dtype=torch.int32, device=q.device)
    grid = (splits, batch * kv_heads)
    prec = 1 if q.dtype == torch.float32 else (2 if q.device.type == "cpu" else 0)  # (as the library's kernels)

    def call() -> torch.Tensor:
        if zero_each_call:
            count.zero_()
        single_launch_decode[grid](q, k, v, out, part, count, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                                   k.stride(2), v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1),
                                   kv_heads, group, keys, splits, dim ** -0.5 * 1.4426950408889634, HEAD_DIM=dim,
                                   BLOCK_R=block_r, BLOCK_N=block_n, BLOCK_S=64, PREC=prec, num_warps=warps,
                                   num_stages=stages)
        return out
    return call


def main() -> None:
    from torchembed.tools import bench
    from torchembed.tools.bench_decode import _copies, _device_ms, _torchembed

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bandwidth", type=float, default=None, help="copy bandwidth, bytes/s (default: measured)")
    parser.add_argument("--out", default=".")
    parser.add_argument("--name", default="decode-single-launch")
    args = parser.parse_args()
    dev = torch.device("cuda")
    bandwidth = args.bandwidth or bench.copy_bandwidth(dev)
    rows = []
    for keys in (16384, 65536, 131072):
        copies = _copies("gqa", keys, dev, torch.bfloat16)
        one = copies[0]
        floor = one["bytes"] / bandwidth * 1e6
        plan = A.forward_plan(one["q"], one["k"], one["v"], None, None, None, one["dim"] ** -0.5, False, False)
        splits = plan.main.grid[0]
        reference = _torchembed(one)().float()
        for name, make in (("torchembed (split pass + combine)", _torchembed),
                           *((f"one launch, {splits} parts, {w} warps, {s} stages" + (", counter zeroed per call" if z
                                                                                       else ""),
                              lambda c, w=w, s=s, z=z: single_launch(c["q"], c["k"], c["v"], splits, 64, w, s, z))
                             for w, s, z in ((4, 3, False), (4, 4, False), (8, 3, False), (4, 3, True)))):
            error = (make(one)().float() - reference).abs().max().item()
            us = _device_ms(make, copies, dev) * 1e3
            rows.append({"keys": keys, "what": name, "us": us, "floor_us": floor, "of_floor": floor / us,
                         "max_diff": error})
            print(f"| {keys} | {name} | {us:.1f} | {floor:.1f} | {floor / us:.2f} | {error:.1e} |", flush=True)
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "bandwidth": bandwidth}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = [f"# Decode at batch 1 in one launch ({meta['device']})", "", f"- date: {meta['date']}",
             f"- versions: torch {meta['torch']}, triton {meta['triton']}",
             f"- floor: K and V bytes (8 kv heads, d 128, bf16) over {bandwidth / 1e9:.0f} GB/s", "",
             "Device time replayed from a CUDA graph; max diff: largest difference from torchembed's output.", "",
             "| keys | kernel | us | floor us | of floor | max diff |", "|---:|---|---:|---:|---:|---:|"]
    lines += [f"| {r['keys']} | {r['what']} | {r['us']:.1f} | {r['floor_us']:.1f} | {r['of_floor']:.2f} | "
              f"{r['max_diff']:.1e} |" for r in rows]
    (out / f"{args.name}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
