"""Per-model-type fixes to the zoo's generic tiny models (:mod:`torchembed.tools.zoo`).

The zoo makes a tiny config of every model type from its config class by generic rules. Where a
class's defaults cannot be shrunk by those rules, or a model's forward takes inputs the generic
builder does not make, one entry here says what differs, and why:

* :data:`CONFIG`: ``model_type -> overrides``. A dict is merged into the generic keyword arguments
  (a dict value into a sub-config's dict, recursively); a callable ``fix(default, kwargs)`` edits
  them in place (``default``: the class-default config, for reading what this release has).
* :data:`INPUTS`: ``model_type -> inputs(model)``, the tiny inputs to run the built model on
  (replacing :func:`torchembed.tools.zoo.tiny_inputs`' generic choice).

Keep entries in alphabetical order, each with a comment naming the upstream rule it satisfies.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Union

import torch
from torch import Tensor, nn

__all__ = ["CONFIG", "INPUTS", "apply_config_fix"]

ConfigFix = Union[dict[str, Any], Callable[[Any, dict[str, Any]], None]]


def _mllama_config(default: Any, kwargs: dict[str, Any]) -> None:
    """Mllama: one tile per image (its tile embeddings are per aspect ratio of max_num_tiles), the tower's
    output the last hidden state and each of intermediate_layers_indices' stacked, and self-attention (the
    rotary layers) between the cross-attention ones; 4.x's rotary embedding reads rope_scaling["rope_type"],
    None by default."""
    _merge(kwargs, {"vision_config": {"max_num_tiles": 1, "supported_aspect_ratios": [[1, 1]], "attention_heads": 4,
                                      "num_global_layers": 2, "intermediate_layers_indices": [1, 3], "vision_output_dim": 3 * 64},
                    "text_config": {"cross_attention_layers": [1, 3]}})
    if getattr(default.text_config, "rope_scaling", {}) is None:
        kwargs["text_config"]["rope_scaling"] = {"rope_type": "default"}


CONFIG: dict[str, ConfigFix] = {
    # Aria: its projector has learned queries per number of patches (1225 or 4900); the tiny image has 4
    "aria": {"projector_patch_to_query_dict": {4: 4}},
    # DeepSeek-VL hybrid: its SAM tower's neck and projection widths (256, then x 2 and x 4) follow output_channels
    "deepseek_vl_hybrid": {"high_res_vision_config": {"output_channels": 16}},
    # Granite 4 Vision: its Q-Former projectors need a window rate and which vision layers feed which
    # LLM layers (no defaults); the 2 x 2 patches of the tiny image make one window, pooled to 1 x 1
    "granite4_vision": {"downsample_rate": "1/2", "deepstack_layer_map": [[-1, 0], [-2, 2]],
                        "spatial_target_layers": [0, 1, 2, 3]},
    # InternVL: image and patch sizes are (height, width) pairs, which the generic rules leave at 448 / 14
    "internvl": {"vision_config": {"image_size": 16, "patch_size": 8}},
    # Mistral 3: its projector squeezes the merged patches of one image, so it needs more than one (a 4 x 4 grid)
    "mistral3": {"vision_config": {"image_size": 32}},
    "mistral_large4": {"vision_config": {"image_size": 32}},  # Mistral 3's tower and projector
    "mllama": _mllama_config,  # tiles, tower outputs, cross-attention layers (see there)
    # Qianfan-OCR: InternVL's tower
    "qianfan_ocr": {"vision_config": {"image_size": 16, "patch_size": 8}},
    # VipLLaVA: the tower's hidden states it concatenates, [-2, -5, -8, -11, 6] of 24 layers; 5 of the tiny 4 layers'
    "vipllava": {"vision_feature_layers": [-1, -2, -3, -4, 1]},
}


def _idefics(model: nn.Module) -> dict[str, Tensor]:
    """IDEFICS' images enter by cross-attention (no image token): one image, and which tokens attend to it (all)."""
    from torchembed.tools.zoo import SPECIAL_IDS

    config, gen = model.config, torch.Generator().manual_seed(0)
    size, seq_len = config.vision_config.image_size, 12
    return {"input_ids": torch.randint(3, config.vocab_size - SPECIAL_IDS, (1, seq_len), generator=gen),
            "pixel_values": torch.randn(1, 1, config.vision_config.num_channels, size, size, generator=gen),
            "image_attention_mask": torch.ones(1, seq_len, 1, dtype=torch.long)}


def _mllama(model: nn.Module) -> dict[str, Tensor]:
    """Mllama's images enter by cross-attention: one image of one tile, its aspect ratio (id 1: 1 x 1)
    and which tokens attend to it (all), after its image token."""
    from torchembed.tools.zoo import SPECIAL_IDS

    config, gen = model.config, torch.Generator().manual_seed(0)
    size, seq_len = config.vision_config.image_size, 12
    ids = torch.randint(3, config.text_config.vocab_size - SPECIAL_IDS, (1, seq_len), generator=gen)
    ids[0, 2] = config.image_token_id
    return {"input_ids": ids, "pixel_values": torch.randn(1, 1, 1, config.vision_config.num_channels, size, size, generator=gen),
            "aspect_ratio_ids": torch.tensor([[1]]), "aspect_ratio_mask": torch.ones(1, 1, 1, dtype=torch.long),
            "cross_attention_mask": torch.ones(1, seq_len, 1, 1, dtype=torch.long)}


INPUTS: dict[str, Callable[[nn.Module], dict[str, Tensor]]] = {
    "idefics": _idefics,
    "mllama": _mllama,
}


def _merge(into: dict[str, Any], values: dict[str, Any]) -> None:
    for key, value in values.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


def apply_config_fix(model_type: str, default: Any, kwargs: dict[str, Any]) -> None:
    """Apply :data:`CONFIG`'s entry for ``model_type`` (if any) to ``kwargs``, in place."""
    fix = CONFIG.get(model_type)
    if fix is None:
        return
    if callable(fix):
        fix(default, kwargs)
    else:
        _merge(kwargs, fix)
