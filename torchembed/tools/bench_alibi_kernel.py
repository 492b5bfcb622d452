"""``torchembed bench alibi --kernel``: one ALiBi attention layer, torchembed against the alternatives.

Per shape ``(batch, heads, seq, head dim)`` (bf16 by default; q, k, v in HF's layout: ``(b, s, h, d)``
memory viewed as ``(b, h, s, d)``), in one run, ``triton.testing.do_bench`` medians in ms:

* ``floor``: ``F.scaled_dot_product_attention(is_causal=True)`` with no bias (flash / cuDNN): what
  attention without ALiBi costs. Decode (one query over a KV cache): the same without ``is_causal``
  (the query sees every key).
* ``sdpa-flash``, ``sdpa-cudnn``: the floor held to one SDPA backend (``sdpa_kernel``), still without a
  bias: FlashAttention-2 (the kernel family whose ``alibi_slopes`` flash-attn ships; its ALiBi costs
  at least this) and cuDNN's fused attention, so the table shows which one the floor is and how far
  apart the two are (CUDA only).
* ``torchembed``: ``ALiBiEmbedding.attention`` as dispatched by default (``fused=None``: the fused
  kernel wherever it runs; from ``AlibiTuning.skip_min_keys`` keys it leaves out the keys of negligible weight);
* ``kernel``: ``ALiBiEmbedding.attention(fused=True)``: the fused kernel, bias computed inside.
* ``flex``: ``flex_attention`` (compiled) with the ALiBi ``score_mod`` and a causal block mask
  made once outside the timing (prefill only).
* ``sdpa-bias``: SDPA with the ``(1, h, q, k)`` ALiBi + causal bias materialised once, outside the
  timing, in the input dtype.
* ``flash-attn``: ``flash_attn_func(..., causal=True, alibi_slopes=...)`` where flash-attn is installed.

Forward and forward+backward (gradients of q, k, v from a random output gradient). Each
implementation's error: max |out - ref| with ``ref`` the float32 attention (upcast inputs, scores
materialised) on batch 0, every head and up to 512 query rows (the last ones included); for
forward+backward also the max error of dq, dk, dv at shapes small enough for a full float32
reference. Each time is the median of ``--rounds`` ``do_bench`` runs, interleaved over the
implementations (a drift of the host during the run touches all alike). Forward + backward is also
replayed from a CUDA graph (``torch.autograd.grad``; floor, cuDNN, torchembed, kernel): the device
time, which the eager time exceeds where the host issues the launches slower than the GPU runs them.
Decode rows also give the host wall time per call over back-to-back calls (``bench.host_loop``),
which ``do_bench`` does not see.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from torchembed.tools import bench
from torchembed.tools.options import count

PREFILL = ((1, 16, 1024, 64), (4, 16, 2048, 64), (4, 16, 8192, 64), (4, 16, 16384, 64), (1, 32, 4096, 128),
           (8, 32, 2048, 128))
DECODE = ((1, 16, 4096, 64), (8, 32, 8192, 128))
IMPLS = ("floor", "sdpa-flash", "sdpa-cudnn", "torchembed", "kernel", "flex", "sdpa-bias", "flash-attn")
BIAS_FREE = ("floor", "sdpa-flash", "sdpa-cudnn")  # attention without ALiBi: no error against the ALiBi reference
# forward + backward also replayed from a CUDA graph (device time, the host's cost per call left out) for these
GRAPHED = ("floor", "sdpa-cudnn", "torchembed", "kernel")
GRAPH_PASS = "forward+backward, CUDA graph"
_ROWS = 512  # query rows of the float32 reference
_FULL_GRAD_SCORES = 2**28  # forward+backward errors where b * h * s * s is at most this


def _slopes(heads: int, device: torch.device) -> Tensor:
    from torchembed.functional.alibi import alibi_slopes

    return alibi_slopes(heads, device)


def _inputs(shape: tuple[int, int, int, int], q_len: int, dtype: torch.dtype, device: torch.device,
            grad: bool) -> tuple[Tensor, Tensor, Tensor]:
    """q ``(b, q_len, h, d)``, k, v ``(b, s, h, d)`` memory (HF's layout); leaves when ``grad``."""
    b, h, s, d = shape
    make = lambda n: torch.randn(b, n, h, d, device=device, dtype=dtype).requires_grad_(grad)  # noqa: E731
    return make(q_len), make(s), make(s)


def _heads_view(x: Tensor) -> Tensor:
    return x.transpose(1, 2)  # (b, s, h, d) memory as (b, h, s, d)


def _alibi_bias(slopes: Tensor, q_len: int, k_len: int, dtype: torch.dtype) -> Tensor:
    """``(1, h, q, k)``: ``-slope * (i - j)`` where key ``j`` is at or before query ``i`` (queries last),
    ``-inf`` after it."""
    device = slopes.device
    pos_q = torch.arange(k_len - q_len, k_len, device=device)[:, None]
    pos_k = torch.arange(k_len, device=device)[None, :]
    bias = torch.empty(1, slopes.shape[0], q_len, k_len, device=device, dtype=dtype)
    for h in range(slopes.shape[0]):  # one head at a time: no (h, q, k) float32 tensor
        bias[0, h] = (-slopes[h] * (pos_q - pos_k).float()).masked_fill(pos_k > pos_q, float("-inf")).to(dtype)
    return bias


def _reference(q: Tensor, k: Tensor, v: Tensor, slopes: Tensor, rows: Tensor) -> Tensor:
    """float32 ALiBi attention of ``rows`` (query indices, queries last) of batch 0: ``(h, rows, d)``."""
    qf, kf, vf = (x[0].transpose(0, 1).float() for x in (q, k, v))  # (h, s, d)
    q_len, k_len = q.shape[1], k.shape[1]
    pos_q = (k_len - q_len + rows)[:, None]
    pos_k = torch.arange(k_len, device=q.device)[None, :]
    s = qf[:, rows] @ kf.transpose(-1, -2) * q.shape[-1] ** -0.5
    s = s - slopes[:, None, None] * (pos_q - pos_k).float()
    s = s.masked_fill(pos_k > pos_q, float("-inf"))
    return s.softmax(-1) @ vf


def _rows(q_len: int, device: torch.device) -> Tensor:
    n = min(q_len, _ROWS)
    return torch.unique(torch.linspace(0, q_len - 1, n, device=device).round().long())


def _allow_recompiles(limit: int = 64) -> None:
    """Let FlexAttention compile for every benchmarked shape: past the recompile limit dynamo falls
    back to the unfused implementation, which would be timed instead."""
    import torch._dynamo

    for name in ("recompile_limit", "cache_size_limit"):  # (the name of older torch releases)
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(limit, getattr(torch._dynamo.config, name)))


