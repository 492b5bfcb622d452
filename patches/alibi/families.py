"""ALiBi families (BLOOM, MPT, Falcon with ``alibi=True``): torchembed's slopes, bias and attention.

Upstream builds the bias in key-only form (``slope * position_of_key``), which differs from the paper's
``-slope * |i - j|`` by a per-row constant that softmax ignores. torchembed's builders keep that form, computed in
float32 from :func:`torchembed.functional.alibi_slopes` (the slopes of ``ALiBiEmbedding``), zero at the newest key and
non-positive, so the values that matter most for a causal row are the smallest and round least in low precision.

* BLOOM: ``BloomModel.build_alibi_tensor`` and, where transformers builds the bias inline without a mask, the slopes it
  uses (``_get_alibi_slopes``), per instance.
* MPT: ``MptModel.build_mpt_alibi_tensor``, per instance.
* Falcon: releases hand the bias to the attention differently (4.57-5.24: an ``alibi`` argument beside a mask with
  the bias folded in; 5.25: only the folded ``(b, h, q, k)`` mask), so ``build_alibi_tensor`` is rebound for the
  instance to :func:`falcon_no_model_bias`: every release passes the plain causal mask, from which the patched attention
  derives the bias once per forward (:func:`falcon_key_bias`). Upstream rounds Falcon's slopes to bfloat16 even in
  float32 models; torchembed does not. The patched attention computes upstream's **sdpa** path whatever
  ``attn_implementation`` says: upstream's eager path before 5.25 adds the bias a second time on top of the folded mask
  (an upstream bug), hence the registry's ``reference_attn="sdpa"`` (what ``torchembed compare`` uses).

All three also get torchembed's attention forward, per instance: ALiBi inside one fused Triton kernel
(:func:`torchembed.kernels.attention.alibi_flash`: the bias computed in the kernel, grouped kv heads read in place,
split-key decode steps, nothing quadratic materialised) or, where that measured faster (small prefills) or
``cudnn_decode=True`` asks for it (decode steps), SDPA with a row-centred bias built once per forward
(:func:`torchembed.kernels.route.alibi_path` decides). ``output_attentions=True`` and BLOOM's ``slow_but_exact``
tensor-parallel emulation fall back to upstream's forward. On a model split over devices, the layers of each device
share one copy of the mask and bias (:mod:`torchembed.patches.devices`).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from torchembed.functional.alibi import alibi_key_bias, alibi_slopes
from torchembed.kernels.alibi import alibi_attention, causal_keep
from torchembed.kernels.per_forward import current, derive
from torchembed.patches.actions import AddForwardPreHook, Component
from torchembed.patches.adapters import (KeepGenerationCache, OverrideMethod, ReplaceForward, ReplaceGlobals, modules_of,
                                        qualname, require_params)
from torchembed.patches.decode_graphs import ReplayDecodeSteps
from torchembed.patches.devices import ShareDeviceCopies
from torchembed.patches.errors import StructureError
from torchembed.patches import kv_cache
from torchembed.patches.kv_cache import CACHE_KEYWORDS
from torchembed.patches.registry import Family, PatchOptions, register

__all__ = ["AlibiOptions", "InstanceConstants", "bloom_alibi_tensor", "falcon_key_bias", "falcon_no_model_bias", "mpt_alibi_tensor"]


class InstanceConstants:
    """What a patched model derives from its config alone (the slopes, MPT's bias table), built once per (heads,
    length, device) instead of at every forward (a host-to-device copy and a few launches per decode step) and kept per
    model instance: at most :attr:`LIMIT` entries, the oldest dropped. Inside a graph that ``torch.compile`` traces
    nothing is kept (the graph builds them). A copy of the model (deep copy, pickle) starts empty."""

    LIMIT = 4

    def __init__(self) -> None:
        self._kept: dict[tuple, Tensor] = {}

    def get(self, key: tuple, make: Any) -> Tensor:
        if torch.compiler.is_compiling():
            return make()
        value = self._kept.get(key)
        if value is None:
            if len(self._kept) >= self.LIMIT:
                try:  # (threads may drop the same oldest entry at once: either does)
                    self._kept.pop(next(iter(self._kept)), None)
                except (StopIteration, RuntimeError):
                    pass
            value = self._kept[key] = make()
        return value

    def __len__(self) -> int:
        return len(self._kept)

    def __deepcopy__(self, memo: dict) -> "InstanceConstants":
        return InstanceConstants()

    def __reduce__(self) -> tuple:
        return (InstanceConstants, ())


def _slopes(constants: InstanceConstants | None, num_heads: int, device: torch.device) -> Tensor:
    make = lambda: alibi_slopes(num_heads, device)  # noqa: E731
    return make() if constants is None else constants.get(("slopes", num_heads, device), make)


def bloom_alibi_tensor(attention_mask: Tensor, num_heads: int, dtype: torch.dtype, *,
                       constants: InstanceConstants | None = None) -> Tensor:
    """BLOOM's bias from a ``(b, k)`` mask: ``(b * h, 1, k)`` float32 (torchembed's BLOOM
    attention consumes it in float32; ``dtype`` is ignored). ``constants``: the model's."""
    batch, length = attention_mask.shape
    slopes = _slopes(constants, num_heads, attention_mask.device)
    return alibi_key_bias(slopes, attention_mask).reshape(batch * num_heads, 1, length)


