"""``torchembed bench {rope,e2e,alibi}``: speed benchmarks, plus the helpers they share.

Timing (all results in milliseconds unless a name says otherwise):

* :func:`do_bench`: device time of one call. CUDA: ``triton.testing.do_bench(fn,
  return_mode="median")`` (it flushes L2 before every call; callers also rotate inputs through
  copies larger than L2, see :func:`n_copies`); CPU: median of ``perf_counter`` over a few calls.
* :func:`host_loop`: wall time per call over N back-to-back calls followed by one synchronize.
  For host-bound shapes (decode) this is the real cost per call; do_bench under-reports it.
* :func:`wall`: one synchronized wall-clock run (end-to-end measurements); it and
  :func:`generate_timed` pause Python's garbage collector while they time (:func:`gc_paused`).
* :func:`copy_bandwidth`: device-to-device copy bandwidth (bytes read + written per second of
  ``dst.copy_(src)`` on a ~1 GB buffer): the "copy floor" of memory-bound kernels.

Results go to ``--out`` (default ``./torchembed-results/``, relative to the current folder) as
``NAME.json`` and ``NAME.md`` (with date, device and versions); the markdown is printed, then
where the files went.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import gc
import importlib
import itertools
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from torch import nn

from torchembed.tools.options import count, seconds

__all__ = ["add_common_args", "setup", "environment", "do_bench", "host_loop", "wall", "copy_bandwidth", "measure",
           "paired_ratio", "gc_paused", "generate_timed", "write_results", "md_table", "dynamo_config", "main"]

L2_BYTES = 60 * 2**20  # H100/H200 L2 is 50-60 MB; rotate inputs through copies larger than this
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_BENCHMARKS = ("rope", "e2e", "alibi", "train", "long", "decode")
DEFAULT_OUT = "torchembed-results"  # relative to the current folder
_written: list[Path] = []  # the files of the last write_results: bench.main says where they went


# --- Arguments, device, metadata -----------------------------------------------------


def add_common_args(parser: argparse.ArgumentParser) -> None:
    """``--out``, ``--name``, ``--smoke``, ``--dtype``, ``--max-seconds``, ``--seed``."""
    parser.add_argument("--out", default=DEFAULT_OUT, help=f"output folder (default: ./{DEFAULT_OUT})")
    parser.add_argument("--name", default=None, help="base name of the result files (default: the benchmark's)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU in seconds (exercises the script)")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(_DTYPES))
    parser.add_argument("--max-seconds", type=seconds, default=None,
                        help="stop starting new measurements after this many seconds; the rest is recorded as skipped")
    parser.add_argument("--seed", type=count(0), default=0)


def setup(args: argparse.Namespace, device: str = "cuda") -> torch.device:
    """Seed, pick the device (CUDA; CPU for ``--smoke`` or ``device="cpu"``); without CUDA a full CUDA
    run becomes ``--smoke``."""
    torch.manual_seed(args.seed)
    args.torch_dtype = _DTYPES[args.dtype]
    if device == "cpu":
        return torch.device("cpu")
    if not args.smoke and not torch.cuda.is_available():
        print("no CUDA device: running --smoke instead (tiny shapes on CPU)", file=sys.stderr)
        args.smoke = True
    return torch.device("cpu" if args.smoke else "cuda")


def version_of(dist: str) -> str | None:
    """Installed version of a distribution (``None`` when not installed)."""
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def environment(device: torch.device) -> dict[str, Any]:
    """Date, device, versions (torch, triton, transformers, liger-kernel, python)."""
    env: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device": device.type,
        "gpu": None,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": version_of("triton") or version_of("pytorch-triton"),
        "transformers": version_of("transformers"),
        "liger_kernel": version_of("liger-kernel") or version_of("liger_kernel"),
        "python": platform.python_version(),
        "platform": platform.platform(terse=True),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(gpu=props.name, gpu_memory_gb=round(props.total_memory / 2**30, 1),
                   capability=f"{props.major}.{props.minor}")
    else:
        env["gpu"] = f"none (CPU, {os.cpu_count()} cores)"
    return env


def no_interpreter(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """On CPU, keep torchembed off the Triton interpreter (``TORCHEMBED_DISABLE_TRITON=1``) for
    the block: timing an interpreter means nothing. The environment is restored afterwards."""
    if device.type == "cuda":
        return contextlib.nullcontext()
    return mock.patch.dict(os.environ, {"TORCHEMBED_DISABLE_TRITON": "1"})


class Budget:
    """``--max-seconds``: ``exhausted()`` once that much wall time has passed since creation."""

    def __init__(self, seconds: float | None) -> None:
        self.seconds, self.start = seconds, time.perf_counter()

    def exhausted(self) -> bool:
        return self.seconds is not None and time.perf_counter() - self.start > self.seconds


# --- Timers --------------------------------------------------------------------------


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def do_bench(fn: Callable[[], Any], device: torch.device, *, grad_to_none: Sequence[torch.Tensor] | None = None,
             reps: int = 5) -> float:
    """Median device time of one call of ``fn``, in ms (see the module docstring)."""
    if device.type == "cuda":
        try:
            from triton.testing import do_bench as triton_do_bench
        except ImportError:  # no Triton: synchronized wall time per call, below
            reps = 50
        else:
            return float(triton_do_bench(fn, grad_to_none=list(grad_to_none or []) or None, return_mode="median"))
    fn()
    times = []
    for _ in range(reps):
        for t in grad_to_none or ():
            t.grad = None
        times.append(wall(fn, device))
    return statistics.median(times)


def graph_time(fn: Callable[[], Any], device: torch.device, *, calls: int = 10, reps: int = 20) -> float:
    """Median device time of one call of ``fn`` in ms, replayed from a CUDA graph of ``calls``
    back-to-back calls: the host's cost per call (Python, dispatch, autograd) is excluded, which
    ``do_bench`` cannot do where the host is slower than the kernels. CUDA only."""
    if device.type != "cuda":
        raise ValueError(f"graph_time needs a CUDA device, got {device}")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the default stream (allocator, autograd state)
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / calls)
    del graph
    return statistics.median(times)


def n_copies(bytes_per_copy: int, *, max_copies: int = 16, max_bytes: int = 4 * 2**30) -> int:
    """How many input copies to rotate through so that their total exceeds 2 x L2 (1 when one
    copy already does, or when more would not be cheap: at most ``max_copies`` / ``max_bytes``)."""
    want = math.ceil(2 * L2_BYTES / max(bytes_per_copy, 1))
    return max(1, min(want, max_copies, max_bytes // max(bytes_per_copy, 1)))


def rotate(fns: Sequence[Callable[[], Any]]) -> Callable[[], Any]:
    """One callable that calls ``fns[0]``, ``fns[1]``, ... in turn (inputs rotated through copies)."""
    if len(fns) == 1:
        return fns[0]
    turn = itertools.cycle(fns)
    return lambda: next(turn)()


def host_loop(fn: Callable[[], Any], device: torch.device, *, calls: int = 200, repeats: int = 5) -> float:
    """Wall time per call (ms) of ``calls`` back-to-back calls + one synchronize; median of repeats."""
    fn()
    sync(device)
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        sync(device)
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times) * 1e3


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Collect the young generations, then keep Python's garbage collector off for the block (as
    ``timeit`` does): a collection landing inside one timed run and not another is noise, not the code
    under test. The last block's garbage is young (made while the collector was off), so a full
    collection (hundreds of ms over a large heap, e.g. inside a test session) would add only time."""
    gc.collect(1)
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def wall(fn: Callable[[], Any], device: torch.device) -> float:
    """Synchronized wall time of one call, in ms (garbage collector paused)."""
    with gc_paused():
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        return (time.perf_counter() - start) * 1e3


