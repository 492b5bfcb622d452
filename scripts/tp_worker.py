"""One rank of a tensor-parallel run: ``from_pretrained(path, tp_plan="auto")``, patched.

Started by ``scripts/multi_gpu.py --parts tp`` under ``torch.distributed.run`` (one process per
GPU; ``--cpu``: gloo processes on the CPU, float32). Every rank runs the same steps; rank 0 writes
``--out`` (``.pt``: logits of upstream, patched and unpatched on the batch given in ``--inputs``;
``.json``: the checks and greedy-generation timings, upstream and patched in turns on the same
model).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

from torchembed.patches.loading import load_upstream
from torchembed.tools.launch import hide_gpus


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--inputs", type=Path, required=True, help="a torch.save'd dict of forward inputs")
    parser.add_argument("--out", type=Path, required=True, help="rank 0 writes OUT.pt and OUT.json")
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    if args.cpu:
        hide_gpus()

    import transformers

    import torchembed
    from torchembed.tools import bench

    transformers.logging.set_verbosity_error()
    dtype = torch.float32 if args.cpu else torch.bfloat16
    if not args.cpu:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    model = load_upstream(transformers.AutoModelForCausalLM, args.checkpoint, tp_plan="auto", dtype=dtype).eval()
    device = next(model.parameters()).device
    rank, world = dist.get_rank(), dist.get_world_size()
    inputs = {k: v.to(device) for k, v in torch.load(args.inputs).items()}

    @torch.no_grad()
    def logits() -> torch.Tensor:
        return model(**inputs).logits.float().cpu()

    upstream = logits()
    torchembed.patch(model)
    patched = logits()
    components = len(torchembed.find_positional_components(model))
    sharded = type(model.model.layers[0].self_attn.q_proj.weight).__name__
    torchembed.unpatch(model)
    restored = logits()

    generate = []
    for batch in (1, 8):
        ids = torch.randint(1, model.config.vocab_size, (batch, args.prompt), generator=torch.Generator().manual_seed(batch))
        ids = ids.to(device)
        runs: dict[str, list] = {"upstream": [], "patched": []}
        for repeat in range(args.repeats + 1):  # the first round warms up
            for variant in runs:
                if variant == "patched":
                    torchembed.patch(model)
                out = bench.generate_timed(model, ids, args.new_tokens)
                torchembed.unpatch(model)
                if repeat:
                    runs[variant].append(out)
        row = {"batch": batch, "prompt": args.prompt, "new_tokens": args.new_tokens}
        for variant, timings in runs.items():
            per_token = bench.stats([t["per_token"] for t in timings])
            row[variant] = {"prefill_ms": bench.stats([t["prefill"] for t in timings]), "per_token_ms": per_token}
        row["decode_speedup"] = row["upstream"]["per_token_ms"]["median"] / row["patched"]["per_token_ms"]["median"]
        generate.append(row)
    # the greedy tokens of a patched and an upstream generation agree on this model too
    ids = inputs["input_ids"][:1]
    with torch.no_grad():
        tokens_up = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
        torchembed.patch(model)
        tokens_pt = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
        torchembed.unpatch(model)
    if rank == 0:
        torch.save({"upstream": upstream, "patched": patched, "restored": restored}, args.out.with_suffix(".pt"))
        record = {"world_size": world, "weights": sharded, "components_patched": components,
                  "unpatch_bit_exact": torch.equal(restored, upstream),
                  "generated_tokens_equal": torch.equal(tokens_up.cpu(), tokens_pt.cpu()), "generate": generate}
        args.out.with_suffix(".json").write_text(json.dumps(record))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
