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
import weakref
from collections.abc import Callable, Hashable
from typing import Any

import torch
from torch import Tensor

from torchembed.functional.alibi import alibi_attention_reference, alibi_decode_bias

__all__ = ["alibi_attention", "flex_available", "alibi_score_mod", "MaskCache"]


_CAUSAL: dict = {}
# Devices whose prefill goes through FlexAttention (tests add "cpu" to exercise the path).
_FLEX_DEVICES: tuple[str, ...] = ("cuda",)
# Dynamo compiles flex_attention once per distinct (shapes, strides, dtype, heads) guard set and
# counts them per function: past its default of 8 it silently runs flex_attention unfused, which
# materialises the scores. One process serving several ALiBi models, batch sizes and layouts needs
# more, so the limit is raised around torchembed's calls (and restored after each).
_RECOMPILE_LIMIT = 64


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


def _causal(q_len: int, k_len: int, device: torch.device) -> tuple[Tensor, "MaskCache"]:
    """The causal ``keep`` mask (queries last) and its cache slot, shared by all layers."""
    key = (q_len, k_len, device)
    entry = _CAUSAL.get(key)
    if entry is None:
        if len(_CAUSAL) >= 8:
            _CAUSAL.clear()
        positions = torch.arange(k_len, device=device)
        entry = MaskCache()
        entry.keep = (positions[None, :] <= positions[k_len - q_len :, None])[None, None]
        _CAUSAL[key] = entry
    return entry.keep, entry


class MaskCache:
    """The ``keep`` mask and FlexAttention block mask derived from one HF mask tensor.

    HF passes the same attention-mask tensor to every layer of a forward; deriving the boolean
    mask and the block mask (which evaluates the mask over all blocks) once per forward instead
    of once per layer matters at long sequences. Keyed by the identity of the source tensor
    through a weak reference, so a new forward (a new mask tensor) always recomputes.
    """

    def __init__(self) -> None:
        self._source: weakref.ref | None = None
        self.keep: Tensor | None = None
        self.block_mask = None
        self._memo: dict = {}

    def lookup(self, source: Tensor) -> "MaskCache | None":
        return self if self._source is not None and self._source() is source else None

    def store(self, source: Tensor, keep: Tensor | None) -> "MaskCache":
        # When the source mask dies (the forward is over), drop what was derived from it.
        self._source, self.keep, self.block_mask = weakref.ref(source, self._clear), keep, None
        self._memo = {}
        return self

    def memo(self, source: Tensor, tag: Hashable, make: Callable[[], Any]) -> Any:
        """``make()`` computed once per ``(source, tag)`` while this mask lives: per-forward
        derivations of tensors every layer receives (the ALiBi bias), shared by the layers.
        ``source`` is held weakly and checked by identity, so a new tensor never hits an old entry."""
        entry = self._memo.get((id(source), tag))
        if entry is not None and entry[0]() is source:
            return entry[1]
        value = make()
        self._memo[(id(source), tag)] = (weakref.ref(source), value)
        return value

    def _clear(self, ref: weakref.ref) -> None:
        if ref is self._source:
            self._source, self.keep, self.block_mask, self._memo = None, None, None, {}


def alibi_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    key_bias: Tensor,
    keep: Tensor | None = None,
    *,
    scale: float,
    dropout_p: float = 0.0,
    cache: MaskCache | None = None,
) -> Tensor:
    """Attention with a key-only ALiBi bias: ``softmax(scale * q k^T + key_bias | keep) v``.

    Args:
        q: ``(b, h, q, d)``; k, v: ``(b, h, k, d)``.
        key_bias: ``(b or 1, h, k)``, any float dtype (used in float32).
        keep: ``(b or 1, 1, q, k)`` bool, True where a query may attend (HF's causal + padding
            mask, static-cache slots included). None: causal, queries at the last positions.
        scale: multiplies ``q k^T``.
        dropout_p: attention dropout (taken by the SDPA path, which implements it).
        cache: where the block mask for ``keep`` (and, at decode, the SDPA mask for ``key_bias``;
            pass the same ``key_bias`` tensor to every layer, e.g. via ``cache.memo``) is kept
            across the layers of one forward.

    Returns:
        ``(b, h, q, d)`` in ``q.dtype``.
    """
    q_len, k_len = q.shape[-2], k.shape[-2]
    if keep is None and q_len > 1:
        keep, cache = _causal(q_len, k_len, q.device)
    use_flex = (
        q.device.type in _FLEX_DEVICES and q_len > 1 and dropout_p == 0.0 and q.shape[-1] >= 16 and flex_available()
        and not torch.compiler.is_compiling()
    )
    if not use_flex:
        if q_len == 1 and cache is not None:  # decode: the mask is the same for every layer
            bias = cache.memo(key_bias, ("decode", q.dtype), lambda: alibi_decode_bias(key_bias, keep, q.dtype))
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=dropout_p,
                                                                    scale=scale)
        return alibi_attention_reference(q, k, v, key_bias, keep, scale=scale, dropout_p=dropout_p)
    flex, create_block_mask = _compiled()
    block_mask = cache.block_mask if cache is not None else None
    if block_mask is None:
        batch_keep = keep.shape[0] != 1

        def mask_mod(b, h, q_idx, kv_idx):
            return keep[b if batch_keep else 0, 0, q_idx, kv_idx]

        batch = keep.shape[0] if batch_keep else None
        block_mask = create_block_mask(mask_mod, batch, None, q_len, k_len, device=q.device, _compile=True)
        if cache is not None:
            cache.block_mask = block_mask
    # key_bias always batch-sized (a stride-0 view when shared), so every call traces the same
    # score_mod: a broadcast flag in its closure would be one more guard and recompile
    score_mod = alibi_score_mod(key_bias.float().expand(q.shape[0], -1, -1))
    config = torch._dynamo.config
    limit = config.recompile_limit
    config.recompile_limit = max(limit, _RECOMPILE_LIMIT)
    try:
        return flex(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale)
    finally:
        config.recompile_limit = limit
