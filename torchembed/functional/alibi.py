"""Attention with Linear Biases (ALiBi), the pure-PyTorch reference.

Press et al., "Train Short, Test Long: Attention with Linear Biases Enables Input Length
Extrapolation", arXiv:2108.12409.

Shape legend: ``b`` batch, ``h`` heads, ``q`` query length, ``k`` key length.
"""

from __future__ import annotations

import math
import numbers

import torch
from torch import Tensor

__all__ = ["alibi_slopes", "alibi_bias", "alibi_key_bias", "causal_keep", "alibi_decode_bias", "alibi_prefill_bias", "alibi_attention_reference"]


def alibi_slopes(num_heads: int, device: torch.device | str | None = None, *, max_bias: float = 8.0) -> Tensor:
    """Per-head slopes, the paper's recipe.

    For ``n`` a power of two the slopes are the geometric sequence ``2^(-8/n), 2^(-16/n), ..., 2^-8``. Otherwise the
    ``n' = 2^floor(log2 n)`` slopes of the closest smaller power of two are followed by every other slope of ``2 n'``
    (the ones in between), as in the reference code. ``max_bias`` replaces the 8 (MPT's ``alibi_bias_max``); BLOOM,
    MPT and Falcon all produce these slopes.

    Returns:
        ``(h,)`` float32, all in ``(0, 1)``.

    Raises:
        ValueError: ``num_heads`` is not a positive int, ``max_bias`` not a finite number > 0.
    """
    if not isinstance(num_heads, int) or isinstance(num_heads, bool) or num_heads <= 0:
        raise ValueError(f"num_heads must be a positive int, got {num_heads!r}")
    if isinstance(max_bias, bool) or not isinstance(max_bias, numbers.Real) or not math.isfinite(max_bias) or max_bias <= 0:
        raise ValueError(f"max_bias must be a finite number > 0, got {max_bias!r}")

    def power_of_2(n: int) -> list[float]:
        start = 2.0 ** (-max_bias / n)
        return [start ** (i + 1) for i in range(n)]

    closest = 2 ** math.floor(math.log2(num_heads))
    slopes = power_of_2(closest)
    if closest != num_heads:
        slopes += power_of_2(2 * closest)[0::2][: num_heads - closest]
    return torch.tensor(slopes, dtype=torch.float32, device=device)


def alibi_bias(slopes: Tensor, query_len: int, key_len: int, *, causal_offset: bool = True,
               dtype: torch.dtype = torch.float32) -> Tensor:
    """The ALiBi bias ``-slope * |i - j|`` for every (query, key) pair.

    Queries are the last ``query_len`` positions of the ``key_len`` keys (as with a KV cache), so query ``i`` sits at
    absolute position ``key_len - query_len + i``. With ``causal_offset=False`` queries and keys both start at 0.

    Args:
        slopes: ``(h,)`` float32.

    Returns:
        ``(h, q, k)`` in ``dtype``, non-positive, zero where query and key positions coincide.
    """
    start = key_len - query_len if causal_offset else 0
    q_pos = torch.arange(start, start + query_len, device=slopes.device)
    k_pos = torch.arange(key_len, device=slopes.device)
    distance = (q_pos[:, None] - k_pos[None, :]).abs().to(torch.float32)
    return (-slopes.float()[:, None, None] * distance).to(dtype)


def alibi_key_bias(slopes: Tensor, attention_mask: Tensor | None = None, *, key_len: int | None = None) -> Tensor:
    """ALiBi in key-only form, ``slope * (p_j - p_last)``: the one builder of the key bias.

    ``p_j`` is key ``j``'s position counted over non-padded tokens (``cumsum(mask) - 1``; without a mask, ``j``), and
    ``p_last`` the position of the row's last real key. For a causal query at ``p_i`` this differs from
    ``-slope * (p_i - p_j)`` by ``slope * (p_i - p_last)``, a constant per query row that softmax ignores; being
    non-positive and zero at the newest key, it keeps the values near the diagonal small, where low-precision dtypes
    round least.

    Args:
        slopes: ``(h,)`` float32.
        attention_mask: ``(b, k)`` with 1 (or True) for real tokens, 0 for padding; or None with ``key_len``: no
            padding.

    Returns:
        ``(b, h, k)`` float32 (``(1, h, key_len)`` without a mask); padded keys get 0 (the attention mask removes them).

    Raises:
        ValueError: neither or both of ``attention_mask`` and ``key_len``.
    """
    if (attention_mask is None) == (key_len is None):
        raise ValueError("alibi_key_bias takes an attention_mask (b, k) or key_len=, exactly one of them")
    slopes = slopes if slopes.dtype == torch.float32 else slopes.float()
    if attention_mask is None:
        return slopes.view(1, -1, 1) * torch.arange(1 - key_len, 1, device=slopes.device, dtype=torch.float32)
    counts = attention_mask.cumsum(-1, dtype=torch.float32)  # real keys up to and including j
    relative = (counts - counts[..., -1:]) * attention_mask  # p_j - p_last; 0 for padding
    return slopes.view(1, -1, 1) * relative.unsqueeze(1)


def causal_keep(query_len: int, key_len: int, device: torch.device | str | None = None) -> Tensor:
    """The causal keep mask, queries at the last ``query_len`` of ``key_len`` positions (as with a KV cache):
    ``(1, 1, q, k)`` bool, True where query ``i`` may attend key ``j`` (``j <= k - q + i``)."""
    positions = torch.arange(key_len, device=device)
    return (positions[None, :] <= positions[key_len - query_len:, None])[None, None]


