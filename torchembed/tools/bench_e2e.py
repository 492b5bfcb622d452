"""``torchembed bench e2e``: whole ~1B-parameter models, upstream vs torchembed-patched vs liger.

Random-weight LLaMA-, Mistral- and Falcon-style configs in bf16 on CUDA (``--device cpu``: on the CPU,
``--threads`` intra-op threads each; ``smollm2`` is SmolLM2-135M's LLaMA shape). Variants share weights:
``upstream``, ``patched`` (``copy.deepcopy`` + ``torchembed.patch``), ``patched-torch`` (the same with
``fused=False``: torchembed's PyTorch rotation, which ``torch.compile`` traces) and ``liger`` (a copy whose
attention instances call liger-kernel's ``liger_rotary_pos_emb``; skipped when not installed).
Phases, each repeated in interleaved order (A/B/C, C/B/A, ...) after one warm-up per variant and
reported as median [min-max], next to the median [min-max] of the per-repeat ratio upstream / patched
(the two runs of a repeat are back to back, so a slow spell of the machine hits both):

* ``prefill``: latency (ms) of one forward over batch x prompt tokens (KV cache on, last logits).
* ``decode``: eager greedy ``generate`` (DynamicCache); ms/token = (generate(N) - generate(1)) /
  (N - 1), each ``generate`` timed whole as a user calls it (no streamer; :func:`bench.generate_timed`);
  tokens/s = batch * 1000 / (ms/token).
* ``step``: one decode forward (one token per sequence against the prompt's cache, cropped back
  outside the clock), ``40 x --repeats`` calls per variant alternating call by call: the finest
  A/B comparison (the CPU's default next to prefill and decode).
* ``compiled-step``: one decode forward compiled as ``generate`` compiles it
  (``torch.compile(mode="reduce-overhead", fullgraph=True)``: CUDA graphs) against a static cache
  of the prompt, ``STEP_CALLS`` calls back to back per run: the compiled step's own time, without
  ``generate``'s Python around it (where compiled decode spends most of its time).
* ``compiled``: the same with ``cache_implementation="static"`` and HF's compile_config
  (``torch.compile(mode="reduce-overhead", fullgraph=True)``), what a user of ``generate`` gets
  from compiling: (generate(N) - generate(1)) / (N - 1) after a warm-up generation of each length
  (no streamer: a per-token clock under CUDA graphs measured 4-5x the step); graph breaks counted
  from ``torch._dynamo.utils.counters["graph_break"]`` (fullgraph failing: retried without).

Python's garbage collector is paused during each timed run (as ``timeit`` does), so a collection
that lands in one run and not the next does not show up as a difference between variants.

Peak memory: ``torch.cuda.max_memory_allocated`` during a run minus what was allocated before it
(weights excluded), in GB.
"""

from __future__ import annotations

import argparse
import copy
import inspect
import sys
import time
from typing import Any

import torch
from torch import nn

from torchembed.tools import bench
from torchembed.tools.options import Parser, count

MODELS = ("llama", "mistral", "falcon", "qwen3", "gemma3_text", "phi3", "smollm2")
VARIANTS = ("upstream", "patched", "patched-torch", "liger")
PHASES = ("prefill", "decode", "step", "compiled", "compiled-step")
STEP_CALLS = 40  # the step phase's calls per variant and --repeats
ATTENTION = {"llama": ("LlamaAttention",), "mistral": ("MistralAttention",),
             "falcon": ("FalconAttention", "FalconFlashAttention2")}


