"""``torchembed bench alibi``: ALiBi models (BLOOM-, MPT-, Falcon-style), upstream vs torchembed-patched.

Random-weight configs (hidden 1024, 8 layers, 16 heads, vocabulary 32000; Falcon in falcon-rw-1b's
layout: ``alibi=True``, multi-head, sequential attention and MLP, biases) in bf16 on CUDA (``--device cpu``:
on the CPU); the patched variant is ``copy.deepcopy`` + ``torchembed.patch`` (same weights). Upstream BLOOM and MPT
run their eager attention (the only one they have); upstream Falcon runs
``attn_implementation="sdpa"``, the function the patched model computes (Falcon's eager path adds
the bias twice), with the bias folded into a ``(b, h, q, k)`` mask. ``--variants ... patched-kernel``
adds the patched model with the fused kernel for every CUDA prefill (also where the materialised
bias is taken by default), ``patched-dense`` with the materialised bias for every one, to compare
the paths. ``--kernel``: one attention layer instead (:mod:`torchembed.tools.bench_alibi_kernel`).
Measured, with the variants interleaved over ``--repeats`` after one warm-up each (median [min-max]):

* prefill latency (ms) of one forward (no KV cache, last logits only) and its peak memory above
  what was allocated before it (weights excluded, GB), per batch size and sequence length.
  ``torch.cuda.OutOfMemoryError`` is recorded as "OOM" (longer lengths are then skipped for that
  variant); a variant whose median exceeded ``--slow-ms`` (2 s) at one length is skipped at the
  longer ones ("skipped: too slow").
* decode (ms/token) of eager greedy ``generate`` after a ``--decode-context`` (2048) token prompt.
"""

from __future__ import annotations

import argparse
import copy
import inspect
import sys
from typing import Any

import torch
from torch import nn

from torchembed.tools import bench
from torchembed.tools.options import Parser, count, seconds

MODELS = ("bloom", "mpt", "falcon")
# "patched-kernel": the patched model with the fused kernel for every CUDA prefill; "patched-dense":
# with the materialised bias for every CUDA prefill
VARIANTS = ("upstream", "patched", "patched-kernel", "patched-dense")


def make_config(name: str, smoke: bool, max_len: int) -> Any:
    import transformers

    hidden, layers, heads, vocab = (64, 2, 4, 128) if smoke else (1024, 8, 16, 32000)
    if name == "bloom":
        return transformers.BloomConfig(hidden_size=hidden, n_layer=layers, n_head=heads, vocab_size=vocab)
    if name == "mpt":
        return transformers.MptConfig(d_model=hidden, n_layers=layers, n_heads=heads, expansion_ratio=4, vocab_size=vocab,
                                      max_seq_len=max_len, attn_config={"alibi": True}, use_cache=True)
    if name == "falcon":
        return transformers.FalconConfig(
            hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, vocab_size=vocab, alibi=True,
            parallel_attn=False, new_decoder_architecture=False, multi_query=False, bias=True,
            attn_implementation="sdpa",
        )
    raise ValueError(f"unknown model {name!r}; choose from {MODELS}")


def build_variants(name: str, args: argparse.Namespace, device: torch.device) -> dict[str, nn.Module]:
    import torchembed

    max_len = max(args.seq_lens + [args.decode_context + args.new_tokens]) + 8
    config = make_config(name, args.smoke, max_len)
    upstream = bench.random_causal_lm(config, device, args.torch_dtype)
    asked = config._attn_implementation  # Falcon: sdpa; BLOOM, MPT: None (their eager)
    if asked and upstream.config._attn_implementation != asked:
        raise RuntimeError(f"{name}: upstream runs {upstream.config._attn_implementation!r} attention, not {asked!r}")
    patched = torchembed.patch(copy.deepcopy(upstream)) if set(args.variants) - {"upstream"} else None
    models = {"upstream": upstream, "patched": patched, "patched-kernel": PrefillPath(patched, "kernel"),
              "patched-dense": PrefillPath(patched, "dense")}
    return {v: models[v] for v in args.variants}