def falcon_no_model_bias(attention_mask: Tensor, num_heads: int, dtype: torch.dtype) -> None:
    """``build_alibi_tensor`` for a patched ``FalconModel.forward``: no bias at model level, so every release passes
    its attention the plain causal mask, from which the patched attention derives the bias (:func:`falcon_key_bias`)."""
    return None


def falcon_key_bias(attention_mask: Tensor | None, num_heads: int, k_len: int, device: torch.device, *,
                    constants: InstanceConstants | None = None) -> Tensor:
    """Falcon's ALiBi bias in key-only form, ``(b or 1, h, k)`` float32, from the layer's causal mask.

    Falcon counts key positions over the keys that are not padding (``cumsum`` of the 2-D mask); those are exactly the
    keys the last query row of the causal mask attends, so the bias is :func:`alibi_key_bias` of that row (up to a
    constant per row, which softmax ignores). A static cache's keys past the newest token are masked in that row too
    and get no weight either way.

    Args:
        attention_mask: ``(b, q, k)`` or ``(b, 1, q, k)``, bool (True = attend) or additive float
            (0 = attend); None: no padding (plain causal attention).
        num_heads: h; ``k_len``: keys; ``device``: where the slopes live; ``constants``: the model's.
    """
    slopes = _slopes(constants, num_heads, device)
    if attention_mask is None:
        return alibi_key_bias(slopes, key_len=k_len)
    row = attention_mask[..., -1, :]  # the newest query's row: (b, 1, k) or (b, k)
    last_row = (row if row.dtype == torch.bool else row == 0).reshape(row.shape[0], -1)  # (b, k) keys it attends
    return alibi_key_bias(slopes, last_row)


def mpt_alibi_tensor(num_heads: int, sequence_length: int, alibi_bias_max: float = 8, device=None, *,
                     constants: InstanceConstants | None = None) -> Tensor:
    """MPT's bias ``(h, 1, L)`` float32: ``slope * (j - (L - 1))`` for keys ``j < L``. It depends on the config only:
    built once per (heads, length, max bias, device) and kept in the model's ``constants`` (read-only)."""

    def make() -> Tensor:
        slopes = alibi_slopes(num_heads, device, max_bias=float(alibi_bias_max))
        return alibi_key_bias(slopes, key_len=sequence_length).transpose(0, 1)  # (1, h, L) -> (h, 1, L)

    if constants is None:
        return make()
    return constants.get(("mpt", num_heads, sequence_length, float(alibi_bias_max), torch.device(device or "cpu")), make)


