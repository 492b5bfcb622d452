"""RoPE families (LLaMA, Mistral, Falcon with rotary): torchembed's angles and rotation.

Two components per model:

* the model's rotary module (``LlamaRotaryEmbedding`` ...) becomes :class:`HFRotaryEmbedding`:
  same frequencies for every ``rope_type`` (from :mod:`torchembed.functional`). Where the fused
  kernel will rotate (Triton, a CUDA device, no attention scaling) it returns the position ids and
  ``inv_freq`` themselves and the kernel computes the angles (no cos/sin tables are made or read);
  elsewhere float32 half tables ``(b, s, r/2)`` instead of upstream's duplicated ``(b, s, d)``
  tables rounded to the activation dtype;
* each attention module's ``apply_rotary_pos_emb`` (a module global in HF) is rebound, for that
  instance only, to torchembed's rotation: the fused Triton kernel (q and k in one launch) where
  it can run, the float32 PyTorch reference elsewhere. Both round once, so bf16 results are at
  least as close to float64 as upstream's (which rounds cos/sin and each product to bf16).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from torchembed import kernels
from torchembed.functional.rope import apply_rotary, rope_cos_sin, rope_inv_freq
from torchembed.patches.actions import Component, OverrideAttribute, SwapModule, bind
from torchembed.patches.rebind import rebind_globals
from torchembed.patches.registry import Family, PatchOptions, register

__all__ = ["HFRotaryEmbedding", "make_apply_rotary_pos_emb", "rope_parameters_of"]


def qualname(obj: Any) -> str:
    cls = obj if isinstance(obj, type) else type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def rope_parameters_of(config: Any) -> dict[str, Any]:
    """The HF rope parameters of a config, 5.x (``rope_parameters``) or 4.x (``rope_theta``/``rope_scaling``)."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and "rope_type" in params:
        return dict(params)
    params = dict(getattr(config, "rope_scaling", None) or {})
    params["rope_type"] = params.pop("type", params.get("rope_type", "default"))
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return params


