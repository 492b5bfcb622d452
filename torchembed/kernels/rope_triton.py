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
``rope_forward`` trusts its arguments.

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

__all__ = ["rope_angles_inplace", "rope_forward", "rope_replayer", "rope_tables_inplace"]


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

# Per-shape launch configuration cache: key -> (grid, constexpr kwargs, NQG).  Everything
# derivable from shapes/dtype/flags is computed once, so a cached call only reads strides and
# launches.  Bounded: cleared when it grows past _CFG_MAX entries (prefill with many lengths).
_CFG: dict = {}
_CFG_MAX = 4096

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


def _config(key: tuple) -> tuple:
    """The launch configuration of a ``rope_forward`` key, made once and kept in ``_CFG``."""
    if len(_CFG) >= _CFG_MAX:
        _CFG.clear()
    (B, Hq, S, D), Hk, *rest = key
    cfg = _CFG[key] = _make_config(B, Hq, Hk, S, D, *rest)
    return cfg


def clear_launch_caches() -> None:
    """Forget every kept launch configuration and compiled kernel (after changing a tuning knob)."""
    from torchembed.kernels import rope_op

    for cache in (_CFG, _COMPILED, _HOT, rope_op._FAST):
        cache.clear()


def _setup(q, k, qo, ko, cos, sin, inv_freq, positions, pos_offset, scale, interleaved, conjugate):
    """``rope_forward``'s launch: (config key, grid, meta, constexprs, kernel arguments)."""
    qshape = q.shape
    use_inv_freq = cos is None
    half = (inv_freq if use_inv_freq else cos).shape[-1]
    pos_mode = 0 if positions is None else positions.dim()
    inplace = qo is q
    key = (qshape, k.shape[1], half, q.dtype, pos_mode, use_inv_freq, interleaved, conjugate, inplace)
    grid, meta, nqg, constexprs = _CFG.get(key) or _config(key)
    S = qshape[2]

    if use_inv_freq:
        cos = sin = inv_freq  # dummies for the unused table pointers
        sc_b = sc_s = 0
    elif cos.dim() == 3:  # per-token table (Bc, S, R/2), Bc in {1, B}; positions is None
        sc_b = cos.stride(0) if cos.shape[0] != 1 else 0
        sc_s = cos.stride(1)
    else:  # position-indexed cache (T, R/2); an int offset arrives as positions=None + pos_offset
        sc_b = 0
        sc_s = cos.stride(0)
    if positions is None:
        pos_t = q  # dummy pointer, never read (POS_MODE == 0)
        sp_b = sp_s = 0
    else:
        pos_t = positions
        sp_b = positions.stride(0) if positions.shape[0] != 1 else 0
        sp_s = positions.stride(1) if pos_mode == 2 else 0
    if inv_freq is None:
        inv_freq = q  # dummy pointer, never read

    sq, sk, sqo, sko = q.stride(), k.stride(), qo.stride(), ko.stride()
    args = (
        q, k, qo, ko, cos, sin, pos_t, inv_freq,
        S, nqg,
        sq[0], sq[1], sq[2], sk[0], sk[1], sk[2],
        sqo[0], sqo[1], sqo[2], sko[0], sko[1], sko[2],
        sc_b, sc_s, sp_b, sp_s,
        pos_offset, scale,
    )
    return key, grid, meta, constexprs, args


def _launch(q, k, qo, ko, cos, sin, inv_freq, positions, pos_offset, scale, interleaved, conjugate):
    """``rope_forward``'s launch: (compiled kernel when launched directly else None, grid, meta,
    constexprs, kernel arguments)."""
    key, grid, meta, constexprs, args = _setup(
        q, k, qo, ko, cos, sin, inv_freq, positions, pos_offset, scale, interleaved, conjugate
    )
    if _DIRECT and q.is_cuda:
        # What Triton specialises on beyond the launch config: the other tensors' dtypes, the
        # strides and offset (their values cover ==1, %16 and int32 range) and the pointers'
        # 16-byte alignment (one bit when all are aligned, the usual case).
        ptrs = tuple(t.data_ptr() for t in args[:8])
        aligned = True if not (ptrs[0] | ptrs[1] | ptrs[2] | ptrs[3] | ptrs[4] | ptrs[5] | ptrs[6] | ptrs[7]) & 15 \
            else tuple(ptr % 16 == 0 for ptr in ptrs)
        cos, sin, pos_t, inv_freq = args[4:8]
        spec = (key, constexprs, meta["num_warps"], cos.dtype, sin.dtype, pos_t.dtype, inv_freq.dtype, args[10:26],
                _int_spec(pos_offset), aligned)
        compiled = _direct_launch(spec, grid, meta, args, q.device.index)
        return compiled, grid, meta, constexprs, args
    _rope_kernel[grid](*args, **meta)
    return None, grid, meta, constexprs, args


