"""Where one decode step's time goes at long context: wall time, GPU busy time, host syncs, host time by owner.

A causal LM (LM head over 1024 tokens) of the given shape with random weights and a ``DynamicCache`` filled
with ``--keys`` random tokens per layer (no prefill). Upstream and patched each run ``--steps`` plain decode
steps (``model(next, past_key_values=cache)``, synchronised); then one more step runs under
``torch.profiler`` (GPU busy time: the union of the kernels' intervals; wall minus it is what the host
adds; the top host operators), three under the profiler with Python stacks (host time by owner: each
operator counted for the torchembed or transformers frame that called it; the least of the three) and one
under CUDA's sync debug mode (host synchronisations). ``compiled`` variants (``upstream-compiled``,
``patched-compiled``) run the same step over a ``StaticCache`` of ``--keys + 64`` slots filled to
``--keys``, with the inputs ``generate`` makes for it, through ``torch.compile(fullgraph=True,
mode="reduce-overhead")`` (CUDA graphs): the step as HF's compiled ``generate`` runs it, without
``generate``'s own per-token work. ``--device cpu`` runs the eager variants in float32 (no GPU columns);
``--hidden`` shrinks the shape. On the GPU the profiled step's kernels are also summed by kind (matmuls, the
library's attention and rotation kernels, inductor's fused kernels, the rest), the matmuls beside their floor
(every weight once over the measured bandwidth) and the attention beside its own (the KV cache once).

    python benchmarks/probes/decode_step_profile.py --model llama --keys 65536 --layers 8 [--out DIR]
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import statistics
import time
import traceback
import warnings
from pathlib import Path

import torch
import transformers
from cache_growth import filled_cache

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


def _python_site() -> str:
    """The innermost torchembed or transformers frame of the running Python stack (where a sync was called)."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if "/torchembed/" in frame.filename or "/patches/" in frame.filename or "/transformers/" in frame.filename:
            return f"{frame.filename.rsplit('/', 2)[-2]}/{frame.filename.rsplit('/', 1)[-1]}:{frame.lineno} {frame.name}"
    return "?"


def _step(model, token, cache):
    return model(token, past_key_values=cache, use_cache=True)


def _static_cache(config, keys: int, dev) -> transformers.StaticCache:
    """A StaticCache of ``keys + 64`` slots whose first ``keys`` hold random keys and values."""
    dynamic = filled_cache(config, keys, dev, torch.bfloat16)
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


# a GPU kernel's kind, by its name (the first pattern that matches; "other" when none does; SDPA's before the
# library's: a flash kernel's name also ends in "_fwd_kernel")
KERNEL_KINDS = (
    ("matmul", ("gemm", "gemv", "nvjet", "cutlass", "xmma", "cublas", "splitk")),
    ("SDPA / flash", ("flash", "fmha", "attention", "sdpa", "cudnn")),
    ("torchembed attention", ("_decode_kernel", "_combine_kernel", "_fwd_kernel")),
    ("torchembed rotation", ("rope", "rotary")),
    ("inductor fused (norms, activations, adds, cache writes)", ("triton_",)),
    ("copies and fills", ("memcpy", "memset", "copy", "fill")),
)


def kernel_kind(name: str) -> str:
    """The kind of GPU kernel ``name`` is (see ``KERNEL_KINDS``)."""
    low = name.lower()
    return next((kind for kind, keys in KERNEL_KINDS if any(k in low for k in keys)), "other")


def _kernels_by_kind(events) -> dict[str, dict[str, float]]:
    """GPU time (ms) and kernel count of one step by kind (each kernel's own interval)."""
    kinds: dict[str, dict[str, float]] = {}
    for e in events:
        if e.device_type != torch.autograd.DeviceType.CUDA or e.name.startswith(("##", "Torch-")):
            continue
        entry = kinds.setdefault(kernel_kind(e.name), {"ms": 0.0, "kernels": 0, "names": {}})
        ms = (e.time_range.end - e.time_range.start) / 1e3
        entry["ms"] += ms
        entry["kernels"] += 1
        entry["names"][e.name] = entry["names"].get(e.name, 0.0) + ms
    for entry in kinds.values():  # the three longest-running kernel names of each kind (ms in all)
        entry["names"] = dict(sorted(entry["names"].items(), key=lambda item: -item[1])[:3])
    return kinds


def _owner_of(frame: str) -> str | None:
    """Whose Python frame (``"path(line): function"``) this is: ``"torchembed"``, ``"transformers"``, or None."""
    if ".py(" not in frame:
        return None
    if "torchembed/" in frame or "/patches/" in frame:
        return "torchembed"
    return "transformers" if "transformers/" in frame else None