def make_config(name: str, smoke: bool, max_positions: int) -> Any:
    """~1B-parameter configs (tiny ones for ``--smoke``: hidden 64, 2 layers)."""
    import transformers

    # LLaMA/Mistral ~1.1B; Falcon ~1.0B (parallel attention + 4x GELU MLP, so 22 layers)
    hidden, layers, falcon_layers, heads, kv, inter, vocab = (
        (64, 2, 2, 4, 2, 128, 128) if smoke else (2048, 16, 22, 32, 8, 8192, 32000))
    llama = dict(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                 intermediate_size=inter, vocab_size=vocab)
    falcon = dict(hidden_size=hidden, num_hidden_layers=falcon_layers, num_attention_heads=heads, num_kv_heads=kv,
                  vocab_size=vocab)
    if name == "llama":
        return transformers.LlamaConfig(**llama, max_position_embeddings=max_positions)
    if name == "smollm2":  # SmolLM2-135M: 30 layers, hidden 576, 9 / 3 heads of 64
        shape = dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                     intermediate_size=1536, vocab_size=49152, rope_theta=100000.0, tie_word_embeddings=True)
        if smoke:
            shape.update(num_hidden_layers=2, vocab_size=128)
        return transformers.LlamaConfig(**shape, max_position_embeddings=max_positions)
    if name == "mistral":
        return transformers.MistralConfig(**llama, max_position_embeddings=max_positions, sliding_window=None)
    if name == "falcon":
        return transformers.FalconConfig(**falcon, max_position_embeddings=max_positions, new_decoder_architecture=True,
                                         parallel_attn=True, bias=False, alibi=False)
    if name in MODELS:  # RoPE families found by structure: the LLaMA sizes, head dim 64, their own defaults otherwise
        return transformers.AutoConfig.for_model(name, **llama, head_dim=hidden // heads, pad_token_id=0, bos_token_id=1,
                                                 eos_token_id=2, max_position_embeddings=max_positions)
    raise ValueError(f"unknown model {name!r}; choose from {MODELS}")


def liger_copy(model: nn.Module, name: str) -> nn.Module:
    """A copy whose attention instances call liger's rotary function (instance-level rebinding).
    Raises ImportError without liger-kernel, ValueError when no attention forward can be rebound."""
    from liger_kernel.transformers.rope import liger_rotary_pos_emb

    from torchembed.patches.actions import InstanceMethod

    model = copy.deepcopy(model)
    swapped = 0
    for module in model.modules():
        if type(module).__name__ in ATTENTION[name]:
            module.forward = InstanceMethod(module, type(module).forward, {"apply_rotary_pos_emb": liger_rotary_pos_emb})
            swapped += 1
    if not swapped:
        raise ValueError(f"no {ATTENTION[name]} module to rebind")
    return model


