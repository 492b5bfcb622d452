"""A decode step's KV-cache concatenation on one GPU: a contiguous new key against BLOOM's strided one.

``torch.cat([cache, new], dim=-2)`` of a ``(1, 32, N, 128)`` bf16 cache and one new token, the token
contiguous or a view with a head stride of ``3 * 128`` (BLOOM's fused q, k, v), as DynamicCache does
each step; CUDA-event medians. The floor: reading and writing the cache at the measured copy rate.

    python benchmarks/probes/cache_concat_probe.py [--keys 16384 65536]
"""

from __future__ import annotations

import argparse

import torch
from triton.testing import do_bench


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", nargs="+", type=int, default=[16384, 65536])
    args = parser.parse_args()
    for n in args.keys:
        cache = torch.randn(1, 32, n, 128, device="cuda", dtype=torch.bfloat16)
        fused = torch.randn(1, 1, 32, 3, 128, device="cuda", dtype=torch.bfloat16)
        strided = fused[..., 1, :].transpose(1, 2)  # (1, 32, 1, 128), head stride 384
        contiguous = strided.contiguous()
        floor = do_bench(lambda: cache.clone(), return_mode="median")
        times = {name: do_bench(lambda t=t: torch.cat([cache, t], dim=-2), return_mode="median")
                 for name, t in (("strided", strided), ("contiguous", contiguous))}
        print(f"{n} keys: cat with a strided new key {times['strided']:.3f} ms, contiguous {times['contiguous']:.3f} ms, "
              f"clone of the cache (floor) {floor:.3f} ms", flush=True)


if __name__ == "__main__":
    main()
