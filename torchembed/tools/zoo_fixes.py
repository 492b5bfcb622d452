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

CONFIG: dict[str, ConfigFix] = {
    # Gemma 4 audio: the mel width is subsampling_conv_channels[0] (the projection takes channels[0] // 4 x
    # channels[1] features after two stride-2 convolutions); 16 mel bins, as the generic audio has
    "gemma4_audio": {"subsampling_conv_channels": [16, 8]},
}


def _gemma3n_audio(model: nn.Module) -> dict[str, Tensor]:
    from torchembed.tools.zoo import AUDIO_FRAMES

    mel = torch.randn(1, AUDIO_FRAMES, model.config.input_feat_size, generator=torch.Generator().manual_seed(2))
    return {"audio_mel": mel, "audio_mel_mask": torch.zeros(1, AUDIO_FRAMES, dtype=torch.bool)}


INPUTS: dict[str, Callable[[nn.Module], dict[str, Tensor]]] = {
    "gemma3n_audio": _gemma3n_audio,  # Gemma 3n's audio encoder: a required audio_mel_mask, True where padded
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
