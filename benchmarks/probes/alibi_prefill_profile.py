"""Where a short ALiBi prefill's time goes, upstream against patched: one sequence of 128-2048 tokens (a probe).

Falcon-ALiBi (falcon-rw-1b's layout: hidden 2048, 32 heads), BLOOM and MPT shapes with ``--layers`` layers, random
weights, bf16, batch 1. For each length: the prefill's wall time (synchronised; median of ``--repeats`` interleaved
runs, upstream and patched back to back), the paths the patched layers took (``torchembed.kernels.route.alibi_path``,
counted), and, profiled once each, the GPU busy time (the union of the kernels' intervals; wall minus it is what the
host adds) and the GPU time by kernel name (the largest ``--top``). ``--python N``: also ``N`` prefills of each under
``cProfile``, the Python functions' own time per prefill, patched less upstream (the ``--top`` largest differences
each way: where the host time goes that one adds). ``--device cpu`` runs a small shape in float32 (no GPU columns) to
check the probe itself.

    python benchmarks/probes/alibi_prefill_profile.py [--models falcon bloom mpt] [--lengths 128 512 1024 2048]
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import pstats
import copy
import datetime
import json
import statistics
import time
from pathlib import Path

import torch
import transformers

import torchembed
from decode_step_profile import _busy_us, _kernels_by_kind  # (this folder)
from torchembed.kernels import alibi as alibi_entry
from torchembed.tools import bench


def config(name: str, hidden: int, heads: int, layers: int) -> object:
    if name == "falcon":
        return transformers.FalconConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                                         vocab_size=50304, alibi=True, parallel_attn=False, bias=True,
                                         new_decoder_architecture=False, multi_query=False, attn_implementation="sdpa")
    if name == "bloom":
        return transformers.BloomConfig(hidden_size=hidden, n_layer=layers, n_head=heads, vocab_size=50304)
    return transformers.MptConfig(d_model=hidden, n_layers=layers, n_heads=heads, expansion_ratio=4, vocab_size=50304,
                                  max_seq_len=4096, attn_config={"alibi": True}, use_cache=True)


def wall_ms(model, ids, sync) -> float:
    sync()
    start = time.perf_counter()
    with torch.no_grad():
        model(ids)
    sync()
    return (time.perf_counter() - start) * 1e3


def profile(model, ids, sync, top: int) -> dict:
    with torch.no_grad(), torch.profiler.profile() as prof:
        start = time.perf_counter()
        model(ids)
        sync()
        wall = (time.perf_counter() - start) * 1e3
    events = prof.events()
    kernels = collections.Counter()
    for e in events:
        if e.device_type == torch.autograd.DeviceType.CUDA and not e.name.startswith(("##", "Torch-")):
            kernels[e.name[:90]] += (e.time_range.end - e.time_range.start) / 1e3
    return {"wall_ms": wall, "gpu_busy_ms": _busy_us(events) / 1e3, "kinds": _kernels_by_kind(events),
            "aten_ops": sum(1 for e in events if e.name.startswith("aten::")), "kernels_ms": dict(kernels.most_common(top))}


def python_diff(upstream, patched, ids, sync, calls: int, top: int) -> dict:
    """Own time per prefill of each Python function (and builtin) under ``cProfile``, patched less upstream (us)."""
    own = {}
    for variant, model in (("upstream", upstream), ("patched", patched)):
        profiler = cProfile.Profile()
        with torch.no_grad():
            profiler.enable()
            for _ in range(calls):
                model(ids)
            sync()
            profiler.disable()
        own[variant] = {f"{path.split('site-packages/')[-1].split('/main/')[-1]}:{line}({fn})": (n / calls, t / calls * 1e6)
                        for (path, line, fn), (_, n, t, _, _) in pstats.Stats(profiler).stats.items()}
    rows = []
    for key in own["upstream"].keys() | own["patched"].keys():
        (cu, tu), (cp, tp) = own["upstream"].get(key, (0, 0.0)), own["patched"].get(key, (0, 0.0))
        rows.append({"function": key, "us": tp - tu, "calls_upstream": cu, "calls_patched": cp})
    rows.sort(key=lambda r: r["us"])
    totals = {v: sum(t for _, t in o.values()) / 1e3 for v, o in own.items()}
    return {"profiled_ms": totals, "patched_more": rows[::-1][:top], "upstream_more": rows[:top]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["falcon", "bloom", "mpt"], choices=["falcon", "bloom", "mpt"])
    p.add_argument("--lengths", nargs="+", type=int, default=[128, 512, 1024, 2048])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--top", type=int, default=8)
    p.add_argument("--python", type=int, default=0, metavar="N", help="N prefills of each under cProfile (0: none)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    hidden, heads = (2048, 32) if dev.type == "cuda" else (128, 4)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    records = []
    real_path = alibi_entry.alibi_path  # (the ALiBi entry asks the route through this name)
    for name in args.models:
        upstream = bench.random_causal_lm(config(name, hidden, heads, args.layers), dev, dtype)
        patched = torchembed.patch(copy.deepcopy(upstream))
        for length in args.lengths:
            ids = torch.randint(3, 50000, (1, length), device=dev)
            paths = collections.Counter()

            def counted(*a, **k):
                path = real_path(*a, **k)
                paths[path] += 1
                return path

            for model in (upstream, patched, upstream, patched):  # warm up (compiles, allocator)
                wall_ms(model, ids, sync)
            alibi_entry.alibi_path = counted
            try:
                wall_ms(patched, ids, sync)
            finally:
                alibi_entry.alibi_path = real_path
            times = {"upstream": [], "patched": []}
            for _ in range(args.repeats):
                for variant, model in (("upstream", upstream), ("patched", patched)):
                    times[variant].append(wall_ms(model, ids, sync))
            record = {"model": name, "length": length, "paths": dict(paths),
                      **{f"{v}_ms": statistics.median(t) for v, t in times.items()},
                      **{f"{v}_all_ms": t for v, t in times.items()}}
            if dev.type == "cuda":
                record["profile"] = {v: profile(m, ids, sync, args.top) for v, m in (("upstream", upstream), ("patched", patched))}
            if args.python:
                record["python"] = python_diff(upstream, patched, ids, sync, args.python, 2 * args.top)
            records.append(record)
            print(f"{name} 1x{length}: upstream {record['upstream_ms']:.3f} ms, patched {record['patched_ms']:.3f} ms "
                  f"({record['upstream_ms'] / record['patched_ms']:.2f}x), paths {dict(paths)}", flush=True)
        del upstream, patched
    lines = [f"# Short ALiBi prefills, upstream against patched ({args.layers} layers, hidden {hidden}, {heads} heads, "
             f"batch 1, {str(dtype).split('.')[-1]})", "", f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
             f"- device: {torch.cuda.get_device_name() if dev.type == 'cuda' else 'CPU'}",
             f"- versions: torch {torch.__version__}, transformers {transformers.__version__}", "",
             "| model | tokens | upstream ms | patched ms | upstream / patched | patched paths | GPU busy ms (u / p) | "
             "host-added ms (u / p) | aten ops (u / p) |", "|---|---:|---:|---:|---:|---|---:|---:|---:|"]
    for r in records:
        prof = r.get("profile")
        gpu = host = ops = "-"
        if prof:
            u, q = prof["upstream"], prof["patched"]
            gpu = f"{u['gpu_busy_ms']:.3f} / {q['gpu_busy_ms']:.3f}"
            host = f"{u['wall_ms'] - u['gpu_busy_ms']:.3f} / {q['wall_ms'] - q['gpu_busy_ms']:.3f}"
            ops = f"{u['aten_ops']} / {q['aten_ops']}"
        lines.append(f"| {r['model']} | {r['length']} | {r['upstream_ms']:.3f} | {r['patched_ms']:.3f} | "
                     f"{r['upstream_ms'] / r['patched_ms']:.2f}x | {r['paths']} | {gpu} | {host} | {ops} |")
    for r in records:
        if r.get("profile"):
            lines += ["", f"## {r['model']} 1x{r['length']}: GPU ms by kernel (profiled once)", ""]
            for variant, prof in r["profile"].items():
                lines.append(f"- {variant}: by kind " + "; ".join(f"{k} {v['ms']:.3f} ({v['kernels']})"
                                                                for k, v in prof["kinds"].items()))
                lines.append(f"- {variant}: longest " + "; ".join(f"`{k}` {v:.3f}" for k, v in prof["kernels_ms"].items()))
    for r in records:
        if r.get("python"):
            py = r["python"]
            lines += ["", f"## {r['model']} 1x{r['length']}: Python own time per prefill under cProfile, patched less "
                      f"upstream (profiled ms: upstream {py['profiled_ms']['upstream']:.3f}, patched "
                      f"{py['profiled_ms']['patched']:.3f})", "", "| us | calls u / p | function |", "|---:|---:|---|"]
            for row in py["patched_more"] + py["upstream_more"]:
                lines.append(f"| {row['us']:.1f} | {row['calls_upstream']:.0f} / {row['calls_patched']:.0f} | "
                             f"`{row['function']}` |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "alibi-prefill-profile.md").write_text(text)
        (args.out / "alibi-prefill-profile.json").write_text(json.dumps(records, indent=1))


if __name__ == "__main__":
    main()
