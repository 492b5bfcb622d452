"""Fused rotary-embedding Triton kernel: q and k rotated in one launch.

Rotary embedding: Su et al., "RoFormer", arXiv:2104.09864. For each (batch b, head h, token s) row of q or k and each
pair index j < R/2 (R = rotary dim):

    x1, x2 = x[j], x[j + R/2]          (half-split, GPT-NeoX / LLaMA pairing)
    x1, x2 = x[2j], x[2j + 1]          (interleaved, GPT-J pairing)
    y1 = x1 * c - x2 * s
    y2 = x2 * c + x1 * s               (s -> -s when CONJUGATE: the inverse rotation)

With ``HALVES`` (half-split pairing, tables read from memory) the second feature of a pair takes its own entries,
``R/2`` further along the table row: ``y2 = x2 * c' + x1 * s'`` -- what HF computes with its full-width tables also
where their two halves differ (HunYuan-VL's M-RoPE sections); ``HALVES == 2`` exchanges ``s`` and ``s'`` (the
backward of ``HALVES == 1``: the transpose of that map).

Dims [R, D) pass through. All math is float32 (float64 for float64 inputs), rounded once on store. Triton code only:
the host side, :mod:`torchembed.kernels.rope`, imports this module on the first launch.

Grid: ``(cdiv(S, BLOCK_S), Hq // HPP + Hk // HPP, B)`` (axes 0 and 1 exchanged with HEADS_FAST). The head axis
enumerates head groups of q first, then of k, so ONE launch rotates both; a program makes the cos/sin of its BLOCK_S
tokens once (loaded, or computed from inv_freq) and applies them to HPP heads (1 for decode-sized grids, for
parallelism; 2 for prefill-sized ones). Batch is grid axis 2, so B <= 65535.

Addressing: every index is cast to int64 *before* it is multiplied by a stride, so tensors (and cos/sin caches) with
more than 2**31 elements are addressed correctly. Only the last dim must have stride 1; every other stride is a
runtime argument (HF's ``(B, H, S, D)`` view over ``(B, S, H, D)`` memory and padded views need no copy).
"""

from __future__ import annotations

import triton
import triton.language as tl

from torchembed.kernels.triton_common import round_f32_to_bf16_rtne

__all__ = ["COMPUTE_DTYPES", "rope_kernel"]

COMPUTE_DTYPES = {"fp32": tl.float32, "fp64": tl.float64}  # the CDT meta-parameter


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
def _store_rotated(x_ptr, o_ptr, x_row, o_row, x1, x2, c, s, c2, s2, s_mask, HALF: tl.constexpr, D: tl.constexpr,
                   BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr, INTERLEAVED: tl.constexpr, HAS_PASS: tl.constexpr,
                   EMULATE_RTNE: tl.constexpr):
    """Store the rotated pairs (x1, x2) of BLOCK_S token rows. ``x_row``/``o_row``: [BLOCK_S] int64 element offsets
    of each token row of the input/output head; ``c``/``s``: [BLOCK_S, BLOCK_D] cos * scale and sin * scale (negated
    when conjugate) in the compute dtype; ``c2``/``s2``: the second features' (``c``/``s`` but with HALVES);
    ``s_mask``: [BLOCK_S] token in range."""
    d1, d2, j_mask = _pair_dims(HALF, BLOCK_D, INTERLEAVED)
    m = s_mask[:, None] & j_mask[None, :]
    op = o_ptr + o_row[:, None]
    y1 = x1 * c - x2 * s
    y2 = x2 * c2 + x1 * s2
    if EMULATE_RTNE:
        y1 = round_f32_to_bf16_rtne(y1)
        y2 = round_f32_to_bf16_rtne(y2)
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
             CONJUGATE: tl.constexpr, HALVES: tl.constexpr, CDT: tl.constexpr):
    """cos * scale and sin * scale (negated when CONJUGATE) of BLOCK_S tokens, [BLOCK_S, BLOCK_D], for
    the first and the second features of the pairs (the same but with HALVES)."""
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
    # (constexpr branches assign, one return at the end: the compiler visits only the branch taken)
    if HALVES == 0:
        c2 = c
        s2 = sn
    else:
        c2 = tl.load(cos_ptr + t_off + HALF, mask=m, other=0.0).to(CDT) * scale
        s2 = tl.load(sin_ptr + t_off + HALF, mask=m, other=0.0).to(CDT) * scale
        if CONJUGATE:
            s2 = -s2
        if HALVES == 2:  # the two halves' sines exchanged
            first = sn
            sn = s2
            s2 = first
    return c, sn, c2, s2