def rope_forward(q, k, qo, ko, cos, sin, inv_freq, positions, pos_offset, scale, interleaved, conjugate):
    """Launch the fused kernel once for q and k.  ``qo is q`` (and ``ko is k``) means in-place.
    Returns ``(compiled kernel, grid, launch arguments after the 8 pointers, constexprs included)``
    when it launched directly (what the in-place hot paths replay), None when through ``kernel[grid]``.

    Preconditions (checked by ``rope_op``): q/k/qo/ko 4-D with stride(-1) == 1, same dtype and
    device; cos/sin unit-stride in their last dim (or None with ``inv_freq`` given); positions
    None, (B|1,) or (B|1, S) integer.  Per-token table mode: cos (Bc, S, R/2), positions None,
    pos_offset 0.  Cache mode: cos (T, R/2), indexed by positions or by pos_offset + s.
    """
    compiled, grid, _, constexprs, args = _launch(
        q, k, qo, ko, cos, sin, inv_freq, positions, pos_offset, scale, interleaved, conjugate
    )
    return None if compiled is None else (compiled, grid, args[8:] + constexprs)


def rope_replayer(q, k, qo, ko, cos, sin, inv_freq, positions, pos_offset, scale, interleaved, conjugate):
    """Launch as ``rope_forward`` does; return ``replay(q, k, qo, ko, cos, sin, inv_freq, positions,
    pos_offset, scale) -> bool``, the same launch with other pointers, offset and scale, for tensors
    of this call's shapes, strides, dtypes and device and an offset Triton specialises alike.

    ``replay`` launches nothing and returns False where it no longer applies (the direct launch was
    switched on or off, a pointer is not 16-byte aligned, the launcher raised): ``rope_forward``
    decides then. None when this call's own launch cannot be replayed (unaligned pointers)."""
    compiled, grid, meta, constexprs, args = _launch(
        q, k, qo, ko, cos, sin, inv_freq, positions, pos_offset, scale, interleaved, conjugate
    )
    fixed = args[8:-2]  # sizes and strides; pos_offset and scale come with each call
    tables = cos is not None
    if compiled is None:
        def replay(q, k, qo, ko, cos, sin, inv_freq, positions, pos_offset, scale) -> bool:
            if _DIRECT and q.is_cuda:
                return False
            if not tables:  # rope_forward's dummies for the unused pointers
                cos = sin = inv_freq
            _rope_kernel[grid](q, k, qo, ko, cos, sin, q if positions is None else positions,
                               q if inv_freq is None else inv_freq, *fixed, pos_offset, scale, **meta)
            return True

        return replay
    if any(t.data_ptr() & 15 for t in args[:8]):
        return None
    run, function, metadata = compiled.run, compiled.function, compiled.packed_metadata
    g0, g1, g2 = grid
    index = q.device.index

    def replay(q, k, qo, ko, cos, sin, inv_freq, positions, pos_offset, scale) -> bool:
        if not _DIRECT:
            return False
        if not tables:  # rope_forward's dummies for the unused pointers
            cos = sin = inv_freq
        if positions is None:
            positions = q
        if inv_freq is None:
            inv_freq = q
        if (q.data_ptr() | k.data_ptr() | qo.data_ptr() | ko.data_ptr() | cos.data_ptr() | sin.data_ptr()
                | positions.data_ptr() | inv_freq.data_ptr()) & 15:
            return False
        try:
            run(g0, g1, g2, torch._C._cuda_getCurrentRawStream(index), function, metadata, None, None, None,
                q, k, qo, ko, cos, sin, positions, inv_freq, *fixed, pos_offset, scale, *constexprs)
        except Exception:  # the installed Triton launches differently: rope_forward decides
            return False
        return True

    return replay


# Hot paths of the patched HF attention at inference: in place, per-token tables or angles from
# position ids, nothing else. One dict lookup keyed on what the call's tensors are (shapes, strides,
# dtypes) yields the kept compiled kernel and every launch argument but the pointers (all functions
# of the key), instead of rope_forward's two keys and its specialisation tuple. Misses (a new shape,
# pointers not 16-byte aligned, no direct launch) go through rope_forward, whose direct launch is
# recorded for the next call.
_HOT: dict = {}