def copy_bandwidth(device: torch.device, nbytes: int | None = None) -> float:
    """Measured copy bandwidth in bytes/s: (bytes read + bytes written) / time of ``dst.copy_(src)``.
    Default buffer: 1 GiB on CUDA, 64 MiB on CPU."""
    nbytes = nbytes or (2**30 if device.type == "cuda" else 64 * 2**20)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    ms = do_bench(functools.partial(dst.copy_, src), device)
    del src, dst
    free_memory(device)
    return 2 * nbytes / (ms * 1e-3)


def stats(values: Sequence[float]) -> dict[str, Any]:
    """``{"median", "min", "max", "n", "values"}`` of a list of measurements (in run order)."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values),
            "values": list(values)}


def paired_ratio(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any] | None:
    """:func:`stats` of ``a[i] / b[i]`` over the repeats of two interleaved measurements (repeat
    ``i`` of each ran back to back, so a slow spell of the machine hits both sides of a pair);
    None when either side has no values."""
    pairs = [x / y for x, y in zip(a.get("values", ()), b.get("values", ())) if y > 0 and not math.isnan(x / y)]
    return stats(pairs) if pairs else None


def interleave(runs: dict[str, Callable[[], float]], repeats: int) -> dict[str, list[float]]:
    """Call each run once per repeat, the order reversed every other repeat (A/B, B/A, ...: drift
    and whatever one run leaves behind for the next hit every variant alike); each run returns its
    own measurement. Returns the measurements per variant, in repeat order."""
    out: dict[str, list[float]] = {name: [] for name in runs}
    names = list(runs)
    for i in range(repeats):
        for name in names if i % 2 == 0 else names[::-1]:
            out[name].append(runs[name]())
    return out


def dynamo_config(values: dict[tuple[str, ...], Any]) -> contextlib.AbstractContextManager[Any]:
    """Patch ``torch._dynamo.config`` for a block: each key lists a setting's names, newest first
    (older torch versions spell some differently); names this torch lacks are ignored."""
    from torch import _dynamo

    cfg = _dynamo.config
    found = {}
    for names, value in values.items():
        name = next((n for n in names if hasattr(cfg, n)), None)
        if name is not None:
            found[name] = value
    return cfg.patch(**found)


def is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower()


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def short_error(exc: BaseException) -> str:
    """"OOM", or "error (Type: first line of the message)"."""
    first_line = str(exc).splitlines()[0][:100] if str(exc) else ""
    return "OOM" if is_oom(exc) else f"error ({type(exc).__name__}: {first_line})"


def error_detail(exc: BaseException, limit: int = 4000) -> str:
    """The whole message's last ``limit`` characters, kept in the JSON beside the table's ``short_error``: an error
    raised in a worker process (inductor's compile subprocess) carries the worker's traceback in its message, below
    a first line that says only that a subprocess failed."""
    return f"{type(exc).__name__}: {exc}"[-limit:]


def _peak_run(run: Callable[[], float], device: torch.device, peaks: list[float]) -> float:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    ms = run()
    if device.type == "cuda":
        peaks.append((torch.cuda.max_memory_allocated(device) - base) / 2**30)
    return ms


def measure(models: dict[str, nn.Module], run: Callable[[nn.Module], float], repeats: int, device: torch.device,
            warm: Callable[[nn.Module], dict[str, Any]] | None = None) -> dict[str, dict[str, Any]]:
    """Warm up each variant (``warm`` or one ``run``), then ``repeats`` interleaved runs. Per variant:
    ``{"ms": stats | error string, "peak_mem_gb": float | None, **warm info}``."""
    res: dict[str, dict[str, Any]] = {}
    runs: dict[str, Callable[[], float]] = {}
    peaks: dict[str, list[float]] = {}

    def attempt(variant: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except Exception as exc:  # OOM or a failing variant: recorded, the others go on
            res.setdefault(variant, {}).update(ms=short_error(exc), error_detail=error_detail(exc))
        free_memory(device)  # outside the except block, once the traceback's tensors are gone
        return math.nan

    def warm_up(model: nn.Module) -> dict[str, Any]:
        if warm is not None:
            return warm(model)
        run(model)
        return {}

    for variant, model in models.items():
        info = attempt(variant, lambda: warm_up(model))
        if not isinstance(info, dict):
            continue
        res[variant], peaks[variant] = info, []

        def timed(model: nn.Module = model, variant: str = variant) -> float:
            if isinstance(res[variant].get("ms"), str):  # failed in an earlier repeat
                return math.nan
            return attempt(variant, lambda: _peak_run(lambda: run(model), device, peaks[variant]))

        runs[variant] = timed
    for variant, values in interleave(runs, repeats).items():
        if not isinstance(res[variant].get("ms"), str):
            res[variant]["ms"] = stats(values)
        res[variant]["peak_mem_gb"] = max(peaks[variant]) if peaks[variant] else None
    return res


# --- Models and generation (e2e, alibi) ----------------------------------------------


def random_causal_lm(config: Any, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """A random-weight causal LM from ``config``, built directly on ``device`` in ``dtype``, eval mode."""
    import transformers

    transformers.logging.set_verbosity_error()
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.generation_config.pad_token_id = 0
    return model.to(device).eval()


class TokenClock:
    """An HF streamer that records the host time of each ``put`` (the prompt first, then every
    generated token, each copied to the host, i.e. after the device finished that step)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: Any) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def generate_timed(model: nn.Module, ids: torch.Tensor, new_tokens: int, **kwargs: Any) -> dict[str, float]:
    """Greedy ``generate`` as a user calls it (no cache flag: the model's generation config decides, e.g. MPT's turns
    the cache off upstream and a patched MPT keeps it), timed whole. Returns ms: ``total`` (``new_tokens``
    tokens), ``prefill`` (one token: the prompt's forward and the first token) and ``per_token`` =
    (total - prefill) / (new_tokens - 1), the time of one decode step.

    No streamer: a per-token clock adds a host sync per token and, under CUDA graphs, measures the
    host's view of the steps rather than what ``generate`` costs. The two calls run back to back
    with the same keywords (``kwargs``: e.g. a static cache and compile config), the garbage
    collector paused.
    """
    if new_tokens < 2:
        raise ValueError(f"new_tokens must be >= 2 (one decode step at least), got {new_tokens}")
    device = ids.device
    mask = torch.ones_like(ids)

    def total(tokens: int) -> float:
        sync(device)
        start = time.perf_counter()
        model.generate(ids, attention_mask=mask, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, **kwargs)
        sync(device)
        return (time.perf_counter() - start) * 1e3

    with gc_paused(), torch.no_grad():
        prefill = total(1)
        full = total(new_tokens)
    return {"total": full, "prefill": prefill, "per_token": (full - prefill) / (new_tokens - 1)}


