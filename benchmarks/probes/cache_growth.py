"""One decode step over a long DynamicCache, patched (the cache grows in place) against upstream (torch.cat).

A LLaMA- or BLOOM-shaped model with random weights; its ``DynamicCache`` is filled with ``--keys`` random
tokens per layer (no prefill), then each variant runs ``--steps`` greedy decode steps on its own copy of
that cache, the variants alternating over ``--repeats``; the first step of each run (where the patched
cache moves into buffers with room) is timed apart. Any device: CPU (float32) or CUDA (bfloat16).

    python benchmarks/probes/cache_growth.py --keys 8192 32768 [--model llama] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import platform
import statistics
import time
from pathlib import Path

import torch
import transformers

import torchembed
from torchembed.patches import kv_cache

SHAPES = {  # (layers, hidden, heads, kv heads): d = 64
    "llama": lambda a: transformers.LlamaConfig(vocab_size=256, hidden_size=a.hidden, intermediate_size=2 * a.hidden,
                                                num_hidden_layers=a.layers, num_attention_heads=a.hidden // 64,
                                                num_key_value_heads=a.kv_heads, max_position_embeddings=1 << 20),
    "bloom": lambda a: transformers.BloomConfig(vocab_size=256, hidden_size=a.hidden, n_head=a.hidden // 64,
                                                n_layer=a.layers),
}


def filled_cache(config, keys: int, device, dtype) -> transformers.DynamicCache:
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    dim = config.hidden_size // config.num_attention_heads
    cache = transformers.DynamicCache()
    gen = torch.Generator(device=device).manual_seed(0)  # (drawn where they live: a CPU draw of GBs takes minutes)
    for layer in range(config.num_hidden_layers):
        k, v = (torch.randn(1, heads, keys, dim, generator=gen, device=device, dtype=dtype) for _ in range(2))
        cache.update(k, v, layer)
    return cache


def _run(model, cache, steps: int, device) -> tuple[float, list[float]]:
    """(first step ms, the other steps' ms) of ``steps`` greedy decode steps."""
    token = torch.zeros(1, 1, dtype=torch.long, device=device)
    times = []
    with torch.no_grad():
        for _ in range(steps):
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            out = model(token, past_key_values=cache, use_cache=True)
            token = out.logits[:, -1:].argmax(-1)
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append((time.perf_counter() - start) * 1e3)
    return times[0], times[1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(SHAPES), default="llama")
    parser.add_argument("--keys", nargs="+", type=int, default=[8192, 32768])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None, help="folder for cache-growth-<model>.{json,md}")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = SHAPES[args.model](args)
    torch.manual_seed(0)
    upstream = transformers.AutoModelForCausalLM.from_config(config).to(device, dtype).eval()
    patched = torchembed.patch(copy.deepcopy(upstream))
    rows = []
    for keys in args.keys:
        filled = filled_cache(config, keys, device, dtype)
        kv_mb = sum(t.numel() * t.element_size() for layer in filled.layers for t in (layer.keys, layer.values)) / 2**20
        runs = {"upstream": [], "patched": []}
        for _ in range(args.repeats):
            for name, model in (("upstream", upstream), ("patched", patched)):
                runs[name].append(_run(model, copy.deepcopy(filled), args.steps, device))
        row = {"keys": keys, "kv_cache_mb": round(kv_mb, 1)}
        for name, results in runs.items():
            row[f"{name}_first_ms"] = statistics.median(first for first, _ in results)
            row[f"{name}_step_ms"] = statistics.median(t for _, rest in results for t in rest)
        row["upstream_over_patched"] = row["upstream_step_ms"] / row["patched_step_ms"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)",
        "versions": f"torch {torch.__version__}, transformers {transformers.__version__}, python {platform.python_version()}",
        "options": vars(args) | {"out": str(args.out), "dtype": str(dtype), "in_place_bytes": kv_cache.IN_PLACE_BYTES},
    }
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        stem = args.out / f"cache-growth-{args.model}"
        stem.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
        lines = [f"# One decode step over a long DynamicCache: patched (grown in place) vs upstream (torch.cat)", "",
                 *(f"- {k}: {v}" for k, v in meta.items()), "",
                 "| keys | KV cache MB | upstream ms/step | patched ms/step | upstream / patched | first step ms (u / p) |",
                 "|---:|---:|---:|---:|---:|---:|"]
        lines += [f"| {r['keys']} | {r['kv_cache_mb']} | {r['upstream_step_ms']:.2f} | {r['patched_step_ms']:.2f} | "
                  f"{r['upstream_over_patched']:.2f}x | {r['upstream_first_ms']:.2f} / {r['patched_first_ms']:.2f} |" for r in rows]
        lines += ["", "Medians over the repeats' steps after the first; python benchmarks/probes/cache_growth.py "
                  + " ".join(f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
                             for k, v in vars(args).items() if k != "out") + "."]
        stem.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
