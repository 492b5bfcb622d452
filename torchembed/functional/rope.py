"""Rotary position embedding (RoPE), the pure-PyTorch reference.

Su et al., "RoFormer: Enhanced Transformer with Rotary Position Embedding", arXiv:2104.09864.

Shape legend: ``b`` batch, ``h`` heads, ``s`` sequence, ``d`` head dim, ``r`` rotary dim (``r <= d``, even), ``t``
table length (positions).

Frequencies follow ``transformers.modeling_rope_utils`` for every ``rope_type`` it defines for decoder LLMs (default,
linear, dynamic, yarn, longrope, llama3) and give the same float32 numbers, so a patched model rotates by exactly the
angles upstream does. Tables are float32 and hold the ``r / 2`` distinct angles only (HF duplicates them to ``r``).
All rotation math runs in float32 and rounds once to the input dtype.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

__all__ = ["ROPE_TYPES", "rope_inv_freq", "rope_cos_sin", "rope_positions", "apply_rotary", "apply_rotary_qk",
           "check_base", "check_nonnegative", "is_position_dtype"]


def check_base(base: Any, name: str = "base") -> float:
    """``base`` as a float, or a ValueError/TypeError naming ``name``: ``theta = base^(-2i/r)`` is finite and
    decreasing in ``i`` only for a finite ``base > 0`` (others give NaN/inf frequencies and NaN outputs, silently)."""
    if isinstance(base, bool) or not isinstance(base, numbers.Real):
        raise TypeError(f"{name} must be a real number (finite, > 0), got {type(base).__name__} {base!r}")
    value = float(base)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {base!r}")
    return value


def is_position_dtype(t: Tensor) -> bool:
    """An integer dtype positions can have (not floating, complex or bool)."""
    return not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool)


def check_nonnegative(positions: Tensor, name: str) -> None:
    """Reject negative ``positions`` where that is cheap: on the host for CPU tensors.

    Accelerator tensors are not checked (a host sync, or extra kernel launches on the hot path); there a negative
    position rotates by the negative angle, as ``pos * theta`` says (no table is indexed by it, nothing is read out of
    bounds). Skipped for empty and meta tensors and while ``torch.compile`` traces.
    """
    if positions.is_cpu and positions.numel() and not torch.compiler.is_compiling():
        low = int(positions.min())
        if low < 0:
            raise ValueError(f"{name} must be non-negative, got a minimum of {low}")


def _inv_freq(dim: int, base: float, device: torch.device | None) -> Tensor:
    # 1 / base^(arange(0, dim, 2) / dim), the exponents built exactly as HF does (int64 -> float32) so the bits match.
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / dim))


def _default(dim: int, base: float, p: Mapping[str, Any], max_pos: int, seq_len: int | None, device) -> tuple[Tensor, float]:
    return _inv_freq(dim, base, device), 1.0


def _linear(dim, base, p, max_pos, seq_len, device):
    return _inv_freq(dim, base, device) / p["factor"], 1.0


def _dynamic(dim, base, p, max_pos, seq_len, device):
    # NTK-aware scaling: the base grows with the sequence once it exceeds max_position_embeddings.
    factor = p["factor"]
    seq_len = max_pos if seq_len is None else max(int(seq_len), max_pos)
    base = base * ((factor * seq_len / max_pos) - (factor - 1)) ** (dim / (dim - 2))
    return _inv_freq(dim, base, device), 1.0


def _yarn(dim, base, p, max_pos, seq_len, device):
    # Peng et al., "YaRN: Efficient Context Window Extension of LLMs", arXiv:2309.00071.
    if base == 1.0:  # correction_dim divides by log(base)
        raise ValueError(f"rope_type 'yarn' needs base (rope_theta) != 1, got {base!r}")
    original = p["original_max_position_embeddings"]
    factor = p.get("factor") or max_pos / original
    attention_factor = p.get("attention_factor")
    mscale, mscale_all_dim = p.get("mscale"), p.get("mscale_all_dim")

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
        else:
            attention_factor = get_mscale(factor)
    beta_fast = p.get("beta_fast") or 32
    beta_slow = p.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp.to(device=device, dtype=torch.float)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(device=device, dtype=torch.float) / dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, attention_factor


def _longrope(dim, base, p, max_pos, seq_len, device):
    # Ding et al., "LongRoPE", arXiv:2402.13753: per-frequency factors, long ones past the original length.
    original = p["original_max_position_embeddings"]
    factor = p.get("factor") or max_pos / original
    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    factors = p["long_factor"] if seq_len and seq_len > original else p["short_factor"]
    ext = torch.tensor(factors, dtype=torch.float32, device=device)
    shape = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
    return 1.0 / (ext * base**shape), attention_factor


def _llama3(dim, base, p, max_pos, seq_len, device):
    inv_freq = _inv_freq(dim, base, device)
    factor, low_ff, high_ff = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_len = p["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low_ff, old_len / high_ff
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low_ff) / (high_ff - low_ff)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled), 1.0


#: ``rope_type`` -> ``fn(dim, base, rope_parameters, max_position_embeddings, seq_len, device)``
#: returning ``(inv_freq (r/2,) float32, attention_scaling)``.
ROPE_TYPES: dict[str, Callable[..., tuple[Tensor, float]]] = {
    "default": _default,
    "linear": _linear,
    "dynamic": _dynamic,
    "yarn": _yarn,
    "longrope": _longrope,
    "llama3": _llama3,
}

_REQUIRED_KEYS = {
    "linear": ("factor",),
    "dynamic": ("factor",),
    "yarn": ("original_max_position_embeddings",),
    "longrope": ("original_max_position_embeddings", "long_factor", "short_factor"),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


def rope_inv_freq(dim: int, base: float = 10000.0, rope_parameters: Mapping[str, Any] | None = None, *,
                  max_position_embeddings: int = 2048, seq_len: int | None = None,
                  device: torch.device | str | None = None) -> tuple[Tensor, float]:
    """Inverse frequencies ``theta_i = base^(-2i/r)`` of one rope type, and its attention scaling.

    Args:
        dim: rotary dim ``r`` (even).
        base: ``rope_theta``; ``rope_parameters["rope_theta"]`` wins when given.
        rope_parameters: HF-style dict: ``rope_type`` plus that type's keys (``factor``,
            ``original_max_position_embeddings``, ``low_freq_factor``, ...). None means default RoPE.
        max_position_embeddings: the model's context length (dynamic/yarn/longrope read it).
        seq_len: current sequence length (dynamic grows the base, longrope picks long factors).

    Returns:
        ``(inv_freq, attention_scaling)``: float32 ``(r/2,)`` and the factor cos/sin are multiplied by.

    Raises:
        ValueError: odd/non-positive ``dim``; a ``base`` (or ``rope_theta``) that is not a finite number > 0; unknown
            ``rope_type``, a missing key, a ``factor`` that is not a finite number > 0, llama3 with
            ``low_freq_factor == high_freq_factor``.
        TypeError: ``base`` not a real number, ``rope_parameters`` not a mapping.
    """
    if not isinstance(dim, int) or dim <= 0 or dim % 2:
        raise ValueError(f"rotary dim must be a positive even int, got {dim!r}")
    if rope_parameters is not None and not isinstance(rope_parameters, Mapping):
        raise TypeError(f"rope_parameters must be a mapping (dict) or None, got {type(rope_parameters).__name__}")
    params = dict(rope_parameters or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"unknown rope_type {rope_type!r}; supported: {sorted(ROPE_TYPES)}")
    missing = [key for key in _REQUIRED_KEYS.get(rope_type, ()) if params.get(key) is None]
    if missing:
        raise ValueError(f"rope_type {rope_type!r} needs rope_parameters keys {missing}, got {sorted(params)}")
    if params.get("rope_theta") is not None:
        base = check_base(params["rope_theta"], "rope_parameters['rope_theta']")
    else:
        base = check_base(base)
    factor = params.get("factor") if rope_type != "default" else None
    if factor is not None and (isinstance(factor, bool) or not isinstance(factor, numbers.Real)
                               or not math.isfinite(factor) or factor <= 0):
        raise ValueError(f"rope_parameters['factor'] must be a finite number > 0, got {factor!r}")
    if rope_type == "llama3" and params["low_freq_factor"] == params["high_freq_factor"]:
        raise ValueError("rope_type 'llama3' needs low_freq_factor != high_freq_factor (the smoothing divides by their "
                         f"difference), got {params['low_freq_factor']!r} and {params['high_freq_factor']!r}")
    inv_freq, scaling = ROPE_TYPES[rope_type](dim, base, params, max_position_embeddings, seq_len, device)
    return inv_freq.to(torch.float32), float(scaling)


def rope_cos_sin(inv_freq: Tensor, positions: Tensor, attention_scaling: float = 1.0) -> tuple[Tensor, Tensor]:
    """Float32 cos/sin tables for integer ``positions``.

    Args:
        inv_freq: ``(r/2,)`` float32.
        positions: any integer shape ``P`` (e.g. ``(s,)`` or ``(b, s)``).

    Returns:
        ``(cos, sin)``, each ``P + (r/2,)`` float32 (float64 for float64 ``inv_freq``), times ``attention_scaling``.
    """
    # Same op order as HF (position * inv_freq in fp32, then cos/sin, then the scaling).
    dtype = torch.promote_types(inv_freq.dtype, torch.float32)  # float64 inv_freq gives float64 tables
    freqs = positions[..., None].to(dtype) * inv_freq.to(device=positions.device, dtype=dtype)
    cos, sin = freqs.cos(), freqs.sin()
    if attention_scaling != 1.0:
        cos, sin = cos * attention_scaling, sin * attention_scaling
    return cos, sin


def rope_positions(offset: int | Tensor, seq_len: int, device: torch.device | None = None) -> Tensor:
    """Positions of ``seq_len`` new tokens after ``offset`` earlier ones.

    Args:
        offset: non-negative int, or ``(b,)`` integer tensor (per-sequence offsets, e.g. a ragged KV cache). Negative
            tensor offsets are a ValueError for CPU tensors; accelerator ones are not checked (no host sync).

    Returns:
        ``(s,)`` for an int offset, ``(b, s)`` for a tensor offset; int64.
    """
    if isinstance(offset, Tensor):
        if offset.dim() != 1 or not is_position_dtype(offset):
            raise ValueError(f"offset tensor must be 1-D integer (b,), got {offset.dtype} {tuple(offset.shape)}")
        check_nonnegative(offset, "offset tensor")
        return offset.long()[:, None] + torch.arange(seq_len, device=offset.device)
    if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
        raise ValueError(f"offset must be a non-negative int or a 1-D integer tensor, got {offset!r}")
    return torch.arange(offset, offset + seq_len, device=device)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor, *, interleaved: bool = False, conjugate: bool = False,
                 full: bool = False) -> Tensor:
    """Rotate the first ``r`` features of ``x``; the rest pass through. torchembed's one PyTorch rotation: the
    module, the patched HF helpers and every fallback of the kernel run it.

    ``y = x * cos + partner(x) * sin``, ``partner`` taking each feature's pair with the rotation's sign (half-split:
    ``(-x2, x1)``; interleaved: ``(-x[2i+1], x[2i])``): the products and the sum of HF's
    ``q * cos + rotate_half(q) * sin``, so float32 inputs give upstream's float32 result bit for bit.

    Args:
        x: ``(..., d)``, any float dtype (float64 computes in float64, the rest in float32).
        cos, sin: broadcastable to ``x[..., :r]``'s rows, e.g. ``(s, w)`` against ``(b, h, s, d)``: half tables,
            ``w = r / 2`` entries (one angle per pair); with ``full``, ``w = r`` entries, each feature its own (HF's
            ``cat(freqs, freqs)`` rows for half-split pairing, ``repeat_interleave(freqs, 2)`` for interleaved), read
            as they are, also where a pair's two entries differ (M-RoPE sections across both halves of the head).
        interleaved: pair ``(x[2i], x[2i+1])`` (GPT-J) instead of ``(x[i], x[i + r/2])`` (GPT-NeoX/LLaMA).
        conjugate: rotate by ``-theta`` (the inverse rotation; what backward applies).

    Returns:
        ``x.shape``, ``x.dtype``; the math runs in float32 (only the tables are converted; ``x`` promotes inside the
        products) and rounds once.

    Raises:
        ValueError: tables of different shapes, or wider than ``x``.
    """
    width = cos.shape[-1]
    rot = width if full else 2 * width
    if sin.shape != cos.shape:
        raise ValueError(f"cos and sin must have one shape, got {tuple(cos.shape)} and {tuple(sin.shape)}")
    if full and width % 2:
        raise ValueError(f"full tables hold one entry per rotated feature, an even number; got rows of {width}")
    if rot > x.shape[-1]:
        what = "cos.shape[-1], full tables" if full else "2 * cos.shape[-1]"
        raise ValueError(f"rotary dim {rot} ({what}) exceeds the feature dim {x.shape[-1]}")
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32  # (not promote_types: an op)
    c, s = cos.to(compute), sin.to(compute)
    if conjugate:
        s = -s
    if not full:  # each feature its pair's entry
        c, s = (t.repeat_interleave(2, -1) if interleaved else torch.cat((t, t), -1) for t in (c, s))
    xr = x if rot == x.shape[-1] else x[..., :rot]
    if interleaved:
        partner = torch.stack((-xr[..., 1::2], xr[..., 0::2]), dim=-1).flatten(-2)
    else:
        partner = torch.cat((-xr[..., rot // 2:], xr[..., : rot // 2]), dim=-1)
    out = (xr * c + partner * s).to(x.dtype)
    return out if xr is x else torch.cat((out, x[..., rot:]), dim=-1)


def apply_rotary_qk(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, *, interleaved: bool = False,
                    conjugate: bool = False) -> tuple[Tensor, Tensor]:
    """:func:`apply_rotary` on queries and keys (which may have different head counts)."""
    return (apply_rotary(q, cos, sin, interleaved=interleaved, conjugate=conjugate),
            apply_rotary(k, cos, sin, interleaved=interleaved, conjugate=conjugate))