class BoundBuilder:
    """A family's bias builder with one model's :class:`InstanceConstants` bound (what a patched model
    calls as its ``build_alibi_tensor``/``build_mpt_alibi_tensor``); picklable, named as the function."""

    def __init__(self, function: Any) -> None:
        self.function, self.constants = function, InstanceConstants()
        self.__module__, self.__qualname__, self.__name__ = function.__module__, function.__qualname__, function.__name__
        self.__doc__ = function.__doc__

    def __call__(self, *args: Any, **kwargs: Any) -> Tensor:
        return self.function(*args, constants=self.constants, **kwargs)

    def __reduce__(self) -> tuple:
        return (BoundBuilder, (self.function,))

    def __repr__(self) -> str:
        return f"<{self.__qualname__} of one model ({len(self.constants)} constants kept)>"


class OverrideBuilder(OverrideMethod):
    """:class:`OverrideMethod` whose replacement gets each module's own :class:`InstanceConstants`."""

    def plan(self, model: nn.Module, config: Any, options: PatchOptions, family: Family) -> list[Any]:
        actions = super().plan(model, config, options, family)
        for action in actions:
            action.value = BoundBuilder(self.replacement)
        return actions


# Keyed by the upstream forward functions (a handful per process, alive as long as their classes). A dict, not
# functools.cache: torch.compile traces through a cached function (and warns), while it reads the dict.
_POSITIONAL_NAMES: dict[Any, tuple[str, ...]] = {}


def _arguments(module: nn.Module, args: tuple, kwargs: dict) -> dict[str, Any]:
    """Upstream forward's arguments after ``self`` by name (positional ones mapped through its signature, the names
    cached per function): the patched forwards accept whatever each release passes."""
    if not args:  # (what the releases' layers pass: keywords after the hidden states, read only here)
        return kwargs
    method = type(module).forward
    names = _POSITIONAL_NAMES.get(method)
    if names is None:
        params = inspect.signature(method).parameters.values()
        names = tuple(p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))[1:]
        _POSITIONAL_NAMES[method] = names
    return {**dict(zip(names, args)), **kwargs}


def _cache_of(arguments: dict[str, Any]) -> Any:
    """The KV cache among the arguments, under whichever name the release gives it; None without one."""
    for name in CACHE_KEYWORDS:
        cache = arguments.get(name)
        if cache is not None:
            return cache
    return None


def _cache_update(arguments: dict[str, Any], k: Tensor, v: Tensor, layer_idx: int) -> tuple[Tensor, Tensor]:
    """``k``, ``v`` as they are without a KV cache among the ``arguments``; else :func:`kv_cache.update
    <torchembed.patches.kv_cache.update>` as each release calls the cache (4.x passes ``cache_position`` for static
    caches), told that ``k``, ``v`` are strided views of the fused query-key-value projection."""
    cache = _cache_of(arguments)
    if cache is None:
        return k, v
    position = arguments.get("cache_position")
    extra = () if position is None else ({"cache_position": position},)
    return kv_cache.update(cache, k, v, layer_idx, *extra, strided_copy=True)


def _upstream(module: nn.Module, args: tuple, kwargs: dict, **changed: Any) -> Any:
    """Upstream's forward with the same arguments (``changed`` ones replaced by name)."""
    if not changed:
        return type(module).forward(module, *args, **kwargs)
    return type(module).forward(module, **{**_arguments(module, args, kwargs), **changed})


