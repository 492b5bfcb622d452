"""``torchembed bench rope``: the RoPE rotation of q and k, per provider and shape.

Providers (each builds ``f(q, k) -> (q_rot, k_rot)`` for one shape; tables built outside timing):

* ``torchembed``: ``rotary_fused`` with float32 half tables ``(B, S, D/2)`` (what the patched
  model passes); where the kernel cannot run (CPU) the PyTorch reference
  ``torchembed.functional.apply_rotary`` runs instead and the results say so (``impl``).
* ``torchembed-angles``: ``rotary_fused`` with ``inv_freq`` and the ``(B, S)`` position ids: the
  kernel computes cos/sin itself (no table bytes to read).
* ``torchembed-module``: ``RotaryEmbedding(D, fused=None)(q, k, position_ids=...)``, the public
  module on the same position ids (angles in the kernel; its kept launch after the first call).
* ``torchembed-hf``: what a patched LLaMA computes per layer: upstream's ``(B, S, D)`` tables
  through the rebound ``apply_rotary_pos_emb`` (in place without grad: ``rotary_fused(..., inplace=True)``).
* ``hf``: transformers' LLaMA ``apply_rotary_pos_emb`` with ``(B, S, D)`` tables in the
  activation dtype, as HF does.
* ``compile``: ``torch.compile`` of that function (static shapes, fresh per shape and mode;
  errors such as a hit recompile limit are recorded as "n/a").
* ``liger``: ``liger_kernel.ops.rope.LigerRopeFunction.apply(q, k, cos, sin)`` (HF tables; it
  rotates q and k in place), skipped when liger-kernel is not installed.
* ``floor``: bytes of q and k read once and written once / measured copy bandwidth (1 GiB copy).
* ``copy``: ``copy_`` of the same q and k into outputs of the same layout (what a copy kernel
  reaches at this size: the practical floor).

q and k use HF's layout: ``(B, S, H, D)`` memory viewed as ``(B, H, S, D)``. Measured: forward
and forward+backward (random output grads) in ms (median of do_bench, inputs rotated through
copies larger than L2); both again as device time, replayed from a CUDA graph (the host's Python,
dispatch and autograd cost excluded: ``do_bench`` includes it wherever the host is slower than the
GPU); accuracy = max abs error vs a float64 evaluation of the same inputs; host
overhead per call at decode shapes (us, back-to-back host loop).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor

from torchembed.tools import bench
from torchembed.tools.options import Parser

PROVIDERS = ("torchembed", "torchembed-angles", "torchembed-module", "torchembed-hf", "hf", "compile", "liger")
Fn = Callable[[Tensor, Tensor], Any]


class Shape(NamedTuple):
    batch: int
    seq: int
    q_heads: int
    kv_heads: int
    head_dim: int

    @property
    def label(self) -> str:
        return f"{self.batch}x{self.seq} h{self.q_heads}/{self.kv_heads} d{self.head_dim}"


SHAPES = [Shape(1, 1, 32, 8, 128), Shape(32, 1, 32, 8, 128), Shape(1, 2048, 32, 8, 128), Shape(4, 4096, 32, 8, 128),
          Shape(1, 32768, 32, 8, 128), Shape(8, 2048, 64, 8, 128)]
SMOKE_SHAPES = [Shape(1, 1, 4, 2, 16), Shape(2, 1, 4, 2, 16), Shape(2, 16, 4, 2, 16)]
# a hit recompile limit must raise (recorded "n/a"), not silently run eager code
STRICT = {("fail_on_recompile_limit_hit", "fail_on_cache_limit_hit"): True}
DECODE_OFFSET = 2047  # decode shapes (S == 1) sit after a 2048-token prompt


@dataclass
class Tables:
    """Per-shape angle tables (built once, shared by all input copies)."""

    positions: Tensor  # (B, S) int64
    inv_freq: Tensor  # (D/2,) float32
    cos_half: Tensor  # (B, S, D/2) float32: torchembed's
    sin_half: Tensor
    cos_full: Tensor  # (B, S, D) activation dtype: HF's
    sin_full: Tensor


def make_tables(shape: Shape, dtype: torch.dtype, device: torch.device) -> Tables:
    from torchembed.functional.rope import rope_cos_sin

    B, S, _, _, D = shape
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, D, 2, dtype=torch.int64, device=device).float() / D))
    offset = DECODE_OFFSET if S == 1 else 0
    positions = (torch.arange(S, device=device) + offset).expand(B, S)
    cos, sin = rope_cos_sin(inv_freq, positions)
    emb = torch.cat((positions[..., None].float() * inv_freq,) * 2, dim=-1)  # HF's op order
    return Tables(positions, inv_freq, cos, sin, emb.cos().to(dtype), emb.sin().to(dtype))


def make_qk(shape: Shape, dtype: torch.dtype, device: torch.device, requires_grad: bool = False) -> tuple[Tensor, Tensor]:
    B, S, Hq, Hk, D = shape
    q = torch.randn(B, S, Hq, D, dtype=dtype, device=device).transpose(1, 2)
    k = torch.randn(B, S, Hk, D, dtype=dtype, device=device).transpose(1, 2)
    return q.requires_grad_(requires_grad), k.requires_grad_(requires_grad)


def _hf_apply() -> Fn:
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    return apply_rotary_pos_emb


def build(provider: str, t: Tables, device: torch.device) -> tuple[Fn, str]:
    """``(f, impl)`` for a provider; raises ImportError when its package is missing."""
    if provider == "torchembed":
        from torchembed import kernels

        probe = torch.empty(0, device=device)
        if device.type == "cuda" and kernels.kernel_can_run(probe):
            cos, sin = t.cos_half, t.sin_half
            return (lambda q, k: kernels.rotary_fused(q, k, cos, sin)), "triton"
        from torchembed.functional.rope import apply_rotary

        c, s = t.cos_half[:, None], t.sin_half[:, None]
        return (lambda q, k: (apply_rotary(q, c, s), apply_rotary(k, c, s))), "reference (functional.apply_rotary)"
    if provider == "torchembed-angles":
        from torchembed import kernels

        probe = torch.empty(0, device=device)
        impl = "triton" if kernels.kernel_can_run(probe) else "reference (rotary_fused without the kernel)"
        inv_freq, positions = t.inv_freq, t.positions
        return (lambda q, k: kernels.rotary_fused(q, k, inv_freq=inv_freq, positions=positions)), impl
    if provider == "torchembed-module":
        # The public module, position ids (B, S): angles in the kernel, as torchembed-angles, plus the
        # module's own checks (first call) or its kept launch (later calls).
        from torchembed import RotaryEmbedding, kernels

        rope = RotaryEmbedding(2 * t.inv_freq.shape[0], fused=None, device=device)
        probe = torch.empty(0, device=device)
        impl = "triton" if kernels.kernel_can_run(probe) else "reference (RotaryEmbedding without the kernel)"
        positions = t.positions
        return (lambda q, k: rope(q, k, position_ids=positions)), impl
    if provider == "torchembed-hf":
        # What a patched LLaMA computes per layer: upstream's (B, S, D) tables through torchembed's
        # replacement of apply_rotary_pos_emb (in place without grad).
        from torchembed.patches.rope.recognition import recognize
        from torchembed.patches.rope.helper import RotaryHelper

        upstream = _hf_apply()
        fn, cos, sin = RotaryHelper.get(recognize(upstream), upstream, None), t.cos_full, t.sin_full
        return (lambda q, k: fn(q, k, cos, sin)), "patched HF apply_rotary_pos_emb (upstream tables)"
    if provider == "hf":
        fn, cos, sin = _hf_apply(), t.cos_full, t.sin_full
        return (lambda q, k: fn(q, k, cos, sin)), "eager"
    if provider == "compile":
        from torch import _dynamo

        _dynamo.reset()
        compiled, cos, sin = torch.compile(_hf_apply(), dynamic=False), t.cos_full, t.sin_full
        return (lambda q, k: compiled(q, k, cos, sin)), "inductor"
    if provider == "liger":
        from liger_kernel.ops.rope import LigerRopeFunction

        cos, sin = t.cos_full, t.sin_full
        return (lambda q, k: LigerRopeFunction.apply(q, k, cos, sin)), "triton (in place)"
    raise ValueError(f"unknown provider {provider!r}; choose from {PROVIDERS}")


def float64_truth(q: Tensor, k: Tensor, t: Tables) -> tuple[Tensor, Tensor]:
    """The rotation in float64 (angles from the same float32 inv_freq and positions)."""
    from torchembed.functional.rope import apply_rotary

    ang = t.positions.double()[..., None] * t.inv_freq.double()
    c, s = ang.cos()[:, None], ang.sin()[:, None]
    return apply_rotary(q.double(), c, s), apply_rotary(k.double(), c, s)


def _short(exc: BaseException) -> str:
    return f"n/a ({type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''})"


def _time(provider: str, t: Tables, device: torch.device, backward: bool, copies: list[tuple[Tensor, Tensor]],
          grads: list[tuple[Tensor, Tensor]], truth: tuple[Tensor, ...] | None) -> tuple[dict[str, Any], float | None]:
    """Build, check accuracy on fresh clones of ``truth``'s inputs (liger rotates in place), warm
    up (compile, autotune) and time one provider. Returns ({"impl", "ms"}, max abs error)."""
    f, impl = build(provider, t, device)
    err = None
    if truth is not None:
        q0, k0, ref_q, ref_k = truth
        out = f(q0.clone(), k0.clone())
        err = max((o.double() - r).abs().max().item() for o, r in zip(out, (ref_q, ref_k)))
        del out
    if backward:
        def step(q: Tensor, k: Tensor, g: tuple[Tensor, Tensor]) -> None:
            q.grad = k.grad = None  # each call's gradients are new tensors, never accumulated
            torch.autograd.backward(f(q, k), g)

        calls = [lambda q=q, k=k, g=g: step(q, k, g) for (q, k), g in zip(copies, grads)]
    else:
        calls = [lambda q=q, k=k: f(q, k) for q, k in copies]
    fn = bench.rotate(calls)
    fn()
    timed: dict[str, Any] = {"impl": impl, "ms": bench.do_bench(fn, device)}
    if device.type == "cuda":
        try:
            timed["graph_ms"] = bench.graph_time(fn, device)
        except Exception as exc:  # e.g. a provider that cannot be captured
            timed["graph_ms"] = _short(exc)
    return timed, err


def _copy_ms(copies: list[tuple[Tensor, Tensor]], device: torch.device) -> dict[str, float]:
    """``copy_`` of q and k into outputs of the same layout, inputs rotated like the providers':
    ``{"ms"}`` (do_bench) and on CUDA ``{"graph_ms"}`` (device time, as the providers')."""
    outs = [(torch.empty_like(q), torch.empty_like(k)) for q, k in copies]
    fn = bench.rotate([lambda q=q, k=k, o=o: (o[0].copy_(q), o[1].copy_(k)) for (q, k), o in zip(copies, outs)])
    timed = {"ms": bench.do_bench(fn, device)}
    if device.type == "cuda":
        timed["graph_ms"] = bench.graph_time(fn, device)
    return timed


def run_shape(shape: Shape, providers: list[str], args: argparse.Namespace, device: torch.device,
              bw: float) -> list[dict[str, Any]]:
    """Forward, forward+backward and accuracy records of every provider for one shape."""
    dtype = args.torch_dtype
    t = make_tables(shape, dtype, device)
    elt = torch.empty(0, dtype=dtype).element_size()
    qk_bytes = shape.batch * shape.seq * (shape.q_heads + shape.kv_heads) * shape.head_dim * elt
    floor_ms = 2 * qk_bytes / bw * 1e3
    base = {"shape": shape._asdict(), "shape_label": shape.label}
    records: list[dict[str, Any]] = [{**base, "section": "forward", "provider": "floor", "ms": floor_ms,
                                      "pct_of_floor": 100.0}]
    with torch.no_grad():
        copies = [make_qk(shape, dtype, device) for _ in range(bench.n_copies(qk_bytes))]
        copy = _copy_ms(copies, device)
        del copies
    copy_rec = {**base, "section": "forward", "provider": "copy", **copy, "pct_of_floor": floor_ms / copy["ms"] * 100}
    if "graph_ms" in copy:  # device time too: the copy and the floor rows of that table
        copy_rec["graph_pct_of_floor"] = floor_ms / copy["graph_ms"] * 100
        records[0].update(graph_ms=floor_ms, graph_pct_of_floor=100.0)
    records.append(copy_rec)
    truth = None
    if not args.no_accuracy:
        q0, k0 = make_qk(shape, dtype, device)
        truth = (q0, k0, *float64_truth(q0, k0, t))
    for backward in (False, True) if not args.no_backward else (False,):
        mode = "forward+backward" if backward else "forward"
        n_copy = bench.n_copies(qk_bytes * (2 if backward else 1))
        copies = [make_qk(shape, dtype, device, requires_grad=backward) for _ in range(n_copy)]
        grads = [(torch.randn_like(q), torch.randn_like(k)) for q, k in copies] if backward else []
        for provider in providers:
            rec: dict[str, Any] = {**base, "section": mode, "provider": provider, "copies": n_copy}
            strict = bench.dynamo_config(STRICT) if provider == "compile" else contextlib.nullcontext()
            try:  # dynamo guards on the grad mode: one mode per build
                with strict, torch.enable_grad() if backward else torch.no_grad():
                    timed, err = _time(provider, t, device, backward, copies, grads, None if backward else truth)
                rec.update(timed)
                rec["pct_of_floor"] = (2 if backward else 1) * floor_ms / rec["ms"] * 100
                if isinstance(rec.get("graph_ms"), float):
                    rec["graph_pct_of_floor"] = (2 if backward else 1) * floor_ms / rec["graph_ms"] * 100
                if err is not None:
                    records.append({**base, "section": "accuracy", "provider": provider, "impl": rec["impl"],
                                    "max_abs_err": err})
            except Exception as exc:  # a provider failing must not end the run
                rec["ms"] = "OOM" if bench.is_oom(exc) else _short(exc)
                bench.free_memory(device)
            records.append(rec)
        del copies, grads
        bench.free_memory(device)
    return records


def host_overhead(providers: list[str], args: argparse.Namespace, device: torch.device) -> list[dict[str, Any]]:
    """Per-call wall time (us) of back-to-back calls at decode shapes (B = 1 and 32), no grad."""
    shapes = [s for s in (SMOKE_SHAPES if args.smoke else SHAPES) if s.seq == 1]
    records = []
    for shape in shapes:
        t = make_tables(shape, args.torch_dtype, device)
        q, k = make_qk(shape, args.torch_dtype, device)
        for provider in [p for p in providers if p != "compile"]:
            f, impl = build(provider, t, device)
            with torch.no_grad():
                ms = bench.host_loop(lambda: f(q, k), device, calls=20 if args.smoke else 200)
            record = {"shape": shape._asdict(), "shape_label": shape.label, "section": "host", "provider": provider,
                      "impl": impl, "us_per_call": ms * 1e3}
            if impl == "triton" and device.type == "cuda":  # still replaying compiled kernels directly?
                from torchembed.kernels import launch

                record["direct_launch"] = launch.direct()
            records.append(record)
    return records


def markdown(records: list[dict[str, Any]], providers: list[str], skipped: dict[str, str]) -> str:
    """Tables: forward (ms + % of floor), forward+backward (ms), accuracy, host overhead (us)."""
    labels = list(dict.fromkeys(r["shape_label"] for r in records if r["section"] == "forward"))

    def cell(section: str, label: str, provider: str, key: str, digits: int = 3) -> str:
        match = (section, label, provider)
        r = next((r for r in records if (r["section"], r["shape_label"], r["provider"]) == match), None)
        if r is None:
            return "-"
        v = r.get(key)
        if key == "max_abs_err" and isinstance(v, float):
            return f"{v:.2e}"
        return bench.fmt(v, 4 if key.endswith("ms") and isinstance(v, float) and v < 0.1 else digits)

    out = []
    ours = [p for p in providers if p.startswith("torchembed")]

    def pct(section: str, label: str, provider: str, key: str = "pct_of_floor") -> str:
        v = cell(section, label, provider, key, 0)
        return v + "%" if v[:1].isdigit() else v

    def timing(title: str, section: str, key: str, pct_key: str, refs: list[str], pct_name: str) -> list[str]:
        """One table of ``key`` per shape and provider (+ ``refs``), with % of floor for ours (+ copy)."""
        with_pct = [*ours, *(p for p in refs if p == "copy")]
        rows = [[lbl, *(cell(section, lbl, p, key) for p in [*providers, *refs]),
                 *(pct(section, lbl, p, pct_key) for p in with_pct)] for lbl in labels]
        headers = ["shape (BxS hq/hk dD)", *providers, *refs, *(f"{p} {pct_name}" for p in with_pct)]
        return [f"## {title}", "", bench.md_table(headers, rows), ""]

    graph = "device time (ms, CUDA graph replay: host cost excluded)"
    for section, refs, pct_name in (("forward", ["floor", "copy"], "% of floor"),
                                    ("forward+backward", [], "% of 2x floor")):
        name = section.replace("+", " + ")
        if any(r["section"] == section for r in records):
            out += timing(f"{name} (ms, median)", section, "ms", "pct_of_floor", refs, pct_name)
        if any("graph_ms" in r for r in records if r["section"] == section):
            out += timing(f"{name}, {graph}", section, "graph_ms", "graph_pct_of_floor", refs, pct_name)
    if any(r["section"] == "accuracy" for r in records):
        rows = [[lbl, *(cell("accuracy", lbl, p, "max_abs_err") for p in providers)] for lbl in labels]
        out += ["## accuracy (max abs error vs float64)", "", bench.md_table(["shape", *providers], rows), ""]
    host_labels = list(dict.fromkeys(r["shape_label"] for r in records if r["section"] == "host"))
    if host_labels:
        hp = [p for p in providers if p != "compile"]
        rows = [[lbl, *(cell("host", lbl, p, "us_per_call", 1) for p in hp)] for lbl in host_labels]
        out += ["## host overhead at decode shapes (us per call, back-to-back loop)", "",
                bench.md_table(["shape", *hp], rows), ""]
    notes = [f"- {p}: skipped ({why})" for p, why in skipped.items()]
    impls = {r.get("impl") for r in records if r["provider"] == "torchembed" and r.get("impl")}
    if any(i.startswith("reference") for i in impls):
        notes.append("- torchembed ran the PyTorch reference path (the Triton kernel cannot run on this device)")
    notes.append("- floor: q and k read once + written once at the measured copy bandwidth (1 GiB copy); "
                 "% of floor = floor / time; forward + backward moves twice the bytes (2x floor)")
    notes.append("- copy: copy_ of the same q and k (same layout): what a copy kernel reaches at this size")
    return "\n".join(out + notes)


def main(argv: list[str]) -> int:
    parser = Parser(prog="torchembed bench rope", description=__doc__.split("\n\n")[0].replace("``", ""))
    bench.add_common_args(parser)
    parser.add_argument("--providers", nargs="+", default=None, choices=PROVIDERS,
                        help="default: all (--smoke: torchembed torchembed-angles hf liger; compile takes ~30 s on CPU)")
    parser.add_argument("--shapes", nargs="+", default=None, metavar="B,S,HQ,HK,D", help="override the shape list")
    parser.add_argument("--no-backward", action="store_true", help="forward only")
    parser.add_argument("--no-accuracy", action="store_true", help="skip the float64 accuracy check")
    args = parser.parse_args(argv)
    device = bench.setup(args)
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    if args.shapes:
        try:
            shapes = [Shape(*(int(x) for x in s.split(","))) for s in args.shapes]
        except (TypeError, ValueError):
            raise ValueError(f"--shapes expects B,S,HQ,HK,D with five integers, got {args.shapes}") from None
        if any(min(s) < 1 or s.head_dim % 2 or s.q_heads % s.kv_heads for s in shapes):
            raise ValueError(f"--shapes: positive sizes, even head dim, q heads a multiple of kv heads; got {args.shapes}")
    requested = args.providers or (["torchembed", "torchembed-angles", "hf", "liger"] if args.smoke else list(PROVIDERS))
    providers, skipped = [], {}
    for p in requested:
        try:
            if p == "hf":
                _hf_apply()
            elif p == "liger":
                if device.type != "cuda":
                    raise ImportError("liger-kernel needs CUDA")
                importlib.import_module("liger_kernel.ops.rope")
            providers.append(p)
        except Exception as exc:  # not installed, or an install that fails to import (version skew)
            skipped[p] = f"{type(exc).__name__}: {str(exc)[:200]}"
    env = bench.environment(device)
    budget = bench.Budget(args.max_seconds)
    with bench.no_interpreter(device):
        bw = bench.copy_bandwidth(device)
        env["copy_bandwidth_gbs"] = bw / 1e9
        records: list[dict[str, Any]] = []
        for shape in shapes:
            if budget.exhausted():
                skipped[f"shape {shape.label}"] = "time budget (--max-seconds)"
                continue
            print(f"rope {shape.label} ...", file=sys.stderr, flush=True)
            records += run_shape(shape, providers, args, device, bw)
        if not budget.exhausted():
            records += host_overhead(providers, args, device)
    md = markdown(records, providers, skipped)
    payload = {"providers": providers, "skipped": skipped, "shapes": [s.label for s in shapes], "results": records}
    bench.write_results(args, "rope", "torchembed bench rope", env, payload, md)
    print(md)
    return 0