def rope_tables_inplace(q, k, cos, sin) -> None:
    """``rope_forward(q, k, q, k, cos, sin, None, None, 0, 1.0, False, False)`` with less host work
    per call. Same preconditions; cos/sin per-token tables ``(B or 1, S, R/2)``."""
    key = (q.shape, k.shape, q.stride(), k.stride(), cos.shape, cos.stride(), sin.stride(), q.dtype, cos.dtype,
           sin.dtype)
    aligned = not (q.data_ptr() | k.data_ptr() | cos.data_ptr() | sin.data_ptr()) & 15
    if not _replay(key, aligned, q, k, cos, sin, q, q):  # unused positions / inv_freq: dummies, as rope_forward
        _record(key, aligned, rope_forward(q, k, q, k, cos, sin, None, None, 0, 1.0, False, False))


def rope_angles_inplace(q, k, positions, inv_freq) -> None:
    """``rope_forward(q, k, q, k, None, None, inv_freq, positions, 0, 1.0, False, False)`` with less
    host work per call. Same preconditions; positions ``(B or 1, S)`` integer, inv_freq ``(R/2,)``."""
    key = (q.shape, k.shape, q.stride(), k.stride(), positions.shape, positions.stride(), inv_freq.shape, q.dtype,
           positions.dtype, inv_freq.dtype)
    aligned = not (q.data_ptr() | k.data_ptr() | positions.data_ptr() | inv_freq.data_ptr()) & 15
    if not _replay(key, aligned, q, k, inv_freq, inv_freq, positions, inv_freq):  # unused tables: dummies
        _record(key, aligned, rope_forward(q, k, q, k, None, None, inv_freq, positions, 0, 1.0, False, False))


def _replay(key, aligned, q, k, cos, sin, pos, inv_freq) -> bool:
    """Launch the entry kept for ``key`` in place on q, k with these pointer arguments; False on a miss."""
    hot = _HOT.get(key)
    if hot is None or not aligned or not _DIRECT:
        return False
    run, function, metadata, grid, tail = hot
    try:
        run(grid[0], grid[1], grid[2], torch._C._cuda_getCurrentRawStream(q.get_device()), function, metadata,
            None, None, None, q, k, q, k, cos, sin, pos, inv_freq, *tail)
        return True
    except Exception:  # the installed Triton launches differently: rope_forward decides from now on
        _HOT.clear()
        return False


def _record(key, aligned, launched) -> None:
    """Keep ``rope_forward``'s direct launch (compiled kernel, grid, non-pointer arguments) for ``key``."""
    if launched is None or not aligned or not _DIRECT:
        return
    if len(_HOT) >= _CFG_MAX:
        _HOT.clear()
    compiled, grid, tail = launched
    _HOT[key] = (compiled.run, compiled.function, compiled.packed_metadata, grid, tail)


# ------------------------------------------------------------------------------------------
# Direct launch: replay the compiled kernel without Triton's per-call binding
# ------------------------------------------------------------------------------------------
# ``kernel[grid](...)`` re-derives the specialisation of every argument on each call (dtype,
# 16-byte alignment, ints equal to 1, 32/64-bit ints), which at decode sizes costs more than the
# kernel. We compute the same facts ourselves, keep the CompiledKernel Triton returned for them,
# and call its launcher. Any mismatch with the installed Triton disables this path for good.
# ``TORCHEMBED_DIRECT_LAUNCH=0`` switches it off.

_DIRECT = os.environ.get("TORCHEMBED_DIRECT_LAUNCH", "1") == "1"
_COMPILED: dict = {}
_I32 = 2**31


def _int_spec(value: int) -> tuple:
    """What Triton specialises an int argument on: == 1, divisible by 16, int32 range."""
    return value == 1, value % 16 == 0, -_I32 <= value < _I32


def _direct_launch(spec, grid, meta, args, device_index):
    """Launch through the CompiledKernel kept for ``spec`` (the first call of a spec compiles
    or fetches it through ``kernel[grid]``); return it (None once the direct path is off)."""
    global _DIRECT
    constexprs = spec[1]
    compiled = _COMPILED.get(spec)
    if compiled is None:
        if len(_COMPILED) >= _CFG_MAX:
            _COMPILED.clear()
        compiled = _COMPILED[spec] = _rope_kernel[grid](*args, **meta)
        return compiled
    try:
        compiled.run(
            grid[0], grid[1], grid[2], torch._C._cuda_getCurrentRawStream(device_index),
            compiled.function, compiled.packed_metadata, None, None, None, *args, *constexprs,
        )
        return compiled
    except Exception:  # the installed Triton launches differently: use its own path from now on
        _DIRECT = False
        _rope_kernel[grid](*args, **meta)
        return None


_CONSTEXPR_NAMES = (
    "HALF", "D", "BLOCK_D", "BLOCK_P", "BLOCK_S", "HPP", "POS_MODE", "USE_INV_FREQ", "INTERLEAVED",
    "CONJUGATE", "HAS_PASS", "CDT", "EMULATE_RTNE", "HEADS_FAST",
)