@triton.jit
def _rotate_heads(
    x_ptr, o_ptr, b, h0, s64, s_mask,
    sx_b, sx_h, sx_s, so_b, so_h, so_s,
    cos_ptr, sin_ptr, pos_ptr, inv_freq_ptr, sc_b, sc_s, sp_b, sp_s, pos_offset, scale,
    HALF: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr, HPP: tl.constexpr,
    POS_MODE: tl.constexpr, USE_INV_FREQ: tl.constexpr, INTERLEAVED: tl.constexpr, CONJUGATE: tl.constexpr,
    HALVES: tl.constexpr, HAS_PASS: tl.constexpr, CDT: tl.constexpr, EMULATE_RTNE: tl.constexpr,
):
    """Rotate heads h0 .. h0 + HPP - 1 of x into o for BLOCK_S tokens; cos/sin made once. The first two heads' loads
    are issued before the positions / tables / angles work, so their memory latency overlaps it."""
    x_row = b * sx_b + h0 * sx_h + s64 * sx_s
    o_row = b * so_b + h0 * so_h + s64 * so_s
    x1, x2 = _load_pairs(x_ptr, x_row, s_mask, HALF, BLOCK_D, INTERLEAVED, CDT)
    if HPP > 1:
        x1b, x2b = _load_pairs(x_ptr, x_row + sx_h, s_mask, HALF, BLOCK_D, INTERLEAVED, CDT)
    c, sn, c2, s2 = _cos_sin(cos_ptr, sin_ptr, pos_ptr, inv_freq_ptr, b, s64, s_mask, sc_b, sc_s, sp_b, sp_s,
                             pos_offset, scale, HALF, BLOCK_D, POS_MODE, USE_INV_FREQ, CONJUGATE, HALVES, CDT)
    _store_rotated(x_ptr, o_ptr, x_row, o_row, x1, x2, c, sn, c2, s2, s_mask,
                   HALF, D, BLOCK_D, BLOCK_P, INTERLEAVED, HAS_PASS, EMULATE_RTNE)
    if HPP > 1:
        _store_rotated(x_ptr, o_ptr, x_row + sx_h, o_row + so_h, x1b, x2b, c, sn, c2, s2, s_mask,
                       HALF, D, BLOCK_D, BLOCK_P, INTERLEAVED, HAS_PASS, EMULATE_RTNE)
    for i in tl.static_range(2, HPP):
        x_row = b * sx_b + (h0 + i) * sx_h + s64 * sx_s
        o_row = b * so_b + (h0 + i) * so_h + s64 * so_s
        x1, x2 = _load_pairs(x_ptr, x_row, s_mask, HALF, BLOCK_D, INTERLEAVED, CDT)
        _store_rotated(x_ptr, o_ptr, x_row, o_row, x1, x2, c, sn, c2, s2, s_mask,
                       HALF, D, BLOCK_D, BLOCK_P, INTERLEAVED, HAS_PASS, EMULATE_RTNE)


@triton.jit
def rope_kernel(
    q_ptr, k_ptr,
    qo_ptr, ko_ptr,  # == q_ptr, k_ptr when in-place
    cos_ptr, sin_ptr,  # table rows of R/2 entries (unused with USE_INV_FREQ)
    pos_ptr,  # int positions (unused with POS_MODE == 0)
    inv_freq_ptr,  # (R/2,) (unused without USE_INV_FREQ)
    S,  # tokens per sequence
    NQG,  # number of q head groups (= Hq // HPP); axis-1 programs >= NQG rotate k
    sq_b, sq_h, sq_s,  # q strides (the last dim has stride 1)
    sk_b, sk_h, sk_s,
    sqo_b, sqo_h, sqo_s,
    sko_b, sko_h, sko_s,
    sc_b, sc_s,  # cos/sin strides per batch row (0: broadcast / cache table) and per position (per token in table mode)
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
    HALVES: tl.constexpr,  # 0; 1: a pair's second feature reads its own entries, R/2 along the row; 2: sines exchanged
    HAS_PASS: tl.constexpr,  # copy dims [R, D) (out-of-place with R < D)
    CDT: tl.constexpr,  # compute dtype: float32 (float64 for float64 inputs)
    EMULATE_RTNE: tl.constexpr,  # interpreter-only bf16 rounding fix (see round_f32_to_bf16_rtne)
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
            HALF, D, BLOCK_D, BLOCK_P, HPP, POS_MODE, USE_INV_FREQ, INTERLEAVED, CONJUGATE, HALVES, HAS_PASS, CDT,
            EMULATE_RTNE,
        )
    else:
        _rotate_heads(
            k_ptr, ko_ptr, b, ((pid_h - NQG) * HPP).to(tl.int64), s64, s_mask,
            sk_b, sk_h, sk_s, sko_b, sko_h, sko_s,
            cos_ptr, sin_ptr, pos_ptr, inv_freq_ptr, sc_b, sc_s, sp_b, sp_s, pos_offset, scale,
            HALF, D, BLOCK_D, BLOCK_P, HPP, POS_MODE, USE_INV_FREQ, INTERLEAVED, CONJUGATE, HALVES, HAS_PASS, CDT,
            EMULATE_RTNE,
        )
