"""Triton kernels: flash attention with an ALiBi bias (or none) computed inside, forward, split-key decode, backward.

Press et al., "Train Short, Test Long", arXiv:2108.12409 (the bias); Dao, "FlashAttention-2", arXiv:2307.08691 (the
tiling, the online softmax, the backward that recomputes the probabilities from the saved log-sum-exp). Shapes: ``B``
batch, ``H`` query heads, ``Hk`` key/value heads (``GROUP = H / Hk`` query heads share one; no copy of k or v), ``M``
queries, ``N`` keys, ``D`` head dim (padded to a power of two ``BLOCK_D`` inside, masked).

Scores are in base-2 units, ``s2 = log2(e) * (scale * q.k + bias)``: each probability is one ``exp2``. The bias of
query row ``i`` and key ``j`` is ``slope_h * (j - c_i)`` (``BIAS == 0``, from the ``(H,)`` slopes), ``key_bias[b, h,
j] - key_bias[b, h, c_i]`` (``BIAS == 1``, from a ``(B or 1, H, N)`` float32 key bias) or none (``BIAS == 2``: what a
RoPE model's decode step runs); ``c_i`` is the row's last kept key. It splits into a key part ``kvec[j]``, relative to
``c0``, the last key any row of the query block keeps (small near the newest keys, where the weight is, so it rounds
least there), and a row part ``rvec[i]``: a per-row constant, which softmax ignores, so each score adds ``kvec[j]`` only
(one fused multiply-add with the scale) and ``rvec`` enters once per row, into the log-sum-exp the backward reads.

Which keys a row sees (``MASK``):

* ``0``: causal with the queries at the last ``M`` of the ``N`` key positions (a prefill after any KV cache,
  ``M <= N``): row ``i`` sees keys ``[0, i + N - M]``;
* ``1``: a boolean ``keep (B or 1, 1, M, N)`` summarised once per forward by :func:`_rows_kernel` into ``rows (B or 1,
  3, M)`` int32: the first kept key ``lo``, one past the last ``hi`` and whether the row keeps every key in between
  (padding, static-cache slots and KV caches give such rows). Only tiles that straddle ``lo`` or ``hi`` are masked; a
  row with holes in its range (``irregular``) makes its tiles read ``keep`` itself. A row that keeps no key gives 0.

A query block visits ``[min lo, max hi)`` only, in up to three loops (the masked tiles at the end first -- causal: the
diagonal --, then the unmasked bulk, then the masked tiles at the start): the bulk runs with no mask arithmetic. Long
prefills (``SKIP``) also leave out the keys of provably negligible weight (:func:`_first_needed`, the horizon of
:func:`_bwd_delta_kernel`). Programs of the shallowest slopes (ALiBi's last heads: the most keys) are scheduled first.

Every index is int64 before it meets a stride; all tensors take any strides. On Hopper and later GPUs the prefill
kernel reads keys and values through tensor descriptors (``TMA``: zero-filling past the last key and the head dim)
where strides and pointers are 16-byte aligned, else through pointers. Matrix products take the input dtype (float32:
full precision) and accumulate in float32; the softmax statistics are float32. Device code only: the host side is
:mod:`torchembed.kernels.attention_plan`, which imports this module (and Triton) on the first launch.
"""

from __future__ import annotations

import triton
import triton.language as tl

from torchembed.kernels.triton_common import round_f32_to_bf16_rtne

__all__ = ["NORM_PARTS"]


# --- Mask summary: keep (B or 1, 1, M, N) -> rows (B or 1, 3, M) = [lo, hi, irregular] ------------


@triton.jit
def _rows_kernel(Keep, Rows, M, N, smb, smm, smn, srb, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr):
    b = tl.program_id(1).to(tl.int64)
    offs_m = tl.program_id(0) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    row_ok = offs_m < M
    base = Keep + b * smb + offs_m.to(tl.int64)[:, None] * smm
    first = tl.full([BLOCK_Q], 2147483647, tl.int32)
    last = tl.full([BLOCK_Q], -1, tl.int32)
    count = tl.zeros([BLOCK_Q], tl.int32)
    for start in range(0, N, BLOCK_K):
        offs_n = start + tl.arange(0, BLOCK_K)
        t = tl.load(base + offs_n.to(tl.int64)[None, :] * smn, mask=row_ok[:, None] & (offs_n < N)[None, :], other=0)
        kept = t != 0
        first = tl.minimum(first, tl.min(tl.where(kept, offs_n[None, :], 2147483647), 1))
        last = tl.maximum(last, tl.max(tl.where(kept, offs_n[None, :], -1), 1))
        count += tl.sum(kept.to(tl.int32), 1)
    empty = count == 0
    lo = tl.where(empty, 0, first)
    hi = tl.where(empty, 0, last + 1)
    irregular = (count != hi - lo).to(tl.int32)
    out = Rows + b * srb + offs_m
    tl.store(out, lo, mask=row_ok)
    tl.store(out + M, hi, mask=row_ok)
    tl.store(out + 2 * M, irregular, mask=row_ok)


# --- Key norms (the skip's bound): k (B, Hk, N, D) -> (B * Hk, NORM_PARTS) float32, each a slice's largest ---

NORM_PARTS = 32  # slices of the keys per (batch, kv head): one program each; the kernels take their max
_NORM_PARTS = tl.constexpr(NORM_PARTS)


