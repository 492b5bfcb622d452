"""transformers' continuous batching (``generate_batch``: a paged cache, requests of different lengths scheduled
together), upstream against patched on one GPU: the greedy tokens in float32 (equal, request by request) and the
throughput in bf16 (new tokens per second, the medians of interleaved runs).

~1B LLaMA shape (torchembed bench e2e's), random weights; ``--requests`` prompts of 64-1024 tokens, ``--new`` new
tokens each, a paged cache of ``--blocks`` blocks.

    python benchmarks/probes/generate_batch_throughput.py --out DIR [--requests 64] [--new 128] [--repeats 3]
"""

from __future__ import annotations

import argparse
import copy
import datetime
import inspect
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers

import torchembed
from torchembed.tools.bench_e2e import make_config


def batch_settings(new: int, blocks: int, max_batch_tokens: int) -> tuple[transformers.GenerationConfig, dict]:
    """The generation config and ``generate_batch``'s extra keywords, as this release takes the paged cache's size."""
    limits, extra = dict(num_blocks=blocks, max_batch_tokens=max_batch_tokens), {}
    if "continuous_batching_config" in inspect.signature(transformers.LlamaForCausalLM.generate_batch).parameters:
        extra["continuous_batching_config"] = transformers.ContinuousBatchingConfig(**limits)
        limits = {}
    config = transformers.GenerationConfig(max_new_tokens=new, min_new_tokens=new, do_sample=False, eos_token_id=-1,
                                           pad_token_id=0, **limits)
    return config, extra


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run(model, requests, settings, extra) -> tuple[list[list[int]], float]:
    _sync()
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate_batch(inputs=requests, generation_config=settings, **extra)
    _sync()
    seconds = time.perf_counter() - start
    return [out[key].generated_tokens for key in sorted(out)], seconds


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--blocks", type=int, default=1024)
    parser.add_argument("--max-batch-tokens", type=int, default=2048)
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--smoke", action="store_true", help="a tiny model on the CPU (checks the probe itself)")
    args = parser.parse_args(argv)
    device = "cpu" if args.smoke else "cuda"
    config = make_config("llama", args.smoke, 4096)
    config._attn_implementation = "sdpa"
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(64, 65 if args.smoke else 1025, (args.requests,), generator=gen).tolist()
    requests = [torch.randint(3, config.vocab_size - 16, (n,), generator=gen).tolist() for n in lengths]
    settings, extra = batch_settings(args.new, args.blocks, args.max_batch_tokens)
    record = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              "gpu": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__, "transformers": transformers.__version__,
              "requests": args.requests, "prompt_tokens": sum(lengths), "new_tokens_each": args.new,
              "blocks": args.blocks, "max_batch_tokens": args.max_batch_tokens}

    torch.manual_seed(0)
    with torch.device(device):
        upstream = transformers.LlamaForCausalLM(config).eval()  # float32 first: the tokens
    patched = torchembed.patch(copy.deepcopy(upstream))
    few = requests[:8]
    want, _ = run(upstream, few, *batch_settings(32, args.blocks, args.max_batch_tokens))
    got, _ = run(patched, few, *batch_settings(32, args.blocks, args.max_batch_tokens))
    record["float32_requests"], record["float32_equal"] = len(few), got == want
    record["float32_tokens_differing"] = sum(a != b for w, g in zip(want, got) for a, b in zip(w, g))
    print(f"float32 tokens equal: {got == want} ({len(want)} requests, {sum(map(len, want))} tokens)", flush=True)

    upstream, patched = upstream.to(torch.bfloat16), patched.to(torch.bfloat16)
    times: dict[str, list[float]] = {"upstream": [], "patched": []}
    run(upstream, requests[:8], settings, extra)  # warm-up, each
    run(patched, requests[:8], settings, extra)
    for _ in range(args.repeats):
        for name, model in (("upstream", upstream), ("patched", patched)):
            tokens, seconds = run(model, requests, settings, extra)
            times[name].append(seconds)
            print(f"{name}: {sum(map(len, tokens))} new tokens in {seconds:.2f} s", flush=True)
    for name in times:
        record[f"{name}_seconds"] = times[name]
        record[f"{name}_tokens_per_s"] = args.requests * args.new / statistics.median(times[name])
    record["patched_over_upstream"] = record["patched_tokens_per_s"] / record["upstream_tokens_per_s"]
    print(f"| generate_batch | {args.requests} requests x {args.new} new | upstream {record['upstream_tokens_per_s']:.0f} "
          f"tok/s | patched {record['patched_tokens_per_s']:.0f} tok/s | {record['patched_over_upstream']:.2f}x |")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "generate-batch.json").write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