def alibi_decode_bias(key_bias: Tensor, keep: Tensor | None, dtype: torch.dtype) -> Tensor:
    """The SDPA mask of one decode step: ``key_bias`` centred on the newest key (softmax ignores the per-row constant;
    the values near it stay small and exact in low precision), the positions ``keep`` excludes set to ``dtype``'s
    minimum.

    Args:
        key_bias: ``(b or 1, h, k)`` float.
        keep: ``(b or 1, 1, 1, k)`` bool or None.

    Returns:
        ``(b or 1, h, 1, k)`` in ``dtype``.
    """
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    bias = key_bias if key_bias.dtype == compute else key_bias.to(compute)
    bias = (bias - bias[..., -1:])[:, :, None, :]
    if keep is not None:
        bias = torch.where(keep, bias, torch.finfo(dtype).min)
    return bias.to(dtype)


def alibi_attention_reference(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, keep: Tensor | None = None, *,
                              scale: float, key_bias: bool = True, dropout_p: float = 0.0, empty_rows: str = "mean",
                              return_lse: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """Attention with ALiBi, the reference: ``softmax(scale * q k^T + bias | keep) v``, the scores materialised in
    float32 (float64 inputs: float64). What every ALiBi path is tested against, and what runs where no kernel and no
    faster PyTorch path applies (the CPU, ``fused=False``).

    Args:
        q: ``(b, h, q, d)``; k, v: ``(b, hk, k, d)``, ``h`` a multiple of ``hk`` (GQA/MQA).
        bias: a key-only bias ``(b or 1, h, k)`` (``key_bias=True``), the ``(h,)`` slopes (``key_bias=False``:
            ``slope * (j - i)`` for a query at position ``i``), or None (no bias).
        keep: ``(b or 1, 1, q, k)`` bool, True where a query may attend; None: causal with the queries at the last
            ``q`` of the ``k`` positions (as with a KV cache).
        scale: multiplies ``q k^T``.
        dropout_p: dropout on the attention weights.
        empty_rows: what a query row that keeps no key gets: ``"mean"`` (the mean of ``v``: upstream's
            eager attention, whose mask is finite) or ``"zero"`` (the fused kernel's).
        return_lse: also return the natural-log log-sum-exp of each row's scores ``(b, h, q)`` float32 (+inf for an
            empty row).

    Returns:
        ``(b, h, q, d)`` in ``q.dtype`` (and the log-sum-exp).
    """
    compute = torch.promote_types(q.dtype, torch.float32)
    group = q.shape[1] // k.shape[1]
    q_len, k_len = q.shape[-2], k.shape[-2]
    s = (q.to(compute) @ k.to(compute).repeat_interleave(group, 1).transpose(-1, -2)) * scale
    if bias is not None and key_bias:
        s = s + bias.to(compute)[:, :, None, :]
    elif bias is not None:
        distance = torch.arange(k_len, device=q.device) - torch.arange(k_len - q_len, k_len, device=q.device)[:, None]
        s = s + bias.to(compute)[None, :, None, None] * distance.to(compute)
    if keep is None:
        keep = causal_keep(q_len, k_len, q.device)
    s = s.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(s, -1)
    empty = torch.isinf(lse)[..., None]
    if empty_rows == "mean":
        s = s.masked_fill(empty, 0.0)  # every key alike
    elif empty_rows != "zero":
        raise ValueError(f"empty_rows must be 'mean' or 'zero', got {empty_rows!r}")
    p = torch.softmax(s, -1).nan_to_num(0.0)
    if dropout_p:
        p = torch.nn.functional.dropout(p, dropout_p)
    out = (p @ v.to(compute).repeat_interleave(group, 1)).to(q.dtype)
    return (out, lse.float()) if return_lse else out


def alibi_prefill_bias(key_bias: Tensor, keep: Tensor | None, dtype: torch.dtype) -> Tensor:
    """The SDPA mask of a prefill: ``key_bias`` re-centred on each query's own key (queries are the last ``q`` of the
    ``k`` keys, as in a prefill after any cache), the positions ``keep`` excludes set to ``dtype``'s minimum (finite,
    as upstream). Softmax ignores the per-row constant; the entries near the diagonal, which carry the attention, are
    then small and exact in low precision.

    Built in one pass in ``dtype`` (the difference computed in float32, rounded once on store) and one masking pass:
    no ``(b, h, q, k)`` float32 tensor. A row that keeps no key attends uniformly.

    Args:
        key_bias: ``(b or 1, h, k)`` float.
        keep: ``(b or 1, 1, q, k)`` bool, or None (every key, one row: the bias shifted by its largest entry).

    Returns:
        ``(b, h, q, k)`` in ``dtype`` (``(b or 1, h, 1, k)`` when ``keep`` is None).
    """
    compute = torch.promote_types(dtype, torch.float32)
    bias = key_bias if key_bias.dtype == compute else key_bias.to(compute)
    if keep is None:
        return (bias - bias.amax(dim=-1, keepdim=True))[:, :, None, :].to(dtype)
    q_len, k_len = keep.shape[-2:]
    shape = (max(bias.shape[0], keep.shape[0]), bias.shape[1], q_len, k_len)
    own = bias[:, :, k_len - q_len :, None]  # (b, h, q, 1): each query's own key
    out = torch.empty(shape, dtype=dtype, device=bias.device)
    torch.sub(bias[:, :, None, :].expand(shape), own.expand(shape), out=out)
    return out.masked_fill_(~keep, torch.finfo(dtype).min)
