"""How far to split the keys of the fused ALiBi decode kernel: a sweep on the GPU.

For each decode shape (one query per sequence over a KV cache, HF's ``(b, s, h, d)`` memory) and each
``(AlibiTuning.decode_programs_per_sm, decode block shape)`` (set with ``settings.changed(alibi=...)``), the
kernel's device time (``triton.testing.do_bench`` median, ms) next to SDPA without a bias (the floor) in
the same run; each candidate's output is checked against a float32 reference. Prints a table and
writes ``DIR/alibi-decode-splits.json``.

    python benchmarks/probes/alibi_decode_splits.py [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torchembed.kernels.settings import changed

SHAPES = [(1, 16, 16, 4096, 64), (8, 16, 16, 8192, 64), (1, 32, 32, 4096, 128), (8, 32, 32, 8192, 128),
          (1, 32, 8, 16384, 128), (32, 32, 8, 2048, 128)]  # (b, h, kv heads, keys, d)
PER_SM = (1, 2, 3, 4, 6, 8)
BLOCKS = {64: [(16, 128, 8, 3), (16, 64, 4, 3), (16, 32, 4, 2), (16, 128, 4, 3), (16, 256, 8, 3)],
          128: [(16, 32, 4, 2), (16, 64, 4, 3), (16, 128, 4, 3), (16, 64, 8, 3)]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    from triton.testing import do_bench

    from torchembed.functional.alibi import alibi_slopes
    from torchembed.kernels import attention_plan as K
    from torchembed.positional import ALiBiEmbedding

    dev = torch.device("cuda")
    rows = []
    for b, h, hk, n, d in SHAPES:
        torch.manual_seed(0)
        q = torch.randn(b, 1, h, d, device=dev, dtype=torch.bfloat16).transpose(1, 2)
        k, v = (torch.randn(b, n, hk, d, device=dev, dtype=torch.bfloat16).transpose(1, 2) for _ in range(2))
        alibi = ALiBiEmbedding(h, max_seq_len=8).to(dev)
        slopes = alibi_slopes(h, dev)
        kf, vf = (x.float().repeat_interleave(h // hk, 1) for x in (k, v))
        s = q.float() @ kf.transpose(-1, -2) * d**-0.5 - slopes[:, None, None] * (n - 1 - torch.arange(n, device=dev)).float()
        ref = s.softmax(-1) @ vf
        floor = do_bench(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=hk != h), return_mode="median")
        for per_sm in PER_SM:
            for cfg in BLOCKS[K.block_d(d)]:
                # (tuned forgets the kept plans on entry and exit: each candidate makes its own)
                with changed(alibi=dict(decode_programs_per_sm=(per_sm, per_sm), blocks={("decode", K.block_d(d), False): cfg})):
                    try:
                        out = alibi.attention(q, k, v, fused=True)
                        err = (out.float() - ref).abs().max().item()
                        ms = do_bench(lambda: alibi.attention(q, k, v, fused=True), return_mode="median")
                    except Exception as exc:  # a block shape this GPU cannot run
                        err, ms = float("nan"), f"failed: {type(exc).__name__}: {str(exc)[:80]}"
                rows.append({"shape": [b, h, hk, n, d], "per_sm": per_sm, "config": list(cfg), "ms": ms,
                             "floor_ms": floor, "max_err": err})
                print(f"b{b} h{h}/{hk} n{n} d{d} per_sm={per_sm} {cfg}: "
                      f"{ms if isinstance(ms, str) else f'{ms * 1e3:.1f} us'} (floor {floor * 1e3:.1f} us) err {err:.1e}",
                      flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    path = Path(args.out) / "alibi-decode-splits.json"
    path.write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                "device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, indent=1))
    best = {}
    for r in rows:
        key = tuple(r["shape"])
        if isinstance(r["ms"], float) and (key not in best or r["ms"] < best[key]["ms"]):
            best[key] = r
    print("\nbest per shape:")
    for key, r in best.items():
        print(f"  {key}: per_sm={r['per_sm']} {tuple(r['config'])} {r['ms'] * 1e3:.1f} us, floor {r['floor_ms'] * 1e3:.1f} us "
              f"({r['floor_ms'] / r['ms']:.2f}x)")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