def bloom_attention_forward(self: nn.Module, *args: Any, options: AlibiOptions | None = None,
                            **kwargs: Any) -> tuple[Tensor, Tensor | None]:
    """``BloomAttention.forward`` with torchembed's ALiBi attention (same inputs and outputs; ``options``:
    the patch's choices and the model's constants, see :func:`_attention`).

    Upstream's forward runs instead for ``output_attentions``, a ``head_mask`` (4.x) and the
    ``slow_but_exact`` tensor-parallel emulation, with the bias in the model dtype it expects.
    """
    a = _arguments(self, args, kwargs)
    hidden_states, residual, alibi, attention_mask = a["hidden_states"], a["residual"], a["alibi"], a.get("attention_mask")
    if a.get("output_attentions") or a.get("head_mask") is not None or (self.pretraining_tp > 1 and self.slow_but_exact):
        return _upstream(self, args, kwargs, alibi=alibi.to(hidden_states.dtype))  # upstream's baddbmm: model dtype
    batch, q_len, _ = hidden_states.shape
    q, k, v = self._reshape(self.query_key_value(hidden_states))  # (b, h, s, d) views
    k, v = _cache_update(a, k, v, self.layer_idx)
    k_len = k.shape[-2]
    if alibi.shape[-1] != k_len:
        raise ValueError(f"ALiBi bias covers {alibi.shape[-1]} keys, attention has {k_len}")
    # HF's mask: additive float (0 = attend) or bool (True = attend); 4.x slices it to the keys.
    if attention_mask is not None and attention_mask.shape[-1] != k_len:
        attention_mask = attention_mask[..., :k_len]
    heads = self.num_heads
    dropout = self.attention_dropout.p if self.training else 0.0
    context = _attention(q, k, v, attention_mask, _bloom_keep, alibi, "bloom",
                         lambda: alibi.view(batch, heads, -1),  # (b*h,1,k) -> (b,h,k)
                         scale=self.inv_norm_factor, dropout_p=dropout, options=options)
    context = context.transpose(1, 2).reshape(batch, q_len, self.hidden_size)  # (b, s, h*d)
    output = F.dropout(self.dense(context), p=self.hidden_dropout, training=self.training) + residual
    return output, None


def falcon_attention_forward(self: nn.Module, *args: Any, options: AlibiOptions | None = None,
                             **kwargs: Any) -> tuple[Tensor, Tensor | None]:
    """``FalconAttention.forward`` for ALiBi models with torchembed's ALiBi attention (``options``: the patch's
    choices and the model's constants, see :func:`_attention`).

    Computes upstream's sdpa path, ``softmax(q k^T / sqrt(d) + alibi / sqrt(d) | mask) v``, with the bias derived from
    the mask (:func:`falcon_key_bias`); an ``alibi`` argument (4.57-5.24, None under a patched model) is not read.
    Upstream arguments used: ``hidden_states`` ``(b, q, hidden)``; ``attention_mask`` ``(b, 1, q, k)`` or ``(b, q, k)``,
    bool (True = attend) or additive float (0 = attend), None: causal; the cache under the release's name.

    Returns:
        ``(dense(context) (b, q, hidden), None)``; with ``output_attentions`` or a ``head_mask`` upstream's eager
        forward runs (:func:`_falcon_upstream`) and returns its ``(b, h, q, k)`` probabilities.

    Raises:
        ValueError: a mask with the bias folded in (``(b, h, q, k)`` float, what upstream's model forward builds when
            it is not patched).
    """
    a = _arguments(self, args, kwargs)
    hidden_states, attention_mask = a["hidden_states"], a.get("attention_mask")
    if attention_mask is not None and attention_mask.ndim == 4 and attention_mask.dtype != torch.bool and attention_mask.shape[1] != 1:
        raise ValueError(
            "got a (b, heads, q, k) float attention mask, which upstream's FalconModel.forward folds the ALiBi bias "
            "into; patch the whole model (torchembed.patch), not only its attention"
        )
    if a.get("output_attentions") or a.get("head_mask") is not None:
        return _falcon_upstream(self, args, kwargs, a, options)
    batch, q_len, _ = hidden_states.shape
    q, k, v = _falcon_qkv(self, hidden_states)
    k, v = _cache_update(a, k, v, self.layer_idx)
    k_len = k.shape[-2]
    scale, heads = self.inv_norm_factor, self.num_heads
    dropout = getattr(self.attention_dropout, "p", self.attention_dropout) if self.training else 0.0  # 5.25: a float
    constants = options.constants if options is not None else None
    context = _attention(q, k, v, attention_mask, _falcon_keep, attention_mask, ("falcon", scale, k_len),
                         lambda: falcon_key_bias(attention_mask, heads, k_len, q.device, constants=constants) * scale,
                         scale=scale, dropout_p=dropout, options=options)  # (upstream: alibi / sqrt(d))
    context = context.transpose(1, 2).reshape(batch, q_len, self.num_heads * self.head_dim)  # (b, q, h*d)
    return self.dense(context), None


