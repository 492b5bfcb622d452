"""``LearnedPositionalEmbedding``: a trainable lookup table of position vectors (BERT, GPT-2).

Devlin et al., "BERT", arXiv:1810.04805; Radford et al., "Language Models are Unsupervised
Multitask Learners" (GPT-2), 2019.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["LearnedPositionalEmbedding"]


class LearnedPositionalEmbedding(nn.Module):
    """Add ``weight[offset + i]`` to token ``i``, then dropout.

    Cannot extrapolate: ``offset + seq_len`` past ``max_seq_len`` is a ``ValueError``.

    Args:
        max_seq_len: rows of the table (positions ``0 .. max_seq_len - 1``).
        dim: embedding dim ``d``.
        dropout: dropout probability after the addition.
        padding_idx: this row starts at zero and never receives a gradient (as ``nn.Embedding``).

    Attributes:
        weight: ``(max_seq_len, d)`` parameter, initialised ``N(0, 0.02)``.

    Shapes:
        ``x``: ``(b, s, d)`` -> same shape and dtype.
    """

    def __init__(self, max_seq_len: int, dim: int, dropout: float = 0.0, padding_idx: int | None = None) -> None:
        super().__init__()
        for name, value in (("max_seq_len", max_seq_len), ("dim", dim)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout!r}")
        if padding_idx is not None:
            if not -max_seq_len <= padding_idx < max_seq_len:
                raise ValueError(f"padding_idx must be in [-{max_seq_len}, {max_seq_len}), got {padding_idx}")
            padding_idx %= max_seq_len
        self.max_seq_len, self.dim, self.padding_idx = max_seq_len, dim, padding_idx
        self.weight = nn.Parameter(torch.empty(max_seq_len, dim))
        self.dropout = nn.Dropout(dropout)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=0.02)
        if self.padding_idx is not None:
            with torch.no_grad():
                self.weight[self.padding_idx].zero_()

    @classmethod
    def from_embedding(cls, table: nn.Embedding, dropout: float = 0.0) -> "LearnedPositionalEmbedding":
        """Wrap an existing ``nn.Embedding``'s weight (the same Parameter, no copy)."""
        module = cls.__new__(cls)
        nn.Module.__init__(module)
        module.max_seq_len, module.dim = table.num_embeddings, table.embedding_dim
        module.padding_idx = table.padding_idx
        module.weight = table.weight
        module.dropout = nn.Dropout(dropout)
        return module

    def lookup(self, position_ids: Tensor) -> Tensor:
        """Rows of the table for integer ``position_ids`` of any shape: ``position_ids.shape + (d,)``.

        Raises:
            ValueError: a position outside ``[0, max_seq_len)`` (checked on the host for CPU tensors; on accelerators
                by an asynchronous device-side assert, no sync).
        """
        if isinstance(position_ids, torch.fx.Proxy):  # symbolic tracing (HF's fx export): no values to check
            return F.embedding(position_ids, self.weight, self.padding_idx)
        if position_ids.is_floating_point():
            raise TypeError(f"position_ids must be integer, got {position_ids.dtype}")
        if position_ids.numel() and not torch.compiler.is_compiling():
            if position_ids.device.type == "cpu":
                low, high = int(position_ids.min()), int(position_ids.max())
                if low < 0 or high >= self.max_seq_len:
                    raise ValueError(f"positions {low}..{high} are outside the learned table of {self.max_seq_len} "
                                     "positions (learned embeddings cannot extrapolate: use a shorter input or a "
                                     "larger table)")
            else:
                torch._assert_async(
                    ((position_ids >= 0) & (position_ids < self.max_seq_len)).all(),
                    "position outside the learned position table",
                )
        return F.embedding(position_ids, self.weight, self.padding_idx)

    def forward(self, x: Tensor, offset: int = 0) -> Tensor:
        """Return ``dropout(x + weight[offset : offset + s])``, shape ``(b, s, d)``."""
        if not isinstance(x, Tensor) or not x.is_floating_point():
            raise TypeError(f"x must be a floating-point tensor, got {getattr(x, 'dtype', type(x))}")
        if x.dim() != 3 or x.shape[-1] != self.dim:
            raise ValueError(f"x must be (batch, seq_len, {self.dim}), got shape {tuple(x.shape)}")
        if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
            raise ValueError(f"offset must be a non-negative int, got {offset!r}")
        seq_len = x.shape[1]
        if offset + seq_len > self.max_seq_len:
            raise ValueError(f"offset + seq_len = {offset} + {seq_len} exceeds max_seq_len={self.max_seq_len}: "
                             "learned positions cannot extrapolate; use a larger max_seq_len")
        positions = torch.arange(offset, offset + seq_len, device=x.device)
        # F.embedding rather than slicing: it honours padding_idx (no gradient into that row).
        pos = F.embedding(positions, self.weight, self.padding_idx)
        return self.dropout(x + pos.to(x.dtype))

    def extra_repr(self) -> str:
        return f"max_seq_len={self.max_seq_len}, dim={self.dim}, padding_idx={self.padding_idx}"
