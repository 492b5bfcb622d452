"""32 layers of (mask summary + split-key decode) over one 65,536-key static-cache mask (1/8 filled, one kv head of
d 128, eight query heads), compiled fullgraph and replayed from a CUDA graph: time per replay and GPU time by kernel
name (``mask-summary-compiled-h100.md``). Run from a tree root: ``python benchmarks/probes/mask_summary_compiled.py
LABEL``; it imports the torchembed of the current directory."""

from __future__ import annotations

import json
import os
import sys

sys.path[0] = os.getcwd()  # (the tree being measured, not this file's)

import torch  # noqa: E402
import triton  # noqa: E402

from torchembed.kernels.attention import fused_attention, mask_rows  # noqa: E402

KEYS, LAYERS = 65536, 32


def step(q: torch.Tensor, keep: torch.Tensor, *keys: torch.Tensor) -> torch.Tensor:
    out = q
    for k in keys:
        out = fused_attention(out, k, k, None, scale=0.088, keep=keep, rows=mask_rows(keep))
    return out


def main() -> None:
    torch.manual_seed(0)
    keep = torch.zeros(1, 1, 1, KEYS, dtype=torch.bool, device="cuda")
    keep[..., : KEYS // 8] = True
    q = torch.randn(1, 8, 1, 128, device="cuda", dtype=torch.bfloat16)
    keys = [torch.randn(1, 1, KEYS, 128, device="cuda", dtype=torch.bfloat16) for _ in range(LAYERS)]
    compiled = torch.compile(step, fullgraph=True)
    compiled(q, keep, *keys)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        compiled(q, keep, *keys)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        compiled(q, keep, *keys)
    times = [triton.testing.do_bench(graph.replay, warmup=50, rep=300, return_mode="median") for _ in range(3)]
    kernels: dict[str, list[float]] = {}
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            entry = kernels.setdefault(e.name[:50], [0, 0.0])
            entry[0] += 1
            entry[1] += e.time_range.end - e.time_range.start
    print(json.dumps({"tree": sys.argv[1] if len(sys.argv) > 1 else "", "gpu": torch.cuda.get_device_name(),
                      "ms": times, "kernels": {k: [n, round(us, 1)] for k, (n, us) in
                                               sorted(kernels.items(), key=lambda item: -item[1][1])}}))


if __name__ == "__main__":
    main()
