"""Where the time of the ALiBi kernels goes with and without the negligible-key skip (GPU).

    python benchmarks/probes/alibi_skip_probe.py [--out FILE] [--shapes B,H,S,D ...] [--configs]

Per causal prefill shape (bf16, random normal inputs laid out as (B, S, H, D) like a model's): the
forward kernel alone with the skip off and on (key norms computed beforehand), the key-norm pass alone,
the tiles the forward visits with the skip (counted by a PyTorch model of its cut: the fraction of the
causal tiles), the dk/dv and dq kernels alone with the skip off and on, and cuDNN's causal attention
(no bias) for scale. ``--configs`` also times the skipping forward under other block shapes.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import torch
import torch.nn.functional as F
from torchembed.kernels.settings import changed, settings

CANDIDATES = {64: [(64, 64, 4, 3), (128, 64, 8, 3), (128, 64, 4, 3), (64, 32, 4, 3), (64, 128, 4, 3), (128, 128, 8, 3)],
              128: [(128, 128, 8, 3), (128, 64, 8, 3), (64, 64, 4, 3), (64, 128, 4, 3), (64, 32, 4, 3), (128, 32, 4, 3)]}


BWD_CANDIDATES = {"dkdv": {64: [(32, 64, 4, 3), (64, 64, 4, 3), (64, 64, 8, 2), (32, 128, 4, 3), (64, 128, 8, 2)],
                            128: [(64, 64, 4, 2), (32, 64, 4, 3), (64, 64, 8, 2), (32, 128, 8, 2), (64, 128, 8, 2)]},
                  "dq": {64: [(64, 64, 4, 3), (128, 64, 8, 2), (64, 32, 4, 3), (128, 32, 8, 3)],
                         128: [(64, 32, 4, 3), (64, 64, 4, 3), (128, 64, 8, 2), (128, 32, 8, 2)]}}


def _bench(fn) -> float:
    if not torch.cuda.is_available():  # (--smoke on the CPU interpreter: one call, checks the plumbing)
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    import triton

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


NORM_VARIANTS = [(8, 64), (16, 64), (16, 128), (32, 32), (64, 32), (8, 128)]


def _norms(K, k, parts, block_k):
    """The key-norm kernel with ``parts`` programs per (batch, kv head) and ``block_k`` keys per load."""
    b, hk, n, d = k.shape
    out = torch.empty(b, hk, parts, device=k.device, dtype=torch.float32)
    K._device()._key_norm_kernel[(parts, b * hk)](k, out, hk, n, -(-n // parts), *K._strides4(k), HEAD_DIM=d, BLOCK_K=block_k,
                                         BLOCK_D=K.block_d(d), PARTS=parts, num_warps=4)
    return out


def _floor():
    B = torch.nn.attention.SDPBackend
    return B.CUDNN_ATTENTION if torch.cuda.is_available() else B.MATH


def _visited_fraction(q, k, slopes, scale, block_m, block_n, skip_log2) -> float:
    """The forward's visited key tiles with the skip over the causal tiles (model of ``_first_needed``;
    the running max after the diagonal tiles)."""
    b, h, s, d = q.shape
    hk = k.shape[1]
    k = k.repeat_interleave(h // hk, 1)
    log2e = 1.4426950408889634
    qk_scale = scale * log2e
    knorm = torch.linalg.vector_norm(k.float(), dim=-1).amax(-1)  # (b, h)
    visited = causal = 0
    for start in range(0, s, block_m):
        rows = torch.arange(start, min(start + block_m, s), device=q.device)
        c0 = int(rows[-1])
        t0 = rows[0].item() // block_n * block_n  # diagonal tiles: [t0, c0]
        keys = torch.arange(t0, c0 + 1, device=q.device)
        sc = torch.einsum("bhmd,bhnd->bhmn", q[:, :, rows].float(), k[:, :, keys].float()) * qk_scale
        sc = sc + slopes.float()[None, :, None, None] * log2e * (keys - c0).float()
        sc = sc.masked_fill(keys[None, :] > rows[:, None], float("-inf"))
        m = sc.amax(-1)  # (b, h, rows)
        bound = qk_scale * torch.linalg.vector_norm(q[:, :, rows].float(), dim=-1) * knorm[:, :, None] + 1.0
        room = m - skip_log2 - bound
        j = c0 + room / (slopes.float() * log2e)[None, :, None]
        first = j.amin(-1).clamp(0, s)  # (b, h)
        needed = torch.minimum((first // block_n) * block_n, torch.full_like(first, t0))
        visited += ((c0 + 1 - needed) / block_n).ceil().sum().item()
        causal += b * h * math.ceil((c0 + 1) / block_n)
    return visited / causal


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--shapes", nargs="*", default=["4,16,2048,64", "8,32,2048,128", "1,32,4096,128", "4,16,4096,64"])
    ap.add_argument("--configs", action="store_true")
    ap.add_argument("--backward", action="store_true")
    args = ap.parse_args()
    from torchembed.functional.alibi import alibi_slopes
    from torchembed.kernels import attention_plan as K

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    rows_out = []
    for spec in args.shapes:
        b, h, s, d = map(int, spec.split(","))
        make = lambda: torch.randn(b, s, h, d, device=dev, dtype=torch.bfloat16).transpose(1, 2)  # noqa: E731
        q, k, v = make(), make(), make()
        slopes = alibi_slopes(h, dev).float()
        scale = d ** -0.5
        row = {"shape": spec}
        with torch.nn.attention.sdpa_kernel(_floor()):
            row["cudnn_fwd_ms"] = _bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
        norms = K.key_norms(k)
        row["key_norms_ms"] = _bench(lambda: K.key_norms(k))
        for parts, block_k in NORM_VARIANTS:
            if parts * block_k <= s:
                row[f"key_norms_{parts}x{block_k}_ms"] = _bench(lambda: _norms(K, k, parts, block_k))
        row["key_norms_torch_ms"] = _bench(lambda: torch.linalg.vector_norm(k, dim=-1, dtype=torch.float32).amax(-1))
        bd = K.block_d(d)
        configs = CANDIDATES[bd] if args.configs else [settings().alibi.blocks[("fwd", bd, False)]]
        never = 1 << 40  # skip_min_keys that turns the skip off
        for cfg in configs:
            for skip in (False, True):
                with changed(alibi=dict(blocks={("fwd", bd, False): cfg}, skip_min_keys=0 if skip else never)):
                    plan = K.forward_plan(q, k, v, slopes, None, None, scale, False, False)
                    out = torch.empty(b, s, h, d, device=dev, dtype=q.dtype).transpose(1, 2)
                    t = (q, k, v, out, out, slopes, slopes, slopes, norms if skip else slopes, slopes)
                    ms = _bench(lambda: plan.main(t))
                row[f"fwd_{'skip' if skip else 'all'}_{cfg}_ms"] = ms
            row[f"visited_{cfg}"] = _visited_fraction(q, k, slopes, scale, cfg[0], cfg[1], K.skip_log2(s))
        if args.backward:
            qg, kg, vg = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
            grad = torch.randn_like(q)
            with torch.nn.attention.sdpa_kernel(_floor()):
                o = F.scaled_dot_product_attention(qg, kg, vg, is_causal=True)
                row["cudnn_bwd_ms"] = _bench(lambda: torch.autograd.grad(o, (qg, kg, vg), grad, retain_graph=True))
            with changed(alibi=dict(skip_min_keys=never)):
                fplan = K.forward_plan(q, k, v, slopes, None, None, scale, False, True)
                out, lse, _ = fplan(q, k, v, slopes, None, None)
            sweeps = {"dkdv": BWD_CANDIDATES["dkdv"][bd], "dq": BWD_CANDIDATES["dq"][bd]} if args.configs else {}
            for skip in (False, True):
                tag = "skip" if skip else "all"
                variants = [("shipped", None, None)] + [(kind, kind, c) for kind, cs in sweeps.items() for c in cs
                                                        if skip]
                for name, kind, cfg in variants:
                    blocks = {} if kind is None else {(kind, bd, False): cfg}
                    with changed(alibi=dict(blocks=blocks, skip_min_keys=0 if skip else never)):
                        bplan = K.backward_plan(grad, q, k, v, out, slopes, None, None, scale, False)
                    delta = torch.empty(b, h, s, device=dev, dtype=torch.float32)
                    horizon = torch.empty(bplan.horizon_shape, device=dev, dtype=torch.float32)
                    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
                    nrm = norms if skip else slopes
                    hz = horizon if skip else slopes
                    dt = (out, grad, delta, q, lse, slopes, slopes, nrm, hz)
                    bplan.delta(dt)
                    suffix = "" if kind is None else f"_{cfg}"
                    if kind in (None, "dkdv"):
                        row[f"dkdv_{tag}{suffix}_ms"] = _bench(
                            lambda: bplan.dkdv((q, k, v, grad, lse, delta, dk, dv, slopes, slopes, slopes, hz, slopes)))
                    if kind in (None, "dq"):
                        row[f"dq_{tag}{suffix}_ms"] = _bench(
                            lambda: bplan.dq((q, k, v, grad, lse, delta, dq, slopes, slopes, slopes, nrm, slopes)))
                    if kind is None:
                        row[f"delta_{tag}_ms"] = _bench(lambda: bplan.delta(dt))
                        row[f"backward_{tag}_ms"] = _bench(
                            lambda: bplan(grad, q, k, v, out, lse, slopes, None, None))
        print(json.dumps(row), flush=True)
        rows_out.append(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                       "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "triton": __import__("triton").__version__, "rows": rows_out}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
