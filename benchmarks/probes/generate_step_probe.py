"""``generate()`` per-token time at long context, upstream against patched, step by step (a probe).

LLaMA-3.1-8B shape (``--layers`` layers, bf16, random weights): a prompt of ``--context`` tokens with its
attention mask, ``--new`` greedy tokens; a streamer synchronises and stamps each new token, so the
per-token time is the median interval between tokens (the prefill is not in it). The two variants
alternate ``--rounds`` times; then the operators of a few generate steps by device and host time.

    python benchmarks/probes/generate_step_probe.py [--context 65536] [--layers 4] [--new 48]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import transformers

import torchembed
from torchembed.tools.bench_long import make_config


class _Stamps:
    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value) -> None:
        torch.cuda.synchronize()
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama")
    parser.add_argument("--context", type=int, default=65536)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--new", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    config = make_config(args.model, args.layers, args.context + args.new, False)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    ids = torch.randint(3, 5000, (1, args.context), device="cuda")
    kwargs = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0, use_cache=True)

    def run(new: int) -> list[float]:
        stamps = _Stamps()
        with torch.no_grad():
            model.generate(ids, max_new_tokens=new, min_new_tokens=new, streamer=stamps, **kwargs)
        gaps = [(b - a) * 1e3 for a, b in zip(stamps.times[2:], stamps.times[3:])]  # (put 0: the prompt)
        return gaps

    results: dict[str, list[float]] = {"upstream": [], "patched": []}
    run(4)  # warm-up
    for _ in range(args.rounds):
        for variant in ("upstream", "patched"):
            if variant == "patched":
                torchembed.patch(model)
            gaps = run(args.new)
            results[variant].append(statistics.median(gaps))
            print(variant, f"median {statistics.median(gaps):.2f} ms/token", [round(g, 1) for g in gaps[:6]], flush=True)
            if variant == "patched":
                torchembed.unpatch(model)
    for variant in ("upstream", "patched"):
        if variant == "patched":
            torchembed.patch(model)
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.no_grad():
            cache = transformers.DynamicCache()
            model(ids, past_key_values=cache, use_cache=True, attention_mask=torch.ones_like(ids))
        with torch.no_grad(), torch.profiler.profile(activities=activities) as prof:
            step = ids[:, -1:]
            for i in range(3):
                mask = torch.ones(1, args.context + 1 + i, dtype=torch.long, device="cuda")
                model(step, past_key_values=cache, use_cache=True, attention_mask=mask)
            torch.cuda.synchronize()
        print(f"--- {variant}: three decode steps with the attention mask, {args.context} keys")
        for key in ("self_device_time_total", "self_cpu_time_total"):
            print(prof.key_averages().table(sort_by=key, row_limit=12, max_name_column_width=70), flush=True)
        if variant == "patched":
            torchembed.unpatch(model)
    print({k: [round(x, 2) for x in v] for k, v in results.items()})


if __name__ == "__main__":
    main()
