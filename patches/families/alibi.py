"""ALiBi families (BLOOM, MPT, Falcon with ``alibi=True``): torchembed's slopes, bias and attention.

Upstream builds the bias in key-only form (``slope * position_of_key``), which differs from the
paper's ``-slope * |i - j|`` by a constant per query row, which softmax ignores. torchembed's
builders keep that form (the attention code consumes it as is) but compute it in float32 from
:func:`torchembed.functional.alibi_slopes` (the slopes of ``ALiBiEmbedding``), zero at the
newest key and non-positive, so the values that matter most for a causal row are the smallest
and round least in low precision.

* BLOOM: ``BloomModel.build_alibi_tensor`` (instance method) and, where transformers builds the
  bias inline without a mask, the slopes it uses (``_get_alibi_slopes``, rebound for the instance).
* MPT: ``MptModel.build_mpt_alibi_tensor`` (instance method).
* Falcon: ``build_alibi_tensor`` and ``create_causal_mask`` as called by ``FalconModel.forward``
  (rebound for the instance). Upstream rounds Falcon's slopes to bfloat16 even in float32 models;
  torchembed does not, so for head counts whose slopes are not powers of two the two differ by
  that rounding.

All three also get torchembed's attention (``BloomAttention``/``MptAttention``/``FalconAttention``
forward, per instance): upstream's eager attention materialises the scores in the model dtype, a
float32 softmax and the probabilities, and Falcon's model folds the bias into a ``(b, h, q, k)``
mask in the model dtype that every layer reads; torchembed's runs ALiBi inside a fused kernel on
CUDA prefill (SDPA's cuDNN kernel with the bias in extra head-dim columns when there is no padding,
FlexAttention with a block mask otherwise; nothing quadratic materialised) and SDPA with a
row-centred bias elsewhere (:func:`torchembed.kernels.alibi_attention.alibi_attention`).
``output_attentions=True`` and BLOOM's ``slow_but_exact`` tensor-parallel emulation fall back to
upstream's forward. On a model split over devices (accelerate ``device_map``), the layers of each
device share one copy of the mask and bias (:mod:`torchembed.patches.devices`), so the masks
derived from them are built once per device and forward, not once per layer.

Falcon: the patched ``FalconModel.forward`` gets the mask from :func:`falcon_causal_mask`, which
drops the singleton head dim of ``create_causal_mask``'s ``(b, 1, q, k)`` mask, so upstream's
fold (taken only for a 4-D mask) is skipped; the layers receive the ``(b * h, 1, k)`` float32 key
bias and the ``(b, q, k)`` mask separately. The patched attention computes upstream's **sdpa**
path, ``softmax(q k^T / sqrt(d) + alibi / sqrt(d))``, whatever ``attn_implementation`` says:
upstream's eager path adds the bias a second time on top of the folded mask (an upstream bug),
so a patched eager Falcon-ALiBi model differs from upstream eager and agrees with upstream sdpa
(the registry records this as ``reference_attn="sdpa"``; ``torchembed compare`` uses it).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from torchembed.functional.alibi import alibi_decode_bias, alibi_key_bias, alibi_slopes
from torchembed.kernels.alibi_attention import MaskCache, alibi_attention
from torchembed.patches.actions import Component, OverrideAttribute, bind
from torchembed.patches.devices import ShareDeviceCopies
from torchembed.patches.rebind import rebind_globals
from torchembed.patches.registry import Family, PatchOptions, register

try:  # imported here, not in falcon_causal_mask: dynamo cannot trace an import from transformers' lazy module
    from transformers.masking_utils import create_causal_mask as _upstream_causal_mask
except ImportError:  # older transformers: FalconModel.forward has no create_causal_mask to rebind
    _upstream_causal_mask = None

__all__ = ["bloom_alibi_tensor", "falcon_alibi_tensor", "falcon_causal_mask", "mpt_alibi_tensor"]


# What the model builders derive from the config alone, built once per (heads, ..., device)
# instead of at every forward (a host-to-device copy and a few launches per decode step).
_CONSTANTS: dict[tuple, Tensor] = {}


def _constant(key: tuple, make: Any) -> Tensor:
    if torch.compiler.is_compiling():  # inside a graph: build it there
        return make()
    value = _CONSTANTS.get(key)
    if value is None:
        value = _CONSTANTS[key] = make()
    return value


def bloom_alibi_tensor(attention_mask: Tensor, num_heads: int, dtype: torch.dtype) -> Tensor:
    """BLOOM's bias from a ``(b, k)`` mask: ``(b * h, 1, k)`` float32 (torchembed's BLOOM
    attention consumes it in float32; ``dtype`` is ignored)."""
    batch, length = attention_mask.shape
    device = attention_mask.device
    slopes = _constant(("slopes", num_heads, device), lambda: alibi_slopes(num_heads, device))
    return alibi_key_bias(slopes, attention_mask).reshape(batch * num_heads, 1, length)


def falcon_alibi_tensor(attention_mask: Tensor, num_heads: int, dtype: torch.dtype) -> Tensor:
    """Falcon's bias from a ``(b, k)`` mask: ``(b * h, 1, k)`` float32, ``slope * position`` with
    positions counted over non-padded keys as upstream (up to a constant per row). Not rounded to
    bfloat16 and not scaled: :func:`falcon_attention_forward` multiplies it by ``1 / sqrt(d)`` in
    float32 (``dtype`` is ignored)."""
    return bloom_alibi_tensor(attention_mask, num_heads, dtype)


def falcon_causal_mask(*args: Any, **kwargs: Any) -> Tensor | None:
    """``create_causal_mask`` for ``FalconModel.forward``, returned without its head dim.

    Upstream folds the ALiBi bias into the mask when it is 4-D (``causal_mask.ndim == 4``),
    materialising ``(b, h, q, k)`` in the model dtype. The ``(b, 1, q, k)`` mask (bool, True =
    attend; additive float for eager) is returned as the ``(b, q, k)`` view, so that fold is skipped
    and :func:`falcon_attention_forward` gets the mask and the key bias separately. Other masks
    (None, 2-D for flash attention) pass through unchanged.

    Raises:
        ValueError: a 4-D mask with several heads (nothing upstream produces).
    """
    mask = _upstream_causal_mask(*args, **kwargs)
    if mask is None or mask.ndim != 4:
        return mask
    if mask.shape[1] != 1:
        raise ValueError(f"expected a (b, 1, q, k) causal mask, got {tuple(mask.shape)}")
    return mask[:, 0]


def mpt_alibi_tensor(num_heads: int, sequence_length: int, alibi_bias_max: float = 8, device=None) -> Tensor:
    """MPT's bias ``(h, 1, L)`` float32: ``slope * (j - (L - 1))`` for keys ``j < L``. It depends
    on the config only: built once per (heads, length, max bias, device) and shared (read-only)."""

    def make() -> Tensor:
        slopes = alibi_slopes(num_heads, device, max_bias=float(alibi_bias_max))
        distance = torch.arange(1 - sequence_length, 1, device=device, dtype=torch.float32)
        return slopes[:, None, None] * distance[None, None, :]

    return _constant(("mpt", num_heads, sequence_length, float(alibi_bias_max), torch.device(device or "cpu")), make)


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
    if alibi.shape[-1] != k_len:
        raise ValueError(f"ALiBi bias covers {alibi.shape[-1]} keys, attention has {k_len}")
    # HF's mask: additive float (0 = attend) or bool (True = attend); derived once per forward.
    keep, cache = _keep_mask(attention_mask, lambda m: m if m.dtype == torch.bool else m == 0, alibi)
    heads = self.num_heads
    dropout = self.attention_dropout.p if self.training else 0.0
    context = _attend(q, k, v, keep, cache, alibi, "bloom", lambda: alibi.view(batch, heads, -1),  # (b*h,1,k) -> (b,h,k)
                      scale=self.inv_norm_factor, dropout_p=dropout)
    context = context.transpose(1, 2).reshape(batch, q_len, self.hidden_size)  # (b, s, h*d)
    output = F.dropout(self.dense(context), p=self.hidden_dropout, training=self.training) + residual
    return output, None


def falcon_attention_forward(
    self: nn.Module,
    hidden_states: Tensor,
    alibi: Tensor | None,
    attention_mask: Tensor | None,
    position_ids: Tensor | None = None,
    layer_past: Any = None,
    use_cache: bool = False,
    output_attentions: bool = False,
    position_embeddings: Any = None,
    **kwargs: Any,
) -> tuple[Tensor, Tensor | None]:
    """``FalconAttention.forward`` for ALiBi models with torchembed's ALiBi attention.

    Computes upstream's sdpa path, ``softmax(q k^T / sqrt(d) + alibi / sqrt(d) | mask) v``.

    Args:
        hidden_states: ``(b, q, hidden)``.
        alibi: ``(b * h, 1, k)`` key bias (:func:`falcon_alibi_tensor`).
        attention_mask: ``(b, q, k)`` from :func:`falcon_causal_mask` or ``(b, 1, q, k)``; bool
            (True = attend) or additive float (0 = attend); None: causal.

    Returns:
        ``(dense(context) (b, q, hidden), None)``; with ``output_attentions`` upstream's eager
        forward runs on the unfolded mask and returns its ``(b, h, q, k)`` probabilities.

    Raises:
        ValueError: no ``alibi``, a 4-D float mask (upstream's fold, which already holds the
            bias), or a bias that does not cover the keys (e.g. a static cache).
    """
    if alibi is None:
        raise ValueError("torchembed's Falcon ALiBi attention needs the alibi bias (config.alibi=True)")
    if attention_mask is not None and attention_mask.ndim == 4 and attention_mask.dtype != torch.bool:
        raise ValueError(
            "got a 4-D float attention mask, which upstream's FalconModel.forward folds the ALiBi bias into; "
            "patch the whole model (torchembed.patch), not only its attention"
        )
    if output_attentions:
        mask = _additive_mask(attention_mask, hidden_states, alibi.shape[-1])
        return type(self).forward(
            self, hidden_states, alibi, mask, position_ids, layer_past, use_cache, output_attentions, position_embeddings, **kwargs
        )
    batch, q_len, _ = hidden_states.shape
    q, k, v = _falcon_qkv(self, hidden_states)
    if layer_past is not None:
        k, v = layer_past.update(k, v, self.layer_idx)
    k_len = k.shape[-2]
    if alibi.shape[-1] != k_len:
        raise ValueError(f"ALiBi bias covers {alibi.shape[-1]} keys, attention has {k_len}")
    keep, cache = _keep_mask(attention_mask, _falcon_keep, alibi)
    scale, heads = self.inv_norm_factor, self.num_heads
    dropout = self.attention_dropout.p if self.training else 0.0
    context = _attend(q, k, v, keep, cache, alibi, ("falcon", scale),
                      lambda: alibi.view(batch, heads, k_len).to(torch.float32) * scale,  # upstream: alibi / sqrt(d)
                      scale=scale, dropout_p=dropout)
    context = context.transpose(1, 2).reshape(batch, q_len, self.num_heads * self.head_dim)  # (b, q, h*d)
    return self.dense(context), None


def _falcon_qkv(attn: nn.Module, hidden_states: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """q ``(b, h, s, d)`` and k, v ``(b, kv, s, d)`` as upstream's ``FalconAttention.forward``
    (``kv`` = 1 for multi-query; ``new_decoder_architecture`` already repeats kv to ``h``)."""
    query, key, value = attn._split_heads(attn.query_key_value(hidden_states))  # (b, s, heads, d)
    # upstream reshapes these (b, heads, s, d) views to their own shape: the same views
    return query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)


def _repeat_kv(x: Tensor, num_heads: int) -> Tensor:
    """``(b, kv, s, d) -> (b, h, s, d)``, each kv head shared by ``h / kv`` query heads (a
    stride-0 view for multi-query, ``kv = 1``; upstream's SDPA broadcasts the same way)."""
    batch, kv, length, dim = x.shape
    if kv == num_heads:
        return x
    if kv == 1:  # multi-query: one view
        return x.expand(batch, num_heads, length, dim)
    if num_heads % kv:
        raise ValueError(f"{num_heads} query heads are not a multiple of {kv} key/value heads")
    return x[:, :, None].expand(batch, kv, num_heads // kv, length, dim).reshape(batch, num_heads, length, dim)


def _falcon_keep(mask: Tensor) -> Tensor:
    """``(b, 1, q, k)`` bool keep mask from Falcon's ``(b, q, k)`` or ``(b, 1, q, k)`` mask."""
    if mask.ndim == 3:
        mask = mask[:, None]
    return mask if mask.dtype == torch.bool else mask == 0


def _additive_mask(attention_mask: Tensor | None, hidden_states: Tensor, k_len: int) -> Tensor:
    """Upstream's eager form of the mask: ``(b or 1, 1, q, k)`` in the model dtype, 0 = attend,
    the finite minimum elsewhere (causal, queries last, when ``attention_mask`` is None)."""
    if attention_mask is None:
        q_len = hidden_states.shape[1]
        keep = torch.ones(q_len, k_len, dtype=torch.bool, device=hidden_states.device).tril(k_len - q_len)[None, None]
    else:
        keep = _falcon_keep(attention_mask)
    zero = torch.zeros((), dtype=hidden_states.dtype, device=hidden_states.device)
    return torch.where(keep, zero, torch.finfo(hidden_states.dtype).min)


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
    if position_bias is not None and position_bias.shape[-1] < k_len:
        raise ValueError(
            f"{k_len} keys exceed MPT's ALiBi table of {position_bias.shape[-1]} positions (config.max_seq_len)"
        )
    # MPT's mask is True where masked. No anchor: the ALiBi table outlives the forward (a constant).
    keep, cache = _keep_mask(attention_mask, torch.logical_not, None)
    heads = self.n_heads

    def key_bias() -> Tensor:  # (h, 1, L) -> (1, h, k); zeros for MPT without ALiBi
        if position_bias is None:
            return k.new_zeros(1, heads, k_len, dtype=torch.float32)
        return position_bias[None, :, 0, -k_len:]

    dropout = self.attn_dropout_p if self.training else 0.0
    context = _attend(q, k, v, keep, cache, position_bias, ("mpt", k_len), key_bias, scale=self.softmax_scale,
                      dropout_p=dropout)
    context = context.transpose(1, 2).reshape(batch, q_len, -1)  # (b, s, h*d)
    return self.out_proj(context), None


# One MaskCache per live HF mask tensor: a forward has one per device of a split model (see
# torchembed.patches.devices); each caller keeps its own cache object. Entries whose mask died
# are dropped when the table is full.
_MASKS: dict[int, MaskCache] = {}
_MASKS_MAX = 8


def _per_forward(cache: MaskCache | None, source: Tensor | None, tag: Any, make: Any) -> Tensor:
    """``make()`` once per forward (``cache.memo``; every layer gets the same ``source``); without
    a cache or a source, on every call."""
    return make() if cache is None or source is None else cache.memo(source, tag, make)


def _attend(q: Tensor, k: Tensor, v: Tensor, keep: Tensor | None, cache: MaskCache | None, source: Tensor | None,
            tag: Any, key_bias: Any, *, scale: float, dropout_p: float) -> Tensor:
    """ALiBi attention of one patched layer, ``(b, h, q, d)``.

    ``key_bias()`` builds the ``(b or 1, h, k)`` float32 bias from ``source``, the bias tensor every
    layer of the forward receives; it and what derives from it are built once per forward (``tag``
    names the family's derivation). Decode (one query, no dropout) is host-bound: one lookup of the
    forward's SDPA mask, then SDPA, which broadcasts a multi-query kv head as upstream's does.
    Prefill goes to :func:`alibi_attention` (its fused kernels take ``h`` kv heads).
    """
    if q.shape[-2] == 1 and dropout_p == 0.0:
        mask = _per_forward(cache, source, (tag, "decode", q.dtype), lambda: alibi_decode_bias(key_bias(), keep, q.dtype))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    heads = q.shape[1]
    k, v = _repeat_kv(k, heads), _repeat_kv(v, heads)
    return alibi_attention(q, k, v, _per_forward(cache, source, tag, key_bias), keep, scale=scale, dropout_p=dropout_p,
                           cache=cache)


def _keep_mask(attention_mask: Tensor | None, to_keep: Any, anchor: Tensor | None) -> tuple[Tensor | None, MaskCache | None]:
    """``keep`` (True = attend) for HF's mask and the cache of this forward, shared by its layers.

    The cache is keyed by the mask tensor or, when there is none (sdpa masks are skipped for
    unpadded batches), by ``anchor``: a bias tensor built anew for each forward and handed to every
    layer (not one that outlives the forward: its cache would keep growing). So what is derived per
    forward (key bias, bias columns, decode mask) is derived once, not per layer.
    """
    if torch.compiler.is_compiling():  # no Python-side caches in a graph (id() of a traced tensor breaks it)
        return (None if attention_mask is None else to_keep(attention_mask)), None
    source = attention_mask if attention_mask is not None else anchor
    if source is None:
        return None, None
    cache = _MASKS.get(id(source))
    if cache is None or cache.lookup(source) is None:
        if len(_MASKS) >= _MASKS_MAX:
            for key in [key for key, entry in _MASKS.items() if not entry.alive()]:  # forward over
                del _MASKS[key]
            if len(_MASKS) >= _MASKS_MAX:
                _MASKS.clear()
        keep = None if attention_mask is None else to_keep(attention_mask)
        cache = _MASKS[id(source)] = MaskCache().store(source, keep)
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
            ShareDeviceCopies(),
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
            ShareDeviceCopies(),
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
        adapters=(
            RebindForwardGlobals(
                "FalconModel", {"build_alibi_tensor": falcon_alibi_tensor, "create_causal_mask": falcon_causal_mask}
            ),
            OverrideForward("FalconAttention", falcon_attention_forward),
            ShareDeviceCopies(),
        ),
        description=(
            "build_alibi_tensor -> torchembed ALiBi (float32 slopes, not folded into the mask); "
            "attention -> fused ALiBi attention (upstream's sdpa function)"
        ),
        reference_attn="sdpa",  # upstream eager adds the bias twice
    )
)