class HFRotaryEmbedding(nn.Module):
    """Drop-in for an HF rotary module: ``forward(x, position_ids) -> (cos, sin)``.

    Returns what the patched attention's rotation (:func:`make_apply_rotary_pos_emb`) reads:

    * ``(position_ids, inv_freq)`` (int ``(b, s)``, float32 ``(r/2,)``; ``r`` = rotary dim) when
      ``angles_in_kernel`` is set, the fused kernel can run on ``x`` and the rope type has no
      attention scaling: the kernel computes ``cos``/``sin`` of ``position_ids * inv_freq`` in
      float32 itself, so no tables are made or read;
    * float32 half tables ``(b, s, r/2)`` otherwise.

    Length-dependent rope types behave as upstream: ``dynamic`` grows the base once a sequence
    exceeds ``max_position_embeddings`` and resets below it; ``longrope`` switches to the long
    factors past ``original_max_position_embeddings``. No parameters, no persistent buffers:
    ``state_dict`` is unchanged by the swap.
    """

    def __init__(self, config: Any, device: torch.device | str | None = None, angles_in_kernel: bool = True) -> None:
        super().__init__()
        self.config = config
        self.angles_in_kernel = angles_in_kernel
        self.rope_parameters = rope_parameters_of(config)
        self.rope_type = self.rope_parameters.get("rope_type", "default")
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        factor = self.rope_parameters.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
        self.rotary_dim = int(head_dim * factor)
        self.max_position_embeddings = config.max_position_embeddings
        self.max_seq_len_cached = self.original_max_seq_len = config.max_position_embeddings
        inv_freq, self.attention_scaling = self._inv_freq(device=device)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("original_inv_freq", inv_freq.clone(), persistent=False)
        if self.rope_type == "longrope":
            original = self.rope_parameters["original_max_position_embeddings"]
            long_inv_freq, _ = self._inv_freq(seq_len=original + 1, device=device)
            self.register_buffer("long_inv_freq", long_inv_freq, persistent=False)

    def _inv_freq(self, seq_len: int | None = None, device=None) -> tuple[Tensor, float]:
        return rope_inv_freq(
            self.rotary_dim,
            rope_parameters=self.rope_parameters,
            max_position_embeddings=self.max_position_embeddings,
            seq_len=seq_len,
            device=device,
        )

    @torch.no_grad()
    def forward(self, x: Tensor, position_ids: Tensor, layer_type: str | None = None) -> tuple[Tensor, Tensor]:
        """``x`` gives the device; ``position_ids`` ``(b, s)`` -> ``(position_ids, inv_freq)`` for the
        kernel, or ``(cos, sin)`` each ``(b, s, r/2)`` float32 (see the class docstring)."""
        if layer_type is not None:
            raise ValueError("per-layer-type rope (layer_type=...) is not supported by torchembed's rotary module")
        position_ids = position_ids.to(self.inv_freq.device)
        if self.rope_type == "dynamic":
            self._dynamic_update(position_ids)
        elif self.rope_type == "longrope":
            original = self.rope_parameters["original_max_position_embeddings"]
            long = torch.max(position_ids) + 1 > original
            self.inv_freq.copy_(torch.where(long, self.long_inv_freq, self.original_inv_freq))
        if self.angles_in_kernel and self.attention_scaling == 1.0 and kernels.kernel_can_run(x):
            return position_ids, self.inv_freq
        return rope_cos_sin(self.inv_freq, position_ids, self.attention_scaling)

    def _dynamic_update(self, position_ids: Tensor) -> None:
        # Mirrors transformers' `dynamic_frequency_update` (a host sync, as upstream).
        seq_len = int(torch.max(position_ids)) + 1
        if seq_len > self.max_seq_len_cached:
            inv_freq, self.attention_scaling = self._inv_freq(seq_len=seq_len, device=self.inv_freq.device)
            self.register_buffer("inv_freq", inv_freq, persistent=False)
            self.max_seq_len_cached = seq_len
        if seq_len < self.original_max_seq_len and self.max_seq_len_cached > self.original_max_seq_len:
            self.register_buffer("inv_freq", self.original_inv_freq.clone(), persistent=False)
            self.max_seq_len_cached = self.original_max_seq_len

    def extra_repr(self) -> str:
        return (f"rope_type={self.rope_type!r}, rotary_dim={self.rotary_dim}, scaling={self.attention_scaling:g}, "
                f"angles_in_kernel={self.angles_in_kernel}")


@functools.lru_cache(maxsize=None)
def make_apply_rotary_pos_emb(fused: bool | None, upstream: Callable[..., Any]) -> Callable[..., tuple[Tensor, Tensor]]:
    """torchembed's ``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)`` (HF's signature).

    ``q``: ``(b, h, s, d)`` (``unsqueeze_dim=1``) or ``(b, s, h, d)`` (``unsqueeze_dim=2``), ``k``
    likewise with its own head count; ``cos``/``sin``: what :class:`HFRotaryEmbedding` returns,
    integer position ids ``(b, s)`` and ``inv_freq`` ``(r/2,)`` (angles computed in the kernel, or
    here where it cannot run) or float32 half tables ``(b, s, r/2)``. Upstream's duplicated
    ``(b, s, d)`` tables are passed to ``upstream``.
    One function per (fused, upstream), so patched models share their rebound attention code.
    """
    use_triton = fused is not False and kernels.triton_available()

    def apply_rotary_pos_emb(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, unsqueeze_dim: int = 1):
        angles = not cos.is_floating_point()  # (position_ids, inv_freq)
        if not angles and cos.shape[-1] == q.shape[-1]:  # an upstream table, not ours
            return upstream(q, k, cos, sin, unsqueeze_dim)
        if use_triton and kernels.kernel_can_run(q):
            if unsqueeze_dim == 2:  # (b, s, h, d): view as (b, h, s, d)
                q_out, k_out = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
                return q_out.transpose(1, 2), k_out.transpose(1, 2)
            if not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad)) and not torch.compiler.is_compiling():
                # Inference: rotate the fresh projections in place, no checks (the inputs are
                # ours): the per-layer host cost is one kernel launch.
                return kernels.rotary_angles_(q, k, cos, sin) if angles else kernels.rotary_tables_(q, k, cos, sin)
            if angles:
                return kernels.rotary_fused(q, k, inv_freq=sin, positions=cos)
            return kernels.rotary_fused(q, k, cos, sin)
        if angles:  # the kernel cannot run on this device (e.g. a layer offloaded to the CPU)
            cos, sin = rope_cos_sin(sin, cos)
        cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)

    apply_rotary_pos_emb.__qualname__ = "torchembed.apply_rotary_pos_emb"
    return apply_rotary_pos_emb


