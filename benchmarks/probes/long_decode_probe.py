"""Decode at long context, one GPU: where the time of a step goes (a probe, not a benchmark).

For an MPT-StoryWriter-shaped model (d 4096, 32 heads, ``--layers`` layers, bf16, random weights) patched
by torchembed, and a LLaMA-3.1-8B-shaped model upstream and patched: prefill ``--context`` tokens, then
time ``--steps`` plain-loop decode steps (``model(next, past_key_values=cache)``, synchronised each) and
``generate``'s per-token time, with SDPA's cuDNN backend on and off, and (ALiBi) with the fused kernel for
decode (``fused=True``). Prints per-step times (the first steps show compiles and plan builds) and the
top host-time operators of one step.

    python benchmarks/probes/long_decode_probe.py [--context 32768] [--layers 2] [--steps 8]
"""

from __future__ import annotations

import argparse
import time

import torch
import transformers

import torchembed


def _steps(model, ids, steps):
    cache = transformers.DynamicCache()
    with torch.no_grad():
        out = model(ids, past_key_values=cache, use_cache=True)
        nxt = out.logits[:, -1:].argmax(-1)
        times = []
        for _ in range(steps):
            torch.cuda.synchronize()
            t = time.perf_counter()
            out = model(nxt, past_key_values=out.past_key_values, use_cache=True)
            nxt = out.logits[:, -1:].argmax(-1)
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t) * 1e3)
    return times


def _generate_ms(model, ids, n):
    with torch.no_grad():
        model.generate(ids, max_new_tokens=2, min_new_tokens=2, do_sample=False)
        torch.cuda.synchronize()
        t = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, do_sample=False)
        torch.cuda.synchronize()
        one = time.perf_counter() - t
        t = time.perf_counter()
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        torch.cuda.synchronize()
        return ((time.perf_counter() - t) - one) / (n - 1) * 1e3


def _profile(model, ids, label):
    cache = transformers.DynamicCache()
    with torch.no_grad():
        out = model(ids, past_key_values=cache, use_cache=True)
        nxt = out.logits[:, -1:].argmax(-1)
        out = model(nxt, past_key_values=out.past_key_values, use_cache=True)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
            model(nxt, past_key_values=out.past_key_values, use_cache=True)
            torch.cuda.synchronize()
    print(f"--- profile of one decode step: {label}")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=8, max_name_column_width=60))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--generate", type=int, default=8)
    args = p.parse_args()
    dev, dtype = torch.device("cuda"), torch.bfloat16
    print("torch", torch.__version__, "transformers", transformers.__version__, torch.cuda.get_device_name())
    gen = torch.Generator().manual_seed(0)
    mpt = transformers.MptConfig(d_model=4096, n_heads=32, n_layers=args.layers, max_seq_len=args.context + 64,
                                 vocab_size=50432, expansion_ratio=4, use_cache=True,
                                 attn_config={"alibi": True, "alibi_bias_max": 8, "attn_impl": "torch"})
    llama = transformers.LlamaConfig(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                                     num_key_value_heads=8, num_hidden_layers=args.layers, vocab_size=128256,
                                     max_position_embeddings=131072, rope_theta=500000.0,
                                     rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    for name, config in (("mpt", mpt), ("llama", llama)):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=dtype).to(dev).eval()
        ids = torch.randint(3, config.vocab_size - 16, (1, args.context), generator=gen).to(dev)
        variants = [("upstream", None)] if name == "llama" else []
        variants += [("patched", None)] + ([("patched fused=True", True)] if name == "mpt" else [])
        for label, fused in variants:
            if label != "upstream":
                torchembed.unpatch(model)
                torchembed.patch(model, fused=fused, cudnn_decode=True)  # SDPA's own choice: the cuDNN toggle below decides
            for cudnn in (True, False):
                torch.backends.cuda.enable_cudnn_sdp(cudnn)
                try:
                    steps = _steps(model, ids, args.steps)
                    gms = _generate_ms(model, ids, args.generate)
                    print(f"{name:6s} {label:20s} cudnn={cudnn!s:5s} steps ms: "
                          + " ".join(f"{t:.1f}" for t in steps) + f" | generate ms/token {gms:.2f}")
                except torch.cuda.OutOfMemoryError:
                    print(f"{name} {label} cudnn={cudnn}: OOM")
                torch.cuda.empty_cache()
            torch.backends.cuda.enable_cudnn_sdp(True)
            if label in ("upstream", "patched"):
                _profile(model, ids, f"{name} {label}")
        torchembed.unpatch(model)
        del model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
