"""ALiBi families (BLOOM, MPT, Falcon with ``alibi=True``): torchembed's slopes and bias.

Upstream builds the bias in key-only form (``slope * position_of_key``), which differs from the
paper's ``-slope * |i - j|`` by a constant per query row, which softmax ignores. torchembed's
builders keep that form (the attention code consumes it as is) but compute it in float32 from
:func:`torchembed.functional.alibi_slopes` (the slopes of ``ALiBiEmbedding``), zero at the
newest key and non-positive, so the values that matter most for a causal row are the smallest
and round least in low precision.

* BLOOM: ``BloomModel.build_alibi_tensor`` (instance method) and, where transformers builds the
  bias inline without a mask, the slopes it uses (``_get_alibi_slopes``, rebound for the instance).
* MPT: ``MptModel.build_mpt_alibi_tensor`` (instance method).
* Falcon: ``build_alibi_tensor`` as called by ``FalconModel.forward`` (rebound for the instance).
  Upstream rounds Falcon's slopes to bfloat16 even in float32 models; torchembed does not, so for
  head counts whose slopes are not powers of two the two differ by that rounding.

BLOOM and MPT also get torchembed's attention (``BloomAttention``/``MptAttention`` forward, per
instance): upstream's eager attention materialises the scores in the model dtype, a float32
softmax and the probabilities; torchembed's runs ALiBi inside FlexAttention on CUDA prefill
(nothing quadratic materialised, masked blocks skipped) and SDPA with a row-centred bias
elsewhere (:func:`torchembed.kernels.alibi_attention.alibi_attention`). ``output_attentions=True``
and BLOOM's ``slow_but_exact`` tensor-parallel emulation fall back to upstream's forward.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from torchembed.functional.alibi import alibi_key_bias, alibi_slopes
from torchembed.kernels.alibi_attention import MaskCache, alibi_attention
from torchembed.patches.actions import Component, OverrideAttribute, bind
from torchembed.patches.rebind import rebind_globals
from torchembed.patches.registry import Family, PatchOptions, register

__all__ = ["bloom_alibi_tensor", "falcon_alibi_tensor", "mpt_alibi_tensor"]


def bloom_alibi_tensor(attention_mask: Tensor, num_heads: int, dtype: torch.dtype) -> Tensor:
    """BLOOM's bias from a ``(b, k)`` mask: ``(b * h, 1, k)`` float32 (torchembed's BLOOM
    attention consumes it in float32; ``dtype`` is ignored)."""
    batch, length = attention_mask.shape
    bias = alibi_key_bias(alibi_slopes(num_heads, attention_mask.device), attention_mask)
    return bias.reshape(batch * num_heads, 1, length)


def falcon_alibi_tensor(attention_mask: Tensor, num_heads: int, dtype: torch.dtype) -> Tensor:
    """Falcon's bias from a ``(b, k)`` mask: ``(b * h, 1, k)`` in ``dtype`` (computed in float32),
    since upstream's attention folds it into its mask."""
    return bloom_alibi_tensor(attention_mask, num_heads, dtype).to(dtype)


def mpt_alibi_tensor(num_heads: int, sequence_length: int, alibi_bias_max: float = 8, device=None) -> Tensor:
    """MPT's bias ``(h, 1, L)`` float32: ``slope * (j - (L - 1))`` for keys ``j < L``."""
    slopes = alibi_slopes(num_heads, device, max_bias=float(alibi_bias_max))
    distance = torch.arange(1 - sequence_length, 1, device=device, dtype=torch.float32)
    return slopes[:, None, None] * distance[None, None, :]