def _host_by_owner(events) -> dict[str, float] | None:
    """Host time (ms) of one step by owner: every event's self time goes to the nearest enclosing Python frame
    of torchembed or transformers (operators and torch's frames count for whoever called them); the rest,
    ``other``, is the probe's loop and what no such frame encloses. The frames are the profiler's Python-function
    events where it records them, else each operator's ``stack``; None where it recorded neither (then every
    operator would count as ``other``, which is no measurement)."""
    total: dict[str, float] = {"torchembed": 0.0, "transformers": 0.0, "other": 0.0}
    frames = 0
    for e in events:
        if e.device_type != torch.autograd.DeviceType.CPU:
            continue
        owner, up = _owner_of(e.name), e
        frames += ".py(" in e.name
        while owner is None and up.cpu_parent is not None:
            up = up.cpu_parent
            owner = _owner_of(up.name)
        stack = list(getattr(e, "stack", None) or ())  # innermost frame first
        frames += bool(stack)
        for frame in stack if owner is None else ():
            owner = _owner_of(frame)
            if owner is not None:
                break
        total[owner or "other"] += e.self_cpu_time_total / 1e3
    return total if frames else None


def _measure(model, config, keys: int, steps: int, compiled: bool = False, dev: torch.device = torch.device("cuda"),
             dtype: torch.dtype = torch.bfloat16) -> dict:
    cuda = dev.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    token = torch.zeros(1, 1, dtype=torch.long, device=dev)
    if compiled:
        cache = _static_cache(config, keys, dev)
        inputs = _generate_inputs(model, cache, keys, dev)  # each step rewrites the same slot
        forward = torch.compile(model, fullgraph=True, mode="reduce-overhead")
        step = lambda m, t, c: forward(**inputs)
        steps += 3  # (compiles and records the graph)
    else:
        cache = filled_cache(config, keys, dev, dtype)
        step = _step
    times = []
    caught: list = []
    with torch.no_grad():
        for _ in range(steps):
            sync()
            start = time.perf_counter()
            step(model, token, cache)
            sync()
            times.append((time.perf_counter() - start) * 1e3)
        acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
        with torch.profiler.profile(activities=acts) as prof:
            step(model, token, cache)
            sync()
        owners = []
        for _ in range(3):  # (the least of three: a profiled step now and then pays the profiler's own setup)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], with_stack=True) as stacked:
                step(model, token, cache)
                sync()
            owners.append(_host_by_owner(stacked.events()))
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("always")
                    warnings.showwarning = lambda message, *_: caught.append((message, _python_site()))
                    step(model, token, cache)
            finally:
                torch.cuda.set_sync_debug_mode("default")
    events = prof.key_averages()
    gpu_us = _busy_us(prof.events())
    top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:12]
    return {"step_ms": statistics.median(times[5 if compiled else 2:]), "steps_ms": times, "gpu_ms": gpu_us / 1e3,
            "kernels_by_kind": _kernels_by_kind(prof.events()) if cuda else {},
            "host_ms_by_owner": min((h for h in owners if h is not None), key=lambda h: sum(h.values()), default=None),
            "host_syncs": sum("synchroniz" in str(message) for message, _ in caught),
            "sync_sites": sorted({f"{str(message).splitlines()[0][:80]} at {site}" for message, site in caught}),
            "top_host_ops": [{"name": e.key[:70], "calls": e.count, "self_cpu_ms": e.self_cpu_time_total / 1e3,
                              "gpu_ms": e.self_device_time_total / 1e3} for e in top]}


