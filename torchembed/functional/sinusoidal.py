"""Fixed sinusoidal position encoding, the pure-PyTorch reference.

Vaswani et al., "Attention Is All You Need", arXiv:1706.03762, section 3.5:
``PE[pos, 2i] = sin(pos / 10000^(2i/d))``, ``PE[pos, 2i+1] = cos(pos / 10000^(2i/d))``.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["sinusoidal_table"]


def sinusoidal_table(num_positions: int, dim: int, *, base: float = 10000.0, offset: int = 0,
                     device: torch.device | str | None = None) -> Tensor:
    """The table for positions ``offset .. offset + num_positions - 1``.

    Returns:
        ``(num_positions, dim)`` float32, sines at even and cosines at odd features.

    Raises:
        ValueError: odd or non-positive ``dim``, negative ``num_positions``.
    """
    if not isinstance(dim, int) or dim <= 0 or dim % 2:
        raise ValueError(f"sinusoidal dim must be a positive even int, got {dim!r}")
    if num_positions < 0:
        raise ValueError(f"num_positions must be >= 0, got {num_positions}")
    # Angles in float64, then one rounding: the table is exact to float32 even at long positions.
    positions = torch.arange(offset, offset + num_positions, dtype=torch.float64, device=device)
    inv_freq = base ** (-torch.arange(0, dim, 2, dtype=torch.float64, device=device) / dim)
    angles = positions[:, None] * inv_freq[None, :]
    table = torch.stack((angles.sin(), angles.cos()), dim=-1).flatten(-2)
    return table.to(torch.float32)