def bloom_attention_forward(
    self: nn.Module,
    hidden_states: Tensor,
    residual: Tensor,
    alibi: Tensor,
    attention_mask: Tensor | None,
    layer_past: Any = None,
    use_cache: bool = False,
    output_attentions: bool = False,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """``BloomAttention.forward`` with torchembed's ALiBi attention (same inputs and outputs)."""
    if output_attentions or (self.pretraining_tp > 1 and self.slow_but_exact):
        alibi = alibi.to(hidden_states.dtype)  # upstream's baddbmm wants the model dtype
        return type(self).forward(self, hidden_states, residual, alibi, attention_mask, layer_past, use_cache, output_attentions, **kwargs)
    batch, q_len, _ = hidden_states.shape
    q, k, v = self._reshape(self.query_key_value(hidden_states))  # (b, h, s, d) views
    if layer_past is not None:
        k, v = layer_past.update(k, v, self.layer_idx)
    k_len = k.shape[-2]
    key_bias = alibi.view(batch, self.num_heads, -1)  # (b*h, 1, k) -> (b, h, k)
    if key_bias.shape[-1] != k_len:
        raise ValueError(f"ALiBi bias covers {key_bias.shape[-1]} keys, attention has {k_len}")
    # HF's mask: additive float (0 = attend) or bool (True = attend); derived once per forward.
    keep, cache = _keep_mask(attention_mask, lambda m: m if m.dtype == torch.bool else m == 0)
    dropout = self.attention_dropout.p if self.training else 0.0
    context = alibi_attention(q, k, v, key_bias, keep, scale=self.inv_norm_factor, dropout_p=dropout, cache=cache)
    context = context.transpose(1, 2).reshape(batch, q_len, self.hidden_size)  # (b, s, h*d)
    output = F.dropout(self.dense(context), p=self.hidden_dropout, training=self.training) + residual
    return output, None


def mpt_attention_forward(
    self: nn.Module,
    hidden_states: Tensor,
    position_bias: Tensor | None,
    past_key_values: Any = None,
    attention_mask: Tensor | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """``MptAttention.forward`` with torchembed's ALiBi attention (same inputs and outputs)."""
    if kwargs.get("output_attentions"):
        return type(self).forward(self, hidden_states, position_bias, past_key_values, attention_mask, **kwargs)
    batch, q_len = hidden_states.shape[:2]
    qkv = self.Wqkv(hidden_states)
    if self.clip_qkv:
        qkv = qkv.clamp(min=-self.clip_qkv, max=self.clip_qkv)
    # (b, s, 3*h*d) -> three (b, h, s, d)
    q, k, v = (t.reshape(batch, q_len, self.n_heads, self.head_dim).transpose(1, 2) for t in qkv.chunk(3, dim=2))
    if past_key_values is not None:
        k, v = past_key_values.update(k, v, self.layer_idx)
    k_len = k.shape[-2]
    if position_bias is None:
        key_bias = k.new_zeros(1, self.n_heads, k_len, dtype=torch.float32)
    else:
        if position_bias.shape[-1] < k_len:
            raise ValueError(
                f"{k_len} keys exceed MPT's ALiBi table of {position_bias.shape[-1]} positions (config.max_seq_len)"
            )
        key_bias = position_bias[None, :, 0, -k_len:]  # (h, 1, L) -> (1, h, k)
    keep, cache = _keep_mask(attention_mask, torch.logical_not)  # MPT's bool mask is True where masked
    dropout = self.attn_dropout_p if self.training else 0.0
    context = alibi_attention(q, k, v, key_bias, keep, scale=self.softmax_scale, dropout_p=dropout, cache=cache)
    context = context.transpose(1, 2).reshape(batch, q_len, -1)  # (b, s, h*d)
    return self.out_proj(context), None


_MASKS = MaskCache()


def _keep_mask(attention_mask: Tensor | None, to_keep: Any) -> tuple[Tensor | None, MaskCache | None]:
    """``keep`` (True = attend) for HF's mask, computed once per forward (all layers share the mask)."""
    if attention_mask is None:
        return None, None
    cache = _MASKS.lookup(attention_mask)
    if cache is None:
        cache = _MASKS.store(attention_mask, to_keep(attention_mask))
    return cache.keep, cache


class OverrideForward:
    """Replace ``forward`` of every module of ``class_name`` by ``forward`` (bound per instance)."""

    def __init__(self, class_name: str, forward: Any) -> None:
        self.class_name, self.forward = class_name, forward

    def plan(self, model: nn.Module, config: Any, options: PatchOptions) -> list[OverrideAttribute]:
        actions = []
        for path, module in model.named_modules():
            if type(module).__name__ == self.class_name:
                component = Component(path, "alibi-attention", _qualname(type(module).forward), _qualname(self.forward))
                actions.append(OverrideAttribute(component, module, "forward", bind(self.forward, module)))
        return actions


def _qualname(fn: Any) -> str:
    return f"{fn.__module__}.{fn.__qualname__}"


class OverrideMethod:
    """Set ``method`` on every module of ``class_name`` to a torchembed function (instance only).

    The function is stored as a plain instance attribute, so it is called without ``self``.
    """

    def __init__(self, class_name: str, method: str, replacement: Any) -> None:
        self.class_name, self.method, self.replacement = class_name, method, replacement

    def plan(self, model: nn.Module, config: Any, options: PatchOptions) -> list[OverrideAttribute]:
        actions = []
        for path, module in model.named_modules():
            if type(module).__name__ == self.class_name:
                upstream = getattr(type(module), self.method)
                component = Component(path, "alibi", _qualname(upstream), _qualname(self.replacement))
                actions.append(OverrideAttribute(component, module, self.method, self.replacement))
        return actions


class RebindForwardGlobals:
    """Rebind module-level names inside ``forward`` of every module of ``class_name``.

    Names the installed transformers does not use are skipped (e.g. BLOOM builds the bias inline
    only in recent versions); a module whose forward uses none of them is left alone.
    """

    def __init__(self, class_name: str, overrides: dict[str, Any]) -> None:
        self.class_name, self.overrides = class_name, overrides

    def plan(self, model: nn.Module, config: Any, options: PatchOptions) -> list[OverrideAttribute]:
        actions = []
        for path, module in model.named_modules():
            cls = type(module)
            if cls.__name__ != self.class_name:
                continue
            forward = cls.forward
            used = {name: fn for name, fn in self.overrides.items() if name in _referenced_names(forward)}
            if used:
                upstream = ", ".join(_qualname(forward.__globals__[name]) for name in used)
                replacement = ", ".join(_qualname(fn) for fn in used.values())
                component = Component(path, "alibi", upstream, replacement)
                actions.append(OverrideAttribute(component, module, "forward", bind(rebind_globals(forward, used), module)))
        return actions


def _referenced_names(fn: Any) -> set[str]:
    while getattr(fn, "__wrapped__", None) is not None and fn.__closure__:
        fn = fn.__wrapped__
    return set(fn.__code__.co_names)


register(
    Family(
        model_type="bloom",
        encoding="alibi",
        adapters=(
            OverrideMethod("BloomModel", "build_alibi_tensor", bloom_alibi_tensor),
            RebindForwardGlobals("BloomModel", {"_get_alibi_slopes": alibi_slopes}),  # same signature
            OverrideForward("BloomAttention", bloom_attention_forward),
        ),
        description="build_alibi_tensor / slopes -> torchembed ALiBi; attention -> fused ALiBi attention",
    )
)
register(
    Family(
        model_type="mpt",
        encoding="alibi",
        adapters=(
            OverrideMethod("MptModel", "build_mpt_alibi_tensor", mpt_alibi_tensor),
            OverrideForward("MptAttention", mpt_attention_forward),
        ),
        description="build_mpt_alibi_tensor -> torchembed ALiBi; attention -> fused ALiBi attention",
    )
)
register(
    Family(
        model_type="falcon",
        encoding="alibi",
        variant="alibi",
        applies=lambda config: bool(getattr(config, "alibi", False)),
        adapters=(RebindForwardGlobals("FalconModel", {"build_alibi_tensor": falcon_alibi_tensor}),),
        description="build_alibi_tensor -> torchembed ALiBi (float32 slopes; upstream rounds them to bf16)",
    )
)
