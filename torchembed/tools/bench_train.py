"""``torchembed bench train``: one training step of ~1B-parameter models, upstream vs torchembed-patched.

Random-weight LLaMA- and Falcon-style configs (those of ``bench e2e``) in bf16 on CUDA, train mode.
Variants share initial weights: ``upstream`` and ``patched`` (``copy.deepcopy`` +
``torchembed.patch``); each has its own AdamW (fused on CUDA). One step = forward with labels
(mean next-token cross-entropy) + backward + ``optimizer.step()`` + ``zero_grad(set_to_none=True)``,
pure bf16 (parameters, gradients and AdamW states), optionally with HF gradient checkpointing
(``--grad-checkpointing``, non-reentrant). Per batch x sequence length, after two warm-up steps
per variant (the first allocates the AdamW states), steps are repeated in interleaved order
(A/B/A/B...) and reported as ms/step, median [min-max]; tokens/s = batch * seq * 1000 / median ms.

Peak memory: ``torch.cuda.max_memory_allocated`` during a step minus what was allocated before it
(weights and AdamW states excluded; activations, gradients and logits included), in GB.
``first_loss`` is the loss of each variant's first step (same weights, same tokens: the variants
should agree to bf16 rounding).
"""

from __future__ import annotations

import argparse
import copy
import sys
from typing import Any

import torch
from torch import nn

from torchembed.tools import bench
from torchembed.tools.options import Parser, count
from torchembed.tools.bench_e2e import make_config

MODELS = ("llama", "falcon")
VARIANTS = ("upstream", "patched")
WARMUP_STEPS = 2


def checkpointing_on(model: nn.Module) -> None:
    """HF gradient (activation) checkpointing of every decoder layer, non-reentrant."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x; the old name warns
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def build_variants(name: str, args: argparse.Namespace, device: torch.device) -> dict[str, nn.Module]:
    """Upstream and patched copies (same weights) in train mode, each with its own AdamW."""
    import torchembed

    config = make_config(name, args.smoke, max(args.seq_lens) + 8)
    config.use_cache = False
    upstream = bench.random_causal_lm(config, device, args.torch_dtype).train()
    if args.grad_checkpointing:
        checkpointing_on(upstream)
    models = {"upstream": upstream, "patched": torchembed.patch(copy.deepcopy(upstream))}
    for model in models.values():
        model._bench_optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda")
    return models


def train_step(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Forward + backward + AdamW step; returns the (detached) loss."""
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    model._bench_optimizer.step()
    model._bench_optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def run_case(name: str, models: dict[str, nn.Module], batch: int, seq: int, args: argparse.Namespace,
             device: torch.device) -> list[dict[str, Any]]:
    """Timed training steps of every variant for one (model, batch, sequence length)."""
    vocab = next(iter(models.values())).config.vocab_size
    generator = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(1, vocab, (batch, seq), generator=generator).to(device)
    print(f"train {name} batch {batch} seq {seq} ...", file=sys.stderr, flush=True)

    def warm(model: nn.Module) -> dict[str, Any]:
        first = train_step(model, ids).item()
        for _ in range(WARMUP_STEPS - 1):
            train_step(model, ids)
        return {"first_loss": first}

    res = bench.measure(models, lambda m: bench.wall(lambda: train_step(m, ids), device), args.repeats, device, warm=warm)
    records = []
    for variant, r in res.items():
        rec = {"model": name, "batch": batch, "seq_len": seq, "grad_checkpointing": args.grad_checkpointing,
               "variant": variant, **r}
        if isinstance(r.get("ms"), dict):
            rec["tokens_per_s"] = batch * seq * 1e3 / r["ms"]["median"]
        records.append(rec)
    return records


