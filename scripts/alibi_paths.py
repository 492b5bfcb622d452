"""ALiBi prefill on the GPU, one attention layer: the materialised bias (``dense``) against the bias
columns (the fused path), with plain causal SDPA as a floor; what ``DENSE_MAX_ELEMENTS`` is set from.

    python scripts/alibi_paths.py [--out benchmarks/results]

bf16, causal, no padding, ``q = k = s``. The per-forward tensors (bias columns, dense bias) are
built before timing: what every layer after a forward's first pays. ``triton.testing.do_bench``
median, ms. Writes ``alibi-paths.json`` and ``alibi-paths.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch
import torch.nn.functional as F


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="torchembed-results")
    args = parser.parse_args()
    import triton
    import triton.testing as tt

    from torchembed.functional.alibi import alibi_prefill_bias, alibi_slopes
    from torchembed.kernels.alibi_attention import _sdpa_with_columns, bias_columns

    dev = torch.device("cuda")
    rows = []
    for h, d in ((16, 64), (32, 128)):
        for b in (1, 2, 4, 8):
            for s in (256, 512, 1024, 2048, 4096):
                if b * h * s * s > 2**31:
                    continue
                q, k, v = (torch.randn(b, h, s, d, device=dev, dtype=torch.bfloat16) for _ in range(3))
                key_bias = alibi_slopes(h, dev)[None, :, None] * (torch.arange(s, device=dev) - s + 1).float()
                scale = d**-0.5
                q_cols, k_cols = (c.expand(b, -1, -1, -1) for c in bias_columns(key_bias, s, scale, q.dtype))
                keep = torch.ones(s, s, dtype=torch.bool, device=dev).tril()[None, None]
                bias = alibi_prefill_bias(key_bias, keep, q.dtype)
                row = dict(h=h, d=d, b=b, s=s, elements=b * h * s * s)
                row["columns_ms"] = tt.do_bench(lambda: _sdpa_with_columns(q, k, v, q_cols, k_cols, scale=scale, dropout_p=0.0),
                                                return_mode="median")
                row["dense_ms"] = tt.do_bench(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale),
                                              return_mode="median")
                row["plain_causal_ms"] = tt.do_bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale),
                                                     return_mode="median")
                rows.append(row)
                print(row, flush=True)
                del q, k, v, bias, q_cols, k_cols
    meta = dict(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), device=torch.cuda.get_device_name(),
                torch=torch.__version__, triton=triton.__version__, python=platform.python_version(), dtype="bfloat16")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "alibi-paths.json").write_text(json.dumps(dict(meta=meta, results=rows), indent=1))
    lines = ["| heads x dim | b x s | b·h·s² | columns (ms) | dense (ms) | causal, no bias (ms) | faster |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        faster = "dense" if r["dense_ms"] < r["columns_ms"] else "columns"
        lines.append(f"| {r['h']} x {r['d']} | {r['b']} x {r['s']} | {r['elements']:.2e} | {r['columns_ms']:.4f} | "
                     f"{r['dense_ms']:.4f} | {r['plain_causal_ms']:.4f} | {faster} |")
    (out / "alibi-paths.md").write_text("\n".join([f"# ALiBi prefill paths ({meta['date']}, {meta['device']})", ""] + lines) + "\n")


if __name__ == "__main__":
    main()
