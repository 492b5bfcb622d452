"""The split-key decode kernel at batch 1 (and the other decode cases at the default): the whole call and its
combine alone, device time replayed from a CUDA graph, under key-split settings and decode block shapes.

Cases and inputs are ``torchembed bench decode``'s (32 query / 8 kv heads, d 128, bf16; ``alibi``: 32 kv heads with
the key bias; ``gqa-padded``: batch 4 with a padding mask). Each call's inputs rotate through copies of more than
200 MB together (more than L2). The floor: the K and V bytes read once over ``--bandwidth``.

    python benchmarks/probes/decode_splits_graph.py [--only-default] [--out DIR] [--name NAME]
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

import torch
import triton
import transformers

from torchembed.kernels import attention_plan as A
from torchembed.kernels.attention import mask_rows
from torchembed.kernels.settings import changed, settings
from torchembed.tools import bench
from torchembed.tools.bench_decode import _copies, _device_ms, _torchembed

# (decode programs per multiprocessor (least, most), keys per part, decode blocks or None: the tuned ones)
GRID = [((1, 4), 1024, None), ((2, 4), 1024, None), ((2, 4), 512, None), ((3, 4), 512, None), ((4, 4), 512, None),
        ((4, 8), 256, None), ((2, 4), 512, (16, 128, 4, 3)), ((2, 4), 512, (16, 64, 4, 4)),
        ((2, 4), 512, (16, 32, 4, 3)), ((2, 4), 512, (16, 64, 8, 3)), ((4, 4), 512, (16, 32, 4, 3))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only-default", action="store_true", help="the settings in force only")
    parser.add_argument("--bandwidth", type=float, default=4244e9, help="copy bandwidth, bytes/s (H200: 4244e9)")
    parser.add_argument("--out", default=".")
    parser.add_argument("--name", default="decode-splits-graph")
    args = parser.parse_args()
    dev = torch.device("cuda")
    tuned = settings().alibi
    grid = [(tuned.decode_programs_per_sm, tuned.decode_split_keys, None)] + ([] if args.only_default else GRID)
    rows = []
    for name in ("gqa", "alibi", "gqa-padded"):
        for keys in (16384, 65536, 131072):
            copies = _copies(name, keys, dev, torch.bfloat16)
            one = copies[0]
            floor = one["bytes"] / args.bandwidth * 1e6
            for per_sm, split_keys, blocks in grid if name == "gqa" else grid[:1]:
                change = {"decode_programs_per_sm": per_sm, "decode_split_keys": split_keys}
                if blocks:
                    change["blocks"] = {("decode", 128, False): blocks}
                with changed(alibi=change):
                    us = _device_ms(_torchembed, copies, dev) * 1e3
                    rows_t = None if one["mask"] is None else mask_rows(one["mask"])
                    plan = A.forward_plan(one["q"], one["k"], one["v"], one["bias"], rows_t, one["mask"],
                                          one["dim"] ** -0.5, one["bias"] is not None, False)
                    splits = plan.main.grid[0] if hasattr(plan.main, "grid") else 1
                    combine = None
                    if plan.combine is not None:
                        out = torch.empty(plan.out_shape, dtype=plan.dtype, device=dev)
                        part = torch.zeros(plan.part, dtype=torch.float32, device=dev)
                        combine = bench.graph_time(lambda: plan.combine((out, out, part)), dev, calls=20) * 1e3
                rows.append({"case": name, "keys": keys, "per_sm": list(per_sm), "split_keys": split_keys,
                             "blocks": list(blocks) if blocks else None, "splits": splits, "us": us, "floor_us": floor,
                             "of_floor": floor / us, "combine_us": combine})
                print(f"| {name} | {keys} | {per_sm} | {split_keys} | {blocks or 'tuned'} | {splits} | {us:.1f} | "
                      f"{floor:.1f} | {floor / us:.2f} | {'-' if combine is None else f'{combine:.1f}'} |", flush=True)
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "transformers": transformers.__version__, "bandwidth": args.bandwidth}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = [f"# Split-key decode: key splits and blocks ({meta['device']})", "",
             f"- date: {meta['date']}", f"- versions: torch {meta['torch']}, triton {meta['triton']}, "
             f"transformers {meta['transformers']}", f"- floor: K and V bytes over {args.bandwidth / 1e9:.0f} GB/s", "",
             "Device time of one decode step's attention, replayed from a CUDA graph; 'combine': the combine launch "
             "alone. Settings: decode programs per multiprocessor (least, most), keys per part, decode blocks "
             "(BLOCK_R, BLOCK_N, warps, stages).", "",
             "| case | keys | per SM | keys per part | blocks | splits | us | floor us | of floor | combine us |",
             "|---|---:|---|---:|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        combine = "-" if r["combine_us"] is None else f"{r['combine_us']:.1f}"
        lines.append(f"| {r['case']} | {r['keys']} | {tuple(r['per_sm'])} | {r['split_keys']} | "
                     f"{tuple(r['blocks']) if r['blocks'] else 'tuned'} | {r['splits']} | {r['us']:.1f} | "
                     f"{r['floor_us']:.1f} | {r['of_floor']:.2f} | {combine} |")
    (out / f"{args.name}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