def _falcon_upstream(self: nn.Module, args: tuple, kwargs: dict, a: dict[str, Any], options: AlibiOptions) -> Any:
    """Upstream's eager ``FalconAttention.forward`` (attention weights, head masks) on what this release expects,
    computing the same function as the patched path: 4.57-5.24 take the key bias as ``alibi`` ``(b * h, 1, k)`` beside
    the unfolded additive mask; 5.25 takes it folded into a ``(b, h, q, k)`` mask in the model dtype, as its
    ``FalconModel.forward`` builds it."""
    hidden_states, attention_mask = a["hidden_states"], a.get("attention_mask")
    past = _cache_of(a)
    k_len = hidden_states.shape[1] + (past.get_seq_length(self.layer_idx) if past is not None else 0)
    if attention_mask is not None:
        k_len = attention_mask.shape[-1]
    constants = options.constants if options is not None else None
    bias = falcon_key_bias(attention_mask, self.num_heads, k_len, hidden_states.device, constants=constants)  # (b or 1, h, k)
    mask = _additive_mask(attention_mask, hidden_states, k_len)  # (b or 1, 1, q, k)
    if "alibi" in _parameter_names(type(self).forward):
        batch = hidden_states.shape[0]
        alibi = bias.expand(batch, -1, -1).reshape(batch * self.num_heads, 1, k_len)
        return _upstream(self, args, kwargs, alibi=alibi, attention_mask=mask)
    folded = (bias[:, :, None, :] * self.inv_norm_factor).to(hidden_states.dtype)
    folded = folded.masked_fill(mask < 0, torch.finfo(hidden_states.dtype).min)
    return _upstream(self, args, kwargs, attention_mask=folded)


