"""Where one eager decode step's time goes at long context: wall time, GPU busy time, host syncs, top host ops.

A causal LM (LM head over 1024 tokens) of the given shape with random weights and a ``DynamicCache`` filled
with ``--keys`` random tokens per layer (no prefill). Upstream and patched each run ``--steps`` plain decode
steps (``model(next, past_key_values=cache)``, synchronised); then one more step runs under
``torch.profiler`` and one under CUDA's sync debug mode (counting host synchronisations). GPU time is the
sum of the step's kernel times; wall minus GPU time is what the host adds. ``compiled`` variants
(``upstream-compiled``, ``patched-compiled``) run the same step over a ``StaticCache`` of ``--keys + 64``
slots filled to ``--keys``, with the inputs ``generate`` makes for it, through ``torch.compile(fullgraph=True, mode="reduce-overhead")`` (CUDA
graphs): the step as HF's compiled ``generate`` runs it, without ``generate``'s own per-token work.

    python benchmarks/probes/decode_step_profile.py --model llama --keys 65536 --layers 8 [--out DIR]
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import statistics
import time
import warnings
from pathlib import Path

import torch
import transformers
from cache_growth import _filled_cache

import torchembed
from torchembed.tools import bench
from torchembed.tools.bench_e2e import decode_floor_ms

SHAPES = {
    "llama": lambda a: transformers.LlamaConfig(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                                                num_key_value_heads=8, num_hidden_layers=a.layers, vocab_size=1024,
                                                max_position_embeddings=1 << 20, rope_theta=500000.0),
    "bloom": lambda a: transformers.BloomConfig(hidden_size=4096, n_head=32, n_layer=a.layers, vocab_size=1024),
    "mpt": lambda a: transformers.MptConfig(d_model=4096, n_heads=32, n_layers=a.layers, vocab_size=1024,
                                            max_seq_len=1 << 20, expansion_ratio=4, use_cache=True,
                                            attn_config={"alibi": True, "alibi_bias_max": 8}),
}


def _step(model, token, cache):
    return model(token, past_key_values=cache, use_cache=True)


def _static_cache(config, keys: int, dev) -> transformers.StaticCache:
    """A StaticCache of ``keys + 64`` slots whose first ``keys`` hold random keys and values."""
    dynamic = _filled_cache(config, keys, dev, torch.bfloat16)
    cache = transformers.StaticCache(config=config, max_cache_len=keys + 64)
    position = torch.arange(keys, device=dev)
    for i, layer in enumerate(dynamic.layers):
        cache.update(layer.keys, layer.values, i, {"cache_position": position})
    return cache


def _busy_us(events) -> float:
    """GPU busy time: the union of the kernels' and copies' intervals (annotations on the GPU timeline, such as
    a compiled graph's ``## Call CompiledFxGraph`` span, cover those kernels again and are left out)."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in events
                   if e.device_type == torch.autograd.DeviceType.CUDA and not e.name.startswith(("##", "Torch-")))
    busy, end = 0.0, float("-inf")
    for start, stop in spans:
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    return busy


def _generate_inputs(model, cache, keys: int, dev) -> dict:
    """What ``generate`` hands a compiled forward for the token after ``keys`` seen ones: the model's own
    ``prepare_inputs_for_generation`` (LLaMA gets a 4-D mask over every static slot, BLOOM a 2-D mask padded to
    the cache's length)."""
    ids = torch.zeros(1, keys + 1, dtype=torch.long, device=dev)
    inputs = model.prepare_inputs_for_generation(ids, next_sequence_length=1, past_key_values=cache,
                                                 attention_mask=torch.ones_like(ids), use_cache=True,
                                                 cache_position=torch.full((1,), keys, device=dev))
    return {k: v for k, v in inputs.items() if v is not None}


