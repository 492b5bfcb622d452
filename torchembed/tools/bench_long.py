"""``torchembed bench long``: long context on one GPU, patched against upstream.

For the shapes of MPT-7B-StoryWriter, BLOOM-7B1, Falcon-RW-7B (ALiBi), LLaMA-3.1-8B (llama3 RoPE scaling)
and Qwen3-8B (random weights, ``--layers`` of their layers, bf16, batch 1), at each ``--contexts``
length: a prefill of that many tokens through the base model (no LM head), then ``--steps`` decode steps
on its cache in a plain loop (``model(next, past_key_values=cache)``, synchronised each step; the median
of the steps after the first two). Each cell: ms, tokens/s, peak memory (GB, weights included) and its
floor: prefill FLOPs at the GPU's measured bf16 matmul rate, decode bytes (weights + KV cache) at its
measured copy bandwidth. An out-of-memory is recorded as ``OOM``. The prefill is timed once after a
warm-up prefill of 4,096 tokens (past the small-prefill bound: the kernels compile there).

    torchembed bench long [--models mpt llama] [--contexts 16384 65536] [--layers 4] [--steps 8] [--generate N] [--compiled N]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from typing import Any

import torch
from torch import nn

from torchembed.tools import bench
from torchembed.tools.bench_e2e import decode_floor_ms, kv_cache_bytes
from torchembed.tools.options import count

MODELS = ("mpt", "bloom", "falcon", "llama", "qwen3")
VARIANTS = ("upstream", "patched")


def make_config(name: str, layers: int, context: int, smoke: bool) -> Any:
    """The model's shape with ``layers`` layers (the smoke shapes are tiny)."""
    import transformers

    hidden, heads, ffn = (64, 4, 128) if smoke else (4096, 32, 14336)
    if name == "mpt":
        return transformers.MptConfig(d_model=hidden, n_heads=heads, n_layers=layers, expansion_ratio=4,
                                      vocab_size=512 if smoke else 50432, max_seq_len=context + 64,
                                      attn_config={"alibi": True, "alibi_bias_max": 8})
    if name == "bloom":
        return transformers.BloomConfig(hidden_size=hidden, n_head=heads, n_layer=layers,
                                        vocab_size=512 if smoke else 250880)
    if name == "falcon":
        return transformers.FalconConfig(hidden_size=hidden, num_attention_heads=heads * (1 if smoke else 2),
                                         num_hidden_layers=layers, vocab_size=512 if smoke else 65024, alibi=True,
                                         multi_query=False, new_decoder_architecture=False, parallel_attn=False,
                                         bias=True, attn_implementation="sdpa")
    if name == "llama":
        return transformers.LlamaConfig(hidden_size=hidden, intermediate_size=ffn, num_attention_heads=heads,
                                        num_key_value_heads=heads // 4, num_hidden_layers=layers,
                                        vocab_size=512 if smoke else 128256, max_position_embeddings=131072,
                                        rope_theta=500000.0, attn_implementation="sdpa",
                                        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    if name == "qwen3":
        return transformers.Qwen3Config(hidden_size=hidden, intermediate_size=128 if smoke else 12288,
                                        num_attention_heads=heads, num_key_value_heads=heads // 4,
                                        head_dim=hidden // heads, num_hidden_layers=layers,
                                        vocab_size=512 if smoke else 151936, max_position_embeddings=131072,
                                        rope_theta=1000000.0, attn_implementation="sdpa")
    raise ValueError(f"unknown model {name!r}; choose from {MODELS}")


def prefill_flops(base: nn.Module, config: Any, context: int) -> float:
    """Matmul FLOPs of a causal prefill: 2 per weight per token in the layers, and the attention's
    ``q k^T`` and ``p v`` over the causal half (``2 * S^2 * hidden`` per layer)."""
    config = config.get_text_config()
    layer_weights = sum(p.numel() for name, p in base.named_parameters() if p.dim() == 2 and "emb" not in name and "wte" not in name)
    return 2.0 * layer_weights * context + 2.0 * config.num_hidden_layers * context**2 * config.hidden_size


def matmul_rate(device: torch.device, dtype: torch.dtype) -> float:
    """Measured FLOP/s of an 8192^3 matmul in ``dtype`` (CPU: 512^3)."""
    n = 8192 if device.type == "cuda" else 512
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    ms = bench.do_bench(lambda: a @ b, device)
    return 2.0 * n**3 / (ms * 1e-3)


def _decode_steps(base: nn.Module, cache: Any, vocab: int, steps: int, device: torch.device) -> list[float]:
    times = []
    nxt = torch.randint(3, vocab - 16, (1, 1), device=device)
    for _ in range(steps):
        bench.sync(device)
        start = time.perf_counter()
        out = base(input_ids=nxt, past_key_values=cache, use_cache=True)
        bench.sync(device)
        times.append((time.perf_counter() - start) * 1e3)
        cache = out.past_key_values
    return times


class StepClock:
    """A logits processor taking the host time at each step of ``generate`` (after the step's forward is issued;
    ``generate`` waits for each step's token before the next): the gaps between consecutive calls are the wall time
    of each decode step inside one call."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.times.append(time.perf_counter())
        return scores

    def gaps_ms(self) -> list[float]:
        return [(b - a) * 1e3 for a, b in zip(self.times, self.times[1:])]


def generate_ms(model: nn.Module, context: int, vocab: int, new_tokens: int, seed: int, device: torch.device,
                compiled: bool = False, repeats: int = 3) -> tuple[float, float | None]:
    """``generate``'s time per new token at ``context`` tokens of prompt: (generate(n) - generate(1)) / (n - 1),
    called plainly (``generate(ids, attention_mask=..., max_new_tokens=n)``: the model's generation config decides the
    cache; MPT's config turns it off upstream),
    the medians of ``repeats`` interleaved pairs (a long prompt's prefill varies by tens of ms between calls, which
    one pair divided by a few tokens would count as decode time), greedy, with the attention mask a user passes,
    after one warm-up call; and its steady time per token, the median gap between steps inside the ``generate(n)``
    calls after their first two (what a long generation pays per token, without the first step's wait for the
    prefill and, compiled, the recording of the CUDA graph each call). ``compiled``: HF's fast path, a static cache
    and ``torch.compile(fullgraph=True, mode="reduce-overhead")`` (CUDA graphs) of the decode step; the warm-up
    generates ``n`` tokens first, so the static cache keeps its size (no recompile)."""
    from transformers import LogitsProcessorList

    ids = torch.randint(3, vocab - 16, (1, context), generator=torch.Generator().manual_seed(seed)).to(device)
    kwargs: dict[str, Any] = {}  # plain generate, as the transformers docs show it (greedy by default)
    if compiled:
        from transformers import CompileConfig

        config = CompileConfig(fullgraph=True, mode="reduce-overhead")
        config._compile_all_devices = device.type != "cuda"  # (--smoke: compiled on the CPU too)
        kwargs.update(cache_implementation="static", compile_config=config, use_cache=True)
    times: dict[int, list[float]] = {1: [], new_tokens: []}
    gaps: list[float] = []
    with torch.no_grad():
        for i, n in enumerate([new_tokens if compiled else 2] + [1, new_tokens] * repeats):  # (the first: a warm-up)
            clock = StepClock()
            bench.sync(device)
            start = time.perf_counter()
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                           logits_processor=LogitsProcessorList([clock]), **kwargs)
            bench.sync(device)
            if i:
                times[n].append(time.perf_counter() - start)
                gaps += clock.gaps_ms()[2:]
    per_token = (statistics.median(times[new_tokens]) - statistics.median(times[1])) / (new_tokens - 1) * 1e3
    return per_token, statistics.median(gaps) if gaps else None  # (None: under 4 new tokens, no step after two)


def measure_cell(base: nn.Module, config: Any, context: int, args: argparse.Namespace,
                 device: torch.device, model: nn.Module | None = None) -> dict[str, Any]:
    """Prefill and decode of one (model, variant, context)."""
    vocab = config.get_text_config().vocab_size
    gen = torch.Generator().manual_seed(args.seed)
    record: dict[str, Any] = {}
    with torch.no_grad():
        warm = torch.randint(3, vocab - 16, (1, min(4096, context)), generator=gen).to(device)
        base(input_ids=warm, use_cache=True)
        del warm
        bench.free_memory(device)
        ids = torch.randint(3, vocab - 16, (1, context), generator=gen).to(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        try:
            bench.sync(device)
            start = time.perf_counter()
            out = base(input_ids=ids, use_cache=True)
            bench.sync(device)
            record["prefill_ms"] = (time.perf_counter() - start) * 1e3
            steps = _decode_steps(base, out.past_key_values, vocab, args.steps, device)
            record["decode_steps_ms"] = steps
            record["decode_ms"] = statistics.median(steps[2:] if len(steps) > 3 else steps)
            out = None
            if model is not None and args.generate:
                bench.free_memory(device)
                record["generate_ms"], record["generate_steady_ms"] = generate_ms(
                    model, context, vocab, args.generate, args.seed, device, repeats=1 if args.smoke else 3)
            if model is not None and args.compiled:
                bench.free_memory(device)
                record["compiled_ms"], record["compiled_steady_ms"] = generate_ms(
                    model, context, vocab, args.compiled, args.seed, device, compiled=True,
                    repeats=1 if args.smoke else 3)
        except Exception as exc:  # noqa: BLE001 - OOM (or another failure) is a result
            if not bench.is_oom(exc):
                raise
            record.setdefault("prefill_ms", "OOM")
            record.setdefault("decode_ms", "OOM")
            for name in ("generate", "compiled"):
                if getattr(args, name):
                    record.setdefault(f"{name}_ms", "OOM")
                    record.setdefault(f"{name}_steady_ms", "OOM")
        finally:
            out = ids = None
            if device.type == "cuda":
                record["peak_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
            gc.collect()
            bench.free_memory(device)
    return record


def run_model(name: str, args: argparse.Namespace, device: torch.device, bandwidth: float,
              rate: float, budget: bench.Budget) -> list[dict[str, Any]]:
    import transformers

    import torchembed

    contexts = sorted(args.contexts)
    config = make_config(name, args.layers, contexts[-1], args.smoke)
    torch.manual_seed(args.seed)
    with device:  # (weights made where they run: a 7B model's random init on the host takes minutes)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=args.torch_dtype).eval()
    base = model.base_model
    weights = sum(p.numel() * p.element_size() for p in base.parameters())
    dtype_bytes = next(base.parameters()).element_size()
    records = []
    for variant in args.variants:
        if variant == "patched":
            torchembed.patch(model)
        for context in contexts:
            rec = {"model": name, "variant": variant, "context": context, "layers": args.layers,
                   "weights_gb": weights / 2**30, "kv_gb": kv_cache_bytes(config, 1, context, dtype_bytes) / 2**30,
                   "prefill_floor_ms": prefill_flops(base, config, context) / rate * 1e3,
                   "decode_floor_ms": decode_floor_ms(base, 1, context, bandwidth)}
            if budget.exhausted():
                rec["skipped"] = "time budget"
            else:
                print(f"long {name} {variant} context {context:,} ...", file=sys.stderr, flush=True)
                rec.update(measure_cell(base, config, context, args, device, model))
            records.append(rec)
        if variant == "patched":
            torchembed.unpatch(model)
    del model, base
    bench.free_memory(device)
    return records


def _cell(value: Any, floor: float, per_token: float) -> str:
    if value is None:
        return "-"
    if not isinstance(value, float):
        return str(value)
    return f"{value:.1f} ({per_token / value * 1e3:,.0f} tok/s; {floor / value:.2f} of floor)"


def _row(rec: dict[str, Any], extra: list[str]) -> list[str]:
    if "skipped" in rec:
        return [rec["model"], rec["variant"], f"{rec['context']:,}", "skipped", "", "", *([""] * len(extra)), "", ""]
    return [rec["model"], rec["variant"], f"{rec['context']:,}",
            _cell(rec.get("prefill_ms"), rec["prefill_floor_ms"], rec["context"]),
            f"{rec['prefill_floor_ms']:.1f}",
            _cell(rec.get("decode_ms"), rec["decode_floor_ms"], 1),
            *(_cell(rec.get(f"{name}_ms"), rec["decode_floor_ms"], 1) for name in extra),
            f"{rec['decode_floor_ms']:.2f}",
            (f"{rec['peak_gb']:.1f}" if "peak_gb" in rec else "-") + f" / {rec['weights_gb'] + rec['kv_gb']:.1f}"]


def markdown(records: list[dict[str, Any]], args: argparse.Namespace, bandwidth: float, rate: float) -> str:
    extra = [name for kind in ("generate", "compiled") if getattr(args, kind) for name in (kind, f"{kind}_steady")]
    titles = {"generate": "plain generate ms/token", "generate_steady": "plain generate steady ms/token",
              "compiled": "compiled generate ms/token", "compiled_steady": "compiled steady ms/token"}
    head = ["model", "variant", "context", "prefill ms", "prefill floor", "decode ms/step",
            *(titles[name] for name in extra), "decode floor", "peak GB / weights + KV"]
    out = [bench.md_table(head, [_row(r, extra) for r in records]), "",
           f"{args.layers} layers of each shape, batch 1, {args.dtype}, random weights; base model (no LM head). "
           f"Prefill: one timed run after a 4,096-token warm-up; decode: the median of {args.steps} plain-loop steps "
           "(`model(next, past_key_values=cache)`, synchronised) after the first two"
           + ("; generate: plain `generate(ids, attention_mask=mask, max_new_tokens=N)` (no cache or compile flags: MPT's "
              "config turns the cache off upstream, a patched MPT keeps it), (generate(N) - generate(1)) / (N - 1), the medians of "
              f"{1 if args.smoke else 3} interleaved pairs; steady: the median gap between steps inside those "
              "generate(N) calls after their first two" if args.generate else "")
           + ("; compiled: the same with a static cache and torch.compile(fullgraph=True, mode=\"reduce-overhead\") "
              "(CUDA graphs), after a warm-up that compiles" if args.compiled else "")
           + ". Floors: prefill matmul FLOPs at "
           f"the measured matmul rate ({rate / 1e12:.0f} TFLOP/s), decode bytes (weights + KV cache) at the measured "
           f"copy bandwidth ({bandwidth / 1e9:.0f} GB/s); \"of floor\" = floor / measured (1.00 = at the floor)."]
    return "\n".join(out)


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", nargs="+", default=None, choices=MODELS, help="default: all")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--contexts", nargs="+", type=count(16), default=None,
                        help="prefill lengths, then the decode context (default 16384 32768 65536 131072; --smoke: 64 128)")
    parser.add_argument("--layers", type=count(1), default=4, help="layers of each shape (default 4; --smoke: 2)")
    parser.add_argument("--steps", type=count(3), default=8, help="decode steps per cell (default 8)")
    parser.add_argument("--generate", type=count(2), default=0, metavar="N",
                        help="also time generate() per new token, (generate(N) - generate(1)) / (N - 1), with its "
                             "attention mask, medians of 3 interleaved pairs (default: off; each costs seven more "
                             "prefills; a long prefill's variation counts divided by N - 1: take N of 64 or more "
                             "at 64k tokens)")
    parser.add_argument("--compiled", type=count(2), default=0, metavar="N",
                        help="also time HF's compiled static-cache generate() per new token the same way (default: off)")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="torchembed bench long", description=__doc__.splitlines()[0])
    bench.add_common_args(parser)
    add_args(parser)
    args = parser.parse_args(argv)
    device = bench.setup(args)
    if args.smoke:
        args.layers = min(args.layers, 2)
    args.models = args.models or list(MODELS)
    args.contexts = args.contexts or ([64, 128] if args.smoke else [16384, 32768, 65536, 131072])
    env = bench.environment(device)
    bandwidth, rate = bench.copy_bandwidth(device), matmul_rate(device, args.torch_dtype)
    budget = bench.Budget(args.max_seconds)
    records = []
    with bench.no_interpreter(device):
        for name in args.models:
            records += run_model(name, args, device, bandwidth, rate, budget)
    md = markdown(records, args, bandwidth, rate)
    print(md)
    bench.write_results(args, "long", "torchembed bench long", env,
                        {"copy_bandwidth_gbs": bandwidth / 1e9, "matmul_tflops": rate / 1e12, "results": records}, md)
    return 0