def _implementations(shape: tuple[int, int, int, int], q_len: int, dtype: torch.dtype, device: torch.device,
                     smoke: bool) -> dict[str, Callable[[Tensor, Tensor, Tensor], Tensor] | str]:
    """name -> f(q, k, v) on (b, h, s, d) views, or the reason it is not measured."""
    from torchembed.positional import ALiBiEmbedding

    b, h, s, d = shape
    slopes = _slopes(h, device)
    scale = d ** -0.5
    decode = q_len != s
    alibi = ALiBiEmbedding(h, max_seq_len=8).to(device)
    impls: dict[str, Any] = {}
    impls["floor"] = ((lambda q, k, v: F.scaled_dot_product_attention(q, k, v)) if decode else
                      (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)))
    for name, backend in (("sdpa-flash", "FLASH_ATTENTION"), ("sdpa-cudnn", "CUDNN_ATTENTION")):
        impls[name] = _one_backend(backend, decode) if device.type == "cuda" else "CUDA only"
    impls["torchembed"] = lambda q, k, v: alibi.attention(q, k, v)
    impls["kernel"] = ((lambda q, k, v: alibi.attention(q, k, v, fused=True)) if device.type == "cuda" else
                       "the kernel is measured on CUDA")
    if decode:
        impls["flex"] = "not measured at decode"
    else:
        try:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        except ImportError as err:
            impls["flex"] = f"unavailable ({err})"
        else:
            _allow_recompiles()  # one compilation per shape and grad mode: past dynamo's default limit of 8
            flex = flex_attention if smoke else torch.compile(flex_attention, dynamic=False)
            mask = create_block_mask(lambda b_, h_, qi, ki: ki <= qi, None, None, s, s, device=device)

            def score_mod(score, b_, h_, qi, ki):
                return score + slopes[h_] * (ki - qi)

            impls["flex"] = lambda q, k, v: flex(q, k, v, score_mod=score_mod, block_mask=mask, scale=scale)
    bias_bytes = h * q_len * s * torch.finfo(dtype).bits // 8
    if bias_bytes > 16 * 2**30:
        impls["sdpa-bias"] = f"bias of {bias_bytes / 2**30:.0f} GB not materialised"
    else:
        bias = _alibi_bias(slopes, q_len, s, dtype)
        impls["sdpa-bias"] = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)
    try:
        from flash_attn import flash_attn_func
    except ImportError:
        impls["flash-attn"] = "not installed"
    else:
        impls["flash-attn"] = lambda q, k, v: flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                              causal=True, alibi_slopes=slopes).transpose(1, 2)
    return impls