def _measure(model, config, keys: int, steps: int, compiled: bool = False) -> dict:
    dev = torch.device("cuda")
    token = torch.zeros(1, 1, dtype=torch.long, device=dev)
    if compiled:
        cache = _static_cache(config, keys, dev)
        inputs = _generate_inputs(model, cache, keys, dev)  # each step rewrites the same slot
        forward = torch.compile(model, fullgraph=True, mode="reduce-overhead")
        step = lambda m, t, c: forward(**inputs)
        steps += 3  # (compiles and records the graph)
    else:
        cache = _filled_cache(config, keys, dev, torch.bfloat16)
        step = _step
    times = []
    with torch.no_grad():
        for _ in range(steps):
            torch.cuda.synchronize()
            start = time.perf_counter()
            step(model, token, cache)
            torch.cuda.synchronize()
            times.append((time.perf_counter() - start) * 1e3)
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=acts) as prof:
            step(model, token, cache)
            torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                step(model, token, cache)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    events = prof.key_averages()
    gpu_us = _busy_us(prof.events())
    top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:12]
    return {"step_ms": statistics.median(times[5 if compiled else 2:]), "steps_ms": times, "gpu_ms": gpu_us / 1e3,
            "host_syncs": sum("synchroniz" in str(w.message) for w in caught),
            "sync_sites": sorted({str(w.message).splitlines()[0][:120] for w in caught}),
            "top_host_ops": [{"name": e.key[:70], "calls": e.count, "self_cpu_ms": e.self_cpu_time_total / 1e3,
                              "gpu_ms": e.self_device_time_total / 1e3} for e in top]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=sorted(SHAPES), default="llama")
    p.add_argument("--keys", type=int, default=65536)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--variants", nargs="+", default=["upstream", "patched"],
                   choices=["upstream", "patched", "upstream-compiled", "patched-compiled"])
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    config = SHAPES[args.model](args)
    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).to("cuda").eval()
    bandwidth = bench.copy_bandwidth(torch.device("cuda"))
    floor = decode_floor_ms(base, 1, args.keys, bandwidth)
    rows = {}
    for variant in args.variants:
        model = torchembed.patch(copy.deepcopy(base)) if variant.startswith("patched") else base
        try:
            rows[variant] = _measure(model, config, args.keys, args.steps, compiled=variant.endswith("compiled"))
        except torch.cuda.OutOfMemoryError:
            rows[variant] = {"oom": True}
        except Exception as exc:  # noqa: BLE001  (a variant this transformers cannot run: say so, go on)
            rows[variant] = {"oom": True, "error": repr(exc)[:300]}
        del model
        torch._dynamo.reset()
        torch.cuda.empty_cache()
    lines = [f"# One decode step, {args.model} shape, {args.layers} layers, {args.keys} keys, batch 1, bf16", "",
             f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
             f"- device: {torch.cuda.get_device_name()}",
             f"- versions: torch {torch.__version__}, transformers {transformers.__version__}",
             f"- floor: weights + KV cache over the measured copy bandwidth ({bandwidth / 1e9:.0f} GB/s): {floor:.2f} ms",
             "", "| variant | step ms | of floor | GPU ms | host-added ms | host syncs |", "|---|---:|---:|---:|---:|---:|"]
    for variant, r in rows.items():
        if r.get("oom"):
            lines.append(f"| {variant} | {r.get('error', 'OOM')} | | | | |")
            continue
        lines.append(f"| {variant} | {r['step_ms']:.2f} | {r['step_ms'] / floor:.2f}x | {r['gpu_ms']:.2f} "
                     f"| {r['step_ms'] - r['gpu_ms']:.2f} "
                     f"| {r['host_syncs']} |")
    for variant, r in rows.items():
        if r.get("oom"):
            continue
        lines += ["", f"Top host ops, {variant} (self CPU ms over one step; calls):", ""]
        lines += [f"- {o['name']}: {o['self_cpu_ms']:.2f} ms, {o['calls']} calls, GPU {o['gpu_ms']:.2f} ms"
                  for o in r["top_host_ops"]]
        lines += [f"- sync: {s}" for s in r["sync_sites"]]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        stem = args.out / f"decode-step-profile-{args.model}"
        stem.with_suffix(".md").write_text(text)
        stem.with_suffix(".json").write_text(json.dumps({"options": vars(args) | {"out": str(args.out)},
                                                         "bandwidth": bandwidth, "floor_ms": floor, "rows": rows}, indent=1, default=str))


if __name__ == "__main__":
    main()
