"""Batched generate() with left-padded prompts, upstream against patched (GPU): ms per new token.

LLaMA-3.1-8B shape (``--layers`` layers, bf16, random weights), batch 4, prompts of S, S-1000, S-2000 and
S-3000 tokens left-padded to S (the attention mask a user passes), greedy; ms/token = (generate(N) -
generate(1)) / (N - 1) after a warm-up, the two variants alternating. Also checks that both variants pick
the same tokens.

    python benchmarks/probes/padded_generate.py [--contexts 4096 16384] [--layers 8] [--new-tokens 16] [--out FILE]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time

import torch


def main(argv: list[str]) -> int:
    import transformers

    import torchembed
    from torchembed.tools.bench_long import make_config

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    config = make_config("llama", args.layers, max(args.contexts), smoke=False)
    torch.manual_seed(0)
    with torch.device("cuda"):
        upstream = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    patched = torchembed.patch(copy.deepcopy(upstream))
    rows = []
    for context in args.contexts:
        ids = torch.randint(3, config.vocab_size - 16, (4, context), generator=torch.Generator().manual_seed(context)).cuda()
        mask = torch.ones_like(ids)
        for b in range(4):
            mask[b, : 1000 * b] = 0
        kwargs = dict(attention_mask=mask, do_sample=False, pad_token_id=0, use_cache=True)

        def total(model, n):
            torch.cuda.synchronize()
            start = time.perf_counter()
            with torch.no_grad():
                out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kwargs)
            torch.cuda.synchronize()
            return time.perf_counter() - start, out

        models = {"upstream": upstream, "patched": patched}
        tokens = {name: total(model, args.new_tokens)[1] for name, model in models.items()}  # warm-up
        per_token = {name: [] for name in models}
        for i in range(args.repeats):
            for name in (list(models) if i % 2 == 0 else list(models)[::-1]):
                one = total(models[name], 1)[0]
                many = total(models[name], args.new_tokens)[0]
                per_token[name].append((many - one) / (args.new_tokens - 1) * 1e3)
        row = {"context": context, "lengths": [context - 1000 * b for b in range(4)], "layers": args.layers,
               "upstream_ms": statistics.median(per_token["upstream"]), "patched_ms": statistics.median(per_token["patched"]),
               "runs": per_token, "same_tokens": bool(torch.equal(tokens["upstream"], tokens["patched"]))}
        row["upstream_over_patched"] = row["upstream_ms"] / row["patched_ms"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    info = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "transformers": transformers.__version__}
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"env": info, "results": rows}, f, indent=1)
    print("| S | upstream ms/token | patched ms/token | upstream / patched | same tokens |")
    print("|---|---:|---:|---:|---|")
    for r in rows:
        print(f"| {r['context']} | {r['upstream_ms']:.2f} | {r['patched_ms']:.2f} | {r['upstream_over_patched']:.2f} | {r['same_tokens']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
