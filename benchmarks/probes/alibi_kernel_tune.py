"""The fused ALiBi attention kernel on the GPU: correctness, block-shape sweep, then the benchmarks.

    python benchmarks/probes/alibi_kernel_tune.py [--out DIR] [--phases warm check sweep bench models] [--smoke]
                                        [--apply FILE] [--bench-args "..."] [--model-args "..."]

* ``warm``: compiles every kernel variant the later phases launch, in parallel processes (Triton's
  on-disk cache then serves the main process);
* ``check``: forward and backward against a float64 reference on fresh random inputs: dtypes,
  head dims (a non-power-of-2 one), GQA/MQA, chunked prefill, decode (split keys), left padding, a
  mask with holes, the key-bias form, HF's strided layout; CUDA-graph replay; ``torch.compile``;
* ``sweep``: times each candidate ``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` per kernel and head
  dim (``triton.testing.do_bench`` median), keeps the fastest for the rest of the run (the blocks of
  ``settings().alibi``, an ``AlibiTuning``, through ``settings.changed(alibi=...)``) and writes them to
  ``DIR/alibi-kernel-tune.json``;
* ``bench``: ``torchembed bench alibi --kernel`` (``--bench-args``) with those block shapes;
* ``models``: ``torchembed bench alibi`` (``--model-args``) with those block shapes.

``--apply FILE`` loads block shapes a previous sweep wrote instead of sweeping.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import shlex
import sys
import time
import traceback
from pathlib import Path

import torch
from torchembed.kernels.settings import changed, settings

# head dim -> candidates (BLOCK_M, BLOCK_N, num_warps, num_stages); decode: (BLOCK_R, BLOCK_N, ...)
FWD = {64: [(128, 64, 8, 3), (128, 64, 4, 3), (64, 64, 4, 3), (64, 64, 4, 2), (64, 128, 4, 3), (64, 32, 4, 3),
            (128, 128, 8, 3)],
       128: [(128, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 3), (64, 64, 4, 2), (64, 128, 4, 3), (64, 32, 4, 3),
             (128, 128, 8, 2)]}
# forward variants (name, keys/values through tensor descriptors where the GPU has them), each timed
# with every FWD candidate; the fastest variant is kept for the rest of the run
FWD_VARIANTS = [("tma", True), ("pointers", False)]
DKDV = {64: [(64, 64, 8, 2), (64, 128, 8, 2), (32, 128, 4, 3), (64, 64, 4, 3), (32, 64, 4, 3), (128, 128, 8, 2)],
        128: [(64, 64, 8, 2), (32, 128, 8, 2), (64, 128, 8, 2), (32, 64, 4, 3), (64, 64, 4, 2), (32, 128, 4, 2)]}
DQ = {64: [(128, 64, 8, 2), (64, 64, 4, 3), (128, 32, 8, 3), (64, 32, 4, 3), (128, 128, 8, 2)],
      128: [(128, 64, 8, 2), (64, 64, 4, 3), (128, 32, 8, 2), (64, 32, 4, 3)]}
DECODE = {64: [(16, 128, 4, 3), (16, 64, 4, 3), (16, 32, 4, 2), (16, 128, 8, 3), (16, 256, 8, 3)],
          128: [(16, 64, 4, 3), (16, 128, 4, 3), (16, 32, 4, 2), (16, 64, 8, 3)]}
# (batch, heads, kv heads, queries, keys, head dim) the sweep times, per head dim
PREFILL_SHAPE = {64: (4, 16, 16, 4096, 4096, 64), 128: (2, 32, 32, 4096, 4096, 128)}
DECODE_SHAPES = {64: [(1, 16, 16, 1, 4096, 64), (8, 16, 16, 1, 8192, 64)],
                 128: [(8, 32, 32, 1, 8192, 128), (1, 32, 32, 1, 4096, 128)]}
_SMOKE_PREFILL = {64: (1, 2, 2, 64, 64, 64), 128: (1, 2, 2, 64, 64, 128)}
_SMOKE_DECODE = {64: [(1, 2, 2, 1, 64, 64)], 128: [(1, 2, 2, 1, 64, 128)]}


def _kernels():
    from torchembed.kernels import attention_plan

    return attention_plan


# The block shapes chosen so far, in force for the rest of the run: each a ``settings.changed(alibi=...)``
# block (merged into the blocks before it) entered here and left when main returns.
_CHOSEN = contextlib.ExitStack()


def _keep_blocks(blocks: dict) -> None:
    """``blocks`` (``(kind, BLOCK_D, masked) -> (BLOCK_M or BLOCK_R, BLOCK_N, num_warps, num_stages)``) for
    the rest of the run (kept plans and launches are forgotten)."""
    _CHOSEN.enter_context(changed(alibi=dict(blocks=blocks)))


def _case(batch, heads, kv_heads, q_len, k_len, dim, dtype, device, *, masked=False, key_bias=False, grad=False,
          layout="bshd", seed=0):
    """Inputs of one kernel call: q, k, v (HF's (b, s, h, d) memory viewed as (b, h, s, d)), the bias
    (slopes or key bias), keep (left padding) or None."""
    from torchembed.functional.alibi import alibi_slopes

    gen = torch.Generator(device="cpu").manual_seed(seed)

    def make(n, h):
        x = torch.randn(batch, n, h, dim, generator=gen).to(device, dtype)
        return x.transpose(1, 2) if layout == "bshd" else x.transpose(1, 2).contiguous()

    q, k, v = make(q_len, heads), make(k_len, kv_heads), make(k_len, kv_heads)
    slopes = alibi_slopes(heads, device)
    keep = None
    if masked:
        positions = torch.arange(k_len, device=device)
        pad = torch.tensor([(3 * i) % max(1, k_len // 2) for i in range(batch)], device=device)
        valid = positions[None, :] >= pad[:, None]
        keep = (positions[None, :] <= positions[k_len - q_len:, None])[None, None] & valid[:, None, None, :]
        if masked == "holes":  # a stripe of keys masked in the middle of some rows
            keep = keep.clone()
            keep[-1, 0, q_len // 2:, k_len // 2: k_len // 2 + 3] = False
    bias = slopes
    if key_bias:
        bias = (slopes[None, :, None] * torch.arange(1 - k_len, 1, device=device).float()).expand(batch, -1, -1).contiguous()
    if grad:
        q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    return q, k, v, bias, keep


def _truth(q, k, v, bias, keep, key_bias):
    """float64 attention with the same bias and mask (rows that keep nothing: 0)."""
    group = q.shape[1] // k.shape[1]
    qd, kd, vd = q.double(), k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    q_len, k_len = q.shape[2], k.shape[2]
    s = qd @ kd.transpose(-1, -2) * q.shape[-1] ** -0.5
    if key_bias:
        s = s + bias.double()[:, :, None, :]
    else:
        s = s + bias.double()[None, :, None, None] * torch.arange(k_len, device=q.device).double()
    if keep is None:
        positions = torch.arange(k_len, device=q.device)
        keep = (positions[None, :] <= positions[k_len - q_len:, None])[None, None]
    return (s.masked_fill(~keep, float("-inf")).softmax(-1).nan_to_num(0.0)) @ vd


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")  # (cpu: --smoke under TRITON_INTERPRET=1)


def _bench(fn) -> float:
    """Median ms of ``fn``: ``triton.testing.do_bench`` on CUDA, a few timed calls elsewhere (--smoke)."""
    if torch.cuda.is_available():
        import triton.testing

        return triton.testing.do_bench(fn, return_mode="median")
    fn()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[1]


def _launch_forward(q, k, v, bias, keep, key_bias, need_lse=False):
    from torchembed.kernels.attention import _forward, mask_rows

    rows = None if keep is None else mask_rows(keep)
    return _forward(q, k, v, bias, rows, keep, q.shape[-1] ** -0.5, key_bias, need_lse)


# ------------------------------------------------------------------------------------------------
# warm: compile in parallel processes
# ------------------------------------------------------------------------------------------------


def _jobs(smoke: bool) -> list[tuple]:
    jobs = []
    prefill = _SMOKE_PREFILL if smoke else PREFILL_SHAPE
    decode = _SMOKE_DECODE if smoke else DECODE_SHAPES
    for dim in (64, 128):
        for variant in FWD_VARIANTS:
            for cfg in FWD[dim]:
                jobs.append(("fwd", dim, cfg, prefill[dim], False, variant))
            jobs.append(("fwd", dim, FWD[dim][0], prefill[dim], True, variant))
        for cfg in DKDV[dim]:
            jobs.append(("dkdv", dim, cfg, prefill[dim], False))
        for cfg in DQ[dim]:
            jobs.append(("dq", dim, cfg, prefill[dim], False))
        for cfg in DECODE[dim]:
            for shape in decode[dim]:
                jobs.append(("decode", dim, cfg, shape, False))
    jobs += [("check", case) for case in CHECK_CASES]
    if not smoke:  # FlexAttention's compilations (inductor's caches then serve the benchmark)
        from torchembed.tools.bench_alibi_kernel import PREFILL

        jobs += [("flex", shape) for shape in PREFILL]
    return jobs


def _run_job(job: tuple) -> str:
    if job[0] == "check":
        return _run_check_job(job[1])
    if job[0] == "flex":
        return _run_flex_job(job[1])
    kind, dim, cfg, shape, masked, *variant = job
    try:
        K = _kernels()
        if variant:
            _use_variant(variant[0])
        with changed(alibi=dict(blocks={(kind, K.block_d(dim), masked): cfg})):  # (plans made afresh inside)
            q, k, v, bias, keep = _case(*shape, torch.bfloat16, _device(), masked=masked, key_bias=masked,
                                        grad=kind in ("dkdv", "dq"))
            if kind in ("fwd", "decode"):
                with torch.no_grad():
                    _launch_forward(q, k, v, bias, keep, masked)
            else:
                _time_backward(q, k, v, bias, keep, masked, reps=False)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
        return f"ok {job}"
    except Exception as exc:  # reported, the sweep skips it
        return f"FAILED {job}: {type(exc).__name__}: {str(exc)[:300]}"


def _run_check_job(case: tuple) -> str:
    from torchembed.kernels.attention import alibi_flash

    name, b, h, hk, m, n, d, dtype, masked, key_bias, layout = case
    try:
        q, k, v, bias, keep = _case(b, h, hk, m, n, d, dtype, _device(), masked=masked, key_bias=key_bias, grad=True,
                                    layout=layout, seed=len(name))
        alibi_flash(q, k, v, bias, scale=d ** -0.5, key_bias=key_bias, keep=keep).sum().backward()
        return f"ok check {name}"
    except Exception as exc:
        return f"FAILED check {name}: {type(exc).__name__}: {str(exc)[:300]}"


def _run_flex_job(shape: tuple) -> str:
    from torchembed.tools import bench_alibi_kernel as kb

    try:
        b, h, s, d = shape
        impl = kb._implementations(shape, s, torch.bfloat16, _device(), False)["flex"]
        if isinstance(impl, str):
            return f"ok flex {shape}: {impl}"
        q, k, v = (kb._heads_view(x) for x in kb._inputs(shape, s, torch.bfloat16, _device(), grad=True))
        with torch.no_grad():
            impl(q.detach(), k.detach(), v.detach())
        impl(q, k, v).sum().backward()
        torch.cuda.synchronize()
        return f"ok flex {shape}"
    except Exception as exc:
        return f"FAILED flex {shape}: {type(exc).__name__}: {str(exc)[:300]}"


def _use_variant(variant: tuple) -> None:
    K = _kernels()
    _, K.USE_TMA = variant


def _worker_init() -> None:
    os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = "1"  # the processes compile in parallel already


def warm(args) -> None:
    jobs = _jobs(args.smoke)[: args.max_jobs]
    start = time.perf_counter()
    workers = min(args.workers, len(jobs))
    pool = mp.get_context("spawn").Pool(workers, initializer=_worker_init)
    try:
        results = pool.map_async(_run_job, jobs, chunksize=1).get(timeout=args.warm_seconds)
    except mp.TimeoutError:
        results = [f"FAILED: warm-up stopped after {args.warm_seconds} s"]
    finally:
        pool.terminate()
        pool.join()
    failed = [r for r in results if not r.startswith("ok")]
    print(f"warm: {len(jobs)} kernel variants compiled in {time.perf_counter() - start:.1f} s by {workers} processes, "
          f"{len(failed)} failed", flush=True)
    for r in failed:
        print("  " + r, flush=True)


# ------------------------------------------------------------------------------------------------
# check
# ------------------------------------------------------------------------------------------------

_TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
CHECK_CASES = [  # (name, batch, heads, kv, q_len, k_len, dim, dtype, masked, key_bias, layout)
    ("causal bf16 d64", 2, 8, 8, 300, 300, 64, torch.bfloat16, False, False, "bshd"),
    ("causal fp16 d128", 1, 4, 4, 257, 257, 128, torch.float16, False, False, "bshd"),
    ("causal fp32 d64", 1, 4, 4, 200, 200, 64, torch.float32, False, False, "bhsd"),
    ("chunked prefill bf16 d128 gqa", 2, 8, 2, 190, 700, 128, torch.bfloat16, False, False, "bshd"),
    ("mqa bf16 d80", 2, 8, 1, 129, 129, 80, torch.bfloat16, False, False, "bshd"),
    ("left padding bf16 d64 key bias", 3, 4, 4, 333, 333, 64, torch.bfloat16, True, True, "bshd"),
    ("left padding cache bf16 d64 slopes", 3, 4, 4, 64, 500, 64, torch.bfloat16, True, False, "bshd"),
    ("holes bf16 d128 key bias", 2, 4, 2, 200, 260, 128, torch.bfloat16, "holes", True, "bshd"),
    ("d256 bf16", 1, 2, 2, 150, 150, 256, torch.bfloat16, False, False, "bhsd"),
    ("d96 fp16 key bias gqa", 2, 6, 3, 100, 100, 96, torch.float16, False, True, "bshd"),
    ("decode bf16 d64", 2, 16, 16, 1, 4100, 64, torch.bfloat16, False, False, "bshd"),
    ("decode bf16 d128 gqa", 4, 32, 8, 1, 3000, 128, torch.bfloat16, False, False, "bshd"),
    ("decode padded bf16 d64 key bias", 3, 16, 16, 1, 1000, 64, torch.bfloat16, True, True, "bshd"),
    ("decode 4 queries fp32 d64", 2, 4, 4, 4, 777, 64, torch.float32, False, False, "bshd"),
]


def check(args) -> bool:
    from torchembed.kernels.attention import alibi_flash, mask_rows

    device = _device()
    small = args.smoke
    cases = list(CHECK_CASES)
    if small:
        cases = [c[:4] + (min(c[4], 40), min(c[5], 70)) + c[6:] for c in cases]
    ok = True
    print("check: max |kernel - float64| / max |float64| (out, dq, dk, dv) and the dtype's tolerance", flush=True)
    for name, b, h, hk, m, n, d, dtype, masked, key_bias, layout in cases:
        try:
            q, k, v, bias, keep = _case(b, h, hk, m, n, d, dtype, device, masked=masked, key_bias=key_bias, grad=True,
                                        layout=layout, seed=len(name))
            truth = None
            qd, kd, vd = (x.detach().double().requires_grad_() for x in (q, k, v))
            truth = _truth(qd, kd, vd, bias, keep, key_bias)
            out = alibi_flash(q, k, v, bias, scale=d ** -0.5, key_bias=key_bias, keep=keep)
            grad = torch.randn_like(out)
            out.backward(grad)
            truth.backward(grad.double())
            errs = []
            for got, want in ((out, truth), (q.grad, qd.grad), (k.grad, kd.grad), (v.grad, vd.grad)):
                errs.append(((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-30)).item())
            good = all(e <= _TOL[dtype] for e in errs) and all(torch.isfinite(x).all() for x in (out, q.grad))
            ok &= good
            print(f"  {'ok  ' if good else 'FAIL'} {name:40s} " + " ".join(f"{e:.1e}" for e in errs)
                  + f"  (tol {_TOL[dtype]:.0e})", flush=True)
        except Exception as exc:
            ok = False
            print(f"  FAIL {name}: {type(exc).__name__}: {exc}", flush=True)
            traceback.print_exc()
    if device.type == "cuda":
        ok &= _check_graph_and_compile(device)
    print(f"check: {'all passed' if ok else 'FAILURES'}", flush=True)
    return ok


def _check_graph_and_compile(device) -> bool:
    from torchembed.kernels.attention import alibi_flash

    ok = True
    q, k, v, bias, _ = _case(2, 8, 8, 1, 2048, 64, torch.bfloat16, device)
    static = alibi_flash(q, k, v, bias, scale=0.125)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = alibi_flash(q, k, v, bias, scale=0.125)
    for _ in range(2):
        q.copy_(torch.randn_like(q))
        graph.replay()
        torch.cuda.synchronize()
        good = torch.equal(static_out, alibi_flash(q, k, v, bias, scale=0.125))
        ok &= good
    print(f"  {'ok  ' if ok else 'FAIL'} CUDA graph replay (decode) equals eager", flush=True)
    del static
    q, k, v, bias, _ = _case(2, 4, 4, 256, 256, 64, torch.bfloat16, device, grad=True)
    compiled = torch.compile(lambda q, k, v: alibi_flash(q, k, v, bias, scale=0.125).float().sum(), fullgraph=True)
    try:
        loss = compiled(q, k, v)
        loss.backward()
        eager_q = q.grad.clone()
        q.grad = None
        alibi_flash(q, k, v, bias, scale=0.125).float().sum().backward()
        good = torch.allclose(eager_q, q.grad, atol=1e-2, rtol=1e-2)
    except Exception as exc:
        good = False
        print(f"  compile failed: {type(exc).__name__}: {exc}", flush=True)
    ok &= good
    print(f"  {'ok  ' if good else 'FAIL'} torch.compile(fullgraph=True) forward + backward equals eager", flush=True)
    return ok


# ------------------------------------------------------------------------------------------------
# sweep
# ------------------------------------------------------------------------------------------------


def _time_backward(q, k, v, bias, keep, key_bias, reps=True):
    from torchembed.kernels.attention import mask_rows

    from torchembed.kernels.attention import _backward_kernel, _forward

    rows = None if keep is None else mask_rows(keep)
    scale = q.shape[-1] ** -0.5
    with torch.no_grad():
        out, lse, bounds = _forward(q, k, v, bias, rows, keep, scale, key_bias, True)
    grad = torch.randn_like(out)

    def step():  # (the forward's skip bounds, as the eager backward takes them)
        _backward_kernel(grad, q, k, v, out, lse, bias, rows, keep, scale, key_bias, bounds)

    step()
    return _bench(step) if reps else None


def sweep(args) -> dict:
    from torchembed.kernels.attention_plan import clear_plans

    K = _kernels()
    device = _device()
    chosen, table = {}, []
    prefill = _SMOKE_PREFILL if args.smoke else PREFILL_SHAPE
    decode = _SMOKE_DECODE if args.smoke else DECODE_SHAPES

    def pick(kind, dim, masked, candidates, timer, variant=""):
        key = (kind, K.block_d(dim), masked)
        best = None
        name = f"{kind}:{variant}" if variant else kind
        for cfg in candidates:
            with changed(alibi=dict(blocks={key: cfg})):  # (plans made afresh with the candidate, forgotten after)
                try:
                    ms = timer()
                except Exception as exc:
                    table.append((name, dim, masked, cfg, f"failed: {type(exc).__name__}: {str(exc)[:120]}"))
                    continue
            table.append((name, dim, masked, cfg, ms))
            if best is None or ms < best[1]:
                best = (cfg, ms)
        if best is not None:
            _keep_blocks({key: best[0]})
            chosen[f"{kind},{K.block_d(dim)},{int(masked)}"] = list(best[0])
        return best

    variants = {}
    for dim in (64, 128):
        shape = prefill[dim]
        q, k, v, bias, keep = _case(*shape, torch.bfloat16, device)
        qm, km, vm, kbm, keepm = _case(*shape, torch.bfloat16, device, masked=True, key_bias=True)
        for variant in FWD_VARIANTS:
            _use_variant(variant)
            with torch.no_grad():
                best = pick("fwd", dim, False, FWD[dim],
                            lambda: _bench(lambda: _launch_forward(q, k, v, bias, None, False)), variant[0])
                masked = pick("fwd", dim, True, FWD[dim][:3] if dim == 64 else FWD[dim][:1],
                              lambda: _bench(lambda: _launch_forward(qm, km, vm, kbm, keepm, True)), variant[0])
            variants[(dim, variant)] = (best, masked)
        winner = min(FWD_VARIANTS, key=lambda var: variants[(dim, var)][0][1])
        for masked in (False, True):
            cfg = variants[(dim, winner)][masked][0]
            _keep_blocks({("fwd", K.block_d(dim), masked): cfg})
            chosen[f"fwd,{K.block_d(dim)},{int(masked)}"] = list(cfg)
        chosen[f"fwd-variant,{K.block_d(dim)}"] = winner[0]
        _use_variant(winner)  # (the variant of the last head dim stays on for the later phases)
        clear_plans()
        pick("dkdv", dim, False, DKDV[dim], lambda: _time_backward(q, k, v, bias, None, False))
        pick("dq", dim, False, DQ[dim], lambda: _time_backward(q, k, v, bias, None, False))
        for masked in (True,):  # the masked backward takes the causal winners
            _keep_blocks({(kind, K.block_d(dim), masked): settings().alibi.blocks[(kind, K.block_d(dim), False)]
                          for kind in ("dkdv", "dq")})
        decode_cases = [_case(*s, torch.bfloat16, device) for s in decode[dim]]

        def decode_time():
            with torch.no_grad():
                return sum(_bench(lambda c=c: _launch_forward(c[0], c[1], c[2], c[3], None, False))
                           for c in decode_cases)

        pick("decode", dim, False, DECODE[dim], decode_time)
        _keep_blocks({("decode", K.block_d(dim), True): settings().alibi.blocks[("decode", K.block_d(dim), False)]})
        del q, k, v, qm, km, vm, decode_cases
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    print("sweep (ms; decode: the sum over its shapes):", flush=True)
    for kind, dim, masked, cfg, ms in table:
        shown = f"{ms:.4f}" if isinstance(ms, float) else ms
        print(f"  {kind:24s} d{dim:<4d} {'mask' if masked else 'causal':6s} {str(cfg):18s} {shown}", flush=True)
    result = {"chosen": chosen, "table": [[str(c) for c in row] for row in table]}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "alibi-kernel-tune.json").write_text(json.dumps(result, indent=1))
    print("chosen: " + json.dumps(chosen), flush=True)
    return chosen


def apply(chosen: dict) -> None:
    from torchembed.kernels.attention_plan import clear_plans

    clear_plans()
    blocks = {}
    for key, cfg in chosen.items():
        if key.startswith("fwd-variant"):
            _use_variant(next(v for v in FWD_VARIANTS if v[0] == cfg))
            continue
        kind, bd, masked = key.split(",")
        blocks[(kind, int(bd), bool(int(masked)))] = tuple(cfg)
        if kind in ("dkdv", "dq", "decode"):
            blocks[(kind, int(bd), True)] = tuple(cfg)
    _keep_blocks(blocks)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="torchembed-results")
    parser.add_argument("--phases", nargs="+", default=["warm", "check", "sweep", "bench"],
                        choices=["warm", "check", "sweep", "bench", "models"])
    parser.add_argument("--apply", default=None, help="block shapes from a previous sweep's JSON")
    parser.add_argument("--workers", type=int, default=max(1, min(14, (os.cpu_count() or 2) - 2)))
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--max-jobs", type=int, default=None, help="warm at most this many variants")
    parser.add_argument("--warm-seconds", type=float, default=180.0, help="stop the warm-up after this long")
    parser.add_argument("--bench-args", default="", help="options of torchembed bench alibi --kernel, one string")
    parser.add_argument("--model-args", default="", help="options of torchembed bench alibi, one string")
    args = parser.parse_args()
    bench_args, model_args = shlex.split(args.bench_args), shlex.split(args.model_args)
    with _CHOSEN:  # the block shapes applied or chosen hold until the run ends
        return _phases(args, bench_args, model_args)


def _phases(args, bench_args: list, model_args: list) -> int:
    if args.apply:
        apply(json.loads(Path(args.apply).read_text())["chosen"])
    status = 0
    for phase in args.phases:
        start = time.perf_counter()
        print(f"== {phase}", flush=True)
        try:
            if phase == "warm":
                warm(args)
            elif phase == "check":
                status |= 0 if check(args) else 1
            elif phase == "sweep":
                sweep(args)
            elif phase == "bench":
                from torchembed.tools import bench

                bench.main(["alibi", "--kernel", "--out", args.out, *bench_args])
            elif phase == "models":
                from torchembed.tools import bench

                bench.main(["alibi", "--out", args.out, *model_args])
        except Exception:
            status = 1
            traceback.print_exc()
        print(f"== {phase} done in {time.perf_counter() - start:.1f} s", flush=True)
        sys.stdout.flush()
    return status


if __name__ == "__main__":
    raise SystemExit(main())
