"""The kernels' configuration, in one object: tunings, the ALiBi policy, how launches are made.

:func:`settings` is read by every kernel's host code. It is made once, on import (outside any graph ``torch.compile``
traces, which could not build it), from the defaults below and these environment variables (read then, not per call):

* ``TORCHEMBED_ALIBI_PREFILL=auto|kernel|dense``: :attr:`AlibiPolicy.prefill`;
* ``TORCHEMBED_ALIBI_SKIP=0``: the ALiBi kernels visit every key (:attr:`AlibiTuning.skip`);
* ``TORCHEMBED_ALIBI_TMA=0``: keys and values through pointers, not tensor descriptors (:attr:`KernelSettings.tma`);
* ``TORCHEMBED_DIRECT_LAUNCH=0``: every launch through ``kernel[grid]`` (:attr:`KernelSettings.direct_launch`).

``TORCHEMBED_DISABLE_TRITON`` and ``TRITON_INTERPRET`` are read per call instead (:mod:`torchembed.kernels.launch`).

:func:`changed` replaces fields for a block (benchmarks, tests). The settings are process-wide: change them in a
program's setup or a benchmark, not while other threads launch kernels.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

__all__ = ["AlibiPolicy", "AlibiTuning", "KernelSettings", "RopeTuning", "changed", "forget_launches", "keep_launches_in",
           "settings", "PREFILL_PATHS"]

PREFILL_PATHS = ("auto", "kernel", "dense")


@dataclass(frozen=True)
class RopeTuning:
    """The launch configuration of the RoPE kernel, measured on an H200 (``benchmarks/results/rope.md``).

    ``tile_pairs``: (token, pair) lanes per program (4 KB of bf16 per operand at 1024). Several heads per program
    share one cos/sin load (or angle computation) on prefill-sized grids only (``grouped_min_programs`` one-head
    programs or more; decode keeps one head per program for parallelism): the first of ``grouped_heads`` dividing both
    head counts, with ``grouped_warps`` warps. ``heads_fast``: head groups fastest on the grid, so the programs running
    together cover whole tokens (contiguous ``(H, D)`` rows in HF's memory)."""

    tile_pairs: int = 1024
    grouped_min_programs: int = 4096
    grouped_heads: tuple[int, ...] = (2,)
    grouped_warps: int = 8
    heads_fast: bool = True


# AlibiTuning.blocks for float16/bfloat16: the fastest candidates of benchmarks/probes/alibi_kernel_tune.py on an H200
# at head dims 64 and 128 (benchmarks/results/alibi-kernel-tune.json; the forward's with keys and values read through
# tensor descriptors; the masked backward takes the causal winners); 16 and 32 take 64's, 256 the largest tiles that
# compile without spilling much (not timed). decode: torchembed bench decode --sweep
# (benchmarks/results/decode-attention.md): the best on average over its cases; masked at 128: decode-ab-masked-h100.md.
_MEASURED_BLOCKS: dict[tuple[str, int, bool], tuple[int, int, int, int]] = {
    **{("fwd", bd, m): (64, 64, 4, 3) for bd in (16, 32, 64) for m in (False, True)},
    ("fwd", 128, False): (64, 64, 4, 3),
    ("fwd", 128, True): (128, 64, 8, 3),
    **{("fwd", 256, m): (64, 64, 8, 2) for m in (False, True)},
    **{("dq", bd, m): (64, 64, 4, 3) for bd in (16, 32, 64) for m in (False, True)},
    **{("dq", 128, m): (64, 32, 4, 3) for m in (False, True)},
    **{("dq", 256, m): (64, 32, 8, 2) for m in (False, True)},
    **{("dkdv", bd, m): (32, 64, 4, 3) for bd in (16, 32, 64) for m in (False, True)},
    **{("dkdv", 128, m): (64, 64, 4, 2) for m in (False, True)},
    **{("dkdv", 256, m): (64, 32, 8, 2) for m in (False, True)},
    **{("decode", bd, m): (16, 128, 4, 3) for bd in (16, 32, 64) for m in (False, True)},
    ("decode", 128, False): (16, 64, 4, 3),
    ("decode", 128, True): (16, 32, 1, 1),
    **{("decode", 256, m): (16, 32, 4, 2) for m in (False, True)},
}


@dataclass(frozen=True)
class AlibiTuning:
    """The launch configuration of the ALiBi kernels.

    ``blocks``: ``(kernel, BLOCK_D bucket, mask given?) -> (BLOCK_M or BLOCK_R, BLOCK_N, num_warps, num_stages)``
    for float16/bfloat16 (float32 and the interpreter take fixed small tiles).
    ``decode_programs_per_sm``: ``(least, most)``: the split-key decode splits the keys until its grid has ``least``
    programs per multiprocessor, and more, up to ``most``, while each part keeps ``decode_split_keys`` keys (H200,
    batch 1, grouped heads: at 16k keys two programs per multiprocessor are 9-12 % faster than one, at 64k and 128k
    two are 10-18 % faster than four, ``decode-splits-graph.md``; over 8 x 8k keys it was 3 % slower,
    ``alibi-decode-splits.json``, so a grid that already fills the machine is not split more).
    ``decode_masked_programs_per_sm``: ``most`` for a masked call, whose kept keys the host does not know (H100 and
    H200, bf16, d 128, one-warp 32-key blocks: the padded batch 3-9 % faster than at one, ``decode-ab-masked-h100.md``;
    parts of fewer than ``decode_split_keys`` keys slowed the 1/8-filled static cache at 16k, 18.2 against 15.7 us,
    ``decode-sweep-16k-masked-h100.md``, and a single kv head's combine, 1,024 parts at 64k: 14 us per call).
    ``decode_combine``: ``(parts, features)``: the split decode's combine merges this many parts per step (their loads
    in flight together) for this many features per program (one program per query row and feature block; H100,
    batch 1: 1-2 % faster than 16 parts per step over all features, ``decode-ab-h100.md``).
    ``skip``, ``skip_margin_bits``, ``skip_min_keys``: the skip of keys of negligible weight in long prefills (from
    this many keys; what is left out is under ``2**-(skip_margin_bits + log2 keys)`` of each row's mass)."""

    blocks: Mapping[tuple[str, int, bool], tuple[int, int, int, int]] = field(
        default_factory=lambda: MappingProxyType(dict(_MEASURED_BLOCKS)))
    decode_programs_per_sm: tuple[int, int] = (1, 2)
    decode_masked_programs_per_sm: int = 8
    decode_split_keys: int = 512
    decode_combine: tuple[int, int] = (64, 32)
    skip: bool = True
    skip_margin_bits: float = 32.0
    skip_min_keys: int = 2048

    def __post_init__(self) -> None:
        least, most = self.decode_programs_per_sm
        if not 1 <= least <= most:
            raise ValueError(f"decode_programs_per_sm must be (least, most) with 1 <= least <= most, "
                             f"got {self.decode_programs_per_sm!r}")
        if self.decode_masked_programs_per_sm < 1 or self.decode_split_keys < 1:
            raise ValueError(f"decode_masked_programs_per_sm and decode_split_keys must be positive, got "
                             f"{self.decode_masked_programs_per_sm}, {self.decode_split_keys}")
        parts, features = self.decode_combine
        if not all(n >= 1 and n & (n - 1) == 0 for n in (parts, features)):
            raise ValueError(f"decode_combine must be (parts, features), powers of two, got {self.decode_combine!r}")


@dataclass(frozen=True)
class AlibiPolicy:
    """What :func:`torchembed.kernels.route.alibi_path` decides with.

    ``prefill``: ``"auto"`` (the materialised bias up to the bounds below, else the kernel), ``"kernel"`` (the kernel
    at every size) or ``"dense"`` (the materialised bias at every size). ``dense_max_elements``: bias elements
    (b * h * q * k) up to which a model layer's prefill materialises the bias (2**26: 128 MB of bf16; beyond, memory
    quadratic in the length); ``dense_grad_max_elements``: the same with gradients recorded (per layer the kernel's
    forward + backward is ahead from 4 x 16 x 2048^2 on, 0.51 vs 1.01 ms). ``dense_devices``: device types whose
    prefill may take the materialised bias (CPU prefills: 0.96-1.51x upstream, the reference's 0.49-0.98x)."""

    prefill: str = "auto"
    dense_max_elements: int = 2**26
    dense_grad_max_elements: int = 2**26
    dense_devices: tuple[str, ...] = ("cuda", "cpu")

    def __post_init__(self) -> None:
        if self.prefill not in PREFILL_PATHS:
            raise ValueError(f"the prefill path must be one of {PREFILL_PATHS}, got {self.prefill!r}")


@dataclass(frozen=True)
class KernelSettings:
    """Everything the kernels' host code is configured with (:func:`settings`, :func:`changed`)."""

    rope: RopeTuning = field(default_factory=RopeTuning)
    alibi: AlibiTuning = field(default_factory=AlibiTuning)
    policy: AlibiPolicy = field(default_factory=AlibiPolicy)
    direct_launch: bool = True  # kept launches call the compiled kernel's launcher with raw pointers
    tma: bool = True  # ALiBi prefill reads keys and values through tensor descriptors on Hopper and later


_settings: KernelSettings = KernelSettings(  # from the environment, once
    alibi=AlibiTuning(skip=os.environ.get("TORCHEMBED_ALIBI_SKIP", "1") == "1"),
    policy=AlibiPolicy(prefill=os.environ.get("TORCHEMBED_ALIBI_PREFILL", "auto")),
    direct_launch=os.environ.get("TORCHEMBED_DIRECT_LAUNCH", "1") == "1",
    tma=os.environ.get("TORCHEMBED_ALIBI_TMA", "1") == "1",
)


def settings() -> KernelSettings:
    """The settings in force (made from the environment when this module is imported)."""
    return _settings


@contextlib.contextmanager
def changed(**changes: Any) -> Iterator[KernelSettings]:
    """Within the block, the settings in force with ``changes``: a field's new value, or for ``rope``, ``alibi`` and
    ``policy`` a mapping of their fields' new values (``alibi={"blocks": {...}}`` merges block entries into the current
    ones). Kept launches are forgotten on entry and exit (they were set up with the old values).

    Raises:
        TypeError: a name that is not a field; ValueError: an unknown prefill path.
    """
    global _settings
    current = settings()
    for name in ("rope", "alibi", "policy"):
        value = changes.get(name)
        if isinstance(value, Mapping):
            value = dict(value)
            if name == "alibi" and "blocks" in value:
                value["blocks"] = MappingProxyType({**current.alibi.blocks, **value["blocks"]})
            changes[name] = dataclasses.replace(getattr(current, name), **value)
    new = dataclasses.replace(current, **changes)
    previous, _settings = current, new
    forget_launches()
    try:
        yield new
    finally:
        _settings = previous
        forget_launches()


# The tables of kept launches (torchembed.kernels.launch.Launches): each launch was set up under the
# settings in force, so a change of the settings forgets them all.
_TABLES: list[Any] = []


def keep_launches_in(table: Any) -> None:
    """Register a table of kept launches (anything with ``clear()``), forgotten with every change."""
    _TABLES.append(table)


def forget_launches() -> None:
    """Forget every kept launch of every kernel."""
    for table in _TABLES:
        table.clear()
