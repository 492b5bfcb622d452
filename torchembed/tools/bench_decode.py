"""``torchembed bench decode``: one decode step's attention over a long KV cache, against its floor.

What a patched model's decode step runs (the split-key kernel, :func:`torchembed.kernels.attention.fused_attention`)
against SDPA's backends called the ways transformers calls them (flash, memory-efficient, cuDNN once its
plan for the length exists, math; grouped heads read natively, packed into the query length as
transformers 5.2x does for one query with a mask, or repeated), in one run. Cases (bf16, head dim 128):

* ``gqa``: LLaMA-3.1-8B / Qwen3-8B attention (32 query heads over 8 kv heads), batch 1, no mask;
* ``gqa-padded``: the same, batch 4, left-padded to lengths N, N-1000, N-2000, N-3000 (a bool mask);
* ``static``: batch 1 over a static cache of N slots of which the first N/8 are filled (a bool mask);
* ``alibi``: BLOOM-7B1 / MPT-7B attention (32 heads, no grouping), batch 1, the key-only ALiBi bias
  (SDPA: the bias materialised as its float mask, what ``cudnn_decode=True`` runs).

The floor is the bytes of the keys and values the step must read (the kept keys only) over the measured
copy bandwidth; "of floor" = floor / time (1.00 = at the floor). ``--sweep`` first times the kernel under
each launch configuration in a grid (``AlibiTuning``) and uses the best per case.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from torchembed.tools import bench

__all__ = ["main", "CASES"]

CASES = ("gqa", "gqa-padded", "static", "alibi")
_BACKENDS = ("flash", "efficient", "cudnn", "math")


def _case(name: str, keys: int, device: torch.device, dtype: torch.dtype, smoke: bool) -> dict[str, Any]:
    """q (b, h, 1, d) over k, v (b, hk, n, d) in a KV cache's layout, the mask (b, 1, 1, n) or None, the
    ALiBi key bias or None, and the bytes the step must read."""
    heads, kv_heads, dim = (4, 2, 32) if smoke else (32, 8, 128)
    batch, lengths, mask_needed, bias = 1, [keys], False, None
    if name == "gqa-padded":
        step = max(1, keys // 16) if smoke else 1000
        batch, lengths, mask_needed = 4, [keys - i * step for i in range(4)], True
    elif name == "static":
        lengths, mask_needed = [keys // 8], True
    elif name == "alibi":
        kv_heads = heads
    gen = torch.Generator(device="cpu").manual_seed(keys)
    q = torch.randn(batch, 1, heads, dim, generator=gen).to(device, dtype).transpose(1, 2)
    k = torch.randn(batch, kv_heads, keys, dim, dtype=dtype, device=device)
    v = torch.randn_like(k)
    mask = None
    if mask_needed:
        positions = torch.arange(keys, device=device)
        if name == "static":
            mask = (positions < lengths[0])[None, None, None, :].expand(batch, 1, 1, keys).contiguous()
        else:
            mask = torch.stack([positions >= keys - n for n in lengths])[:, None, None, :]
    if name == "alibi":
        from torchembed.functional.alibi import alibi_key_bias, alibi_slopes

        bias = alibi_key_bias(alibi_slopes(heads, device), key_len=keys)
    kv_bytes = 2 * kv_heads * dim * k.element_size() * sum(lengths)
    return {"q": q, "k": k, "v": v, "mask": mask, "bias": bias, "bytes": kv_bytes, "batch": batch,
            "heads": heads, "kv_heads": kv_heads, "dim": dim, "lengths": lengths}


def _torchembed(c: dict[str, Any]) -> Callable[[], Any]:
    from torchembed.kernels.route import flash_unsupported
    from torchembed.kernels.attention import fused_attention, mask_rows

    q, k, v, mask, bias = c["q"], c["k"], c["v"], c["mask"], c["bias"]
    assert flash_unsupported(q, k, v, mask) is None
    rows = None if mask is None else mask_rows(mask)  # (once per forward for all layers)
    scale = c["dim"] ** -0.5
    return lambda: fused_attention(q, k, v, bias, scale=scale, key_bias=bias is not None, keep=mask, rows=rows)


def _sdpa_forms(c: dict[str, Any]) -> dict[str, Callable[[], Any]]:
    """SDPA called as transformers calls it for this step: grouped heads natively (``enable_gqa``), packed
    into the query length (one query with a mask: transformers 5.2x) or repeated; ALiBi: the bias
    materialised as a float mask."""
    q, k, v, mask, bias = c["q"], c["k"], c["v"], c["mask"], c["bias"]
    group, scale = c["heads"] // c["kv_heads"], c["dim"] ** -0.5
    if bias is not None:
        from torchembed.functional.alibi import alibi_decode_bias

        additive = alibi_decode_bias(bias, mask, q.dtype)
        return {"bias mask": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=additive, scale=scale)}
    forms = {"native gqa": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                                                  enable_gqa=group > 1)}
    if group > 1:
        packed = q.reshape(q.shape[0], c["kv_heads"], group, c["dim"])
        forms["packed gqa"] = lambda: F.scaled_dot_product_attention(packed, k, v, attn_mask=mask, scale=scale)
        kr, vr = (x.repeat_interleave(group, 1) for x in (k, v))
        forms["repeated kv"] = lambda: F.scaled_dot_product_attention(q, kr, vr, attn_mask=mask, scale=scale)
    return forms


def _copies(name: str, keys: int, device: torch.device, dtype: torch.dtype, smoke: bool = False) -> list[dict[str, Any]]:
    """The inputs of case ``name`` at ``keys`` keys, in as many fresh copies as it takes to exceed L2 twice (at
    most 8): what :func:`_device_ms` rotates through."""
    first = _case(name, keys, device, dtype, smoke)
    return [first] + [_case(name, keys, device, dtype, smoke)
                      for _ in range(bench.n_copies(first["bytes"], max_copies=8) - 1)]


def _device_ms(make: Callable[[dict[str, Any]], Callable[[], Any]], copies: list[dict[str, Any]],
               device: torch.device) -> float:
    """Device time of one call (ms): calls over rotated input copies (more than L2 together) replayed from
    a CUDA graph, so the host's cost per call is left out; elsewhere the synchronized wall time."""
    fns = [make(c) for c in copies]
    if device.type != "cuda":
        return bench.do_bench(fns[0], device)
    per_graph = max(10, len(fns))
    return bench.graph_time(bench.rotate(fns), device, calls=per_graph - per_graph % len(fns))


