"""Shared test helpers: float64 oracles, dtype tolerances, graph breaks."""

from __future__ import annotations

import collections
import contextlib
import inspect
import sys
import threading
from collections.abc import Iterator

import torch
from torch import Tensor

# One rounding of a unit-scale result: half an ulp at 1.0, with headroom for a few fp32 ops
# before the final rounding (inputs are N(0, 1), so values reach ~4-5).
TOL = {
    torch.float64: dict(atol=1e-12, rtol=1e-12),
    torch.float32: dict(atol=2e-5, rtol=1e-5),
    torch.float16: dict(atol=4e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=3e-2, rtol=1.6e-2),
}


def rope_oracle(x: Tensor, positions: Tensor, inv_freq: Tensor, *, interleaved: bool = False, scale: float = 1.0) -> Tensor:
    """Float64 rotation of ``x (..., s, d)`` at integer ``positions`` broadcastable to ``(..., s)``."""
    x = x.double()
    half = inv_freq.shape[0]
    angles = positions.double()[..., None] * inv_freq.double()
    cos, sin = angles.cos() * scale, angles.sin() * scale
    xr = x[..., : 2 * half]
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
    else:
        x1, x2 = xr[..., :half], xr[..., half:]
    o1, o2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    rot = torch.stack((o1, o2), -1).flatten(-2) if interleaved else torch.cat((o1, o2), -1)
    return torch.cat((rot, x[..., 2 * half :]), -1)


def max_err(a: Tensor, b: Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def graph_breaks(model, **inputs) -> tuple[collections.Counter, Tensor]:
    """The graph-break reasons (counted) of ``torch.compile(model, backend="aot_eager")`` on
    ``inputs``, and the compiled model's logits."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    with torch.no_grad():
        out = torch.compile(model, backend="aot_eager")(**inputs).logits
    return collections.Counter(counters["graph_break"]), out


def assert_no_new_graph_breaks(patched: collections.Counter, upstream: collections.Counter) -> None:
    """The patched model breaks the graph for no reason of its own: each of its reasons is one of
    upstream's (a patched layer may run into one of upstream's own breaks more often: BLOOM and
    Falcon on torch 2.8 with transformers 5.24)."""
    new = set(patched) - set(upstream)
    assert not new, f"graph breaks upstream does not have: {new}"


@contextlib.contextmanager
def counting_calls(functions) -> Iterator[collections.Counter]:
    """Counts the calls of ``functions`` (their code, whatever route reaches them: a module global, a
    reference kept elsewhere, a fallback) while the block runs, in this thread and in threads started in the block,
    keyed by function name."""
    codes = {inspect.unwrap(f).__code__: f.__qualname__ for f in functions}
    counts: collections.Counter = collections.Counter()
    previous = sys.getprofile()

    def profile(frame, event, arg):
        if event == "call" and frame.f_code in codes:
            counts[codes[frame.f_code]] += 1

    previous_threads = threading.getprofile()
    sys.setprofile(profile)
    threading.setprofile(profile)  # threads started inside the block too (continuous batching runs the model in one)
    try:
        yield counts
    finally:
        sys.setprofile(previous)
        threading.setprofile(previous_threads)


def upstream_rotation_helpers(model) -> set:
    """The upstream rotation helpers the attentions of (unpatched) ``model`` call."""
    from torchembed.patches.rope.families import discover

    return {helper for _, _, rotations in discover(model).attentions for helper, _ in rotations.recognized.values()}
