"""Decode host time against context length, one GPU (the "host time independent of context" check).

For each model shape (``--models``, ``--layers`` layers, bf16, random weights, patched by torchembed) and
each ``--contexts`` length: prefill, then ``--steps`` plain-loop decode steps (``model(next,
past_key_values=cache)``). Per step: the host time (until the forward returns, the GPU idle at the
start: the step is synchronised before), the whole step (synchronised), and the number of host-device
synchronisations inside the forward (``torch.cuda.set_sync_debug_mode``). Medians of the steps after
the first two; then one step's top operators by host time at the longest context.

    python benchmarks/probes/decode_host_time.py [--models mpt llama] [--contexts 1024 8192 65536] [--layers 4]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings

import torch

import torchembed
from torchembed.tools.bench_long import make_config


def _step(base, nxt, cache):
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode(1)
        start = time.perf_counter()
        out = base(input_ids=nxt, past_key_values=cache, use_cache=True)
        host = time.perf_counter() - start
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    total = time.perf_counter() - start
    syncs = sum("synchroniz" in str(w.message) for w in caught)
    return out.past_key_values, host * 1e3, total * 1e3, syncs


def main() -> None:
    import transformers

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["mpt", "llama"])
    parser.add_argument("--contexts", nargs="+", type=int, default=[1024, 8192, 65536])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", default=None)
    parser.add_argument("--trace-sync", action="store_true", help="print where a synchronising step synchronises")
    args = parser.parse_args()
    device = torch.device("cuda")
    rows = []
    for name in args.models:
        config = make_config(name, args.layers, max(args.contexts), False)
        torch.manual_seed(0)
        with device:
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
        torchembed.patch(model)
        base = model.base_model
        vocab = config.get_text_config().vocab_size
        for context in args.contexts:
            with torch.no_grad():
                ids = torch.randint(3, vocab - 16, (1, context), device=device)
                cache = base(input_ids=ids, use_cache=True).past_key_values
                nxt = ids[:, -1:]
                steps = []
                for _ in range(args.steps):
                    cache, host, total, syncs = _step(base, nxt, cache)
                    steps.append((host, total, syncs))
            kept = steps[2:]
            row = {"model": name, "context": context, "layers": args.layers,
                   "host_ms": statistics.median(s[0] for s in kept), "step_ms": statistics.median(s[1] for s in kept),
                   "syncs_per_step": max(s[2] for s in kept), "first_steps_ms": [round(s[1], 2) for s in steps[:2]]}
            rows.append(row)
            print(json.dumps(row), flush=True)
            if context == max(args.contexts):
                activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
                with torch.no_grad(), torch.profiler.profile(activities=activities) as prof:
                    base(input_ids=nxt, past_key_values=cache, use_cache=True)
                    torch.cuda.synchronize()
                for key in ("self_cpu_time_total", "self_device_time_total"):
                    print(prof.key_averages().table(sort_by=key, row_limit=14, max_name_column_width=60), flush=True)
            if args.trace_sync and steps[-1][2]:  # where the step synchronises: the first such call raises
                torch.cuda.set_sync_debug_mode(2)
                try:
                    with torch.no_grad():
                        base(input_ids=nxt, past_key_values=cache, use_cache=True)
                except RuntimeError:
                    import traceback

                    print("".join(traceback.format_exc().splitlines(keepends=True)[-40:]), flush=True)
                finally:
                    torch.cuda.set_sync_debug_mode(0)
            cache = None
            torch.cuda.empty_cache()
        del model, base
        torch.cuda.empty_cache()
    for name in args.models:
        mine = [r for r in rows if r["model"] == name]
        spread = max(r["host_ms"] for r in mine) / min(r["host_ms"] for r in mine)
        print(f"{name}: host time max/min over contexts {spread:.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"rows": rows, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "transformers": transformers.__version__}, f, indent=1)


if __name__ == "__main__":
    main()
