"""Forward + backward of ALiBi attention against cuDNN's causal attention (no bias), three ways (GPU).

    python benchmarks/probes/alibi_train_step_probe.py [--out FILE] [--shapes B,H,S,D ...] [--repeats N]

Per causal prefill shape (bf16, inputs laid out as (B, S, H, D) like a model's, viewed as (B, H, S, D)),
for cuDNN's SDPA without bias (the floor), ``alibi_flash`` (the kernel's entry point) and
``ALiBiEmbedding.attention`` (the public layer):

* ``eager``: ``do_bench`` median of ``out.backward(grad)`` (what ``torchembed bench alibi --kernel``
  reports: a slow host shows here as gaps between the launches);
* ``graph``: ``torch.autograd.grad`` replayed from a CUDA graph: device time, the host left out;
* ``host``: wall time per call of many back-to-back calls with one synchronize at the end (where
  this exceeds ``graph``, the host is the bound).

Each measurement is taken ``--repeats`` times (interleaved) to show the noise; the table prints
medians and the JSON keeps every value.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch
import torch.nn.functional as F

SHAPES = ((1, 16, 1024, 64), (4, 16, 2048, 64), (8, 32, 2048, 128), (1, 32, 4096, 128))


def _parse(text: str) -> tuple[int, int, int, int]:
    b, h, s, d = (int(x) for x in text.split(","))
    return b, h, s, d


def _impls(heads: int, dim: int, device: torch.device):
    from torchembed.functional.alibi import alibi_slopes
    from torchembed.kernels.attention import alibi_flash
    from torchembed.positional import ALiBiEmbedding

    slopes = alibi_slopes(heads, device)
    layer = ALiBiEmbedding(heads, max_seq_len=8).to(device)
    scale = dim ** -0.5
    cudnn = torch.nn.attention.SDPBackend.CUDNN_ATTENTION

    def floor(q, k, v):
        with torch.nn.attention.sdpa_kernel(cudnn):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    return {"cudnn (no bias)": floor,
            "alibi_flash": lambda q, k, v: alibi_flash(q, k, v, slopes, scale=scale),
            "ALiBiEmbedding.attention": lambda q, k, v: layer.attention(q, k, v)}


def measure(shape, repeats: int, device: torch.device) -> dict:
    from triton.testing import do_bench

    from torchembed.tools import bench

    b, h, s, d = shape
    q, k, v = (torch.randn(b, s, h, d, device=device, dtype=torch.bfloat16).requires_grad_() for _ in range(3))
    grad = torch.randn(b, h, s, d, device=device, dtype=torch.bfloat16)

    def views():
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    result = {}
    impls = _impls(h, d, device)
    steps = {}
    for name, impl in impls.items():
        def eager(impl=impl):
            impl(*views()).backward(grad)

        def grads(impl=impl):
            torch.autograd.grad(impl(*views()), (q, k, v), grad)

        steps[name] = (eager, grads)
        result[name] = {"eager": [], "graph": [], "host": []}
    for _ in range(repeats):
        for name, (eager, grads) in steps.items():
            r = result[name]
            r["eager"].append(do_bench(eager, grad_to_none=[q, k, v], return_mode="median"))
            q.grad = k.grad = v.grad = None
            r["graph"].append(bench.graph_time(grads, device, calls=3))
            r["host"].append(bench.host_loop(grads, device, calls=100, repeats=3))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", type=_parse, default=list(SHAPES))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("alibi_train_step_probe: needs a CUDA GPU")
    device = torch.device("cuda")
    import torchembed

    records = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "torchembed": torchembed.__file__, "shapes": {}}
    print(f"{'b,h,s,d':<14} {'implementation':<26} {'eager ms':>9} {'graph ms':>9} {'host ms':>9}  floor/this (eager, graph)")
    for shape in args.shapes:
        res = measure(shape, args.repeats, device)
        records["shapes"][",".join(map(str, shape))] = res
        med = {name: {key: statistics.median(vals) for key, vals in r.items()} for name, r in res.items()}
        floor = med["cudnn (no bias)"]
        for name, m in med.items():
            print(f"{','.join(map(str, shape)):<14} {name:<26} {m['eager']:9.3f} {m['graph']:9.3f} {m['host']:9.3f}  "
                  f"{floor['eager'] / m['eager']:.2f}x, {floor['graph'] / m['graph']:.2f}x", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
