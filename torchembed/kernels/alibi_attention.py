"""ALiBi inside a fused attention kernel: FlexAttention with an ALiBi ``score_mod``.

Press et al., arXiv:2108.12409. ``flex_attention`` (torch >= 2.5) compiles the score modifier
into a Triton attention kernel, so neither the ``(b, h, q, k)`` bias nor the scores are ever
materialised, and the causal block mask skips the blocks above the diagonal. Used on CUDA for
prefill (``q > 1``); decode steps and CPU tensors take the SDPA reference
(:func:`torchembed.functional.alibi.alibi_attention_reference`).
"""

from __future__ import annotations

import functools
import os

import torch
from torch import Tensor

from torchembed.functional.alibi import alibi_attention_reference

__all__ = ["alibi_attention", "flex_available", "alibi_score_mod"]


@functools.lru_cache(maxsize=None)
def flex_available() -> bool:
    """FlexAttention importable and not disabled (``TORCHEMBED_DISABLE_FLEX=1``)."""
    if os.environ.get("TORCHEMBED_DISABLE_FLEX", "0") == "1":
        return False
    try:
        from torch.nn.attention import flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


@functools.lru_cache(maxsize=None)
def _compiled():
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    return torch.compile(flex_attention), create_block_mask


def alibi_score_mod(key_bias: Tensor):
    """A FlexAttention ``score_mod`` adding ``key_bias[b, h, kv]`` (``(b or 1, h, k)`` float32)."""
    broadcast_batch = key_bias.shape[0] == 1

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + key_bias[0 if broadcast_batch else b, h, kv_idx]

    return score_mod


def alibi_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    key_bias: Tensor,
    keep: Tensor | None = None,
    *,
    scale: float,
    dropout_p: float = 0.0,
) -> Tensor:
    """Attention with a key-only ALiBi bias: ``softmax(scale * q k^T + key_bias | keep) v``.

    Args:
        q: ``(b, h, q, d)``; k, v: ``(b, h, k, d)``.
        key_bias: ``(b or 1, h, k)``, any float dtype (used in float32).
        keep: ``(b or 1, 1, q, k)`` bool, True where a query may attend (HF's causal + padding
            mask, static-cache slots included). None: causal, queries at the last positions.
        scale: multiplies ``q k^T``.
        dropout_p: attention dropout (taken by the SDPA path, which implements it).

    Returns:
        ``(b, h, q, d)`` in ``q.dtype``.
    """
    q_len, k_len = q.shape[-2], k.shape[-2]
    key_bias = key_bias.float()
    if keep is None:
        positions = torch.arange(k_len, device=q.device)
        keep = (positions[None, :] <= positions[k_len - q_len :, None])[None, None]
    use_flex = q.is_cuda and q_len > 1 and dropout_p == 0.0 and flex_available() and not torch.compiler.is_compiling()
    if not use_flex:
        return alibi_attention_reference(q, k, v, key_bias, keep, scale=scale, dropout_p=dropout_p)
    flex, create_block_mask = _compiled()
    batch_keep = keep.shape[0] != 1

    def mask_mod(b, h, q_idx, kv_idx):
        return keep[b if batch_keep else 0, 0, q_idx, kv_idx]

    block_mask = create_block_mask(mask_mod, keep.shape[0] if batch_keep else None, None, q_len, k_len, device=q.device, _compile=True)
    return flex(q, k, v, score_mod=alibi_score_mod(key_bias), block_mask=block_mask, scale=scale)
