"""Triton kernel: an ALiBi prefill's SDPA mask, written once (device code only).

Press et al., "Train Short, Test Long", arXiv:2108.12409. The host side is :func:`torchembed.kernels.alibi.prefill_bias`,
which imports this module (and Triton) on the first launch.
"""

from __future__ import annotations

import triton
import triton.language as tl

from torchembed.kernels.triton_common import round_f32_to_bf16_rtne

__all__ = ["prefill_bias_kernel"]


@triton.jit
def prefill_bias_kernel(
    kb_ptr, keep_ptr, out_ptr, H, Q, K, skb_b, skb_h, skb_k, skp_b, skp_q, skp_k, so_b, so_h, so_q, MIN,
    BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, EMULATE_RTNE: tl.constexpr,
):
    """Grid ``(cdiv(K, BLOCK_K), cdiv(Q, BLOCK_Q), B * H)``, one ``BLOCK_Q x BLOCK_K`` tile of one (b, h) each:
    ``out[b, h, i, j] = key_bias[b, h, j] - key_bias[b, h, K - Q + i]`` where ``keep``, ``MIN`` elsewhere (the
    difference in float32, rounded once on store)."""
    bh = tl.program_id(2).to(tl.int64)
    b, h = bh // H, bh % H
    i = tl.program_id(1).to(tl.int64) * BLOCK_Q + tl.arange(0, BLOCK_Q).to(tl.int64)
    j = tl.program_id(0).to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K).to(tl.int64)
    i_in, j_in = i < Q, j < K
    row = kb_ptr + b * skb_b + h * skb_h
    key = tl.load(row + j * skb_k, mask=j_in, other=0.0).to(tl.float32)
    own = tl.load(row + (K - Q + i) * skb_k, mask=i_in, other=0.0).to(tl.float32)
    m = i_in[:, None] & j_in[None, :]
    kept = tl.load(keep_ptr + b * skp_b + i[:, None] * skp_q + j[None, :] * skp_k, mask=m, other=0)
    y = tl.where(kept != 0, key[None, :] - own[:, None], MIN)
    if EMULATE_RTNE:
        y = round_f32_to_bf16_rtne(y)
    tl.store(out_ptr + b * so_b + h * so_h + i[:, None] * so_q + j[None, :], y.to(out_ptr.dtype.element_ty), mask=m)
