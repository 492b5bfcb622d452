"""Where plain ``generate`` of a patched ~1B model spends each new token on the host once its decode steps replay
from the CUDA graph (``torchembed.patches.decode_graphs``): the wall time per token (the median gap between steps),
then the same ``generate`` under ``cProfile``, its Python functions' time per new token (cumulative and own), so the
host work left (``generate``'s own, the graphed forward's decision and input copies, the replay) is named; on CUDA
also one ``generate`` under ``torch.profiler``: the GPU's busy time per token and its kernels by kind (what the
replayed step costs the GPU, against the weights' read floor).

    python benchmarks/probes/replayed_generate_profile.py [--model llama] [--prompt 512] [--tokens 64] --out DIR
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import sys
from pathlib import Path

import torch
import transformers

import torchembed
from decode_step_profile import _busy_us, _kernels_by_kind  # (this folder)
from torchembed.tools.bench_e2e import make_config
from torchembed.tools.bench_long import StepClock


def generate(model, ids, tokens: int, clock: StepClock | None = None) -> None:
    processors = transformers.LogitsProcessorList([clock] if clock else [])
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, min_new_tokens=tokens,
                   logits_processor=processors)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--smoke", action="store_true", help="a tiny model on the CPU (checks the probe itself)")
    args = parser.parse_args(argv)
    device = torch.device("cpu" if args.smoke else "cuda")
    config = make_config(args.model, args.smoke, 8192)
    torch.manual_seed(0)
    with device:
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    torchembed.patch(model)
    ids = torch.randint(3, config.vocab_size - 16, (1, args.prompt), generator=torch.Generator().manual_seed(1)).to(device)
    record = {"model": args.model, "prompt": args.prompt, "tokens": args.tokens, "device": str(device),
              "gpu": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
              "transformers": transformers.__version__}
    with torch.no_grad():
        generate(model, ids, args.tokens)  # warm-up: the capture
        gaps = []
        for _ in range(3):
            clock = StepClock()
            generate(model, ids, args.tokens, clock)
            gaps += clock.gaps_ms()[2:]
        record["wall_ms_per_token"] = statistics.median(gaps)
        graphs = getattr(model, "_torchembed_decode_graphs", None)
        record["graph_counters"] = {k: getattr(graphs, k, None) for k in ("captures", "replays")} if graphs else None
        profile = cProfile.Profile()
        profile.enable()
        generate(model, ids, args.tokens)
        profile.disable()
        if device.type == "cuda":
            torch.cuda.synchronize()
            with torch.profiler.profile() as prof:
                generate(model, ids, args.tokens)
                torch.cuda.synchronize()
            events = prof.events()
            record["gpu_busy_ms_per_token"] = _busy_us(events) / 1e3 / args.tokens  # (the prefill's share included)
            kinds = _kernels_by_kind(events)
            record["gpu_kinds_ms_per_token"] = {k: {"ms": v["ms"] / args.tokens, "kernels": v["kernels"] / args.tokens,
                                                    "longest": v["names"]} for k, v in kinds.items()}
            weights = sum(p.numel() * p.element_size() for p in model.parameters())
            record["weights_gb"] = weights / 1e9
    stats = pstats.Stats(profile)
    rows = []
    for (path, line, name), (_, calls, own, cumulative, _) in stats.stats.items():
        short = path.split("site-packages/")[-1].split("/main/")[-1]
        rows.append({"function": f"{short}:{line}({name})", "calls_per_token": calls / args.tokens,
                     "own_us_per_token": own / args.tokens * 1e6, "cumulative_us_per_token": cumulative / args.tokens * 1e6})
    record["profiled_ms_per_token"] = sum(r["own_us_per_token"] for r in rows) / 1e3
    record["by_cumulative"] = sorted(rows, key=lambda r: -r["cumulative_us_per_token"])[:args.top]
    record["by_own"] = sorted(rows, key=lambda r: -r["own_us_per_token"])[:args.top]
    print(f"wall {record['wall_ms_per_token']:.3f} ms per token; under cProfile {record['profiled_ms_per_token']:.3f}; "
          f"graphs {record['graph_counters']}")
    if "gpu_busy_ms_per_token" in record:
        print(f"GPU busy {record['gpu_busy_ms_per_token']:.3f} ms per token (the prefill's share included); weights "
              f"{record['weights_gb']:.2f} GB")
        for kind, v in sorted(record["gpu_kinds_ms_per_token"].items(), key=lambda kv: -kv[1]["ms"]):
            print(f"  {kind}: {v['ms']:.3f} ms, {v['kernels']:.1f} kernels per token; longest {list(v['longest'])[:2]}")
    for title in ("by_cumulative", "by_own"):
        print(f"## {title} (us per token: cumulative / own; calls per token)")
        for r in record[title]:
            print(f"{r['cumulative_us_per_token']:9.1f} {r['own_us_per_token']:8.1f} {r['calls_per_token']:6.1f}  {r['function']}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"replayed-generate-profile-{args.model}.json").write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