class PrefillPath:
    """A patched model whose calls (forward, ``generate``) run under
    :func:`torchembed.kernels.alibi.prefill_path` ``(path)``."""

    def __init__(self, model: nn.Module | None, path: str) -> None:
        self.model, self.path = model, path
        self.config = getattr(model, "config", None)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._under_path(self.model, *args, **kwargs)

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        return self._under_path(self.model.generate, *args, **kwargs)

    def _under_path(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        from torchembed.kernels.alibi import prefill_path

        with prefill_path(self.path):
            return fn(*args, **kwargs)


def prefill_records(name: str, models: dict[str, nn.Module], args: argparse.Namespace, device: torch.device,
                    budget: bench.Budget) -> list[dict[str, Any]]:
    """Prefill latency and peak memory over batch sizes x sequence lengths (OOM / too slow: skipped after)."""
    model0 = next(iter(models.values()))
    forward = getattr(model0, "model", model0).forward  # PrefillPath wraps the patched model
    kw = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(forward).parameters else {}
    records = []
    for batch in args.batch_sizes:
        stopped: dict[str, str] = {}
        for length in sorted(args.seq_lens):
            base = {"model": name, "phase": "prefill", "batch": batch, "seq_len": length}
            if budget.exhausted():
                stopped = {v: "skipped: time budget" for v in models}
            records += [{**base, "variant": v, "ms": why} for v, why in stopped.items()]
            active = {v: m for v, m in models.items() if v not in stopped}
            if not active:
                continue
            print(f"alibi {name} prefill batch {batch} length {length} ...", file=sys.stderr, flush=True)
            ids = torch.randint(1, model0.config.vocab_size, (batch, length), device=device)

            def run(m: nn.Module) -> float:
                with torch.no_grad():
                    return bench.wall(lambda: m(input_ids=ids, use_cache=False, **kw), device)

            for variant, r in bench.measure(active, run, args.repeats, device).items():
                records.append({**base, "variant": variant, **r})
                ms = r["ms"]
                if isinstance(ms, str):
                    stopped[variant] = f"skipped: {ms} at {length}"
                elif ms["median"] > args.slow_ms:
                    stopped[variant] = f"skipped: too slow ({ms['median'] / 1e3:.1f} s at {length})"
            bench.free_memory(device)
    return records


def decode_records(name: str, models: dict[str, nn.Module], args: argparse.Namespace, device: torch.device,
                   budget: bench.Budget) -> list[dict[str, Any]]:
    """Eager decode ms/token after a ``decode_context``-token prompt, per batch size."""
    records = []
    for batch in args.batch_sizes:
        base = {"model": name, "phase": "decode", "batch": batch, "seq_len": args.decode_context,
                "new_tokens": args.new_tokens}
        if budget.exhausted():
            records += [{**base, "variant": v, "ms": "skipped: time budget"} for v in models]
            continue
        print(f"alibi {name} decode batch {batch} ...", file=sys.stderr, flush=True)
        ids = torch.randint(1, next(iter(models.values())).config.vocab_size, (batch, args.decode_context), device=device)
        def run(m: nn.Module) -> float:
            return bench.generate_timed(m, ids, args.new_tokens, disable_compile=True)["per_token"]

        res = bench.measure(models, run, args.repeats, device)
        for variant, r in res.items():
            rec = {**base, "variant": variant, **r}
            if isinstance(r["ms"], dict):
                rec["tokens_per_s"] = batch * 1e3 / r["ms"]["median"]
            records.append(rec)
    return records


def markdown(records: list[dict[str, Any]], variants: list[str]) -> str:
    out = []
    ours = [v for v in variants if v != "upstream"] if "upstream" in variants else []
    for phase, title in (("prefill", "prefill latency (ms)"), ("decode", "eager decode (ms/token)")):
        rows_of = [r for r in records if r["phase"] == phase]
        if not rows_of:
            continue
        keys = list(dict.fromkeys((r["model"], r["batch"], r["seq_len"]) for r in rows_of))
        rows = []
        for key in keys:
            by = {r["variant"]: r for r in rows_of if (r["model"], r["batch"], r["seq_len"]) == key}
            med = {v: by[v]["ms"]["median"] for v in variants if isinstance(by.get(v, {}).get("ms"), dict)}
            speeds = [f"{med['upstream'] / med[v]:.2f}x" if "upstream" in med and v in med else "-" for v in ours]
            cells = [bench.fmt_stats(by.get(v, {}).get("ms")) for v in variants]
            peaks = " / ".join(bench.fmt(by.get(v, {}).get("peak_mem_gb"), 2) for v in variants)
            rows.append([key[0], f"{key[1]} x {key[2]}", *cells, *speeds, peaks])
        ctx = "context" if phase == "decode" else "length"
        peak = "peak GB above weights (" + " / ".join(variants) + ")"
        headers = ["model", f"batch x {ctx}", *variants, *(f"upstream / {v}" for v in ours), peak]
        out += [f"## {title}", "", bench.md_table(headers, rows), ""]
    out.append("median [min-max] over interleaved repeats")
    if any(r["model"] == "bloom" for r in records):
        out += ["", "BLOOM's remaining time in the patched model is largely its own Python tanh-GELU (a chain of "
                "elementwise ops), not a positional component: torchembed leaves it as it is."]
    if any(r["model"] == "falcon" for r in records):
        out += ["", "upstream attention: Falcon `sdpa` (the function the patched model computes; its eager path adds"
                " the bias twice), BLOOM and MPT eager (their only one)"]
    return "\n".join(out)


def main(argv: list[str]) -> int:
    if "--kernel" in argv:  # one attention layer against its alternatives (bench_alibi_kernel)
        from torchembed.tools import bench_alibi_kernel

        parser = Parser(prog="torchembed bench alibi --kernel",
                                         description=bench_alibi_kernel.__doc__.split("\n\n")[0].replace("``", ""))
        bench.add_common_args(parser)
        parser.add_argument("--kernel", action="store_true", help="the kernel-level table (this one)")
        bench_alibi_kernel.add_args(parser)
        return bench_alibi_kernel.run(parser.parse_args(argv))
    parser = Parser(prog="torchembed bench alibi", description=__doc__.split("\n\n")[0].replace("``", ""))
    bench.add_common_args(parser)
    parser.add_argument("--kernel", action="store_true",
                        help="instead: one ALiBi attention layer, torchembed vs SDPA without bias, FlexAttention, "
                        "SDPA with the bias, flash-attn (torchembed bench alibi --kernel --help)")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--variants", nargs="+", default=["upstream", "patched"], choices=VARIANTS,
                        help="default: upstream patched; patched-kernel: the fused kernel for every prefill, "
                        "patched-dense: the materialised bias for every prefill (compare the paths)")
    parser.add_argument("--phases", nargs="+", default=["prefill", "decode"], choices=["prefill", "decode"])
    parser.add_argument("--batch-sizes", nargs="+", type=count(1), default=None, help="default 1 4 (--smoke: 1 2)")
    parser.add_argument("--seq-lens", nargs="+", type=count(1), default=None,
                        help="prefill lengths (default 1024 2048 4096 8192 16384; --smoke: 16 32)")
    parser.add_argument("--decode-context", type=count(1), default=None,
                        help="prompt length before decoding (default 2048; --smoke: 16)")
    parser.add_argument("--new-tokens", type=count(2), default=None, help="decode steps, >= 2 (default 64; --smoke: 4)")
    parser.add_argument("--repeats", type=count(1), default=None, help="interleaved repeats (default 3; --smoke: 2)")
    parser.add_argument("--slow-ms", type=seconds, default=2000.0, help="skip longer lengths after a median above this (ms)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cpu: full-size runs on the CPU (pass --dtype float32 where bf16 matmuls are slow)")
    parser.add_argument("--threads", type=count(1), default=None,
                        help="with --device cpu: CPU intra-op threads (default: torch's)")
    args = parser.parse_args(argv)
    if args.threads is not None and args.device != "cpu":
        parser.error("--threads is for --device cpu")
    device = bench.setup(args, args.device)
    if args.threads is not None:
        torch.set_num_threads(args.threads)  # (this benchmark's own process)
    smoke = args.smoke
    args.batch_sizes = args.batch_sizes or ([1, 2] if smoke else [1, 4])
    args.seq_lens = args.seq_lens or ([16, 32] if smoke else [1024, 2048, 4096, 8192, 16384])
    args.decode_context = args.decode_context or (16 if smoke else 2048)
    args.new_tokens = args.new_tokens or (4 if smoke else 64)
    args.repeats = args.repeats or (2 if smoke else 3)
    if smoke and args.dtype == "bfloat16":
        args.torch_dtype = torch.float32  # CPU smoke: float32
    name = "-".join(["alibi", *(["cpu"] if device.type == "cpu" and not smoke else []),
                     *(args.models if args.models != list(MODELS) else []),
                     *(args.phases if len(args.phases) == 1 else [])])
    env, records = bench.environment(device), []
    if device.type == "cpu" and not smoke:
        env["threads"] = torch.get_num_threads()
    budget = bench.Budget(args.max_seconds)
    variants = list(args.variants)

    def save(quiet: bool) -> str:
        md = markdown(records, variants)
        bench.write_results(args, name, "torchembed bench alibi", env, {"variants": variants, "results": records}, md,
                            quiet=quiet)
        return md

    with bench.no_interpreter(device):
        for model_name in args.models:
            models = build_variants(model_name, args, device)
            if "prefill" in args.phases:
                records += prefill_records(model_name, models, args, device, budget)
                save(quiet=True)  # partial results survive an interrupted run
            if "decode" in args.phases:
                records += decode_records(model_name, models, args, device, budget)
                save(quiet=True)
            del models
            bench.free_memory(device)
    print(save(quiet=False))
    return 0
