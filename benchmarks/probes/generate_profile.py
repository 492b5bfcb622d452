"""Where HF's compiled static-cache ``generate`` spends each new token at long context, beyond the compiled step:
the decode steps of one ``generate`` call under ``torch.profiler``, counted per new token (CUDA graph launches,
eager kernel launches, compiled-region calls, host synchronisations, top host operators), beside the wall time
per token as ``bench long`` takes it (medians of interleaved ``generate(N)`` / ``generate(1)`` pairs).

A compiled step that replays its CUDA graph shows one ``cudaGraphLaunch`` per token and few eager launches; a
count of eager launches growing with the layers means the graph is not replayed (or the step runs eager).

    python benchmarks/probes/generate_profile.py --model llama --layers 32 --keys 65536 [--variants patched upstream]
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from pathlib import Path

import torch
import transformers
from transformers import CompileConfig

import torchembed
from torchembed.tools.bench_long import StepClock, make_config


def _generate(model, ids, n: int, config: CompileConfig, clock: StepClock | None = None) -> None:
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                   pad_token_id=0, use_cache=True, cache_implementation="static", compile_config=config,
                   logits_processor=transformers.LogitsProcessorList([clock] if clock else []))


def measure(model, keys: int, tokens: int, vocab: int, device: torch.device) -> dict:
    config = CompileConfig(fullgraph=True, mode="reduce-overhead")
    config._compile_all_devices = device.type != "cuda"  # (--smoke on the CPU: compiled there too)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    ids = torch.randint(3, vocab - 16, (1, keys), generator=torch.Generator().manual_seed(0)).to(device)
    with torch.no_grad():
        _generate(model, ids, tokens, config)  # compiles, records the graph
        times: dict[int, list[float]] = {1: [], tokens: []}
        gaps: list[list[float]] = []
        for n in [1, tokens] * 3:
            clock = StepClock()
            sync()
            start = time.perf_counter()
            _generate(model, ids, n, config, clock)
            sync()
            times[n].append(time.perf_counter() - start)
            if n == tokens:
                gaps.append(clock.gaps_ms())
        per_token = (statistics.median(times[tokens]) - statistics.median(times[1])) / (tokens - 1) * 1e3
        steady = statistics.median([g for run in gaps for g in run[2:]])  # (the first two steps: warm-up, record)
        first = [statistics.median(run[i] for run in gaps) for i in range(2)]
        counts: dict[int, dict] = {}
        for n in (1, tokens):  # the profile of generate(N) less that of generate(1): the decode steps alone
            with torch.profiler.profile() as prof:
                _generate(model, ids, n, config)
                sync()
            counts[n] = {e.key: (e.count, e.self_cpu_time_total / 1e3, e.self_device_time_total / 1e3)
                         for e in prof.key_averages()}
    steps = tokens - 1
    per_step = {}
    for key, (count, cpu_ms, gpu_ms) in counts[tokens].items():
        c1, cpu1, gpu1 = counts[1].get(key, (0, 0.0, 0.0))
        per_step[key] = ((count - c1) / steps, (cpu_ms - cpu1) / steps, (gpu_ms - gpu1) / steps)
    picked = {k: per_step.get(k, (0, 0, 0)) for k in ("cudaGraphLaunch", "cudaLaunchKernel", "cuLaunchKernelEx",
                                                      "cudaDeviceSynchronize", "cudaStreamSynchronize",
                                                      "cudaMemcpyAsync", "Torch-Compiled Region: 0/0",
                                                      "TorchDynamo Cache Lookup")}
    top = sorted(per_step.items(), key=lambda kv: -kv[1][1])[:15]
    return {"generate_ms_per_token": per_token, "steady_ms_per_token": steady, "first_steps_ms": first,
            "per_token": picked, "top_host": top,
            "gpu_ms_per_token": sum(v[2] for k, v in per_step.items() if not k.startswith("## Call"))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama", choices=["llama", "qwen3", "bloom", "falcon"])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--keys", type=int, default=65536)
    parser.add_argument("--tokens", type=int, default=33)
    parser.add_argument("--variants", nargs="+", default=["patched"], choices=["patched", "upstream"])
    parser.add_argument("--out", default=".")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (exercises the script)")
    parser.add_argument("--why", action="store_true",
                        help="print each CUDA-graph re-recording with its reason (and inductor's counters)")
    args = parser.parse_args()
    if args.why:  # cudagraph_trees logs each re-recording's reason at DEBUG level
        rerecords = logging.getLogger("torch._inductor.cudagraph_trees")
        rerecords.setLevel(logging.DEBUG)
        handler = logging.StreamHandler()
        handler.addFilter(lambda record: "Re-recording" in record.getMessage())
        handler.setFormatter(logging.Formatter("- re-record: %(message).600s"))
        rerecords.addHandler(handler)
    device = torch.device("cpu" if args.smoke else "cuda")
    config = make_config(args.model, args.layers, args.keys, args.smoke)
    torch.manual_seed(0)
    with device:
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    vocab = config.get_text_config().vocab_size
    rows = {}
    for variant in args.variants:
        if variant == "patched":
            torchembed.patch(model)
        rows[variant] = measure(model, args.keys, args.tokens, vocab, device)
        if variant == "patched":
            torchembed.unpatch(model)
        if args.why:
            from torch._dynamo.utils import counters
            print(f"- {variant}: inductor counters {dict(counters['inductor'])}")
            counters.clear()
        torch._dynamo.reset()
        r = rows[variant]
        print(f"## {args.model}, {args.layers} layers, {args.keys} keys, {variant}: generate {r['generate_ms_per_token']:.2f}"
              f" ms/token, GPU {r['gpu_ms_per_token']:.2f} ms/token; steady {r['steady_ms_per_token']:.2f} ms/token, first "
              f"steps {r['first_steps_ms'][0]:.1f} / {r['first_steps_ms'][1]:.1f} ms")
        for key, (count, cpu_ms, gpu_ms) in r["per_token"].items():
            print(f"| {key} | {count:.1f} calls | {cpu_ms:.3f} ms host | {gpu_ms:.3f} ms GPU |")
        for key, (count, cpu_ms, gpu_ms) in r["top_host"]:
            print(f"- {key[:70]}: {count:.1f} calls, {cpu_ms:.3f} ms host, {gpu_ms:.3f} ms GPU per token")
    meta = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
            "transformers": transformers.__version__, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    write(Path(args.out), {"meta": meta, "args": vars(args), "rows": rows})


def write(out: Path, result: dict) -> None:
    """``generate-profile-<model>.json`` and its markdown table (one row per variant and counted event)."""
    meta, args, rows = result["meta"], result["args"], result["rows"]
    name = f"generate-profile-{args['model']}"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(result, indent=1))
    lines = [f"# Compiled static-cache generate, per new token ({args['model']}, {args['layers']} layers, "
             f"{args['keys']} keys)", "", f"- date: {meta['date']}", f"- device: {meta['device']}",
             f"- versions: torch {meta['torch']}, transformers {meta['transformers']}", "",
             f"`generate(N)` less `generate(1)` (N = {args['tokens']}) under `torch.profiler`, divided by N - 1; "
             "wall: medians of 3 interleaved pairs without the profiler. Steady: the median gap between consecutive "
             "steps inside one `generate` (host time at each step's logits processing), the first two steps left "
             "out; first steps: the first two gaps (median over the 3 calls).", "",
             "| variant | wall ms/token | steady ms/token | first steps ms |", "|---|---:|---:|---:|"]
    lines += [f"| {v} | {r['generate_ms_per_token']:.2f} | {r['steady_ms_per_token']:.2f} | "
              f"{r['first_steps_ms'][0]:.1f} / {r['first_steps_ms'][1]:.1f} |" for v, r in rows.items()]
    lines += ["", "| variant | wall ms/token | GPU ms/token | event | calls/token | host ms/token | GPU ms/token |",
              "|---|---:|---:|---|---:|---:|---:|"]
    for variant, r in rows.items():
        for key, (count, cpu_ms, gpu_ms) in r["per_token"].items():
            lines.append(f"| {variant} | {r['generate_ms_per_token']:.2f} | {r['gpu_ms_per_token']:.2f} | {key} | "
                         f"{count:.2f} | {cpu_ms:.3f} | {gpu_ms:.3f} |")
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")

if __name__ == "__main__":
    main()
