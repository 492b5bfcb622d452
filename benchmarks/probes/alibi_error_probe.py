"""Errors of bf16 ALiBi attention against float32: the fused kernel, FlexAttention + ALiBi, SDPA + bias (GPU).

Max and mean error of each against a float32 reference.

    python benchmarks/probes/alibi_error_probe.py [--out FILE] [--seeds N] [--shapes B,H,S,D ...]

Per causal prefill shape and seed (standard-normal q, k, v laid out as (B, S, H, D)), over batch 0, all
heads, every query row: max |out - ref| and mean |out - ref|.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import torch
import torch.nn.functional as F

SHAPES = ((1, 16, 1024, 64), (4, 16, 2048, 64), (1, 32, 4096, 128))


def _parse(text: str) -> tuple[int, int, int, int]:
    b, h, s, d = (int(x) for x in text.split(","))
    return b, h, s, d


def _bias(slopes: torch.Tensor, s: int, dtype: torch.dtype) -> torch.Tensor:
    pos = torch.arange(s, device=slopes.device)
    rel = (pos[None, :] - pos[:, None]).float()
    bias = slopes[:, None, None] * rel
    return bias.masked_fill(pos[None, :] > pos[:, None], float("-inf"))[None].to(dtype)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", type=_parse, default=list(SHAPES))
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("alibi_error_probe: needs a CUDA GPU")
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from torchembed.functional.alibi import alibi_slopes
    from torchembed.kernels.attention import alibi_flash

    flex = torch.compile(flex_attention, dynamic=False)
    records = []
    print(f"{'b,h,s,d':<14} {'seed':>4} {'implementation':<12} {'max':>9} {'mean':>9}")
    for shape in args.shapes:
        b, h, s, d = shape
        slopes = alibi_slopes(h, "cuda")
        scale = d ** -0.5
        mask = create_block_mask(lambda b_, h_, qi, ki: ki <= qi, None, None, s, s, device="cuda")
        bias = _bias(slopes, s, torch.bfloat16)

        def score_mod(score, b_, h_, qi, ki):
            return score + slopes[h_] * (ki - qi)

        impls = {"kernel": lambda q, k, v: alibi_flash(q, k, v, slopes, scale=scale),
                 "flex": lambda q, k, v: flex(q, k, v, score_mod=score_mod, block_mask=mask, scale=scale),
                 "sdpa-bias": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)}
        for seed in range(args.seeds):
            gen = torch.Generator(device="cuda").manual_seed(seed)
            q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=gen).transpose(1, 2)
                       for _ in range(3))
            with torch.no_grad():
                ref = F.scaled_dot_product_attention(q[:1].float(), k[:1].float(), v[:1].float(),
                                                     attn_mask=_bias(slopes, s, torch.float32), scale=scale)
                for name, impl in impls.items():
                    err = (impl(q, k, v)[:1].float() - ref).abs()
                    row = {"shape": list(shape), "seed": seed, "impl": name, "max": err.max().item(),
                           "mean": err.mean().item()}
                    records.append(row)
                    print(f"{','.join(map(str, shape)):<14} {seed:>4} {name:<12} {row['max']:9.2e} {row['mean']:9.2e}",
                          flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": records}, f, indent=1)
    assert all(math.isfinite(r["max"]) for r in records)


if __name__ == "__main__":
    main()