def markdown(records: list[dict[str, Any]], skipped: dict[str, str], params_b: dict[str, float],
             grad_checkpointing: bool) -> str:
    keys = list(dict.fromkeys((r["model"], r["batch"], r["seq_len"]) for r in records))
    headers = ["model", "batch x seq", *VARIANTS, "upstream / patched", "tokens/s (u/p)", "peak GB (u/p)",
               "first loss (u/p)"]
    rows = []
    for model, batch, seq in keys:
        by = {r["variant"]: r for r in records if (r["model"], r["batch"], r["seq_len"]) == (model, batch, seq)}
        ms = {v: by.get(v, {}).get("ms") for v in VARIANTS}
        med = {v: m["median"] for v, m in ms.items() if isinstance(m, dict)}
        speed = f"{med['upstream'] / med['patched']:.2f}x" if len(med) == 2 else "-"
        size = f"{params_b[model]:.2f}B" if params_b[model] >= 0.01 else f"{params_b[model] * 1e3:.2f}M"
        rows.append([f"{model} ({size})", f"{batch} x {seq}", *(bench.fmt_stats(ms[v]) for v in VARIANTS),
                     speed, " / ".join(bench.fmt(by.get(v, {}).get("tokens_per_s"), 0) for v in VARIANTS),
                     " / ".join(bench.fmt(by.get(v, {}).get("peak_mem_gb"), 2) for v in VARIANTS),
                     " / ".join(bench.fmt(by.get(v, {}).get("first_loss"), 4) for v in VARIANTS)])
    title = "training step (ms/step: forward + backward + AdamW" + (", gradient checkpointing)" if grad_checkpointing
                                                                     else ")")
    out = [f"## {title}", "", bench.md_table(headers, rows), ""]
    out += ["median [min-max] over interleaved repeats; peak GB = max allocated during a step minus weights and "
            "AdamW states"]
    out += [f"- {k}: skipped ({v})" for k, v in skipped.items()]
    return "\n".join(out)


def main(argv: list[str]) -> int:
    parser = Parser(prog="torchembed bench train", description=__doc__.split("\n\n")[0].replace("``", ""))
    bench.add_common_args(parser)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--batch-sizes", nargs="+", type=count(1), default=None, help="default 4 (--smoke: 2)")
    parser.add_argument("--seq-lens", nargs="+", type=count(2), default=None, help="default 2048 (--smoke: 16)")
    parser.add_argument("--grad-checkpointing", action="store_true", help="HF gradient checkpointing (non-reentrant)")
    parser.add_argument("--repeats", type=count(1), default=None, help="interleaved repeats (default 5; --smoke: 2)")
    args = parser.parse_args(argv)
    device = bench.setup(args)
    smoke = args.smoke
    args.batch_sizes = args.batch_sizes or ([2] if smoke else [4])
    args.seq_lens = args.seq_lens or ([16] if smoke else [2048])
    args.repeats = args.repeats or (2 if smoke else 5)
    if smoke and args.dtype == "bfloat16":
        args.torch_dtype = torch.float32  # CPU smoke: float32 (bf16 matmuls are slow on many CPUs)
    name = "-".join(["train", *(args.models if args.models != list(MODELS) else []),
                     *(["gc"] if args.grad_checkpointing else [])])
    env, skipped, records, params_b = bench.environment(device), {}, [], {}
    budget = bench.Budget(args.max_seconds)

    def save(quiet: bool) -> str:
        md = markdown(records, skipped, params_b, args.grad_checkpointing)
        payload = {"variants": list(VARIANTS), "params_b": params_b, "skipped": skipped, "results": records}
        bench.write_results(args, name, "torchembed bench train", env, payload, md, quiet=quiet)
        return md

    with bench.no_interpreter(device):
        for model_name in args.models:
            if budget.exhausted():
                skipped[model_name] = "time budget (--max-seconds)"
                continue
            models = build_variants(model_name, args, device)
            params_b[model_name] = sum(p.numel() for p in models["upstream"].parameters()) / 1e9
            for batch in args.batch_sizes:
                for seq in args.seq_lens:
                    if budget.exhausted():
                        skipped[f"{model_name} {batch} x {seq}"] = "time budget (--max-seconds)"
                        continue
                    records += run_case(model_name, models, batch, seq, args, device)
                    save(quiet=True)  # partial results survive an interrupted run
            del models
            bench.free_memory(device)
    print(save(quiet=False))
    return 0