def _shrunk(config, model: str, hidden: int):
    """The shape with a hidden size of ``hidden`` (heads of 64; LLaMA keeps 4 query heads per kv head)."""
    heads = max(1, hidden // 64)
    if model == "llama":
        config.hidden_size, config.intermediate_size, config.head_dim = hidden, hidden * 7 // 2, 64
        config.num_attention_heads, config.num_key_value_heads = heads, max(1, heads // 4)
    elif model == "bloom":
        config.hidden_size, config.n_head = hidden, heads
    else:
        config.d_model, config.n_heads = hidden, heads
    return config


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=sorted(SHAPES), default="llama")
    p.add_argument("--keys", type=int, default=65536)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--variants", nargs="+", default=["upstream", "patched"],
                   choices=["upstream", "patched", "upstream-compiled", "patched-compiled"])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cpu: eager variants in float32, for the host time by owner (no GPU columns)")
    p.add_argument("--hidden", type=int, default=None, help="a smaller hidden size (heads of 64), e.g. for the CPU")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    if not cuda and any(v.endswith("compiled") for v in args.variants):
        p.error("the compiled variants replay CUDA graphs: they need --device cuda")
    dtype = torch.bfloat16 if cuda else torch.float32
    config = SHAPES[args.model](args)
    if args.hidden:
        config = _shrunk(config, args.model, args.hidden)
    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).to(dev).eval()
    bandwidth = bench.copy_bandwidth(dev)
    floor = decode_floor_ms(base, 1, args.keys, bandwidth)
    weights_floor = decode_floor_ms(base, 1, 0, bandwidth)  # every weight once, no cache
    rows = {}
    for variant in args.variants:
        model = torchembed.patch(copy.deepcopy(base)) if variant.startswith("patched") else base
        try:
            rows[variant] = _measure(model, config, args.keys, args.steps, compiled=variant.endswith("compiled"),
                                     dev=dev, dtype=dtype)
        except torch.cuda.OutOfMemoryError:
            rows[variant] = {"oom": True}
        except Exception as exc:  # noqa: BLE001  (a variant this transformers cannot run: say so, go on)
            rows[variant] = {"oom": True, "error": repr(exc)[:300]}
        del model
        torch._dynamo.reset()
        if cuda:
            torch.cuda.empty_cache()
    shape = f"{args.model} shape" + (f" (hidden {args.hidden})" if args.hidden else "")
    lines = [f"# One decode step, {shape}, {args.layers} layers, {args.keys} keys, batch 1, {str(dtype)[6:]}", "",
             f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
             f"- device: {torch.cuda.get_device_name() if cuda else f'CPU, {torch.get_num_threads()} threads'}",
             f"- versions: torch {torch.__version__}, transformers {transformers.__version__}",
             f"- floor: weights + KV cache over the measured copy bandwidth ({bandwidth / 1e9:.0f} GB/s): {floor:.2f} ms",
             "", "| variant | step ms | x floor | GPU ms | host-added ms | host syncs |", "|---|---:|---:|---:|---:|---:|"]
    for variant, r in rows.items():
        if r.get("oom"):
            lines.append(f"| {variant} | {r.get('error', 'OOM')} | | | | |")
            continue
        lines.append(f"| {variant} | {r['step_ms']:.2f} | {r['step_ms'] / floor:.2f}x | {r['gpu_ms']:.2f} "
                     f"| {r['step_ms'] - r['gpu_ms']:.2f} | {r['host_syncs'] if cuda else '-'} |")
    lines += ["", "Host time of one step by owner (ms under the profiler with Python stacks, which slows the host; "
              "each operator counted for the torchembed or transformers frame that called it):", "",
              "| variant | torchembed | transformers | other | torchembed per layer |", "|---|---:|---:|---:|---:|"]
    for variant, r in rows.items():
        if not r.get("oom"):
            h = r["host_ms_by_owner"]
            if h is None:
                lines.append(f"| {variant} | not recorded: this torch's profiler kept no Python frames | | | |")
                continue
            lines.append(f"| {variant} | {h['torchembed']:.2f} | {h['transformers']:.2f} | {h['other']:.2f} "
                         f"| {h['torchembed'] / args.layers:.3f} |")
    kind_floor = {"matmul": weights_floor, "torchembed attention": floor - weights_floor,
                  "SDPA / flash": floor - weights_floor}
    for variant, r in rows.items():
        if r.get("oom") or not r.get("kernels_by_kind"):
            continue
        lines += ["", f"GPU time of one step by kernel kind, {variant} (each kernel's own interval; the matmuls' "
                  "floor: every weight once, the attention's: the KV cache once, at the same bandwidth):", "",
                  "| kind | kernels | ms | floor ms | x floor | longest kernels (ms) |",
                  "|---|---:|---:|---:|---:|---|"]
        for kind, k in sorted(r["kernels_by_kind"].items(), key=lambda item: -item[1]["ms"]):
            f = kind_floor.get(kind)
            ratio = "-" if f is None else f"{k['ms'] / f:.2f}x"
            names = "; ".join(f"`{n[:60]}` {ms:.2f}" for n, ms in k.get("names", {}).items())
            lines.append(f"| {kind} | {k['kernels']} | {k['ms']:.2f} | {'-' if f is None else f'{f:.2f}'} "
                         f"| {ratio} | {names} |")
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
        stem = args.out / (f"decode-step-profile-{args.model}" + ("" if cuda else "-cpu"))
        stem.with_suffix(".md").write_text(text)
        stem.with_suffix(".json").write_text(json.dumps({"options": vars(args) | {"out": str(args.out)},
                                                         "bandwidth": bandwidth, "floor_ms": floor, "rows": rows},
                                                        indent=1, default=str))


if __name__ == "__main__":
    main()
