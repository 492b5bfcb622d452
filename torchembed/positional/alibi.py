"""``ALiBiEmbedding``: linear distance biases on attention scores.

Press et al., "Train Short, Test Long: Attention with Linear Biases Enables Input Length
Extrapolation", arXiv:2108.12409.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from torchembed.functional.alibi import alibi_slopes

__all__ = ["ALiBiEmbedding"]

# (heads, shapes, dtypes, devices) of q, k, v that passed ALiBiEmbedding._check_qkv: not re-checked
_CHECKED: set[tuple] = set()


class ALiBiEmbedding(nn.Module):
    """Add ``-slope_h * |i - j|`` to the attention logits of head ``h``.

    No parameters. The slopes follow the paper (non-power-of-2 head counts interleave the slopes of the next power of
    two). The bias is non-positive and zero where query and key positions coincide. With ``seq_q < seq_k`` the queries
    are the last ``seq_q`` positions (KV cache).

    Args:
        num_heads: attention heads ``h``; each gets its own slope.
        max_seq_len: distances ``0 .. max_seq_len - 1`` are precomputed per head as a ``(h, max_seq_len)`` float32
            table (non-persistent); longer inputs extend it.

    Shapes:
        ``attn_scores``: ``(b, h, q, k)`` -> same shape and dtype (bias added in float32).

    Raises:
        ValueError: bad ``num_heads``/``max_seq_len``; scores not 4D, with another head count, ``seq_q > seq_k`` or on
            another device than the module's buffers.
        TypeError: scores not a floating-point tensor.
    """

    def __init__(self, num_heads: int, max_seq_len: int = 2048) -> None:
        super().__init__()
        if not isinstance(max_seq_len, int) or isinstance(max_seq_len, bool) or max_seq_len <= 0:
            raise ValueError(f"max_seq_len must be a positive int, got {max_seq_len!r}")
        self.num_heads, self.max_seq_len = num_heads, max_seq_len
        self.register_buffer("slopes", alibi_slopes(num_heads), persistent=False)
        self._build_table(max_seq_len)

    def _build_table(self, length: int) -> None:
        distance = torch.arange(length, device=self.slopes.device, dtype=torch.float32)
        self.register_buffer("bias_table", -self.slopes[:, None] * distance, persistent=False)

    def bias(self, seq_q: int, seq_k: int) -> Tensor:
        """The ``(h, seq_q, seq_k)`` float32 bias; queries are the last ``seq_q`` of ``seq_k`` positions."""
        for name, value in (("seq_q", seq_q), ("seq_k", seq_k)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be a non-negative int, got {value!r}")
        if seq_q > seq_k:
            raise ValueError(f"seq_q ({seq_q}) must not exceed seq_k ({seq_k}): queries are the last keys' positions")
        if seq_k > self.bias_table.shape[1]:
            self._build_table(max(seq_k, 2 * self.bias_table.shape[1]))
        device = self.bias_table.device
        q_pos = torch.arange(seq_k - seq_q, seq_k, device=device)
        distance = (q_pos[:, None] - torch.arange(seq_k, device=device)[None, :]).abs()
        return self.bias_table[:, distance]  # (h, q, k) gathered by |i - j|

    def score_mod(self, offset: int = 0):
        """A FlexAttention ``score_mod`` adding this module's bias, ``-slope_h * |i + offset - j|``.

        Example::

            from torch.nn.attention.flex_attention import flex_attention
            out = flex_attention(q, k, v, score_mod=alibi.score_mod())  # nothing materialised
        """
        slopes = self.slopes

        def alibi_score_mod(score, b, h, q_idx, kv_idx):
            return score - slopes[h] * (q_idx + offset - kv_idx).abs()

        return alibi_score_mod

    def attention(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool = True, key_padding_mask: Tensor | None = None,
                  scale: float | None = None, dropout_p: float = 0.0, fused: bool | None = None) -> Tensor:
        """Attention with this ALiBi bias fused in: ``softmax(q k^T * scale + bias) v``.

        Causal attention runs in one fused Triton kernel that computes the bias from the slopes
        (:func:`torchembed.kernels.attention.alibi_flash`; no ``(b, h, q, k)`` tensor of any kind) where it can run: CUDA
        tensors, float16/bfloat16/float32, head dim <= 256, no dropout. From 2048 keys it leaves out the keys whose
        weight is provably under ``2**-(32 + log2 keys)`` of their row's largest (the bias falls with distance;
        ``TORCHEMBED_ALIBI_SKIP=0`` visits every key). Elsewhere, and for non-causal attention, SDPA with the bias
        materialised (:meth:`bias`, row-centred). Queries are the last ``seq_q`` positions (KV cache).

        Args:
            q: ``(b, h, seq_q, d)``; k, v: ``(b, hk, seq_k, d)``: floating-point, one dtype, one device, the same
                batch, ``h = num_heads`` a multiple of ``hk`` (GQA/MQA: query head ``i`` attends with key/value head
                ``i // (h // hk)``), q and k the same ``d``.
            key_padding_mask: ``(b, seq_k)`` bool, True for real tokens (left padding).
            scale: default ``d ** -0.5``.
            dropout_p: in ``[0, 1]``.
            fused: None: the fused kernel where it runs, PyTorch elsewhere; True: the kernel or
                :class:`~torchembed.kernels.route.FusedUnavailableError`; False: PyTorch only.

        Returns:
            ``(b, h, seq_q, d)`` (``v``'s last dim). ``seq_q = 0`` gives an empty ``(b, h, 0, d)`` result (also with
            ``seq_k = 0``). A query that keeps no key (all padding) gets 0 from the kernel, the mean of ``v`` from SDPA.

        Raises:
            TypeError: q, k, v not floating-point tensors of one dtype; ``fused`` not None/True/False.
            ValueError: shapes, devices, ``key_padding_mask`` or ``dropout_p`` that do not fit, naming what was
                expected and what was given.
            FusedUnavailableError: ``fused=True`` where the kernel cannot run (CPU tensors, ``causal=False``,
                dropout, ...), naming why.

        Example::

            alibi = ALiBiEmbedding(num_heads=8)
            out = alibi.attention(q, k, v)      # == softmax(alibi(q @ k^T / sqrt(d)) + causal mask) @ v
        """
        from torchembed.kernels.alibi import alibi_attention, causal_keep, masked_sdpa, repeat_kv
        from torchembed.kernels.route import check_fused, refuse

        fused = check_fused(fused)
        checked = None
        if type(q) is Tensor and type(k) is Tensor and type(v) is Tensor:
            checked = (self.num_heads, q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, k.device, v.device)
        if checked is None or checked not in _CHECKED:
            self._check_qkv(q, k, v)
            if checked is not None:
                if len(_CHECKED) >= 1024:
                    _CHECKED.clear()
                _CHECKED.add(checked)
        seq_q, seq_k = q.shape[-2], k.shape[-2]
        if seq_q > seq_k:
            raise ValueError(f"seq_q ({seq_q}) must not exceed seq_k ({seq_k}): queries are the last keys' positions")
        if not 0.0 <= dropout_p <= 1.0:
            raise ValueError(f"dropout_p must be in [0, 1], got {dropout_p!r}")
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        keep = None
        if key_padding_mask is not None:
            if (not isinstance(key_padding_mask, Tensor) or key_padding_mask.shape != (q.shape[0], seq_k)
                    or key_padding_mask.dtype != torch.bool):
                raise ValueError(f"key_padding_mask must be bool (batch, seq_k) = {(q.shape[0], seq_k)}, got "
                                 f"{getattr(key_padding_mask, 'dtype', type(key_padding_mask).__name__)} "
                                 f"{tuple(getattr(key_padding_mask, 'shape', ()))}")
            if key_padding_mask.device != q.device:
                raise ValueError(f"key_padding_mask must be on q's device {q.device}, got {key_padding_mask.device}")
            keep = key_padding_mask[:, None, None, :]
        if seq_q == 0:  # nothing to attend from: empty, but still connected to q, k, v for autograd
            k, v = repeat_kv(k, q.shape[1]), repeat_kv(v, q.shape[1])
            return (q @ k.transpose(-2, -1))[..., :0] @ v[..., :0, :]
        slopes = self.slopes.to(q.device)
        if causal:
            if keep is not None:
                keep = keep & causal_keep(seq_q, seq_k, q.device)
            # the bias slope * (j - i), computed from the slopes in the kernel (up to a per-row constant)
            return alibi_attention(q, k, v, None, keep, scale=scale, dropout_p=dropout_p, fused=fused, slopes=slopes)
        if fused:
            raise refuse("the fused ALiBi attention kernel", "it is causal, and causal=False runs SDPA with the "
                         "materialised bias")
        bias = self.bias(seq_q, seq_k).to(q.device)[None]  # (1, h, q, k), exact near the diagonal
        if keep is not None:
            bias = bias.masked_fill(~keep, torch.finfo(q.dtype).min)
        return masked_sdpa(q, k, v, bias.to(q.dtype), scale, dropout_p)

    def _check_qkv(self, q: Tensor, k: Tensor, v: Tensor) -> None:
        """Validate :meth:`attention`'s q, k, v: Python compares only (no kernel, no sync)."""
        for name, t in (("q", q), ("k", k), ("v", v)):
            if not isinstance(t, Tensor) or not t.is_floating_point():
                raise TypeError(f"{name} must be a floating-point tensor, got {getattr(t, 'dtype', type(t).__name__)}")
        shapes = f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or q.shape[1] != self.num_heads:
            raise ValueError(f"q, k, v must be (batch, {self.num_heads} heads, seq, dim), got {shapes}")
        kv_heads = k.shape[1]
        if k.shape[:2] != v.shape[:2] or k.shape[0] != q.shape[0] or kv_heads < 1 or self.num_heads % kv_heads:
            raise ValueError(f"k and v must have q's batch {q.shape[0]} and one head count dividing {self.num_heads} "
                             f"(GQA/MQA), got {shapes}")
        if k.shape[-1] != q.shape[-1]:
            raise ValueError(f"q and k must have the same head dim, got {shapes}")
        if v.shape[-2] != k.shape[-2]:
            raise ValueError(f"k and v must have the same sequence length seq_k, got {shapes}")
        if not q.dtype == k.dtype == v.dtype:
            raise TypeError(f"q, k, v must have one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
        if not q.device == k.device == v.device:
            raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")

    def forward(self, attn_scores: Tensor) -> Tensor:
        """Return ``attn_scores + bias``, shape ``(b, h, q, k)``, in ``attn_scores.dtype``."""
        if not isinstance(attn_scores, Tensor) or not attn_scores.is_floating_point():
            raise TypeError(f"attn_scores must be a floating-point tensor, got {getattr(attn_scores, 'dtype', type(attn_scores))}")
        if attn_scores.dim() != 4:
            raise ValueError(f"attn_scores must be (batch, heads, seq_q, seq_k), got shape {tuple(attn_scores.shape)}")
        if attn_scores.shape[1] != self.num_heads:
            raise ValueError(f"attn_scores has {attn_scores.shape[1]} heads, this ALiBiEmbedding has num_heads={self.num_heads}")
        if attn_scores.device != self.bias_table.device:
            raise ValueError(f"attn_scores are on {attn_scores.device} but this ALiBiEmbedding's buffers are on "
                             f"{self.bias_table.device}: move the module with .to({str(attn_scores.device)!r})")
        bias = self.bias(attn_scores.shape[-2], attn_scores.shape[-1])
        compute = torch.promote_types(attn_scores.dtype, torch.float32)  # add in >= float32, round once
        return (attn_scores.to(compute) + bias).to(attn_scores.dtype)

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, max_seq_len={self.max_seq_len}"