def build_variants(name: str, args: argparse.Namespace, device: torch.device,
                   skipped: dict[str, str]) -> dict[str, nn.Module]:
    import torchembed

    config = make_config(name, args.smoke, max(args.prompt_lens) + args.new_tokens + 8)
    upstream = bench.random_causal_lm(config, device, args.torch_dtype)
    out: dict[str, nn.Module] = {}
    for variant in args.variants:
        try:
            if variant == "upstream":
                out[variant] = upstream
            elif variant == "patched":
                out[variant] = torchembed.patch(copy.deepcopy(upstream))
            elif variant == "patched-torch":  # torchembed's PyTorch rotation everywhere (fused=False)
                out[variant] = torchembed.patch(copy.deepcopy(upstream), fused=False)
            elif variant == "liger":
                if device.type != "cuda":
                    raise ImportError("liger-kernel needs CUDA")
                out[variant] = liger_copy(upstream, name)
        except Exception as exc:  # liger missing, failing to import (version skew) or not applicable
            skipped[f"{name}/{variant}"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    return out


def _compile_kwargs(fullgraph: bool) -> dict[str, Any]:
    from transformers import CompileConfig

    return {"cache_implementation": "static", "disable_compile": False, "use_cache": True,
            "compile_config": CompileConfig(fullgraph=fullgraph, mode="reduce-overhead")}


def run_case(name: str, models: dict[str, nn.Module], batch: int, prompt: int, args: argparse.Namespace,
             device: torch.device, budget: bench.Budget) -> list[dict[str, Any]]:
    """All requested phases for one (model, batch, prompt length)."""
    vocab = next(iter(models.values())).config.get_text_config().vocab_size
    ids = torch.randint(1, vocab, (batch, prompt), device=device)
    n = args.new_tokens
    takes_keep = "logits_to_keep" in inspect.signature(next(iter(models.values())).forward).parameters
    records = []
    for phase in args.phases:
        base = {"model": name, "phase": phase, "batch": batch, "prompt_len": prompt}
        if budget.exhausted():
            records += [{**base, "variant": v, "ms": "skipped: time budget"} for v in models]
            continue
        print(f"e2e {name} batch {batch} prompt {prompt} {phase} ...", file=sys.stderr, flush=True)
        if phase == "prefill":
            kw = _last_logits_only(takes_keep)

            def run(m: nn.Module) -> float:
                with torch.no_grad():
                    return bench.wall(lambda: m(input_ids=ids, use_cache=True, **kw), device)

            res = bench.measure(models, run, args.repeats, device)
        elif phase == "decode":
            res = bench.measure(models, lambda m: bench.generate_timed(m, ids, n, disable_compile=True)["per_token"],
                                args.repeats, device)
        elif phase == "step":
            res = _measure_steps(models, ids, args.repeats * STEP_CALLS, device, _last_logits_only(takes_keep))
        elif phase == "compiled-step":
            res = _measure_compiled_steps(models, ids, args.repeats, device, _last_logits_only(takes_keep))
        else:
            if device.type != "cuda":
                records += [{**base, "variant": v, "ms": "skipped: compiled decode needs CUDA"} for v in models]
                continue
            res = bench.measure(models, lambda m: bench.generate_timed(m, ids, n, **m._bench_compile)["per_token"],
                                args.repeats, device, warm=lambda m: _warm_compiled(m, ids, n))
        up, pa = res.get("upstream", {}).get("ms"), res.get("patched", {}).get("ms")
        if isinstance(up, dict) and isinstance(pa, dict):
            res["patched"]["paired_speedup"] = bench.paired_ratio(up, pa)
        floor = None
        if phase in ("decode", "compiled", "compiled-step") and getattr(args, "bandwidth", None):
            context = prompt + 1 if phase == "compiled-step" else prompt + n // 2
            floor = decode_floor_ms(next(iter(models.values())), batch, context, args.bandwidth)
        for variant, r in res.items():
            rec = {**base, "variant": variant, "new_tokens": n if phase in ("decode", "compiled") else None,
                   "floor_ms": floor, **r}
            if phase in ("decode", "compiled") and isinstance(r.get("ms"), dict):
                rec["tokens_per_s"] = batch * 1e3 / r["ms"]["median"]
            records.append(rec)
    return records


def kv_cache_bytes(config: Any, batch: int, context: int, dtype_bytes: int) -> int:
    """Bytes of the KV cache of ``context`` tokens of ``batch`` sequences."""
    config = config.get_text_config()
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or getattr(config, "num_kv_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return 2 * config.num_hidden_layers * batch * kv_heads * head_dim * context * dtype_bytes


def decode_floor_ms(model: nn.Module, batch: int, context: int, bandwidth: float) -> float:
    """The decode step's floor: every weight and the KV cache of ``context`` tokens read once, at the
    measured copy bandwidth (bytes/s, read + write). What no implementation can beat on this GPU."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    cache = kv_cache_bytes(model.config, batch, context, next(model.parameters()).element_size())
    return (weights + cache) / bandwidth * 1e3


def _last_logits_only(takes_keep: bool) -> dict[str, Any]:
    """Forward keywords computing the last position's logits only (where the model takes them)."""
    return {"logits_to_keep": 1} if takes_keep else {}


def _measure_steps(models: dict[str, nn.Module], ids: torch.Tensor, calls: int, device: torch.device,
                   kw: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The ``step`` phase: one decode forward (one new token per sequence against a cache of the prompt),
    the variants alternating call by call (A/B, B/A, ...), the cache cropped back to the prompt outside
    the clock; the garbage collector off throughout (one collection before)."""
    prompt = ids.shape[1]
    caches: dict[int, Any] = {}

    def warm(m: nn.Module) -> dict[str, Any]:
        with torch.no_grad():
            caches[id(m)] = m(input_ids=ids, use_cache=True, **kw).past_key_values
        run(m)
        return {}

    def run(m: nn.Module) -> float:
        cache = caches[id(m)]
        extra = cache.get_seq_length() - prompt
        if extra > 0:
            cache.crop(-extra)  # (a negative length: how many to drop, in every transformers version)
        with torch.no_grad():
            bench.sync(device)
            start = time.perf_counter()
            m(input_ids=ids[:, -1:], past_key_values=cache, use_cache=True, **kw)
            bench.sync(device)
        return (time.perf_counter() - start) * 1e3

    with bench.gc_paused():
        return bench.measure(models, run, calls, device, warm=warm)


def _measure_compiled_steps(models: dict[str, nn.Module], ids: torch.Tensor, repeats: int, device: torch.device,
                            kw: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The ``compiled-step`` phase: per variant a static cache holding the prompt (an eager prefill)
    and the model's forward compiled for one new token (reduce-overhead on CUDA); each run times
    ``STEP_CALLS`` back-to-back calls of it, each one token further (as ``generate`` steps), and
    reports ms per call."""
    from transformers import StaticCache

    prompt = ids.shape[1]
    steps: dict[int, Any] = {}
    length = prompt + 3 + (repeats + 1) * STEP_CALLS  # every step of the warm-up and the runs

    def warm(m: nn.Module) -> dict[str, Any]:
        cache = StaticCache(config=m.config, max_cache_len=length)
        with torch.no_grad():
            m(input_ids=ids, past_key_values=cache, use_cache=True, cache_position=torch.arange(prompt, device=device),
              **kw)
        mode = "reduce-overhead" if device.type == "cuda" else "default"
        forward = torch.compile(m.forward, mode=mode, fullgraph=True)
        token, position = ids[:, -1:], torch.tensor([prompt], device=device)

        def step() -> None:
            forward(input_ids=token, past_key_values=cache, use_cache=True, cache_position=position, **kw)
            position.add_(1)  # (in place: the captured graph reads it)

        steps[id(m)] = step
        start = time.perf_counter()
        with torch.no_grad():
            for _ in range(3):  # compile, record the graph, replay
                steps[id(m)]()
        return {"compile_s": time.perf_counter() - start}

    def run(m: nn.Module) -> float:
        step = steps[id(m)]
        with torch.no_grad():
            bench.sync(device)
            start = time.perf_counter()
            for _ in range(STEP_CALLS):
                step()
            bench.sync(device)
        return (time.perf_counter() - start) * 1e3 / STEP_CALLS

    with bench.gc_paused():
        return bench.measure(models, run, repeats, device, warm=warm)


def _warm_compiled(model: nn.Module, ids: torch.Tensor, n: int) -> dict[str, Any]:
    """Compile (first generate) with fullgraph=True, else without; count graph breaks."""
    from torch._dynamo.utils import counters

    info: dict[str, Any] = {}
    before = sum(counters["graph_break"].values())
    start = time.perf_counter()
    for fullgraph in (True, False):
        model._bench_compile = _compile_kwargs(fullgraph)
        try:
            bench.generate_timed(model, ids, n, **model._bench_compile)
            info["fullgraph"] = fullgraph
            break
        except Exception as exc:
            if not fullgraph or bench.is_oom(exc):
                raise
            info["note"] = f"fullgraph=True failed: {bench.short_error(exc)}"
    info["graph_breaks"] = sum(counters["graph_break"].values()) - before
    info["compile_s"] = time.perf_counter() - start
    return info


def markdown(records: list[dict[str, Any]], variants: list[str], skipped: dict[str, str]) -> str:
    titles = {"prefill": "prefill latency (ms)",
              "decode": "eager decode (ms/token = (generate(N) - generate(1)) / (N - 1), DynamicCache)",
              "step": f"one decode forward (ms, {STEP_CALLS} x --repeats calls per variant alternating call by call)",
              "compiled": "compiled static-cache decode (ms/token = (generate(N) - generate(1)) / (N - 1), reduce-overhead)",
              "compiled-step": f"one compiled decode forward (ms per call, {STEP_CALLS} back-to-back calls per run, "
                               "static cache, reduce-overhead)"}
    out = []
    for phase in PHASES:
        rows_of = [r for r in records if r["phase"] == phase]
        if not rows_of:
            continue
        keys = list(dict.fromkeys((r["model"], r["batch"], r["prompt_len"]) for r in rows_of))
        peak = "peak GB (" + "/".join(v[0] for v in variants) + ")"
        headers = ["model", "batch x prompt", *variants, "upstream / patched", "paired", peak]
        if phase in ("decode", "compiled", "compiled-step"):
            headers[2:2] = ["floor"]
            headers.insert(-1, "tokens/s patched")
        if phase == "compiled":
            headers.append("graph breaks")
        rows = []
        for model, batch, prompt in keys:
            by = {r["variant"]: r for r in rows_of if (r["model"], r["batch"], r["prompt_len"]) == (model, batch, prompt)}
            ms = {v: by.get(v, {}).get("ms") for v in variants}
            med = {v: m["median"] for v, m in ms.items() if isinstance(m, dict)}
            speed = f"{med['upstream'] / med['patched']:.2f}x" if "upstream" in med and "patched" in med else "-"
            paired = by.get("patched", {}).get("paired_speedup")
            row = [model, f"{batch} x {prompt}", *(bench.fmt_stats(ms[v]) for v in variants), speed,
                   bench.fmt_stats(paired, 2) if paired else "-"]
            if phase in ("decode", "compiled", "compiled-step"):
                row[2:2] = [bench.fmt(next((r.get("floor_ms") for r in by.values()), None))]
            if phase in ("decode", "compiled"):
                row.append(bench.fmt(by.get("patched", {}).get("tokens_per_s"), 1))
            row.append(" / ".join(bench.fmt(by.get(v, {}).get("peak_mem_gb"), 2) for v in variants))
            if phase == "compiled":
                row.append(" / ".join(bench.fmt(by.get(v, {}).get("graph_breaks"), 0) for v in variants))
            rows.append(row)
        out += [f"## {titles[phase]}", "", bench.md_table(headers, rows), ""]
    out += ["median [min-max] over interleaved repeats; upstream / patched = ratio of the medians (the speedup, "
            "above 1: patched faster); paired = median [min-max] of upstream / patched per repeat (the two runs of a "
            "repeat are back to back); floor = (weights + KV cache at prompt + N/2 tokens; compiled-step: prompt + 1) / measured copy bandwidth; "
            "peak GB = max allocated during a run minus weights"]
    out += [f"- {k}: skipped ({v})" for k, v in skipped.items()]
    out += [f"- {r['model']}/{r['variant']} b{r['batch']}: {r['note']}" for r in records if r.get("note")]
    return "\n".join(out)


def main(argv: list[str]) -> int:
    parser = Parser(prog="torchembed bench e2e", description=__doc__.split("\n\n")[0].replace("``", ""))
    bench.add_common_args(parser)
    parser.add_argument("--models", nargs="+", default=None, choices=MODELS,
                        help="default: all but smollm2 on CUDA, smollm2 on the CPU")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cpu: full-size runs on the CPU (prefill and eager decode)")
    parser.add_argument("--threads", type=count(1), nargs="+", default=None,
                        help="CPU intra-op thread counts, each a run of its own (default: torch's)")
    parser.add_argument("--variants", nargs="+", default=None, choices=VARIANTS,
                        help="default: all (on the CPU: upstream patched)")
    parser.add_argument("--phases", nargs="+", default=None, choices=PHASES, help="default: prefill decode compiled (CPU: prefill decode step; --smoke: prefill decode)")
    parser.add_argument("--batch-sizes", nargs="+", type=count(1), default=None, help="default 1 8 (--smoke: 1 2)")
    parser.add_argument("--prompt-lens", nargs="+", type=count(1), default=None, help="default 2048 (--smoke: 16)")
    parser.add_argument("--new-tokens", type=count(2), default=None, help="decode steps, >= 2 (default 128; --smoke: 4)")
    parser.add_argument("--repeats", type=count(1), default=None, help="interleaved repeats (default 5; --smoke: 2)")
    args = parser.parse_args(argv)
    device = bench.setup(args, args.device)
    smoke = args.smoke
    args.variants = args.variants or (["upstream", "patched"] if device.type == "cpu" else list(VARIANTS))
    args.models = args.models or (["smollm2"] if device.type == "cpu" and not smoke else [m for m in MODELS if m != "smollm2"])
    default_phases = (["prefill", "decode"] if smoke else ["prefill", "decode", "step"] if device.type == "cpu"
                      else ["prefill", "decode", "compiled"])
    args.phases = args.phases or default_phases
    args.batch_sizes = args.batch_sizes or ([1, 2] if smoke else [1, 8])
    args.prompt_lens = args.prompt_lens or ([16] if smoke else [2048])
    args.new_tokens = args.new_tokens or (4 if smoke else 128)
    args.repeats = args.repeats or (2 if smoke else 5)
    if smoke and args.dtype == "bfloat16":
        args.torch_dtype = torch.float32  # CPU smoke: float32 (bf16 matmuls are slow on many CPUs)
    name = "-".join(["e2e", *(["cpu"] if device.type == "cpu" and not smoke else []),
                     *(args.models if args.models != [m for m in MODELS if m != "smollm2"] else []),
                     *(args.phases if args.phases != default_phases and not smoke else [])])
    env, skipped, records = bench.environment(device), {}, []
    budget = bench.Budget(args.max_seconds)
    if device.type == "cuda" and not smoke:  # the decode floor's bandwidth
        args.bandwidth = bench.copy_bandwidth(device)
        env["copy_bandwidth_gbs"] = args.bandwidth / 1e9

    def save(quiet: bool) -> str:
        md = markdown(records, [v for v in args.variants if any(r["variant"] == v for r in records)], skipped)
        payload = {"variants": args.variants, "skipped": skipped, "results": records}
        bench.write_results(args, name, "torchembed bench e2e", env, payload, md, quiet=quiet)
        return md

    limits = {("recompile_limit", "cache_size_limit"): 64,
              ("accumulated_recompile_limit", "accumulated_cache_size_limit"): 1024}
    threads = args.threads or [torch.get_num_threads()]
    with bench.no_interpreter(device), bench.dynamo_config(limits):  # every variant and batch size is its own graph
        for n_threads in threads:
            if args.device == "cpu":
                torch.set_num_threads(n_threads)
                env["threads"] = threads
            for model_name in args.models:
                if budget.exhausted():
                    skipped[model_name] = "time budget (--max-seconds)"
                    continue
                models = build_variants(model_name, args, device, skipped)
                for batch in args.batch_sizes:
                    for prompt in args.prompt_lens:
                        case = run_case(model_name, models, batch, prompt, args, device, budget)
                        if args.device == "cpu":  # (--smoke runs on the CPU too: its records keep their names)
                            for record in case:
                                record["threads"] = n_threads
                                record["model"] = f"{model_name} ({n_threads} thread{'s' if n_threads > 1 else ''})"
                        records += case
                        save(quiet=True)  # partial results survive an interrupted run
                del models
                bench.free_memory(device)
    print(save(quiet=False))
    return 0