def _time_sdpa(copies: list[dict[str, Any]], device: torch.device) -> dict[str, float | None]:
    """The best device time of each SDPA backend over the forms it takes (None: it takes none)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}
    times: dict[str, float | None] = {}
    for name, backend in backends.items():
        best = None
        for form in _sdpa_forms(copies[0]):
            with sdpa_kernel([backend]):  # (a benchmark: process-wide switches are fine here)
                try:
                    _sdpa_forms(copies[0])[form]()
                except RuntimeError:
                    continue
                ms = _device_ms(lambda c, form=form: _sdpa_forms(c)[form], copies, device)
            best = ms if best is None else min(best, ms)
        times[name] = best
    return times


def _grid(smoke: bool) -> list[tuple[tuple[int, int, int, int], int]]:
    """(BLOCK_R, BLOCK_N, warps, stages) x decode programs per multiprocessor: one stage (no pipelining, latency
    hidden by more programs) to four, one warp to eight, one program per multiprocessor to eight."""
    if smoke:
        return [((16, 16, 4, 1), 1), ((16, 32, 4, 1), 2)]
    blocks = [(16, n, w, s) for n, w, s in itertools.product((32, 64, 128), (1, 2, 4, 8), (1, 2, 3, 4))]
    return [(b, p) for b in blocks for p in (1, 2, 4, 8)]


def _tuning(config: Sequence[int], per_sm: int, dim: int, masked: bool) -> dict[str, Any]:
    """The ``AlibiTuning`` change that runs the decode kernel under one launch configuration: its blocks, and
    ``per_sm`` programs per multiprocessor exactly (whatever the keys a part keeps)."""
    from torchembed.kernels.attention_plan import block_d

    return {"blocks": {("decode", block_d(dim), masked): tuple(config)}, "decode_programs_per_sm": (per_sm, per_sm),
            "decode_masked_programs_per_sm": per_sm}


def _sweep(cases: dict[tuple[str, int], dict[str, Any]], device: torch.device, smoke: bool) -> dict[str, Any]:
    """The kernel's time per case under each configuration; the best per case."""
    from torchembed.kernels.settings import changed

    records, best = [], {}
    for config, per_sm in _grid(smoke):
        for (name, keys), c in cases.items():
            record = {"case": name, "keys": keys, "config": config, "per_sm": per_sm}
            with changed(alibi=_tuning(config, per_sm, c["dim"], c["mask"] is not None)):
                try:
                    record["ms"] = bench.do_bench(_torchembed(c), device)
                except Exception as exc:  # a configuration that does not compile or fit: recorded
                    records.append({**record, "error": bench.short_error(exc)})
                    continue
            records.append(record)
            if (name, keys) not in best or record["ms"] < best[(name, keys)]["ms"]:
                best[(name, keys)] = {k: record[k] for k in ("config", "per_sm", "ms")}
    return {"records": records, "best": {f"{n}@{k}": v for (n, k), v in best.items()}}


