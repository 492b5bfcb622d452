"""``SinusoidalEmbedding``: the fixed sin/cos position encoding.

Vaswani et al., "Attention Is All You Need", arXiv:1706.03762, section 3.5.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from torchembed.functional.sinusoidal import sinusoidal_table

__all__ = ["SinusoidalEmbedding"]


class SinusoidalEmbedding(nn.Module):
    """Add ``PE[pos]`` (sin at even, cos at odd features) to token embeddings, then dropout.

    Args:
        dim: embedding dim ``d`` (even).
        max_seq_len: positions precomputed as a non-persistent float32 ``(max_seq_len, d)`` table;
            longer inputs compute the extra rows from the same formula.
        dropout: dropout probability after the addition.
        learned_scale: add one trainable scalar ``scale`` (init 1.0) multiplying the encoding.

    Shapes:
        ``x``: ``(b, s, d)`` -> same shape and dtype (sum in float32, one rounding).

    Raises:
        ValueError: odd/non-positive ``dim``, bad ``max_seq_len``/``dropout``, ``x`` of another shape.
    """

    def __init__(self, dim: int, max_seq_len: int = 4096, dropout: float = 0.0, learned_scale: bool = False) -> None:
        super().__init__()
        if not isinstance(max_seq_len, int) or isinstance(max_seq_len, bool) or max_seq_len <= 0:
            raise ValueError(f"max_seq_len must be a positive int, got {max_seq_len!r}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout!r}")
        self.dim, self.max_seq_len = dim, max_seq_len
        self.register_buffer("pe", sinusoidal_table(max_seq_len, dim), persistent=False)
        self.scale = nn.Parameter(torch.ones(())) if learned_scale else None
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor, offset: int = 0) -> Tensor:
        """Return ``dropout(x + scale * PE[offset : offset + s])``; ``offset`` serves KV-cache decoding."""
        if not isinstance(x, Tensor) or not x.is_floating_point():
            raise TypeError(f"x must be a floating-point tensor, got {getattr(x, 'dtype', type(x))}")
        if x.dim() != 3 or x.shape[-1] != self.dim:
            raise ValueError(f"x must be (batch, seq_len, {self.dim}), got shape {tuple(x.shape)}")
        if not isinstance(offset, int) or offset < 0:
            raise ValueError(f"offset must be a non-negative int, got {offset!r}")
        seq_len = x.shape[1]
        if offset + seq_len <= self.pe.shape[0]:
            pe = self.pe[offset : offset + seq_len]
        else:
            pe = sinusoidal_table(seq_len, self.dim, offset=offset, device=x.device)
        if self.scale is not None:
            pe = self.scale * pe
        compute = torch.promote_types(x.dtype, torch.float32)  # add in >= float32, round once
        return self.dropout((x.to(compute) + pe).to(x.dtype))

    def extra_repr(self) -> str:
        return f"dim={self.dim}, max_seq_len={self.max_seq_len}, learned_scale={self.scale is not None}"
