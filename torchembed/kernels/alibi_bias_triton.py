"""Triton kernel: the ``(b, h, q, k)`` ALiBi prefill bias in one pass.

Press et al., "Train Short, Test Long", arXiv:2108.12409.  For batch ``b``, head ``h``, query
``i`` (queries are the last ``q`` of the ``k`` keys) and key ``j``:

    out[b, h, i, j] = key_bias[b, h, j] - key_bias[b, h, k - q + i]    where keep[b, 0, i, j]
                    = MIN                                                elsewhere

the difference in float32, rounded once on store (what :func:`torchembed.functional.alibi.
alibi_prefill_bias` computes with a subtraction and a masking pass).  One program writes a
``BLOCK_Q x BLOCK_K`` tile of one ``(b, h)``; grid ``(cdiv(k, BLOCK_K), cdiv(q, BLOCK_Q), B * H)``.
Every index is int64 before it meets a stride; ``key_bias`` and ``keep`` take any strides (0 for a
batch of 1 broadcast).  A launch is kept and repeated (:mod:`torchembed.kernels.launch`): once per
forward, but Triton's own binding costs ~0.1 ms of host time on a slow host.  This module imports Triton; ``alibi_bias`` imports it on the first launch.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from torchembed.kernels import launch
from torchembed.kernels.rope_triton import _round_f32_to_bf16_rtne

__all__ = ["write"]

BLOCK_Q, BLOCK_K = 16, 256
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # fixed when triton.jit decorates the kernel


@triton.jit
def _alibi_bias_kernel(
    kb_ptr, keep_ptr, out_ptr,
    H, Q, K,
    skb_b, skb_h, skb_k,
    skp_b, skp_q, skp_k,
    so_b, so_h, so_q,
    MIN,
    BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, EMULATE_RTNE: tl.constexpr,
):
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
        y = _round_f32_to_bf16_rtne(y)
    tl.store(out_ptr + b * so_b + h * so_h + i[:, None] * so_q + j[None, :], y.to(out_ptr.dtype.element_ty), mask=m)


# Kept launches: key -> Launch, the key holding every argument Triton specialises on but alignment
# (dtypes, the int arguments themselves, the device).
LAUNCHES = launch.Launches(1024)  # prefill lengths are many: cleared when full


def write(key_bias: Tensor, keep: Tensor, out: Tensor) -> Tensor:
    """Write the bias into ``out`` ``(B, H, Q, K)`` (unit last-dim stride) from ``key_bias``
    ``(B or 1, H, K)`` and ``keep`` ``(B or 1, 1, Q, K)`` bool; checked by the caller. The launch is
    kept (:mod:`torchembed.kernels.launch`): a later call with the same arguments but pointers repeats it."""
    batch, heads, q_len, k_len = out.shape
    ints = (
        heads, q_len, k_len,
        key_bias.stride(0) if key_bias.shape[0] != 1 else 0, key_bias.stride(1), key_bias.stride(2),
        keep.stride(0) if keep.shape[0] != 1 else 0, keep.stride(2), keep.stride(3),
        out.stride(0), out.stride(1), out.stride(2),
    )
    key = (key_bias.dtype, out.dtype, out.device, batch, ints)
    kept = LAUNCHES.get(key)
    if kept is None:
        emulate = _INTERPRET and out.dtype == torch.bfloat16  # the interpreter's cast truncates
        grid = (triton.cdiv(k_len, BLOCK_K), triton.cdiv(q_len, BLOCK_Q), batch * heads)
        kept = LAUNCHES.keep(key, launch.Launch(
            _alibi_bias_kernel, grid, (*ints, torch.finfo(out.dtype).min),
            {"BLOCK_Q": BLOCK_Q, "BLOCK_K": BLOCK_K, "EMULATE_RTNE": emulate}, num_warps=4))
    kept((key_bias, keep.view(torch.uint8), out))
    return out