# --- Output --------------------------------------------------------------------------


def fmt(x: Any, digits: int = 3) -> str:
    """A number with ``digits`` decimals; strings ("OOM", "n/a", ...) and None as they are."""
    if x is None:
        return "-"
    if isinstance(x, (int, float)):
        return f"{x:.{digits}f}" if math.isfinite(x) else str(x)
    return str(x)


def fmt_stats(s: Any, digits: int = 3) -> str:
    """``median [min-max]`` of a :func:`stats` dict (other values via :func:`fmt`)."""
    if isinstance(s, dict) and "median" in s:
        return f"{s['median']:.{digits}f} [{s['min']:.{digits}f}-{s['max']:.{digits}f}]"
    return fmt(s, digits)


def md_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A markdown table; the first column left-aligned, the rest right-aligned."""
    lines = ["| " + " | ".join(headers) + " |", "|---|" + "---:|" * (len(headers) - 1)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _header(title: str, env: dict[str, Any], args: dict[str, Any]) -> str:
    names = ("torch", "triton", "transformers", "liger_kernel", "python")
    versions = ", ".join(f"{k} {env[k]}" for k in names if env.get(k))
    cuda = f" (CUDA {env['cuda']})" if env["device"] == "cuda" else ""
    lines = [f"# {title}", "", f"- date: {env['date']}", f"- device: {env['gpu']}{cuda}", f"- versions: {versions}"]
    if "copy_bandwidth_gbs" in env:
        lines.append(f"- measured copy bandwidth: {env['copy_bandwidth_gbs']:.0f} GB/s (read + write)")
    shown = {k: v for k, v in args.items() if k not in ("out", "torch_dtype")}
    lines.append("- options: " + " ".join(f"{k}={v}" for k, v in shown.items()))
    return "\n".join(lines)


def write_results(args: argparse.Namespace, default_name: str, title: str, env: dict[str, Any], payload: dict[str, Any],
                  markdown: str, *, quiet: bool = False) -> tuple[Path, Path]:
    """Write ``NAME.json`` (env, options, ``payload``) and ``NAME.md`` into ``args.out``;
    ``-smoke`` is appended to the name of smoke runs. Returns both paths."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = (args.name or default_name) + ("-smoke" if args.smoke and not args.name else "")
    options = {k: v for k, v in vars(args).items() if k != "torch_dtype"}
    json_path, md_path = out / f"{name}.json", out / f"{name}.md"
    document = {"benchmark": default_name, "env": env, "options": options, **payload}
    json_path.write_text(json.dumps(document, indent=1, default=str))
    md_path.write_text(_header(title, env, options) + "\n\n" + markdown.strip() + "\n")
    _written[:] = [md_path.resolve(), json_path.resolve()]
    if not quiet:
        print(f"wrote {_written[0]} and {_written[1].name}", file=sys.stderr)
    return json_path, md_path


# --- Dispatch ------------------------------------------------------------------------


def main(argv: Sequence[str]) -> int:
    """``main([what, *options])`` with what in rope, e2e, alibi (train: if its module exists)."""
    argv = list(argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in _BENCHMARKS:
        print(f"usage: torchembed bench {{{','.join(_BENCHMARKS)}}} [--smoke] [--out DIR] ... (--help per benchmark); "
              f"results go to ./{DEFAULT_OUT} or --out DIR", file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    try:
        module = importlib.import_module(f"torchembed.tools.bench_{argv[0]}")
    except ModuleNotFoundError as exc:
        if exc.name != f"torchembed.tools.bench_{argv[0]}":
            raise
        print(f"torchembed bench {argv[0]}: not available in this version", file=sys.stderr)
        return 2
    _written.clear()
    code = int(module.main(argv[1:]) or 0)
    if _written:  # after the printed table: where the files are
        print(f"results: {_written[0]} and {_written[1].name} (--out DIR to write elsewhere)", file=sys.stderr)
    return code