def sweep_table(sweep: dict[str, Any], top: int = 5) -> str:
    """The ``top`` fastest launch configurations of each case in a sweep, as markdown (``do_bench`` time: L2
    flushed before each call, the launch included)."""
    rows = []
    for case in sweep["best"]:
        name, keys = case.rsplit("@", 1)
        timed = sorted((r for r in sweep["records"] if r["case"] == name and r["keys"] == int(keys) and "ms" in r),
                       key=lambda r: r["ms"])
        rows += [[name, keys, i + 1, "/".join(map(str, r["config"])), r["per_sm"], f"{r['ms'] * 1e3:.1f}"]
                 for i, r in enumerate(timed[:top])]
    return bench.md_table(["case", "keys", "rank", "BLOCK_R/BLOCK_N/warps/stages", "programs per SM", "us"], rows)


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="torchembed bench decode", description=__doc__.split("\n\n")[0])
    bench.add_common_args(parser)
    parser.add_argument("--keys", type=int, nargs="+", default=[16384, 65536, 131072], help="KV cache lengths")
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    parser.add_argument("--sweep", action="store_true", help="time the kernel's launch configurations first")
    args = parser.parse_args(list(argv))
    device = bench.setup(args)
    if args.smoke:
        args.keys = [64, 256]
    env = bench.environment(device)
    bandwidth = bench.copy_bandwidth(device)
    env["copy_bandwidth_gbs"] = bandwidth / 1e9
    specs = [(name, n) for name in args.cases for n in args.keys]
    sweep = None
    if args.sweep:
        sweep = _sweep({spec: _case(*spec, device, args.torch_dtype, args.smoke) for spec in specs}, device, args.smoke)
        bench.free_memory(device)
    rows, records = [], []
    from torchembed.kernels.settings import changed

    for name, keys in specs:
        copies = _copies(name, keys, device, args.torch_dtype, args.smoke)
        first = copies[0]
        floor = first["bytes"] / bandwidth * 1e3
        chosen = (sweep or {}).get("best", {}).get(f"{name}@{keys}")
        tuning = (changed(alibi=_tuning(chosen["config"], chosen["per_sm"], first["dim"],
                                        first["mask"] is not None)) if chosen else contextlib.nullcontext())
        with tuning:
            ours = _device_ms(_torchembed, copies, device)
            host = bench.host_loop(_torchembed(first), device, calls=50)
        sdpa = _time_sdpa(copies, device) if device.type == "cuda" else {b: None for b in _BACKENDS}
        timed = [t for t in sdpa.values() if t is not None]
        best_sdpa = min(timed) if timed else None
        record = {"case": name, "keys": keys, "batch": first["batch"], "lengths": first["lengths"], "floor_ms": floor,
                  "torchembed_ms": ours, "torchembed_host_loop_ms": host, "sdpa_ms": sdpa, "sdpa_best_ms": best_sdpa,
                  "config": chosen, "of_floor": floor / ours if ours else None}
        records.append(record)

        def frac(ms: float | None) -> str:
            return "-" if ms is None else f"{floor / ms:.2f}"

        rows.append([name, keys, first["batch"], f"{floor * 1e3:.1f}", f"{ours * 1e3:.1f}", frac(ours),
                     *(frac(sdpa[b]) for b in _BACKENDS),
                     "-" if best_sdpa is None else f"{best_sdpa / ours:.2f}", f"{host * 1e3:.1f}"])
        del first, copies
        bench.free_memory(device)
    headers = ["case", "keys", "batch", "floor us", "torchembed us", "of floor", *(f"SDPA {b}" for b in _BACKENDS),
               "SDPA best / torchembed", "eager call us"]
    md = "\n".join([
        "One decode step's attention (one query per sequence over the KV cache): device time (calls replayed "
        "from a CUDA graph, inputs rotated through copies larger than L2) as a fraction of the floor (K and V "
        "bytes of the kept keys once over the measured copy bandwidth; 1.00 = at the floor). SDPA: each backend's "
        "best over the ways transformers calls it; '-': the backend takes none of them. Eager call: wall time per "
        "call of torchembed's route in a loop of back-to-back calls (host included).",
        "", bench.md_table(headers, rows)])
    if sweep:
        md += ("\n\nThe sweep's fastest launch configurations per case (device time of one call, L2 flushed before "
               "it, the launch included; the table above runs each case's first):\n\n" + sweep_table(sweep))
    print(md)
    bench.write_results(args, "decode-attention", "Decode attention against its floor", env,
                        {"results": records, "sweep": sweep}, md)
    return 0