@triton.jit
def _key_norm_kernel(K, Out, Hk, N, CHUNK, skb, skh, skn, skd, HEAD_DIM: tl.constexpr, BLOCK_K: tl.constexpr,
                     BLOCK_D: tl.constexpr, PARTS: tl.constexpr):
    """Grid ``(PARTS, B * Hk)``: ``Out[b * Hk + hk, part]``, the largest Euclidean norm among keys ``[part * CHUNK,
    (part + 1) * CHUNK)`` of (batch, kv head) (0: none; a NaN key: inf, so nothing is skipped)."""
    part = tl.program_id(0)
    bk = tl.program_id(1).to(tl.int64)
    b, hk = bk // Hk, bk % Hk
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    base = K + b * skb + hk * skh
    largest = tl.zeros([BLOCK_K], dtype=tl.float32)
    stop = tl.minimum(part * CHUNK + CHUNK, N)
    for start in range(part * CHUNK, stop, BLOCK_K):
        offs_n = start + tl.arange(0, BLOCK_K)
        x = tl.load(base + offs_n.to(tl.int64)[:, None] * skn + offs_d[None, :] * skd,
                    mask=(offs_n < stop)[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        sq = tl.sum(x * x, 1)
        largest = tl.maximum(largest, tl.where(sq == sq, sq, float("inf")))
    tl.store(Out + bk * PARTS + part, tl.sqrt(tl.max(largest, 0)))


@triton.jit
def _head_key_norm(KNorm, bk, PARTS: tl.constexpr):
    """The largest key norm of (batch, kv head) ``bk`` from :func:`_key_norm_kernel`'s slices."""
    return tl.max(tl.load(KNorm + bk * PARTS + tl.arange(0, PARTS)), 0)


# --- Shared pieces --------------------------------------------------------------------------------


@triton.jit
def _row_ranges(Rows, rows_base, offs_m, row_ok, M, N, MASK: tl.constexpr):
    """Per query row: first key ``lo``, one past the last ``hi`` (0, 0: none), ``irregular``; rows past M: none."""
    if MASK == 0:
        hi = tl.where(row_ok, offs_m + (N - M) + 1, 0)
        lo = tl.zeros_like(hi)
        irregular = tl.zeros_like(hi)
    else:
        ptr = Rows + rows_base + offs_m
        lo = tl.load(ptr, mask=row_ok, other=0)
        hi = tl.load(ptr + M, mask=row_ok, other=0)
        irregular = tl.load(ptr + 2 * M, mask=row_ok, other=0)
    return lo, hi, irregular


@triton.jit
def _query_block(H, GROUP, M, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """The query block of a program over (query blocks, batch x heads): the longest (causal) blocks and the shallowest
    slopes (the most keys to visit) first. ``(b, h, b * H + h, kv head, rows, rows < M, features, features < D)``."""
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)
    b, h = pid_bh // H, H - 1 - pid_bh % H
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    return b, h, b * H + h, h // GROUP, offs_m, offs_m < M, offs_d, offs_d < HEAD_DIM


@triton.jit
def _masked(s, offs_n, lo, hi, keep_base, offs_m, row_ok, n_ok, n64, smm, smn, HOLES: tl.constexpr):
    """Scores ``s``, -inf where a row keeps no key: outside its ``[lo, hi)`` and (``HOLES``) where ``keep`` says so."""
    keep = (offs_n[None, :] >= lo[:, None]) & (offs_n[None, :] < hi[:, None])
    if HOLES:
        t = tl.load(keep_base + offs_m.to(tl.int64)[:, None] * smm + n64[None, :] * smn,
                    mask=row_ok[:, None] & n_ok[None, :], other=0)
        keep = keep & (t != 0)
    return tl.where(keep, s, float("-inf"))


@triton.jit
def _bias_at(Bias, bias_base, sbn, c0, BIAS: tl.constexpr):
    """The key bias at position ``c0`` (key-bias mode; 0 otherwise)."""
    if BIAS == 1:
        return tl.load(Bias + bias_base + c0.to(tl.int64) * sbn)
    else:
        return 0.0


@triton.jit
def _row_bias(Bias, bias_base, sbn, c, c0, kb0, slope2, row_ok, BIAS: tl.constexpr):
    """``rvec[i]``: the row part of the base-2 bias relative to position ``c0``."""
    if BIAS == 0:
        return slope2 * (c0 - c).to(tl.float32)
    elif BIAS == 1:
        kbc = tl.load(Bias + bias_base + c.to(tl.int64) * sbn, mask=row_ok, other=0.0)
        return (kb0 - kbc) * 1.4426950408889634
    else:
        return tl.zeros(c.shape, tl.float32)


@triton.jit
def _key_bias(Bias, bias_base, sbn, offs_n, c0, kb0, slope2, N, BIAS: tl.constexpr, BOUNDED: tl.constexpr):
    """``kvec[j]``: the key part of the base-2 bias relative to position ``c0`` (``kb0``: the key bias there)."""
    if BIAS == 0:
        return slope2 * (offs_n - c0).to(tl.float32)
    elif BIAS == 1:
        ptr = Bias + bias_base + offs_n.to(tl.int64) * sbn
        if BOUNDED:
            kb = tl.load(ptr, mask=offs_n < N, other=0.0)
        else:
            kb = tl.load(ptr)
        return (kb - kb0) * 1.4426950408889634
    else:
        return tl.zeros(offs_n.shape, tl.float32)


@triton.jit
def _head_slope(Bias, h, sbh, BIAS: tl.constexpr):
    """The head's slope in base-2 units (0 in key-bias mode, where the bias is read per key)."""
    if BIAS == 0:
        return tl.load(Bias + h * sbh) * 1.4426950408889634
    else:
        return 0.0


@triton.jit
def _qk_bound(q, knorm, qk_scale):
    """Per query row: the largest ``|qk_scale * q_i . k|`` over keys of norm at most ``knorm`` (Cauchy-Schwarz), plus 1
    (base 2) for rounding."""
    qf = q.to(tl.float32)
    return tl.abs(qk_scale) * tl.sqrt(tl.sum(qf * qf, 1)) * knorm + 1.0


@triton.jit
def _first_reaching(Reach, reach_base, t, N, STEPS):
    """The first key position ``j`` with ``reach[j] >= t`` (``N``: none), elementwise over ``t`` (scalar or tensor):
    ``reach`` (the key bias's running maximum, NaN as inf) does not decrease, so ``STEPS >= bit_length(N)`` halvings
    of a binary search find it."""
    lo = tl.zeros_like(t).to(tl.int32)
    hi = lo + N
    for _ in range(0, STEPS):
        mid = (lo + hi) // 2
        r = tl.load(Reach + reach_base + mid.to(tl.int64), mask=mid < N, other=float("inf"))
        left = r >= t
        hi = tl.where(left, mid, hi)
        lo = tl.where(left, lo, mid + 1)
    return lo


@triton.jit
def _first_needed(m_i, q, knorm, c0, kb0, slope2, qk_scale, skip_log2, row_ok, N, Reach, reach_base, STEPS,
                  BIAS: tl.constexpr):
    """The first key position any row of a query block needs (``SKIP``): a key ``j`` is negligible for row ``i`` when
    even the Cauchy-Schwarz bound of its score, ``|qk_scale| * |q_i| * knorm + bias2(j)`` (base 2, relative to ``c0``),
    is below ``m_i - skip_log2`` (``m_i`` a score the row has; ``knorm`` the head's largest key norm): its weight is
    then under ``2**-skip_log2`` of the row's largest. Slopes: ``bias2(j) = slope2 * (j - c0)`` falls with distance,
    so every key before that position is negligible too (a slope <= 0: nothing is skipped). Key bias: every key up to
    ``j`` has a bias at most ``reach[j]``, the running maximum; :func:`_first_reaching` finds where it reaches the rows'
    smallest threshold. Rows that saw no key yet, NaN: nothing is skipped (0)."""
    room = m_i - skip_log2 - _qk_bound(q, knorm, qk_scale)
    if BIAS == 0:
        j = c0.to(tl.float32) + room / tl.where(slope2 > 0.0, slope2, 1.0)
        j = tl.where(row_ok, j, 3.0e38)  # rows past M constrain nothing
        j = tl.where(j == j, j, -3.0e38)  # NaN: every key
        first = tl.min(j, 0)
        first = tl.where(slope2 > 0.0, first, -3.0e38)
        first = tl.minimum(tl.maximum(first, 0.0), N * 1.0)
        return first.to(tl.int32)
    else:
        t = kb0 + room * 0.6931471805599453  # the key bias below which a key is negligible for the row
        t = tl.where(row_ok, t, 3.0e38)
        t = tl.where(t == t, t, -3.0e38)
        return _first_reaching(Reach, reach_base, tl.min(t, 0), N, STEPS)


@triton.jit
def _cast(x, dtype: tl.constexpr, PREC: tl.constexpr):
    """float32 ``x`` as ``dtype``, rounded to nearest even as the GPU rounds, also under the interpreter (``PREC`` 2),
    whose float32 -> bfloat16 cast truncates."""
    if PREC == 2:
        if dtype == tl.bfloat16:
            x = round_f32_to_bf16_rtne(x)
    return x.to(dtype)


@triton.jit
def _dot_acc(a, b, acc, PREC: tl.constexpr):
    """``acc + a @ b`` (see :func:`_dot`)."""
    if PREC == 0:
        return tl.dot(a, b, acc)
    elif PREC == 1:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")


@triton.jit
def _dot(a, b, PREC: tl.constexpr):
    """``a @ b`` accumulated in float32. ``PREC``: 0 the operands' own (half) precision, 1 float32 operands at full
    precision (not tf32), 2 half operands upcast first (the interpreter's half dot is wrong)."""
    if PREC == 0:
        return tl.dot(a, b)
    elif PREC == 1:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")


# --- Forward (prefill): one program per (query block, batch x head) -------------------------------


@triton.jit
def _load_tile(ptrs, n_ok, d_ok, MASKED: tl.constexpr, FULL_D: tl.constexpr, KEYS_ACROSS: tl.constexpr):
    """A tile of keys or values at ``ptrs``: ``(n, d)``, or ``(d, n)`` with ``KEYS_ACROSS``; keys outside ``n_ok``
    (read only when ``MASKED``) and features past the head dim (unless ``FULL_D``) load as 0."""
    if KEYS_ACROSS:
        keys, dims = n_ok[None, :], d_ok[:, None]
    else:
        keys, dims = n_ok[:, None], d_ok[None, :]
    if MASKED:
        x = tl.load(ptrs, mask=keys & dims, other=0.0)
    elif FULL_D:
        x = tl.load(ptrs)
    else:
        x = tl.load(ptrs, mask=dims, other=0.0)
    return x


@triton.jit
def _fwd_tile(acc, l_i, m_i, q, lo, hi, k_base, v_base, k_desc, v_desc, Bias, bias_base, keep_base, offs_m,
              row_ok, c0, kb0, slope2, start_n, N, skn, skd, svn, svd, sbn, smm, smn, qk_scale,
              HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BIAS: tl.constexpr,
              MASKED: tl.constexpr, HOLES: tl.constexpr, PREC: tl.constexpr, TMA: tl.constexpr):
    """One key tile of the online softmax. ``MASKED``: the tile straddles some row's ``lo`` or ``hi`` (or the end of
    the keys); ``HOLES``: it reads ``keep`` as well."""
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    offs_n = start_n + tl.arange(0, BLOCK_N)
    n64 = offs_n.to(tl.int64)
    n_ok = offs_n < N
    if TMA:  # tensor-memory-accelerator loads: keys past N and features past HEAD_DIM read as 0
        kt = tl.trans(k_desc.load([start_n, 0]))
    else:
        # addresses made afresh for each tile (a loop-carried tile of 64-bit pointers costs registers the scores need)
        kt = _load_tile(k_base + n64[None, :] * skn + offs_d[:, None] * skd, n_ok, d_ok, MASKED,
                        HEAD_DIM == BLOCK_D, True)
    qk = _dot(q, kt, PREC)
    kvec = _key_bias(Bias, bias_base, sbn, offs_n, c0, kb0, slope2, N, BIAS, MASKED)
    s = qk * qk_scale + kvec[None, :]  # (the row part of the bias: added to the log-sum-exp at the end)
    if MASKED:
        s = _masked(s, offs_n, lo, hi, keep_base, offs_m, row_ok, n_ok, n64, smm, smn, HOLES)
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    if TMA:
        v = v_desc.load([start_n, 0])
    else:
        v = _load_tile(v_base + n64[:, None] * svn + offs_d[None, :] * svd, n_ok, d_ok, MASKED,
                       HEAD_DIM == BLOCK_D, False)
    acc = _dot_acc(_cast(p, v.dtype, PREC), v, acc, PREC)
    return acc, l_i, m_new


@triton.jit
def _key_ranges(lo, hi, irregular, row_ok, N, BLOCK_N: tl.constexpr, MASK: tl.constexpr):
    """The key tiles a query block visits: ``[full_lo, full_hi)`` where every row sees every key, then ``n_a`` masked
    tiles from ``first`` and ``n_b`` from ``full_hi`` (up to ``hi_max``); ``holes``: some row has holes in its range
    (then ``full_lo = full_hi = first``, ``n_a = 0``: every tile masked, reading ``keep``)."""
    lo_min = tl.min(tl.where(row_ok, lo, N), 0)
    lo_max = tl.max(lo, 0)
    hi_min = tl.min(tl.where(row_ok, hi, N), 0)
    hi_max = tl.max(hi, 0)
    if MASK == 0:  # causal: every row starts at key 0
        holes = False
        first = 0
        full_lo = 0
        full_hi = hi_min // BLOCK_N * BLOCK_N
    else:
        holes = tl.max(irregular, 0) != 0
        first = lo_min // BLOCK_N * BLOCK_N
        full_lo = tl.minimum(tl.cdiv(lo_max, BLOCK_N) * BLOCK_N, hi_max)
        full_hi = tl.maximum(tl.minimum(hi_min // BLOCK_N * BLOCK_N, hi_max), full_lo)
        full_lo = tl.where(holes, first, full_lo)
        full_hi = tl.where(holes, first, full_hi)
    n_a = tl.cdiv(full_lo - first, BLOCK_N)
    n_b = tl.cdiv(hi_max - full_hi, BLOCK_N)
    return first, full_lo, full_hi, n_a, n_b, hi_max, holes


@triton.jit
def _query_keys(Bias, Rows, b, h, srb, sbb, sbh, sbn, offs_m, row_ok, M, N, BLOCK_N: tl.constexpr,
                BIAS: tl.constexpr, MASK: tl.constexpr):
    """A query block's key ranges (:func:`_row_ranges`, :func:`_key_ranges`), each row's last kept key ``c``
    and the block's ``c0``, and the bias's base, slope and value at ``c0`` (as the forward and dq read them)."""
    lo, hi, irregular = _row_ranges(Rows, b * srb, offs_m, row_ok, M, N, MASK)
    first, full_lo, full_hi, n_a, n_b, hi_max, holes = _key_ranges(lo, hi, irregular, row_ok, N, BLOCK_N, MASK)
    c0 = tl.maximum(hi_max - 1, 0)
    bias_base = b * sbb + h * sbh
    kb0 = _bias_at(Bias, bias_base, sbn, c0, BIAS)
    return (lo, hi, first, full_lo, full_hi, n_a, n_b, holes, tl.maximum(hi - 1, 0), c0, bias_base,
            _head_slope(Bias, h, sbh, BIAS), kb0)


@triton.jit(do_not_specialize=("STEPS",))  # (the search's length: no compile per power of two)
def _fwd_kernel(
    Q, K, V, Out, Lse, Bias, Rows, Keep, KNorm, Reach,
    sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, som, sod,
    sbb, sbh, sbn, srb, smb, smm, smn, sxb, sxh,
    H, GROUP, M, N, STEPS, qk_scale, skip_log2,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BIAS: tl.constexpr, MASK: tl.constexpr, PREC: tl.constexpr, STORE_LSE: tl.constexpr,
    TMA: tl.constexpr, SKIP: tl.constexpr,
):
    b, h, bh, hk, offs_m, row_ok, offs_d, d_ok = _query_block(H, GROUP, M, HEAD_DIM, BLOCK_M, BLOCK_D)
    q = tl.load(Q + b * sqb + h * sqh + offs_m.to(tl.int64)[:, None] * sqm + offs_d[None, :] * sqd,
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    lo, hi, first, full_lo, full_hi, n_a, n_b, holes, c, c0, bias_base, slope2, kb0 = _query_keys(
        Bias, Rows, b, h, srb, sbb, sbh, sbn, offs_m, row_ok, M, N, BLOCK_N, BIAS, MASK)

    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh
    if TMA:
        k_desc = tl.make_tensor_descriptor(k_base, shape=[N, HEAD_DIM], strides=[skn, 1], block_shape=[BLOCK_N, BLOCK_D])
        v_desc = tl.make_tensor_descriptor(v_base, shape=[N, HEAD_DIM], strides=[svn, 1], block_shape=[BLOCK_N, BLOCK_D])
    else:
        k_desc, v_desc = k_base, v_base  # (unused)
    keep_base = Keep + b * smb
    if holes:  # (rows mode only) some row has holes in its range: every tile masked, reading keep
        for t in range(0, n_b):  # (from full_hi = first)
            acc, l_i, m_i = _fwd_tile(acc, l_i, m_i, q, lo, hi, k_base, v_base, k_desc, v_desc, Bias, bias_base,
                                      keep_base, offs_m, row_ok, c0, kb0, slope2, full_hi + t * BLOCK_N, N, skn, skd, svn,
                                      svd, sbn, smm, smn, qk_scale, HEAD_DIM, BLOCK_N, BLOCK_D, BIAS, True, True, PREC,
                                      TMA)
    else:
        for t in range(0, n_b):  # first the tiles some row ends inside (causal: the diagonal), the newest keys
            acc, l_i, m_i = _fwd_tile(acc, l_i, m_i, q, lo, hi, k_base, v_base, k_desc, v_desc, Bias, bias_base,
                                      keep_base, offs_m, row_ok, c0, kb0, slope2, full_hi + t * BLOCK_N, N, skn, skd,
                                      svn, svd, sbn, smm, smn, qk_scale, HEAD_DIM, BLOCK_N, BLOCK_D, BIAS, True, False,
                                      PREC, TMA)
        needed = first
        if SKIP:  # keys whose weight is provably below 2**-skip_log2 of every row's largest: not visited
            knorm = _head_key_norm(KNorm, b * (H // GROUP) + hk, _NORM_PARTS)
            needed = _first_needed(m_i, q, knorm, c0, kb0, slope2, qk_scale, skip_log2, row_ok, N, Reach,
                                   b * sxb + h * sxh, STEPS, BIAS) // BLOCK_N * BLOCK_N
        for start_n in range(tl.maximum(full_lo, needed), full_hi, BLOCK_N):  # the bulk: no mask arithmetic
            start_n = tl.multiple_of(start_n, BLOCK_N)
            acc, l_i, m_i = _fwd_tile(acc, l_i, m_i, q, lo, hi, k_base, v_base, k_desc, v_desc, Bias, bias_base,
                                      keep_base, offs_m, row_ok, c0, kb0, slope2, start_n, N, skn, skd, svn, svd, sbn, smm,
                                      smn, qk_scale, HEAD_DIM, BLOCK_N, BLOCK_D, BIAS, False, False, PREC, TMA)
        for t in range(tl.maximum(needed - first, 0) // BLOCK_N, n_a):  # the tiles some row starts inside
            acc, l_i, m_i = _fwd_tile(acc, l_i, m_i, q, lo, hi, k_base, v_base, k_desc, v_desc, Bias, bias_base,
                                      keep_base, offs_m, row_ok, c0, kb0, slope2, first + t * BLOCK_N, N, skn, skd,
                                      svn, svd, sbn, smm, smn, qk_scale, HEAD_DIM, BLOCK_N, BLOCK_D, BIAS, True, False,
                                      PREC, TMA)

    seen = l_i > 0.0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    tl.store(Out + b * sob + h * soh + offs_m.to(tl.int64)[:, None] * som + offs_d[None, :] * sod,
             _cast(out, Out.dtype.element_ty, PREC), mask=row_ok[:, None] & d_ok[None, :])
    if STORE_LSE:
        # +inf for a row that sees nothing: the backward's exp2(s - lse) is then 0 there
        lse = tl.where(seen, m_i + tl.math.log2(tl.where(seen, l_i, 1.0)), float("inf"))
        lse += _row_bias(Bias, bias_base, sbn, c, c0, kb0, slope2, row_ok, BIAS)  # (left out of the scores)
        tl.store(Lse + bh * M + offs_m, lse, mask=row_ok)


# --- Forward (decode, few queries): split the keys over programs, then combine (flash-decoding) ---


# What grows with the cache is not specialised on (Triton would compile a variant each time the key count or a
# key-bias/mask stride changes between "divisible by 16" and not): one compile per decode configuration, whatever the
# context length. (K/V strides stay specialised: their alignment feeds vectorised loads; a cache's are multiples of D.)
_DECODE_LENGTHS = ("sbb", "sbh", "smb", "smm", "N", "SPLITS")


@triton.jit
def _decode_tile(acc, l_i, m_i, q, lo, hi, k_base, v_base, bias_rows, keep_rows, slope2, c, kbc, start_n, first,
                 last, skn, skd, svn, svd, sbn, smn, r_ok, qk_scale, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_D: tl.constexpr, BIAS: tl.constexpr, MASKED: tl.constexpr, HOLES: tl.constexpr,
                 PREC: tl.constexpr):
    """One key tile of a decode program's online softmax. ``MASKED``: the tile straddles some row's ``lo`` or ``hi``;
    only keys in ``[first, last)`` (those some row keeps) are read, so what lies outside (a static cache's empty
    slots) never reaches the result. ``HOLES``: it reads ``keep`` too."""
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    offs_n = start_n + tl.arange(0, BLOCK_N)
    n64 = offs_n.to(tl.int64)
    n_ok = (offs_n >= first) & (offs_n < last)
    kt = _load_tile(k_base + n64[None, :] * skn + offs_d[:, None] * skd, n_ok, d_ok, MASKED, HEAD_DIM == BLOCK_D,
                    True)
    s = _dot(q, kt, PREC) * qk_scale
    if BIAS == 0:
        s += slope2[:, None] * (offs_n[None, :] - c[:, None]).to(tl.float32)
    elif BIAS == 1:
        if MASKED:
            kb = tl.load(bias_rows[:, None] + n64[None, :] * sbn, mask=r_ok[:, None] & n_ok[None, :], other=0.0)
        else:
            kb = tl.load(bias_rows[:, None] + n64[None, :] * sbn, mask=r_ok[:, None], other=0.0)
        s += (kb - kbc[:, None]) * 1.4426950408889634
    if MASKED:
        keep = (offs_n[None, :] >= lo[:, None]) & (offs_n[None, :] < hi[:, None])
        if HOLES:
            t = tl.load(keep_rows[:, None] + n64[None, :] * smn, mask=r_ok[:, None] & n_ok[None, :], other=0)
            keep = keep & (t != 0)
        s = tl.where(keep, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = _load_tile(v_base + n64[:, None] * svn + offs_d[None, :] * svd, n_ok, d_ok, MASKED, HEAD_DIM == BLOCK_D,
                   False)
    acc = acc * alpha[:, None] + _dot(_cast(p, v.dtype, PREC), v, PREC)
    return acc, l_i, m_new


@triton.jit(do_not_specialize=_DECODE_LENGTHS)
def _decode_kernel(
    Q, K, V, Out, Lse, Part, Bias, Rows, Keep,
    sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, som, sod,
    sbb, sbh, sbn, srb, smb, smm, smn,
    H, GROUP, M, N, SPLITS, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BIAS: tl.constexpr, MASK: tl.constexpr, PREC: tl.constexpr, SINGLE: tl.constexpr, STORE_LSE: tl.constexpr,
):
    """Grid ``(SPLITS, B * Hk)``; rows are the ``GROUP * M`` queries of one (batch, kv head): every kv head's keys are
    read once per split. The keys its rows keep, ``[min lo, max hi)`` (a static cache's filled part, a padded
    sequence's own tokens), are split into ``SPLITS`` equal parts on the device, one per program, so empty cache slots
    and padding are never read, whatever the length the launch was set up for. ``SINGLE``: one split, the result is
    written directly; else the split's unnormalised ``(acc, m, l)`` go to ``Part`` for :func:`_combine_kernel`."""
    split = tl.program_id(0)
    bk = tl.program_id(1).to(tl.int64)
    Hk = H // GROUP
    b, hk = bk // Hk, bk % Hk
    r = tl.arange(0, BLOCK_R)
    r_ok = r < GROUP * M
    i = r % M
    h = (hk * GROUP + r // M).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    q = tl.load(Q + b * sqb + h[:, None] * sqh + i.to(tl.int64)[:, None] * sqm + offs_d[None, :] * sqd,
                mask=r_ok[:, None] & d_ok[None, :], other=0.0)
    lo, hi, irregular = _row_ranges(Rows, b * srb, i, r_ok, M, N, MASK)
    c = tl.maximum(hi - 1, 0)
    slope2, kbc = 0.0, 0.0
    if BIAS == 0:
        slope2 = tl.load(Bias + h * sbh, mask=r_ok, other=0.0) * 1.4426950408889634
    bias_rows = Bias + b * sbb + h * sbh
    if BIAS == 1:
        kbc = tl.load(bias_rows + c.to(tl.int64) * sbn, mask=r_ok, other=0.0)
    keep_rows = Keep + b * smb + i.to(tl.int64) * smm
    # this program's share of the keys the rows keep
    hi_max = tl.max(hi, 0)
    lo_min = tl.min(tl.where(r_ok, lo, N), 0)
    base = lo_min // BLOCK_N * BLOCK_N
    chunk = tl.cdiv(tl.cdiv(tl.maximum(hi_max - base, 0), SPLITS), BLOCK_N) * BLOCK_N
    start = base + split * chunk
    stop = tl.minimum(start + chunk, hi_max)
    # tiles every row keeps whole: [full_lo, full_hi) (none where some row has holes)
    full_lo = tl.minimum(tl.maximum(tl.cdiv(tl.max(tl.where(r_ok, lo, 0), 0), BLOCK_N) * BLOCK_N, start), stop)
    full_hi = tl.maximum(tl.minimum(tl.min(tl.where(r_ok, hi, N), 0) // BLOCK_N * BLOCK_N, stop), full_lo)
    holes = False
    if MASK != 0:
        holes = tl.max(irregular, 0) != 0
    if holes:
        full_hi = full_lo

    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_R], dtype=tl.float32)
    m_i = tl.full([BLOCK_R], -1.0e30, dtype=tl.float32)
    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh
    for start_n in range(full_lo, full_hi, BLOCK_N):  # the bulk: no mask arithmetic
        start_n = tl.multiple_of(start_n, BLOCK_N)
        acc, l_i, m_i = _decode_tile(acc, l_i, m_i, q, lo, hi, k_base, v_base, bias_rows, keep_rows, slope2, c, kbc,
                                     start_n, lo_min, hi_max, skn, skd, svn, svd, sbn, smn, r_ok, qk_scale, HEAD_DIM,
                                     BLOCK_N, BLOCK_D, BIAS, False, False, PREC)
    if holes:
        for start_n in range(start, stop, BLOCK_N):
            acc, l_i, m_i = _decode_tile(acc, l_i, m_i, q, lo, hi, k_base, v_base, bias_rows, keep_rows, slope2, c,
                                         kbc, start_n, lo_min, hi_max, skn, skd, svn, svd, sbn, smn, r_ok, qk_scale,
                                         HEAD_DIM, BLOCK_N, BLOCK_D, BIAS, True, True, PREC)
    else:
        for start_n in range(full_hi, stop, BLOCK_N):  # the tiles some row ends inside (the newest keys)
            acc, l_i, m_i = _decode_tile(acc, l_i, m_i, q, lo, hi, k_base, v_base, bias_rows, keep_rows, slope2, c,
                                         kbc, start_n, lo_min, hi_max, skn, skd, svn, svd, sbn, smn, r_ok, qk_scale,
                                         HEAD_DIM, BLOCK_N, BLOCK_D, BIAS, True, False, PREC)
        for start_n in range(start, full_lo, BLOCK_N):  # the tiles some row starts inside (padding)
            acc, l_i, m_i = _decode_tile(acc, l_i, m_i, q, lo, hi, k_base, v_base, bias_rows, keep_rows, slope2, c,
                                         kbc, start_n, lo_min, hi_max, skn, skd, svn, svd, sbn, smn, r_ok, qk_scale,
                                         HEAD_DIM, BLOCK_N, BLOCK_D, BIAS, True, False, PREC)

    if SINGLE:
        seen = l_i > 0.0
        out = acc / tl.where(seen, l_i, 1.0)[:, None]
        tl.store(Out + b * sob + h[:, None] * soh + i.to(tl.int64)[:, None] * som + offs_d[None, :] * sod,
                 _cast(out, Out.dtype.element_ty, PREC), mask=r_ok[:, None] & d_ok[None, :])
        if STORE_LSE:
            lse = tl.where(seen, m_i + tl.math.log2(tl.where(seen, l_i, 1.0)), float("inf"))
            tl.store(Lse + (b * H + h) * M + i, lse, mask=r_ok)
    else:
        # Part: (splits, B * Hk, BLOCK_R, BLOCK_D + 2) float32: acc, then m and l
        # (the rows past GROUP * M are padding of the dot's tile: not written, the combine never reads them)
        part = Part + ((split * tl.num_programs(1) + bk) * BLOCK_R + r.to(tl.int64)) * (BLOCK_D + 2)
        tl.store(part[:, None] + offs_d[None, :], acc, mask=r_ok[:, None])
        tl.store(part + BLOCK_D, m_i, mask=r_ok)
        tl.store(part + BLOCK_D + 1, l_i, mask=r_ok)


@triton.jit
def merge_parts(row, stride, offs_d, SPLITS, BLOCK_D: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr):
    """Merges one query row's ``SPLITS`` partial ``(acc, m, l)`` (``row``: its first part, ``BLOCK_D + 2`` float32;
    the next part ``stride`` further) over the features ``offs_d`` (``BLOCK_C`` of them), ``BLOCK_S`` parts per
    step: the unnormalised ``(acc, l, m)`` of all keys (log-sum-exp rescaling, Milakov & Gimelshein 2018)."""
    offs_s = tl.arange(0, BLOCK_S)
    acc = tl.zeros([BLOCK_C], dtype=tl.float32)
    l_i = 0.0
    m_i = -1.0e30
    for s0 in range(0, SPLITS, BLOCK_S):
        s_ok = s0 + offs_s < SPLITS
        part = row + (s0 + offs_s).to(tl.int64) * stride
        m_s = tl.load(part + BLOCK_D, mask=s_ok, other=-1.0e30)
        l_s = tl.load(part + BLOCK_D + 1, mask=s_ok, other=0.0)
        a_s = tl.load(part[:, None] + offs_d[None, :], mask=s_ok[:, None], other=0.0)
        m_new = tl.maximum(m_i, tl.max(m_s, 0))
        alpha = tl.math.exp2(m_i - m_new)
        beta = tl.math.exp2(m_s - m_new)
        acc = acc * alpha + tl.sum(a_s * beta[:, None], 0)
        l_i = l_i * alpha + tl.sum(l_s * beta, 0)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit(do_not_specialize=("SPLITS",))
def _combine_kernel(
    Out, Lse, Part, sob, soh, som, sod, H, GROUP, M, SPLITS,
    HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_C: tl.constexpr,
    BLOCK_S: tl.constexpr, STORE_LSE: tl.constexpr, PREC: tl.constexpr,
):
    """Grid ``(B * Hk, GROUP * M, BLOCK_D // BLOCK_C)``: one program per query row and ``BLOCK_C`` features merges
    that row's ``SPLITS`` partial ``(acc, m, l)`` of :func:`_decode_kernel` into ``Out``, ``BLOCK_S`` parts per step
    (their loads in flight together; one step for the usual split counts)."""
    bk = tl.program_id(0).to(tl.int64)
    r = tl.program_id(1)
    chunk = tl.program_id(2)
    Hk = H // GROUP
    b, hk = bk // Hk, bk % Hk
    h = (hk * GROUP + r // M).to(tl.int64)
    i = (r % M).to(tl.int64)
    offs_d = chunk * BLOCK_C + tl.arange(0, BLOCK_C)
    stride = tl.num_programs(0).to(tl.int64) * BLOCK_R * (BLOCK_D + 2)
    row = Part + (bk * BLOCK_R + r) * (BLOCK_D + 2)
    acc, l_i, m_i = merge_parts(row, stride, offs_d, SPLITS, BLOCK_D, BLOCK_C, BLOCK_S)
    seen = l_i > 0.0
    out = acc / tl.where(seen, l_i, 1.0)
    tl.store(Out + b * sob + h * soh + i * som + offs_d * sod, _cast(out, Out.dtype.element_ty, PREC),
             mask=offs_d < HEAD_DIM)
    if STORE_LSE:
        if chunk == 0:
            lse = tl.where(seen, m_i + tl.math.log2(tl.where(seen, l_i, 1.0)), float("inf"))
            tl.store(Lse + (b * H + h) * M + i, lse)


# --- Backward -------------------------------------------------------------------------------------


@triton.jit
def _bwd_delta_kernel(Out, DO, Delta, Q, Lse, Bias, Rows, KNorm, Horizon,
                      sob, soh, som, sod, sgb, sgh, sgm, sgd, sqb, sqh, sqm, sqd, sbb, sbh, sbn, srb, H, GROUP, M, N,
                      qk_scale, skip_log2,
                      HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BIAS: tl.constexpr,
                      MASK: tl.constexpr, SKIP: tl.constexpr):
    """Grid ``(cdiv(M, BLOCK_M), B * H)``: ``delta[b, h, i] = sum_d dO * O`` (float32), the rowsum the softmax backward
    subtracts. ``SKIP`` also ``horizon[b, h, block]``: the smallest over the block's rows of ``lse_i + bias2(c_i) -
    bound_i - skip_log2`` (``c_i`` the row's last key, ``bias2`` the base-2 bias at a key relative to key 0: ``slope2 *
    c_i`` or ``log2(e) * key_bias[c_i]``, ``bound_i`` :func:`_qk_bound` with the head's largest key norm): a key block
    whose base-2 bias is at most ``bias2(j)`` at every key (its last key ``j``; key bias: the running maximum there)
    below it gives every row of the query block a weight under ``2**-skip_log2`` (-inf where that cannot be shown:
    NaN, a slope <= 0)."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b, h = bh // H, bh % H
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < M
    offs_d = tl.arange(0, BLOCK_D)
    m = row_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    rows = offs_m.to(tl.int64)[:, None]
    o = tl.load(Out + b * sob + h * soh + rows * som + offs_d[None, :] * sod, mask=m, other=0.0).to(tl.float32)
    do = tl.load(DO + b * sgb + h * sgh + rows * sgm + offs_d[None, :] * sgd, mask=m, other=0.0).to(tl.float32)
    tl.store(Delta + bh * M + offs_m, tl.sum(o * do, 1), mask=row_ok)
    if SKIP:
        q = tl.load(Q + b * sqb + h * sqh + rows * sqm + offs_d[None, :] * sqd, mask=m, other=0.0)
        lse = tl.load(Lse + bh * M + offs_m, mask=row_ok, other=float("inf"))
        lo, hi, irregular = _row_ranges(Rows, b * srb, offs_m, row_ok, M, N, MASK)
        knorm = _head_key_norm(KNorm, b * (H // GROUP) + h // GROUP, _NORM_PARTS)
        c = tl.maximum(hi - 1, 0)
        if BIAS == 0:
            slope2 = _head_slope(Bias, h, sbh, 0)
            bias_c = slope2 * c.to(tl.float32)
        else:
            bias_c = tl.load(Bias + b * sbb + h * sbh + c.to(tl.int64) * sbn, mask=row_ok, other=0.0) * 1.4426950408889634
        t = lse + bias_c - _qk_bound(q, knorm, qk_scale) - skip_log2
        t = tl.where(t == t, t, float("-inf"))  # (NaN, inf - inf: needed)
        if BIAS == 0:
            t = tl.where(slope2 > 0.0, t, float("-inf"))  # (a slope <= 0: the bias does not fall with distance)
        t = tl.where(row_ok, t, float("inf"))
        tl.store(Horizon + bh * tl.num_programs(0) + pid_m, tl.min(t, 0))


@triton.jit
def _bwd_kv_block(dk, dv, k, v, Lse, Delta, Bias, Rows, Keep, q_base, do_base, bh, b, h,
                  bias_base, slope2, kvec_c0, offs_n, n_ok, start_m, stop_m,
                  sqm, sqd, sgm, sgd, sbn, srb, smb, smm, smn, M, N, qk_scale,
                  HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                  BIAS: tl.constexpr, MASK: tl.constexpr, MASKED: tl.constexpr, PREC: tl.constexpr):
    """dk, dv of one key block from the query blocks ``[start_m, stop_m)`` of head ``h``."""
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    kb0 = _bias_at(Bias, bias_base, sbn, kvec_c0, BIAS)
    kvec = _key_bias(Bias, bias_base, sbn, offs_n, kvec_c0, kb0, slope2, N, BIAS, True)
    j0 = tl.min(offs_n, 0)
    j_end = j0 + BLOCK_N
    for start in range(start_m, stop_m, BLOCK_M):
        offs_m = start + tl.arange(0, BLOCK_M)
        row_ok = offs_m < M
        lo, hi, irregular = _row_ranges(Rows, b * srb, offs_m, row_ok, M, N, MASK)
        go = True
        if MASK != 0:  # skip the query blocks none of whose rows sees this key block
            go = (tl.max(hi, 0) > j0) & (tl.min(tl.where(hi > lo, lo, N), 0) < j_end)
        if go:
            rows = offs_m.to(tl.int64)
            m2 = row_ok[:, None] & d_ok[None, :]
            q = tl.load(q_base + rows[:, None] * sqm + offs_d[None, :] * sqd, mask=m2, other=0.0)
            lse = tl.load(Lse + bh * M + offs_m, mask=row_ok, other=float("inf"))
            c = tl.maximum(hi - 1, 0)
            # the row part of the bias (a per-row constant) taken off the log-sum-exp instead of each score
            lse -= _row_bias(Bias, bias_base, sbn, c, kvec_c0, kb0, slope2, row_ok, BIAS)
            do = tl.load(do_base + rows[:, None] * sgm + offs_d[None, :] * sgd, mask=m2, other=0.0)
            delta = tl.load(Delta + bh * M + offs_m, mask=row_ok, other=0.0)
            st = _dot(k, tl.trans(q), PREC) * qk_scale + kvec[:, None]  # (BLOCK_N, BLOCK_M)
            if MASKED:
                keep = (offs_n[:, None] >= lo[None, :]) & (offs_n[:, None] < hi[None, :])
                if MASK != 0:
                    if tl.max(irregular, 0) != 0:
                        t = tl.load(Keep + b * smb + rows[None, :] * smm + offs_n.to(tl.int64)[:, None] * smn,
                                    mask=row_ok[None, :] & n_ok[:, None], other=0)
                        keep = keep & (t != 0)
                st = tl.where(keep, st, float("-inf"))
            pt = tl.math.exp2(st - lse[None, :])
            dv = _dot_acc(_cast(pt, do.dtype, PREC), do, dv, PREC)
            dpt = _dot(v, tl.trans(do), PREC)
            dst = pt * (dpt - delta[None, :])
            dk = _dot_acc(_cast(dst, q.dtype, PREC), q, dk, PREC)
    return dk, dv


@triton.jit
def _reach(Horizon, bh, NH, thr, M, HBLOCK: tl.constexpr):
    """One past the last query row whose block's horizon (:func:`_bwd_delta_kernel`) is at or below ``thr``: later
    query blocks give the key block no weight (``M`` where ``thr`` is NaN)."""
    last = -1
    for start in range(0, NH, 128):
        idx = start + tl.arange(0, 128)
        hz = tl.load(Horizon + bh * NH + idx, mask=idx < NH, other=float("inf"))
        last = tl.maximum(last, tl.max(tl.where(hz <= thr, idx, -1), 0))
    return tl.where(thr == thr, tl.minimum((last + 1) * HBLOCK, M), M)


@triton.jit
def _bwd_dkdv_kernel(
    Q, K, V, DO, Lse, Delta, DK, DV, Bias, Rows, Keep, Horizon, Reach,
    sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sgb, sgh, sgm, sgd,
    sdkb, sdkh, sdkn, sdkd, sdvb, sdvh, sdvn, sdvd,
    sbb, sbh, sbn, srb, smb, smm, smn, sxb, sxh,
    H, GROUP, M, N, NH, qk_scale, scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BIAS: tl.constexpr, MASK: tl.constexpr, PREC: tl.constexpr, SKIP: tl.constexpr, HBLOCK: tl.constexpr,
):
    """One program per (key block, batch x kv head): its dk, dv summed over the ``GROUP`` query heads that share the kv
    head (no atomics). ``SKIP``: each head's query blocks stop after the last one whose horizon (``NH`` per head,
    ``HBLOCK`` rows each) reaches this key block."""
    pid_n = tl.program_id(0)
    bk = tl.program_id(1).to(tl.int64)
    Hk = H // GROUP
    b, hk = bk // Hk, Hk - 1 - bk % Hk  # the shallowest slopes (most queries to visit) first
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    n64 = offs_n.to(tl.int64)
    m2 = n_ok[:, None] & d_ok[None, :]
    k = tl.load(K + b * skb + hk * skh + n64[:, None] * skn + offs_d[None, :] * skd, mask=m2, other=0.0)
    v = tl.load(V + b * svb + hk * svh + n64[:, None] * svn + offs_d[None, :] * svd, mask=m2, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    j0 = pid_n * BLOCK_N
    kvec_c0 = j0
    for g in range(0, GROUP):
        h = hk * GROUP + g
        bh = b * H + h
        q_base = Q + b * sqb + h * sqh
        do_base = DO + b * sgb + h * sgh
        bias_base = b * sbb + h * sbh
        slope2 = _head_slope(Bias, h, sbh, BIAS)
        stop_m = M
        if SKIP:  # the block's largest bias is at most the (running maximum of the) bias at its last key
            if BIAS == 0:
                thr = slope2 * (j0 + BLOCK_N - 1).to(tl.float32)
            else:
                j_last = tl.minimum(j0 + BLOCK_N, N) - 1
                thr = tl.load(Reach + b * sxb + h * sxh + j_last.to(tl.int64)) * 1.4426950408889634
            stop_m = _reach(Horizon, bh, NH, thr, M, HBLOCK)
        if MASK == 0:
            off = N - M
            start_m = tl.maximum(j0 - off, 0) // BLOCK_M * BLOCK_M
            # the first query block every row of which sees the whole key block (a full one)
            full_m = tl.cdiv(tl.maximum(j0 + BLOCK_N - 1 - off, 0), BLOCK_M) * BLOCK_M
            full_m = tl.where(j0 + BLOCK_N > N, M, full_m)  # a partial key block: masked throughout
            full_m = tl.minimum(tl.maximum(full_m, start_m), M)
            dk, dv = _bwd_kv_block(dk, dv, k, v, Lse, Delta, Bias, Rows, Keep, q_base, do_base, bh, b, h,
                                   bias_base, slope2, kvec_c0, offs_n, n_ok, start_m, full_m,
                                   sqm, sqd, sgm, sgd, sbn, srb, smb, smm, smn, M, N, qk_scale,
                                   HEAD_DIM, BLOCK_M, BLOCK_N, BLOCK_D, BIAS, MASK, True, PREC)
            dk, dv = _bwd_kv_block(dk, dv, k, v, Lse, Delta, Bias, Rows, Keep, q_base, do_base, bh, b, h,
                                   bias_base, slope2, kvec_c0, offs_n, n_ok, full_m, stop_m,
                                   sqm, sqd, sgm, sgd, sbn, srb, smb, smm, smn, M, N, qk_scale,
                                   HEAD_DIM, BLOCK_M, BLOCK_N, BLOCK_D, BIAS, MASK, False, PREC)
        else:
            dk, dv = _bwd_kv_block(dk, dv, k, v, Lse, Delta, Bias, Rows, Keep, q_base, do_base, bh, b, h,
                                   bias_base, slope2, kvec_c0, offs_n, n_ok, 0, stop_m,
                                   sqm, sqd, sgm, sgd, sbn, srb, smb, smm, smn, M, N, qk_scale,
                                   HEAD_DIM, BLOCK_M, BLOCK_N, BLOCK_D, BIAS, MASK, True, PREC)
    tl.store(DK + b * sdkb + hk * sdkh + n64[:, None] * sdkn + offs_d[None, :] * sdkd,
             _cast(dk * scale, DK.dtype.element_ty, PREC), mask=m2)
    tl.store(DV + b * sdvb + hk * sdvh + n64[:, None] * sdvn + offs_d[None, :] * sdvd,
             _cast(dv, DV.dtype.element_ty, PREC), mask=m2)


@triton.jit
def _bwd_q_tile(dq, q, do, lse, delta, lo, hi, k_base, v_base, Bias, bias_base, keep_base, offs_m, row_ok, c0,
                kb0, slope2, start_n, N, skn, skd, svn, svd, sbn, smm, smn, qk_scale,
                HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BIAS: tl.constexpr,
                MASKED: tl.constexpr, HOLES: tl.constexpr, PREC: tl.constexpr):
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    offs_n = start_n + tl.arange(0, BLOCK_N)
    n64 = offs_n.to(tl.int64)
    n_ok = offs_n < N
    k = _load_tile(k_base + n64[:, None] * skn + offs_d[None, :] * skd, n_ok, d_ok, MASKED, HEAD_DIM == BLOCK_D, False)
    v = _load_tile(v_base + n64[:, None] * svn + offs_d[None, :] * svd, n_ok, d_ok, MASKED, HEAD_DIM == BLOCK_D, False)
    kvec = _key_bias(Bias, bias_base, sbn, offs_n, c0, kb0, slope2, N, BIAS, MASKED)
    s = _dot(q, tl.trans(k), PREC) * qk_scale + kvec[None, :]
    if MASKED:
        s = _masked(s, offs_n, lo, hi, keep_base, offs_m, row_ok, n_ok, n64, smm, smn, HOLES)
    p = tl.math.exp2(s - lse[:, None])
    dp = _dot(do, tl.trans(v), PREC)
    ds = p * (dp - delta[:, None])
    return _dot_acc(_cast(ds, k.dtype, PREC), k, dq, PREC)


@triton.jit(do_not_specialize=("STEPS",))  # (the search's length: no compile per power of two)
def _bwd_dq_kernel(
    Q, K, V, DO, Lse, Delta, DQ, Bias, Rows, Keep, KNorm, Reach,
    sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sgb, sgh, sgm, sgd, sdqb, sdqh, sdqm, sdqd,
    sbb, sbh, sbn, srb, smb, smm, smn, sxb, sxh,
    H, GROUP, M, N, STEPS, qk_scale, scale, skip_log2,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BIAS: tl.constexpr, MASK: tl.constexpr, PREC: tl.constexpr, SKIP: tl.constexpr,
):
    b, h, bh, hk, offs_m, row_ok, offs_d, d_ok = _query_block(H, GROUP, M, HEAD_DIM, BLOCK_M, BLOCK_D)
    rows = offs_m.to(tl.int64)[:, None]
    m2 = row_ok[:, None] & d_ok[None, :]
    q = tl.load(Q + b * sqb + h * sqh + rows * sqm + offs_d[None, :] * sqd, mask=m2, other=0.0)
    do = tl.load(DO + b * sgb + h * sgh + rows * sgm + offs_d[None, :] * sgd, mask=m2, other=0.0)
    lse = tl.load(Lse + bh * M + offs_m, mask=row_ok, other=float("inf"))
    delta = tl.load(Delta + bh * M + offs_m, mask=row_ok, other=0.0)

    lo, hi, first, full_lo, full_hi, n_a, n_b, holes, c, c0, bias_base, slope2, kb0 = _query_keys(
        Bias, Rows, b, h, srb, sbb, sbh, sbn, offs_m, row_ok, M, N, BLOCK_N, BIAS, MASK)
    lse -= _row_bias(Bias, bias_base, sbn, c, c0, kb0, slope2, row_ok, BIAS)  # (see _bwd_kv_block)
    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh
    keep_base = Keep + b * smb
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if holes:
        for t in range(0, n_b):  # (from full_hi = first)
            dq = _bwd_q_tile(dq, q, do, lse, delta, lo, hi, k_base, v_base, Bias, bias_base, keep_base, offs_m,
                             row_ok, c0, kb0, slope2, full_hi + t * BLOCK_N, N, skn, skd, svn, svd, sbn, smm, smn,
                             qk_scale, HEAD_DIM, BLOCK_N, BLOCK_D, BIAS, True, True, PREC)
    else:
        needed = first
        if SKIP:  # as the forward's, against the log-sum-exp: p = exp2(s - lse) < 2**-skip_log2 before it
            knorm = _head_key_norm(KNorm, b * (H // GROUP) + hk, _NORM_PARTS)
            needed = _first_needed(lse, q, knorm, c0, kb0, slope2, qk_scale, skip_log2, row_ok, N, Reach,
                                   b * sxb + h * sxh, STEPS, BIAS) // BLOCK_N * BLOCK_N
        for start_n in range(tl.maximum(full_lo, needed), full_hi, BLOCK_N):
            start_n = tl.multiple_of(start_n, BLOCK_N)
            dq = _bwd_q_tile(dq, q, do, lse, delta, lo, hi, k_base, v_base, Bias, bias_base, keep_base, offs_m,
                             row_ok, c0, kb0, slope2, start_n, N, skn, skd, svn, svd, sbn, smm, smn, qk_scale,
                             HEAD_DIM, BLOCK_N, BLOCK_D, BIAS, False, False, PREC)
        n_skip = tl.minimum(tl.maximum(needed - first, 0) // BLOCK_N, n_a)  # (front tiles before the needed keys)
        for t in range(n_skip, n_a + n_b):
            start_n = tl.where(t < n_a, first + t * BLOCK_N, full_hi + (t - n_a) * BLOCK_N)
            dq = _bwd_q_tile(dq, q, do, lse, delta, lo, hi, k_base, v_base, Bias, bias_base, keep_base, offs_m,
                             row_ok, c0, kb0, slope2, start_n, N, skn, skd, svn, svd, sbn, smm, smn, qk_scale,
                             HEAD_DIM, BLOCK_N, BLOCK_D, BIAS, True, False, PREC)
    tl.store(DQ + b * sdqb + h * sdqh + offs_m.to(tl.int64)[:, None] * sdqm + offs_d[None, :] * sdqd,
             _cast(dq * scale, DQ.dtype.element_ty, PREC), mask=m2)