def _one_backend(backend: str, decode: bool) -> Callable[[Tensor, Tensor, Tensor], Tensor] | str:
    """The floor's SDPA call held to one backend (``SDPBackend`` member name)."""
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError as err:
        return f"unavailable ({err})"
    chosen = getattr(SDPBackend, backend, None)
    if chosen is None:
        return f"this torch has no SDPBackend.{backend}"

    def call(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        with sdpa_kernel(chosen):
            return F.scaled_dot_product_attention(q, k, v, is_causal=not decode)

    return call


def _names() -> tuple[str, ...]:
    return IMPLS


def _max_err(a: Tensor, b: Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def _timed_rounds(fns: dict[str, Callable[[], Any]], device: torch.device, rounds: int,
                  grad_to_none: list[Tensor] | None = None) -> dict[str, list[float] | str]:
    """``do_bench`` of each callable ``rounds`` times, the rounds interleaved (a drift of the host or
    the clocks during the run touches every implementation alike): name -> times, or the failure."""
    times: dict[str, list[float] | str] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            if isinstance(times[name], str):
                continue
            try:
                times[name].append(bench.do_bench(fn, device, grad_to_none=grad_to_none))
            except Exception as exc:  # one implementation failing must not lose the others
                times[name] = f"failed: {bench.short_error(exc)}"
    return times


def _timing(times: list[float] | str) -> dict[str, Any]:
    if isinstance(times, str):
        return {"ms": times}
    return {"ms": statistics.median(times), "ms_rounds": times}


def measure_shape(shape: tuple[int, int, int, int], q_len: int, args: argparse.Namespace,
                  device: torch.device) -> list[dict[str, Any]]:
    """Forward (and, for prefill, forward+backward) records of every implementation at one shape."""
    b, h, s, d = shape
    dtype = args.torch_dtype
    decode = q_len != s
    label = f"{'decode' if decode else 'prefill'} {b},{h},{'1x' if decode else ''}{s},{d}"
    print(f"alibi kernel {label} ...", file=sys.stderr, flush=True)
    impls = _implementations(shape, q_len, dtype, device, args.smoke)
    slopes = _slopes(h, device)
    records, timed, base = [], {}, {}
    q, k, v = _inputs(shape, q_len, dtype, device, grad=False)
    views = [_heads_view(x) for x in (q, k, v)]
    rows = _rows(q_len, device)
    ref = _reference(q, k, v, slopes, rows)
    for name in _names():
        impl = impls[name]
        base[name] = {"shape": list(shape), "q_len": q_len, "phase": "decode" if decode else "prefill",
                      "pass": "forward", "impl": name, "label": label}
        if isinstance(impl, str):
            records.append({**base[name], "ms": impl})
            continue
        try:
            with torch.no_grad():
                out = impl(*views)
                base[name]["max_err"] = None if name in BIAS_FREE else _max_err(out[0][:, rows], ref)
                base[name]["host_ms"] = (bench.host_loop(lambda impl=impl: impl(*views), device)
                                         if decode and device.type == "cuda" else None)
            timed[name] = lambda impl=impl: impl(*views)
        except Exception as exc:  # one implementation failing must not lose the others
            records.append({**base[name], "ms": f"failed: {bench.short_error(exc)}"})
    with torch.no_grad():
        times = _timed_rounds(timed, device, args.rounds)
    records += [{**base[name], **_timing(t)} for name, t in times.items()]
    bench.free_memory(device)
    if not decode and "backward" in args.passes:
        records += _backward_records(shape, impls, args, device, label)
    return records


def _backward_records(shape: tuple[int, int, int, int], impls: dict[str, Any], args: argparse.Namespace,
                      device: torch.device, label: str) -> list[dict[str, Any]]:
    b, h, s, d = shape
    dtype = args.torch_dtype
    q, k, v = _inputs(shape, s, dtype, device, grad=True)
    grad = torch.randn(b, h, s, d, device=device, dtype=dtype)
    full = b * h * s * s <= _FULL_GRAD_SCORES
    truth = None
    if full:  # float32 gradients of the whole layer
        slopes = _slopes(h, device)
        qf, kf, vf = (x.detach().float().requires_grad_() for x in (q, k, v))
        bias = _alibi_bias(slopes, s, s, torch.float32)
        out = F.scaled_dot_product_attention(*(_heads_view(x) for x in (qf, kf, vf)), attn_mask=bias)
        out.backward(grad.float())
        truth = [x.grad for x in (qf, kf, vf)]
        del qf, kf, vf, bias, out
    records, steps, base = [], {}, {}
    for name in _names():
        impl = impls[name]
        base[name] = {"shape": list(shape), "q_len": s, "phase": "prefill", "pass": "forward+backward", "impl": name,
                      "label": label}
        if isinstance(impl, str):
            records.append({**base[name], "ms": impl})
            continue

        def step(impl=impl) -> None:
            impl(*(_heads_view(x) for x in (q, k, v))).backward(grad)

        try:
            step()
            if truth is not None and name not in BIAS_FREE:
                base[name]["max_err"] = max(_max_err(x.grad, t) for x, t in zip((q, k, v), truth))
            steps[name] = step
        except Exception as exc:
            records.append({**base[name], "ms": f"failed: {bench.short_error(exc)}"})
        for x in (q, k, v):
            x.grad = None
    times = _timed_rounds(steps, device, args.rounds, grad_to_none=[q, k, v])
    records += [{**base[name], **_timing(t)} for name, t in times.items()]
    bench.free_memory(device)
    if device.type == "cuda":  # device time: the same step replayed from a CUDA graph
        for name in GRAPHED:
            if name not in steps:
                continue

            def grads(impl=impls[name]) -> None:
                torch.autograd.grad(impl(*(_heads_view(x) for x in (q, k, v))), (q, k, v), grad)

            try:
                ms = bench.graph_time(grads, device, calls=3)
            except Exception as exc:
                ms = f"failed: {bench.short_error(exc)}"
            records.append({**base[name], "pass": GRAPH_PASS, "ms": ms, "max_err": None})
            bench.free_memory(device)
    return records


def markdown(records: list[dict[str, Any]]) -> str:
    out = []
    for phase, passname, title in (("prefill", "forward", "prefill, forward"),
                                   ("prefill", "forward+backward", "prefill, forward + backward"),
                                   ("prefill", GRAPH_PASS, "prefill, forward + backward replayed from a CUDA graph "
                                    "(device time: the host's cost per call left out)"),
                                   ("decode", "forward", "decode (one query over the KV cache)")):
        chosen = [r for r in records if r["phase"] == phase and r["pass"] == passname]
        if not chosen:
            continue
        labels = list(dict.fromkeys(r["label"] for r in chosen))
        rows = []
        for label in labels:
            by = {r["impl"]: r for r in chosen if r["label"] == label}
            floor = by.get("floor", {}).get("ms")
            names = _names()
            cells = []
            for name in names:
                ms = by.get(name, {}).get("ms")
                if isinstance(ms, float) and isinstance(floor, float) and name != "floor":
                    cells.append(f"{ms:.3f} ({floor / ms:.2f}x)")
                else:
                    cells.append(bench.fmt(ms))
            alibi_names = [n for n in names if n not in BIAS_FREE]
            errs = [f"{by[name]['max_err']:.1e}" if isinstance(by.get(name, {}).get("max_err"), float) else "-"
                    for name in alibi_names]
            row = [label.split(" ", 1)[1], *cells, " / ".join(errs)]
            if phase == "decode":
                row.append(" / ".join(bench.fmt(by.get(n, {}).get("host_ms"), 3) for n in ("floor", "torchembed",
                                                                                           "sdpa-bias")))
            rows.append(row)
        headers = ["b, h, s, d", *(f"{n} (ms)" for n in _names()),
                   "max error: " + " / ".join(n for n in _names() if n not in BIAS_FREE)]
        if phase == "decode":
            headers.append("host ms/call: floor / torchembed / sdpa-bias")
        out += [f"## {title}", "", bench.md_table(headers, rows), ""]
    out.append("ms: the median of `--rounds` `triton.testing.do_bench` medians, the rounds interleaved over the "
               "implementations (CUDA graph: the median of 20 replays of 3 steps); (Nx): the floor's time over this one's (1.00x = as fast as "
               "attention without ALiBi). sdpa-flash / sdpa-cudnn: the floor held to FlashAttention-2 / cuDNN, no bias. "
               "Errors: max |out - float32 reference| (forward: batch 0, all heads, up to "
               f"{_ROWS} query rows; forward + backward: max over dq, dk, dv, where the float32 reference fits).")
    return "\n".join(out)


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--passes", nargs="+", default=["forward", "backward"], choices=["forward", "backward"],
                        help="forward only, or forward and forward+backward (default)")
    parser.add_argument("--rounds", type=count(1), default=3,
                        help="do_bench runs per cell, interleaved over the implementations; the cell shows their "
                        "median (default 3)")
    parser.add_argument("--shapes", nargs="+", default=None,
                        help="prefill shapes b,h,s,d (default: the issue's and 4,16,16384,64); decode ones as "
                        "b,h,1xS,d")


def _parse(shape: str) -> tuple[tuple[int, int, int, int], bool]:
    b, h, s, d = shape.split(",")
    decode = s.startswith("1x")
    return (int(b), int(h), int(s[2:] if decode else s), int(d)), decode


def run(args: argparse.Namespace) -> int:
    """The kernel table (``args`` from ``torchembed bench alibi --kernel ...``)."""
    device = bench.setup(args)
    if args.shapes:
        parsed = [_parse(x) for x in args.shapes]
        prefill = [s for s, dec in parsed if not dec]
        decode = [s for s, dec in parsed if dec]
    elif args.smoke:
        prefill, decode = [(1, 2, 64, 16)], [(1, 2, 64, 16)]
    else:
        prefill, decode = list(PREFILL), list(DECODE)
    if args.smoke and args.dtype == "bfloat16":
        args.torch_dtype = torch.float32
    env, records = bench.environment(device), []
    budget = bench.Budget(args.max_seconds)

    def save(quiet: bool) -> str:
        md = markdown(records)
        bench.write_results(args, "alibi-kernel", "torchembed bench alibi --kernel", env, {"results": records}, md,
                            quiet=quiet)
        return md

    with bench.no_interpreter(device):
        for shape, q_len in [(s, s[2]) for s in prefill] + [(s, 1) for s in decode]:
            if budget.exhausted():
                records.append({"shape": list(shape), "q_len": q_len, "phase": "prefill" if q_len > 1 else "decode",
                                "pass": "forward", "impl": "floor", "label": str(shape), "ms": "skipped: time budget"})
                continue
            records += measure_shape(shape, q_len, args, device)
            save(quiet=True)
            bench.free_memory(device)
    print(save(quiet=False))
    return 0

