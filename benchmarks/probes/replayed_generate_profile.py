"""Where plain ``generate`` of a patched model spends each new token once its decode steps replay from the CUDA
graph (``torchembed.patches.decode_graphs``): the wall time per token (the median gap between steps), the first
decode step's parts (the cache moved into rooms, the warm-up and the capture: each timed apart with the device
synchronised around it in one more call; the gap before the first step holds the prefill's GPU time, since the logits
processor that clocks it runs when the prefill is queued), then the same ``generate`` under ``cProfile``, its Python functions' time per new token
(cumulative and own), so the host work left (``generate``'s own, the graphed forward's decision and input copies, the
replay) is named; on CUDA also one ``generate`` under ``torch.profiler`` from its third decode step on: the GPU's busy
time per token and its kernels by kind, against the wall time (the rest is host time with the GPU idle), and the
captured step replayed on its own (the graph's time with the gaps between its kernels, which the busy time leaves out).

    python benchmarks/probes/replayed_generate_profile.py [--model llama] [--prompt 512] [--tokens 64] --out DIR
    python benchmarks/probes/replayed_generate_profile.py --long --layers 32 --prompt 131072 --tokens 32 --out DIR

``--long``: ``torchembed bench long``'s shape of the model (LLaMA-3.1-8B, BLOOM-7B1, MPT-7B-StoryWriter, ...) with
``--layers`` layers, instead of ``bench e2e``'s ~1B one.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers

import torchembed
from decode_step_profile import _busy_us, _kernels_by_kind  # (this folder)
from torchembed.patches import decode_graphs
from torchembed.tools import bench_long
from torchembed.tools.bench_e2e import make_config
from torchembed.tools.bench_long import StepClock


class ProfileFrom:
    """A logits processor starting ``profiler`` at its ``step``-th call (the decode steps after it are profiled)."""

    def __init__(self, profiler, step: int) -> None:
        self.profiler, self.step, self.calls = profiler, step, 0

    def __call__(self, input_ids, scores):
        self.calls += 1
        if self.calls == self.step:
            self.profiler.start()
        return scores


def first_step_parts(model, ids, tokens: int) -> dict:
    """One more ``generate`` with the graphed step's parts timed apart (the device synchronised around each, so they
    do not overlap as in a plain call): the cache moved into rooms, the warm-up (the step run eagerly), the capture."""
    parts: dict[str, list[float]] = {"rooms_ms": [], "warm_up_and_capture_ms": [], "capture_ms": []}
    cls = decode_graphs.DecodeGraphs
    graph_cls = torch.cuda.CUDAGraph
    rooms_for, capture, begin, end = cls.rooms_for, cls._capture, graph_cls.capture_begin, graph_cls.capture_end

    def timed(name, fn, *a, **k):
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = fn(*a, **k)
        torch.cuda.synchronize()
        parts[name].append((time.perf_counter() - t) * 1e3)
        return out

    def capture_begin(graph, *a, **k):  # from here to the capture's end: the capture (host time, the GPU idle)
        torch.cuda.synchronize()
        parts["capture_ms"].append(-time.perf_counter() * 1e3)
        return begin(graph, *a, **k)

    def capture_end(graph, *a, **k):
        out = end(graph, *a, **k)
        parts["capture_ms"][-1] += time.perf_counter() * 1e3
        return out

    cls.rooms_for = staticmethod(lambda step: timed("rooms_ms", rooms_for, step))
    cls._capture = lambda self, *a: timed("warm_up_and_capture_ms", capture, self, *a)
    graph_cls.capture_begin, graph_cls.capture_end = capture_begin, capture_end
    try:
        clock = StepClock()
        generate(model, ids, tokens, clock)
    finally:
        cls.rooms_for, cls._capture = staticmethod(rooms_for), capture
        graph_cls.capture_begin, graph_cls.capture_end = begin, end
    return {name: values[0] if values else None for name, values in parts.items()} | {"gaps_ms": clock.gaps_ms()[:4]}


def generate(model, ids, tokens: int, clock: StepClock | None = None, extra=()) -> None:
    processors = transformers.LogitsProcessorList(([clock] if clock else []) + list(extra))
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, min_new_tokens=tokens,
                   logits_processor=processors)


def replay_alone(graphs: object, n: int = 20) -> dict | None:
    """The last captured decode step replayed on its own (its inputs as the last step left them: each replay writes
    the same slot again): ms per replay ``n`` back to back (the graph's own time, gaps between its kernels included)
    and each followed by a synchronisation (plus the launch's host time). A token's wall time less the first is
    host time with the GPU idle and ``generate``'s own kernels."""
    captured = getattr(graphs, "captured", None)
    if captured is None:
        return None
    graph = captured.graph
    graph.replay()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        graph.replay()
    torch.cuda.synchronize()
    back_to_back = (time.perf_counter() - start) * 1e3 / n
    times = []
    for _ in range(n):
        start = time.perf_counter()
        graph.replay()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return {"back_to_back_ms": back_to_back, "synchronised_ms": statistics.median(times), "replays": n}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--long", action="store_true", help="bench long's shape of the model (e.g. LLaMA-3.1-8B)")
    parser.add_argument("--layers", type=int, default=32, help="with --long: its layers")
    parser.add_argument("--smoke", action="store_true", help="a tiny model on the CPU (checks the probe itself)")
    args = parser.parse_args(argv)
    device = torch.device("cpu" if args.smoke else "cuda")
    if args.long:
        config = bench_long.make_config(args.model, args.layers, args.prompt, args.smoke)
    else:
        config = make_config(args.model, args.smoke, 8192)
    torch.manual_seed(0)
    with device:
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    torchembed.patch(model)
    ids = torch.randint(3, config.vocab_size - 16, (1, args.prompt), generator=torch.Generator().manual_seed(1)).to(device)
    record = {"model": args.model, "long": args.long, "layers": config.num_hidden_layers, "prompt": args.prompt,
              "tokens": args.tokens, "device": str(device),
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
        if device.type == "cuda":
            record["first_step_parts"] = first_step_parts(model, ids, args.tokens)
        graphs = getattr(model, "_torchembed_decode_graphs", None)
        record["graph_counters"] = {k: getattr(graphs, k, None) for k in ("captures", "replays")} if graphs else None
        profile = cProfile.Profile()
        profile.enable()
        generate(model, ids, args.tokens)
        profile.disable()
        if device.type == "cuda":
            torch.cuda.synchronize()
            prof = torch.profiler.profile()
            start = 4  # profiled from the logits of the 3rd decode step on: the replayed steps after it
            clock = StepClock()
            generate(model, ids, args.tokens, clock, [ProfileFrom(prof, start)])
            torch.cuda.synchronize()
            prof.stop()
            steps = args.tokens - start  # decode steps whose work lies wholly in the window (the last one's tail too)
            wall = (clock.times[-1] - clock.times[start - 1]) * 1e3 / steps
            events = prof.events()
            record["profiled_steps"] = steps
            record["profiled_wall_ms_per_token"] = wall
            record["gpu_busy_ms_per_token"] = _busy_us(events) / 1e3 / steps
            kinds = _kernels_by_kind(events)
            record["gpu_kinds_ms_per_token"] = {k: {"ms": v["ms"] / steps, "kernels": v["kernels"] / steps,
                                                    "longest": v["names"]} for k, v in kinds.items()}
            weights = sum(p.numel() * p.element_size() for p in model.parameters())
            record["weights_gb"] = weights / 1e9
            record["replay_alone"] = replay_alone(graphs)
    stats = pstats.Stats(profile)
    rows = []
    for (path, line, name), (_, calls, own, cumulative, _) in stats.stats.items():
        short = path.split("site-packages/")[-1].split("/main/")[-1]
        rows.append({"function": f"{short}:{line}({name})", "calls_per_token": calls / args.tokens,
                     "own_us_per_token": own / args.tokens * 1e6, "cumulative_us_per_token": cumulative / args.tokens * 1e6})
    record["profiled_ms_per_token"] = sum(r["own_us_per_token"] for r in rows) / 1e3
    record["by_cumulative"] = sorted(rows, key=lambda r: -r["cumulative_us_per_token"])[:args.top]
    record["by_own"] = sorted(rows, key=lambda r: -r["own_us_per_token"])[:args.top]
    print(f"wall {record['wall_ms_per_token']:.3f} ms per token; "
          f"under cProfile {record['profiled_ms_per_token']:.3f}; graphs {record['graph_counters']}")
    if "first_step_parts" in record:
        print(f"first step's parts, synchronised: {record['first_step_parts']}")
    if "gpu_busy_ms_per_token" in record:
        print(f"GPU busy {record['gpu_busy_ms_per_token']:.3f} ms per token of {record['profiled_wall_ms_per_token']:.3f} "
              f"wall (steps {record['profiled_steps']}); weights {record['weights_gb']:.2f} GB")
        for kind, v in sorted(record["gpu_kinds_ms_per_token"].items(), key=lambda kv: -kv[1]["ms"]):
            print(f"  {kind}: {v['ms']:.3f} ms, {v['kernels']:.1f} kernels per token; longest {list(v['longest'])[:2]}")
        if record.get("replay_alone"):
            alone = record["replay_alone"]
            print(f"the captured step replayed alone: {alone['back_to_back_ms']:.3f} ms back to back, "
                  f"{alone['synchronised_ms']:.3f} ms with a synchronisation after each")
    for title in ("by_cumulative", "by_own"):
        print(f"## {title} (us per token: cumulative / own; calls per token)")
        for r in record[title]:
            print(f"{r['cumulative_us_per_token']:9.1f} {r['own_us_per_token']:8.1f} {r['calls_per_token']:6.1f}  {r['function']}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"replayed-generate-profile-{args.model}{'-long' if args.long else ''}-{args.prompt}.json").write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