def _falcon_qkv(attn: nn.Module, hidden_states: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """q ``(b, h, s, d)`` and k, v ``(b, kv, s, d)``: views of ``query_key_value``'s output in the layout every
    release reads it (``kv`` = 1 for multi-query; new_decoder_architecture: each kv group's queries, then its key and
    value; otherwise q, k, v interleaved per head)."""
    batch, seq = hidden_states.shape[:2]
    fused, heads, dim = attn.query_key_value(hidden_states), attn.num_heads, attn.head_dim  # (b, s, parts * d)
    if attn.new_decoder_architecture:
        grouped = fused.view(batch, seq, attn.num_kv_heads, -1, dim)  # (b, s, kv, group + 2, d)
        q, k, v = grouped[..., :-2, :].flatten(2, 3), grouped[..., -2, :], grouped[..., -1, :]
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if attn.multi_query:
        parts = fused.view(batch, seq, heads + 2, dim).transpose(1, 2)  # (b, h + 2, s, d)
        return parts[:, :heads], parts[:, heads:heads + 1], parts[:, heads + 1:]
    q, k, v = fused.view(batch, seq, heads, 3, dim).permute(3, 0, 2, 1, 4).unbind()  # (3, b, h, s, d): the fewest ops
    return q, k, v


def _bloom_keep(mask: Tensor) -> Tensor:
    """BLOOM's mask as a keep mask: bool (True = attend) as it is, additive float: 0 = attend."""
    return mask if mask.dtype == torch.bool else mask == 0


def _falcon_keep(mask: Tensor) -> Tensor:
    """``(b, 1, q, k)`` bool keep mask from Falcon's ``(b, q, k)`` or ``(b, 1, q, k)`` mask."""
    return _bloom_keep(mask[:, None] if mask.ndim == 3 else mask)


def _additive_mask(attention_mask: Tensor | None, hidden_states: Tensor, k_len: int) -> Tensor:
    """Upstream's eager form of the mask: ``(b or 1, 1, q, k)`` in the model dtype, 0 = attend, the finite minimum
    elsewhere (causal, queries last, when ``attention_mask`` is None)."""
    if attention_mask is None:
        keep = causal_keep(hidden_states.shape[1], k_len, hidden_states.device)
    else:
        keep = _falcon_keep(attention_mask)
    zero = torch.zeros((), dtype=hidden_states.dtype, device=hidden_states.device)
    return torch.where(keep, zero, torch.finfo(hidden_states.dtype).min)


def mpt_attention_forward(self: nn.Module, *args: Any, options: AlibiOptions | None = None,
                          **kwargs: Any) -> tuple[Tensor, Tensor | None]:
    """``MptAttention.forward`` with torchembed's ALiBi attention (same inputs and outputs; ``options``: the patch's
    choices and the model's constants, see :func:`_attention`).

    Upstream's ``MptAttention`` always returns its attention weights; ``MptBlock`` does not pass ``output_attentions``
    down. :class:`AttentionWeightsRequest` (a pre-hook on each block) records whether the block was asked for them,
    and then upstream's forward runs and returns them.
    """
    if getattr(self, WEIGHTS_REQUESTED, False):
        return type(self).forward(self, *args, **kwargs)
    a = _arguments(self, args, kwargs)
    hidden_states, position_bias, attention_mask = a["hidden_states"], a.get("position_bias"), a.get("attention_mask")
    batch, q_len = hidden_states.shape[:2]
    qkv = self.Wqkv(hidden_states)
    if self.clip_qkv:
        qkv = qkv.clamp(min=-self.clip_qkv, max=self.clip_qkv)
    # (b, s, 3*h*d) -> three (b, h, s, d)
    q, k, v = (t.reshape(batch, q_len, self.n_heads, self.head_dim).transpose(1, 2) for t in qkv.chunk(3, dim=2))
    k, v = _cache_update(a, k, v, self.layer_idx)
    k_len = k.shape[-2]
    if position_bias is not None and position_bias.shape[-1] < k_len:
        raise ValueError(f"{k_len} keys exceed MPT's ALiBi table of {position_bias.shape[-1]} positions "
                         "(config.max_seq_len)")
    if attention_mask is not None and attention_mask.shape[-1] != k_len:  # 4.x: a longer static-cache mask
        attention_mask = attention_mask[..., -k_len:]
    heads = self.n_heads

    def key_bias() -> Tensor:  # (h, 1, L) -> (1, h, k); zeros for MPT without ALiBi
        if position_bias is None:
            return k.new_zeros(1, heads, k_len, dtype=torch.float32)
        return position_bias[None, :, 0, -k_len:]

    dropout = self.attn_dropout_p if self.training else 0.0
    # MPT's mask is True where masked
    context = _attention(q, k, v, attention_mask, torch.logical_not, position_bias, ("mpt", k_len),
                         key_bias, scale=self.softmax_scale, dropout_p=dropout, options=options)
    context = context.transpose(1, 2).reshape(batch, q_len, -1)  # (b, s, h*d)
    return self.out_proj(context), None


WEIGHTS_REQUESTED = "_torchembed_attention_weights_requested"


class AttentionWeightsRequest:
    """Forward pre-hook (with kwargs) of an ``MptBlock``: tells its attention whether this call was asked for attention
    weights (``output_attentions``), which the block does not pass on."""

    replayable = True  # (a graphed decode step never asks for attention weights: the flag it sets is the same)

    def __init__(self, position: int) -> None:
        self.position = position  # index of output_attentions among the block's positional args

    def __call__(self, block: nn.Module, args: tuple, kwargs: dict) -> None:
        requested = kwargs.get("output_attentions", args[self.position] if len(args) > self.position else False)
        setattr(block.attn, WEIGHTS_REQUESTED, bool(requested))


class RequestAttentionWeights:
    """Adapter: an :class:`AttentionWeightsRequest` pre-hook on every module of ``class_name``."""

    def __init__(self, class_name: str) -> None:
        self.class_name = class_name

    def plan(self, model: nn.Module, config: Any, options: PatchOptions, family: Family) -> list[AddForwardPreHook]:
        actions = []
        for path, module in modules_of(model, self.class_name):
            where = f"{type(module).__qualname__}.forward"
            require_params(family, where, type(module).forward, ("self", "output_attentions"))
            if not isinstance(getattr(module, "attn", None), nn.Module):
                raise StructureError(family.name, type(module).__qualname__, "an attention submodule `attn`", "none")
            params = [p.name for p in inspect.signature(type(module).forward).parameters.values()]
            hook = AttentionWeightsRequest(params.index("output_attentions") - 1)
            component = Component(path, "alibi-attention", f"{qualname(type(module))} output_attentions",
                                  qualname(AttentionWeightsRequest))
            actions.append(AddForwardPreHook(component, module, hook))
        return actions


def _attention(q: Tensor, k: Tensor, v: Tensor, attention_mask: Tensor | None, to_keep: Any, source: Tensor | None,
               tag: Any, key_bias: Any, *, scale: float, dropout_p: float, options: "AlibiOptions | None") -> Tensor:
    """ALiBi attention of one patched layer, ``(b, h, q, d)``; ``k``, ``v`` may have fewer heads: the policy's
    (:func:`torchembed.kernels.alibi.alibi_attention` with ``layer=True``), with what this forward derives once for all
    its layers kept in its :class:`~torchembed.kernels.per_forward.PerForward` (none outside a patched model's
    forward): ``to_keep`` makes HF's mask a keep mask, ``key_bias()`` builds the ``(b or 1, h, k)`` float32 bias from
    ``source``, the tensor every layer receives (``tag`` names the family's derivation)."""
    cache = current()
    keep, bias = derive(cache, (attention_mask, source), tag, _keep_and_bias, attention_mask, to_keep, key_bias)
    fused, sdpa_decode = (options.fused, options.sdpa_decode) if options is not None else (None, False)
    return alibi_attention(q, k, v, bias, keep, scale=scale, dropout_p=dropout_p, cache=cache, fused=fused, layer=True,
                           sdpa_decode=sdpa_decode)


def _keep_and_bias(attention_mask: Tensor | None, to_keep: Any, key_bias: Any) -> tuple[Tensor | None, Tensor]:
    return None if attention_mask is None else to_keep(attention_mask), key_bias()


def _parameter_names(fn: Any) -> tuple[str, ...]:
    try:  # (None, or a callable without a signature: no names)
        return tuple(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return ()


class AlibiOptions:
    """What a patched ALiBi model's attention forwards share: the patch's ``fused`` and decode choice (``sdpa_decode``:
    the patch's ``cudnn_decode``) and the model's :class:`InstanceConstants`."""

    __slots__ = ("fused", "sdpa_decode", "constants")

    def __init__(self, fused: bool | None, sdpa_decode: bool = False) -> None:
        self.fused, self.sdpa_decode, self.constants = fused, sdpa_decode, InstanceConstants()

    def __reduce__(self) -> tuple:
        return (AlibiOptions, (self.fused, self.sdpa_decode))

    def __repr__(self) -> str:
        return f"AlibiOptions(fused={self.fused}, sdpa_decode={self.sdpa_decode})"


class AlibiForward(functools.partial):
    """A family's patched attention forward with one model's :class:`AlibiOptions` bound: called as
    ``forward(module, *args, **kwargs)`` (a ``functools.partial``: no Python frame of its own in every layer's call);
    picklable and deep-copyable (rebuilt from the module-level function and the choices), named as the function."""

    def __new__(cls, forward: Any, options: AlibiOptions) -> "AlibiForward":
        self = super().__new__(cls, forward, options=options)
        self.__module__, self.__qualname__, self.__name__ = forward.__module__, forward.__qualname__, forward.__name__
        self.__doc__ = forward.__doc__
        return self

    @property
    def forward(self) -> Any:
        return self.func

    @property
    def options(self) -> AlibiOptions:
        return self.keywords["options"]

    def __reduce__(self) -> tuple:
        return (AlibiForward, (self.func, self.options))

    def __repr__(self) -> str:
        return f"<{self.__qualname__} {self.options}>"


class ReplaceAlibiForward(ReplaceForward):
    """:class:`ReplaceForward` whose forwards (every layer of one model) share one :class:`AlibiOptions`."""

    def plan(self, model: nn.Module, config: Any, options: PatchOptions, family: Family) -> list[Any]:
        shared = AlibiOptions(options.fused, options.cudnn_decode)
        bound = ReplaceForward(self.class_name, AlibiForward(self.forward, shared), self.requires,
                               self.cache_any_of, self.kind)
        return bound.plan(model, config, options, family)


_ATTENTION_NEEDS = {  # what the replaced forwards read from upstream's arguments
    "bloom": ("hidden_states", "residual", "alibi", "attention_mask"),
    "mpt": ("hidden_states", "position_bias", "attention_mask"),
    "falcon": ("hidden_states", "attention_mask"),
}


def _falcon_alibi(config: Any) -> bool:
    return bool(getattr(config, "alibi", False))


register(Family(
    model_type="bloom", encoding="alibi",
    adapters=(
        OverrideBuilder("BloomModel", "build_alibi_tensor", bloom_alibi_tensor, ("attention_mask", "num_heads", "dtype")),
        ReplaceGlobals("BloomModel", required={}, optional={"_get_alibi_slopes": alibi_slopes}),  # same signature
        ReplaceAlibiForward("BloomAttention", bloom_attention_forward, _ATTENTION_NEEDS["bloom"], CACHE_KEYWORDS),
        ShareDeviceCopies(),
        ReplayDecodeSteps(),
    ),
    description="build_alibi_tensor / slopes -> torchembed ALiBi; attention -> fused ALiBi attention",
))
register(Family(
    model_type="mpt", encoding="alibi",
    adapters=(
        OverrideBuilder("MptModel", "build_mpt_alibi_tensor", mpt_alibi_tensor,
                        ("num_heads", "sequence_length", "alibi_bias_max", "device")),
        ReplaceAlibiForward("MptAttention", mpt_attention_forward, _ATTENTION_NEEDS["mpt"], CACHE_KEYWORDS),
        RequestAttentionWeights("MptBlock"),
        ShareDeviceCopies(),
        KeepGenerationCache(),
        ReplayDecodeSteps(),
    ),
    description=("build_mpt_alibi_tensor -> torchembed ALiBi; attention -> fused ALiBi attention; generate keeps a KV "
                 "cache (MptConfig turns it off)"),
))
register(Family(
    model_type="falcon", encoding="alibi", variant="alibi", applies=_falcon_alibi,
    adapters=(
        ReplaceGlobals("FalconModel", {"build_alibi_tensor": falcon_no_model_bias}),
        ReplaceAlibiForward("FalconAttention", falcon_attention_forward, _ATTENTION_NEEDS["falcon"], CACHE_KEYWORDS),
        ShareDeviceCopies(),
    ),
    description=("build_alibi_tensor -> none (not folded into the mask); attention -> fused ALiBi attention "
                 "with torchembed's float32 bias (upstream's sdpa function)"),
    reference_attn="sdpa",  # upstream eager adds the bias twice
))