class SwapRotaryModule:
    """Replace every module whose class is one of ``class_names`` by :class:`HFRotaryEmbedding`."""

    def __init__(self, *class_names: str) -> None:
        self.class_names = class_names

    def plan(self, model: nn.Module, config: Any, options: PatchOptions) -> list[SwapModule]:
        actions = []
        for parent_path, parent in model.named_modules():
            for name, child in parent.named_children():
                if type(child).__name__ in self.class_names:
                    device = getattr(child, "inv_freq", torch.empty(0)).device
                    new = HFRotaryEmbedding(getattr(child, "config", config), device=None if device.type == "meta" else device,
                                            angles_in_kernel=options.fused is not False)
                    path = f"{parent_path}.{name}" if parent_path else name
                    component = Component(path, "rope", qualname(child), qualname(new))
                    actions.append(SwapModule(component, parent, name, new))
        return actions


class RebindRotation:
    """Rebind ``apply_rotary_pos_emb`` in the forward of every attention module of ``class_names``."""

    global_name = "apply_rotary_pos_emb"

    def __init__(self, *class_names: str) -> None:
        self.class_names = class_names

    def plan(self, model: nn.Module, config: Any, options: PatchOptions) -> list[OverrideAttribute]:
        actions, rebound = [], {}
        for path, module in model.named_modules():
            cls = type(module)
            if cls.__name__ not in self.class_names:
                continue
            if cls not in rebound:
                original = cls.forward
                upstream = original.__globals__[self.global_name]
                apply = make_apply_rotary_pos_emb(options.fused, upstream)
                rebound[cls] = (rebind_globals(original, {self.global_name: apply}), upstream)
            fn, upstream = rebound[cls]
            component = Component(path, "rope-apply", f"{upstream.__module__}.{self.global_name}", "torchembed.apply_rotary_pos_emb")
            actions.append(OverrideAttribute(component, module, "forward", bind(fn, module)))
        return actions


def _falcon_rotary(config: Any) -> bool:
    return not getattr(config, "alibi", False)


for _model_type, _prefix in (("llama", "Llama"), ("mistral", "Mistral")):
    register(
        Family(
            model_type=_model_type,
            encoding="rope",
            adapters=(SwapRotaryModule(f"{_prefix}RotaryEmbedding"), RebindRotation(f"{_prefix}Attention")),
            description=f"{_prefix}RotaryEmbedding -> HFRotaryEmbedding; apply_rotary_pos_emb -> fused RoPE",
        )
    )

register(
    Family(
        model_type="falcon",
        encoding="rope",
        variant="rotary",
        applies=_falcon_rotary,
        adapters=(SwapRotaryModule("FalconRotaryEmbedding"), RebindRotation("FalconAttention", "FalconFlashAttention2")),
        description="FalconRotaryEmbedding -> HFRotaryEmbedding; apply_rotary_pos_emb -> fused RoPE",
    )
)
