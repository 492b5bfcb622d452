"""Fused rotary-embedding Triton kernel (q and k in one launch) and its host launcher.

Rotary embedding: Su et al., "RoFormer", arXiv:2104.09864.  For each (batch b, head h,
token s) row of q or k and each pair index j < R/2 (R = rotary dim):

    x1, x2 = x[j], x[j + R/2]          (half-split, GPT-NeoX / LLaMA pairing)
    x1, x2 = x[2j], x[2j + 1]          (interleaved, GPT-J pairing)
    y1 = x1 * c - x2 * s
    y2 = x2 * c + x1 * s               (s -> -s when CONJUGATE: the inverse rotation)

Dims [R, D) pass through.  All math is float32 (float64 for float64 inputs); the result is
rounded once, on store.

This module imports Triton at import time; ``torchembed.kernels`` imports it lazily, only
when a kernel is about to run.  Input validation lives in ``rope_op`` (the public entry);
``launch`` trusts its arguments; ``rope_launches`` keeps the launches.

Grid: ``(cdiv(S, BLOCK_S), Hq // HPP + Hk // HPP, B)``.  Axis 1 enumerates head groups of q
first, then of k, so q and k are rotated by ONE launch; a program loads the cos/sin (or
computes them from inv_freq) for its BLOCK_S tokens once and applies them to HPP heads
(HPP = 1 for decode-sized grids, for parallelism; 2 for prefill-sized ones); the first heads' q/k
loads are issued before that cos/sin work, so their latency overlaps it.  Batch is grid axis
2, so B <= 65535.

Addressing: every index is cast to int64 *before* it is multiplied by a stride, so tensors
(and cos/sin caches) with more than 2**31 elements are addressed correctly.  Only the last
dim must have stride 1; every other stride is a runtime argument (HF's ``(B, H, S, D)``
transposed view over ``(B, S, H, D)`` memory and padded views work without copies).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from torchembed.kernels import direct_launch, rope_launches
from torchembed.kernels.rope_launches import RopeArgs

__all__ = ["clear_launch_caches", "launch"]


@triton.jit
def _pair_dims(HALF: tl.constexpr, BLOCK_D: tl.constexpr, INTERLEAVED: tl.constexpr):
    """Dims of the BLOCK_D pair lanes: (first, second, lane < HALF)."""
    j = tl.arange(0, BLOCK_D)
    if INTERLEAVED:
        return 2 * j, 2 * j + 1, j < HALF
    return j, j + HALF, j < HALF


@triton.jit
def _load_pairs(x_ptr, x_row, s_mask, HALF: tl.constexpr, BLOCK_D: tl.constexpr, INTERLEAVED: tl.constexpr,
                CDT: tl.constexpr):
    """The rotated pairs (x1, x2) of BLOCK_S token rows, each [BLOCK_S, BLOCK_D] in the compute dtype."""
    d1, d2, j_mask = _pair_dims(HALF, BLOCK_D, INTERLEAVED)
    m = s_mask[:, None] & j_mask[None, :]
    xp = x_ptr + x_row[:, None]
    return (tl.load(xp + d1[None, :], mask=m, other=0.0).to(CDT),
            tl.load(xp + d2[None, :], mask=m, other=0.0).to(CDT))


@triton.jit
def _store_rotated(
    x_ptr,
    o_ptr,
    x_row,  # [BLOCK_S] int64 element offset of each token row of the input head
    o_row,  # [BLOCK_S] int64 element offset of each token row of the output head
    x1,
    x2,
    c,  # [BLOCK_S, BLOCK_D] cos * scale, compute dtype
    s,  # [BLOCK_S, BLOCK_D] sin * scale (negated when conjugate), compute dtype
    s_mask,  # [BLOCK_S] token in range
    HALF: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_P: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    HAS_PASS: tl.constexpr,
    EMULATE_RTNE: tl.constexpr,
):
    d1, d2, j_mask = _pair_dims(HALF, BLOCK_D, INTERLEAVED)
    m = s_mask[:, None] & j_mask[None, :]
    op = o_ptr + o_row[:, None]
    y1 = x1 * c - x2 * s
    y2 = x2 * c + x1 * s
    if EMULATE_RTNE:
        y1 = _round_f32_to_bf16_rtne(y1)
        y2 = _round_f32_to_bf16_rtne(y2)
    tl.store(op + d1[None, :], y1.to(o_ptr.dtype.element_ty), mask=m)
    tl.store(op + d2[None, :], y2.to(o_ptr.dtype.element_ty), mask=m)
    if HAS_PASS:
        # Out-of-place with partial rotary: copy the pass-through dims [R, D) verbatim.
        p = 2 * HALF + tl.arange(0, BLOCK_P)
        pm = s_mask[:, None] & (p < D)[None, :]
        xp = x_ptr + x_row[:, None]
        tl.store(op + p[None, :], tl.load(xp + p[None, :], mask=pm), mask=pm)


@triton.jit
def _cos_sin(cos_ptr, sin_ptr, pos_ptr, inv_freq_ptr, b, s64, s_mask, sc_b, sc_s, sp_b, sp_s, pos_offset, scale,
             HALF: tl.constexpr, BLOCK_D: tl.constexpr, POS_MODE: tl.constexpr, USE_INV_FREQ: tl.constexpr,
             CONJUGATE: tl.constexpr, CDT: tl.constexpr):
    """cos * scale and sin * scale (negated when CONJUGATE) of BLOCK_S tokens, [BLOCK_S, BLOCK_D]."""
    j = tl.arange(0, BLOCK_D)
    j_mask = j < HALF
    if POS_MODE == 0:
        pos = s64 + pos_offset
    elif POS_MODE == 1:
        pos = tl.load(pos_ptr + b * sp_b).to(tl.int64) + s64
    else:
        pos = tl.load(pos_ptr + b * sp_b + s64 * sp_s, mask=s_mask, other=0).to(tl.int64)
    if USE_INV_FREQ:
        # The angle is a float32 product (as HF computes it), whatever the compute dtype.
        inv = tl.load(inv_freq_ptr + j, mask=j_mask, other=0.0).to(tl.float32)
        ang = (pos.to(tl.float32)[:, None] * inv[None, :]).to(CDT)
        c = tl.cos(ang) * scale
        sn = tl.sin(ang) * scale
    else:
        m = s_mask[:, None] & j_mask[None, :]
        t_off = (b * sc_b + pos * sc_s)[:, None] + j[None, :]
        c = tl.load(cos_ptr + t_off, mask=m, other=0.0).to(CDT) * scale
        sn = tl.load(sin_ptr + t_off, mask=m, other=0.0).to(CDT) * scale
    if CONJUGATE:
        sn = -sn
    return c, sn


@triton.jit
def _rotate_heads(
    x_ptr, o_ptr, b, h0, s64, s_mask,
    sx_b, sx_h, sx_s, so_b, so_h, so_s,
    cos_ptr, sin_ptr, pos_ptr, inv_freq_ptr, sc_b, sc_s, sp_b, sp_s, pos_offset, scale,
    HALF: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr, HPP: tl.constexpr,
    POS_MODE: tl.constexpr, USE_INV_FREQ: tl.constexpr, INTERLEAVED: tl.constexpr, CONJUGATE: tl.constexpr,
    HAS_PASS: tl.constexpr, CDT: tl.constexpr, EMULATE_RTNE: tl.constexpr,
):
    """Rotate heads h0 .. h0 + HPP - 1 of x into o for BLOCK_S tokens; cos/sin made once.  The first
    two heads' loads are issued before the positions / tables / angles work, so their memory latency
    overlaps it (in-kernel angles at 4 x 4096 on an H200: 89.7 -> 97.1 % of the copy floor)."""
    x_row = b * sx_b + h0 * sx_h + s64 * sx_s
    o_row = b * so_b + h0 * so_h + s64 * so_s
    x1, x2 = _load_pairs(x_ptr, x_row, s_mask, HALF, BLOCK_D, INTERLEAVED, CDT)
    if HPP > 1:
        x1b, x2b = _load_pairs(x_ptr, x_row + sx_h, s_mask, HALF, BLOCK_D, INTERLEAVED, CDT)
    c, sn = _cos_sin(cos_ptr, sin_ptr, pos_ptr, inv_freq_ptr, b, s64, s_mask, sc_b, sc_s, sp_b, sp_s,
                     pos_offset, scale, HALF, BLOCK_D, POS_MODE, USE_INV_FREQ, CONJUGATE, CDT)
    _store_rotated(x_ptr, o_ptr, x_row, o_row, x1, x2, c, sn, s_mask,
                   HALF, D, BLOCK_D, BLOCK_P, INTERLEAVED, HAS_PASS, EMULATE_RTNE)
    if HPP > 1:
        _store_rotated(x_ptr, o_ptr, x_row + sx_h, o_row + so_h, x1b, x2b, c, sn, s_mask,
                       HALF, D, BLOCK_D, BLOCK_P, INTERLEAVED, HAS_PASS, EMULATE_RTNE)
    for i in tl.static_range(2, HPP):
        x_row = b * sx_b + (h0 + i) * sx_h + s64 * sx_s
        o_row = b * so_b + (h0 + i) * so_h + s64 * so_s
        x1, x2 = _load_pairs(x_ptr, x_row, s_mask, HALF, BLOCK_D, INTERLEAVED, CDT)
        _store_rotated(x_ptr, o_ptr, x_row, o_row, x1, x2, c, sn, s_mask,
                       HALF, D, BLOCK_D, BLOCK_P, INTERLEAVED, HAS_PASS, EMULATE_RTNE)


@triton.jit
def _round_f32_to_bf16_rtne(y):
    # Round-to-nearest-even onto the bf16 grid, staying in float32 (the later .to(bf16) is then
    # exact).  Only used under TRITON_INTERPRET, whose fp32->bf16 cast truncates; the GPU cast
    # already rounds to nearest even.
    bits = y.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _rope_kernel(
    q_ptr,
    k_ptr,
    qo_ptr,  # == q_ptr when in-place
    ko_ptr,  # == k_ptr when in-place
    cos_ptr,  # table rows of R/2 entries (unused with USE_INV_FREQ)
    sin_ptr,
    pos_ptr,  # int positions (unused with POS_MODE == 0)
    inv_freq_ptr,  # (R/2,) (unused without USE_INV_FREQ)
    S,  # tokens per sequence
    NQG,  # number of q head groups (= Hq // HPP); axis-1 programs >= NQG rotate k
    sq_b, sq_h, sq_s,  # q strides (the last dim has stride 1)
    sk_b, sk_h, sk_s,
    sqo_b, sqo_h, sqo_s,
    sko_b, sko_h, sko_s,
    sc_b,  # cos/sin stride per batch row (0: broadcast / cache table)
    sc_s,  # cos/sin stride per position (per token in table mode)
    sp_b, sp_s,  # positions strides (batch, token); 0 where broadcast
    pos_offset,  # added to the token index when POS_MODE == 0
    scale,  # multiplies cos and sin
    HALF: tl.constexpr,  # R / 2: number of rotated pairs
    D: tl.constexpr,  # head dim
    BLOCK_D: tl.constexpr,  # next_power_of_2(HALF): pair lanes per token row
    BLOCK_P: tl.constexpr,  # next_power_of_2(D - R): pass-through lanes (only if HAS_PASS)
    BLOCK_S: tl.constexpr,  # tokens per program
    HPP: tl.constexpr,  # heads per program (divides Hq and Hk, so no head mask is needed)
    POS_MODE: tl.constexpr,  # 0: pos = pos_offset + s; 1: pos = P[b] + s; 2: pos = P[b, s]
    USE_INV_FREQ: tl.constexpr,  # compute cos/sin from pos * inv_freq instead of loading a table
    INTERLEAVED: tl.constexpr,  # pairs (2j, 2j+1) instead of (j, j + R/2)
    CONJUGATE: tl.constexpr,  # rotate by -angle (inverse rotation; the backward pass)
    HAS_PASS: tl.constexpr,  # copy dims [R, D) (out-of-place with R < D)
    CDT: tl.constexpr,  # compute dtype: float32 (float64 for float64 inputs)
    EMULATE_RTNE: tl.constexpr,  # interpreter-only bf16 rounding fix (see _round_f32_to_bf16_rtne)
    HEADS_FAST: tl.constexpr,  # grid axis 0 enumerates head groups (else token blocks)
):
    if HEADS_FAST:  # consecutive programs take neighbouring heads of the same tokens
        pid_h = tl.program_id(0)
        pid_s = tl.program_id(1)
    else:
        pid_s = tl.program_id(0)
        pid_h = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    s_idx = pid_s * BLOCK_S + tl.arange(0, BLOCK_S)
    s_mask = s_idx < S
    s64 = s_idx.to(tl.int64)
    # head groups of q (axis-1 ids < NQG), then of k; heads are int64 before any stride product
    if pid_h < NQG:
        _rotate_heads(
            q_ptr, qo_ptr, b, (pid_h * HPP).to(tl.int64), s64, s_mask,
            sq_b, sq_h, sq_s, sqo_b, sqo_h, sqo_s,
            cos_ptr, sin_ptr, pos_ptr, inv_freq_ptr, sc_b, sc_s, sp_b, sp_s, pos_offset, scale,
            HALF, D, BLOCK_D, BLOCK_P, HPP, POS_MODE, USE_INV_FREQ, INTERLEAVED, CONJUGATE, HAS_PASS, CDT,
            EMULATE_RTNE,
        )
    else:
        _rotate_heads(
            k_ptr, ko_ptr, b, ((pid_h - NQG) * HPP).to(tl.int64), s64, s_mask,
            sk_b, sk_h, sk_s, sko_b, sko_h, sko_s,
            cos_ptr, sin_ptr, pos_ptr, inv_freq_ptr, sc_b, sc_s, sp_b, sp_s, pos_offset, scale,
            HALF, D, BLOCK_D, BLOCK_P, HPP, POS_MODE, USE_INV_FREQ, INTERLEAVED, CONJUGATE, HAS_PASS, CDT,
            EMULATE_RTNE,
        )


# ------------------------------------------------------------------------------------------
# Host launcher
# ------------------------------------------------------------------------------------------

# Tile: at most _TILE_PAIRS (token, pair) lanes per program (4 KB of bf16 per operand).
_TILE_PAIRS = 1024
# Group several heads per program (amortising the cos/sin load/compute) only once the
# 1-head-per-program grid would have at least this many programs (prefill); decode keeps
# one head per program for parallelism.  At 1 x 2048 (5120 programs) two heads per program with
# in-kernel angles measured 0.0166 vs 0.0209 ms for one (H200, scripts/tune_rope.py, 2026-11-30).
_HPP_MIN_PROGRAMS = 4096
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
# Heads per program, largest first that divides both head counts (prefill-sized grids only), with
# _WARPS_GROUPED warps. Measured on an H200 (scripts/tune_rope.py, scripts/probe_bandwidth.py): with
# in-kernel angles two heads share the cos/sin work (71 -> 91-95 % of the copy floor, 2026-11-29);
# with tables, two heads and 8 warps reached 93.9 / 95.4 / 96.2 % at 4 x 4096, 1 x 32768 and
# 8 x 2048 h64 against 93.0 / 94.6 / 95.8 % for one head and 4 warps (2026-11-30, device time).
_HPP_CANDIDATES: tuple[int, ...] = (2,)
_WARPS_GROUPED = 8  # warps of a program that rotates several heads
# Grid order: head groups fastest, so the programs running together cover whole tokens
# (contiguous (H, D) rows in HF's (B, S, H, D) memory); +3-17 points of the copy floor.
_HEADS_FAST = True


def _next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length() if n > 1 else 1


def _make_config(B, Hq, Hk, S, D, half, dtype, pos_mode, use_inv_freq, interleaved, conjugate, inplace):
    block_d = _next_pow2(half)
    block_s = min(_next_pow2(S), max(1, _TILE_PAIRS // block_d))
    n_s = triton.cdiv(S, block_s)
    hpp = 1
    if n_s * B * (Hq + Hk) >= _HPP_MIN_PROGRAMS:
        for cand in _HPP_CANDIDATES:
            if Hq % cand == 0 and Hk % cand == 0:
                hpp = cand
                break
    has_pass = (not inplace) and 2 * half < D
    lanes = block_s * block_d
    num_warps = 1 if lanes <= 128 else 2 if lanes <= 512 else 4
    if hpp > 1:
        num_warps = _WARPS_GROUPED
    meta = dict(
        HALF=half,
        D=D,
        BLOCK_D=block_d,
        BLOCK_P=_next_pow2(D - 2 * half) if has_pass else 1,
        BLOCK_S=block_s,
        HPP=hpp,
        POS_MODE=pos_mode,
        USE_INV_FREQ=use_inv_freq,
        INTERLEAVED=interleaved,
        CONJUGATE=conjugate,
        HAS_PASS=has_pass,
        CDT=tl.float64 if dtype == torch.float64 else tl.float32,
        EMULATE_RTNE=_INTERPRET and dtype == torch.bfloat16,
        HEADS_FAST=_HEADS_FAST and n_s < 65536,  # grid axis 1 is limited to 65535
        num_warps=num_warps,
    )
    n_h = Hq // hpp + Hk // hpp
    grid = (n_h, n_s, B) if meta["HEADS_FAST"] else (n_s, n_h, B)
    constexprs = tuple(meta[name] for name in _CONSTEXPR_NAMES)  # signature order, for direct launch
    return grid, meta, Hq // hpp, constexprs


def clear_launch_caches() -> None:
    """Forget every kept launch (after changing a tuning knob)."""
    rope_launches.clear()


def _arguments(a: RopeArgs, qo: Tensor, ko: Tensor) -> tuple:
    """The launch of rotation ``a`` into ``qo``/``ko``: (grid, meta, constexprs, kernel arguments)."""
    q, k, cos, sin, inv_freq, positions = a.q, a.k, a.cos, a.sin, a.inv_freq, a.positions
    B, Hq, S, D = q.shape
    use_inv_freq = cos is None
    half = (inv_freq if use_inv_freq else cos).shape[-1]
    pos_mode = 0 if positions is None else positions.dim()
    grid, meta, nqg, constexprs = _make_config(B, Hq, k.shape[1], S, D, half, q.dtype, pos_mode, use_inv_freq,
                                               a.interleaved, a.conjugate, qo is q)
    if use_inv_freq:
        cos = sin = inv_freq  # dummies for the unused table pointers
        sc_b = sc_s = 0
    elif cos.dim() == 3:  # per-token table (Bc, S, R/2), Bc in {1, B}; positions is None
        sc_b = cos.stride(0) if cos.shape[0] != 1 else 0
        sc_s = cos.stride(1)
    else:  # position-indexed cache (T, R/2), by the positions tensor or by offset + s
        sc_b = 0
        sc_s = cos.stride(0)
    if positions is None:
        positions = q  # dummy pointer, never read (POS_MODE == 0)
        sp_b = sp_s = 0
    else:
        sp_b = positions.stride(0) if positions.shape[0] != 1 else 0
        sp_s = positions.stride(1) if pos_mode == 2 else 0
    if inv_freq is None:
        inv_freq = q  # dummy pointer, never read
    sq, sk, sqo, sko = q.stride(), k.stride(), qo.stride(), ko.stride()
    args = (
        q, k, qo, ko, cos, sin, positions, inv_freq,
        S, nqg,
        sq[0], sq[1], sq[2], sk[0], sk[1], sk[2],
        sqo[0], sqo[1], sqo[2], sko[0], sko[1], sko[2],
        sc_b, sc_s, sp_b, sp_s,
        a.offset, a.scale,
    )
    return grid, meta, constexprs, args


def launch(a: RopeArgs, qo: Tensor, ko: Tensor, key=None) -> None:
    """Rotate ``a.q``/``a.k`` into ``qo``/``ko`` (``qo is a.q``: in place) with one launch.  With a
    ``key`` (:func:`rope_launches.key_of`, or another key that determines the same launch) the
    launch is kept in :data:`rope_launches.LAUNCHES`, where the next call with that key finds it.

    Preconditions (checked by ``rope_op``): q/k/qo/ko 4-D with stride(-1) == 1, same dtype and
    device; cos/sin unit-stride in their last dim (or None with ``inv_freq`` given); positions
    None, (B|1,) or (B|1, S) integer.  Per-token table mode: cos (Bc, S, R/2), positions None,
    offset 0.  Cache mode: cos (T, R/2), indexed by positions or by offset + s.
    """
    grid, meta, constexprs, args = _arguments(a, qo, ko)
    compiled = _rope_kernel[grid](*args, **meta)  # compiles on the first call of a specialisation
    if key is not None:
        kept = _keep(compiled, grid, meta, constexprs, args, a.cos is not None)
        if kept is not None:
            rope_launches.store(key, kept)


# ------------------------------------------------------------------------------------------
# Kept launches: the compiled kernel again, without Triton's per-call binding
# ------------------------------------------------------------------------------------------
# A kept launch calls the compiled kernel's launcher directly (:mod:`direct_launch`) with raw
# pointers; the key it is kept under fixes everything else Triton specialised on, and the launch
# checks the pointers' alignment itself.  Any failure of the installed Triton's launcher switches the
# direct launch off for good (then a kept launch is a plain ``kernel[grid]`` call with the kept
# configuration).  ``TORCHEMBED_DIRECT_LAUNCH=0`` too.

_DIRECT = direct_launch.ENABLED
_raw_stream = direct_launch.raw_stream


def _on_gpu(t: Tensor) -> bool:
    return t.is_cuda


def _switch_direct_off() -> None:
    global _DIRECT
    _DIRECT = False
    rope_launches.clear()


def _keep(compiled, grid, meta, constexprs, args, tables: bool):
    """A :data:`rope_launches.Launch` repeating this launch; None where it cannot be kept."""
    fixed = args[8:-2]  # sizes and strides; the offset and scale come with each call
    g0, g1, g2 = grid
    q = args[0]
    found = direct_launch.entry_of(compiled)
    if not (_DIRECT and _on_gpu(q) and found is not None):
        def relaunch(q, k, qo, ko, cos, sin, inv_freq, positions, offset, scale) -> bool:
            if _DIRECT and _on_gpu(q):  # the direct launch came back on: launch() keeps one
                return False
            if not tables:  # the dummies of _arguments
                cos = sin = inv_freq
            _rope_kernel[grid](q, k, qo, ko, cos, sin, q if positions is None else positions,
                               q if inv_freq is None else inv_freq, *fixed, offset, scale, **meta)
            return True

        return relaunch
    if any(t.data_ptr() & 15 for t in args[:8]):  # compiled for unaligned pointers: not kept
        return None
    index = q.device.index
    entry, head = found

    def replay(q, k, qo, ko, cos, sin, inv_freq, positions, offset, scale) -> bool:
        if not _DIRECT:
            return False
        qp, kp = q.data_ptr(), k.data_ptr()
        qop = qp if qo is q else qo.data_ptr()
        kop = kp if ko is k else ko.data_ptr()
        if tables:
            cp, sp, ip = cos.data_ptr(), sin.data_ptr(), qp
        else:
            cp = sp = ip = inv_freq.data_ptr()
        pp = qp if positions is None else positions.data_ptr()
        if (qp | kp | qop | kop | cp | sp | pp | ip) & 15:
            return False
        try:
            entry(g0, g1, g2, _raw_stream(index), *head, qp, kp, qop, kop, cp, sp, pp, ip, *fixed, offset, scale,
                  *constexprs)
        except Exception:  # the installed Triton launches differently: kernel[grid] from now on
            _switch_direct_off()
            return False
        return True

    return replay


_CONSTEXPR_NAMES = (
    "HALF", "D", "BLOCK_D", "BLOCK_P", "BLOCK_S", "HPP", "POS_MODE", "USE_INV_FREQ", "INTERLEAVED",
    "CONJUGATE", "HAS_PASS", "CDT", "EMULATE_RTNE", "HEADS_FAST",
)
