"""``from_pretrained``: load an HF checkpoint with transformers, then patch it."""

from __future__ import annotations

import os
from typing import Any

from torch import nn

from torchembed.patches.core import patch

__all__ = ["from_pretrained", "model_class_for"]

_ENCODERS = {"bert"}


def model_class_for(config: Any) -> Any:
    """The transformers class a checkpoint was saved from (``config.architectures``), else an Auto class."""
    import transformers

    for name in getattr(config, "architectures", None) or []:
        cls = getattr(transformers, name, None)
        if cls is not None:
            return cls
    return transformers.AutoModel if config.model_type in _ENCODERS else transformers.AutoModelForCausalLM


def from_pretrained(name_or_path: str | os.PathLike[str], fused: bool | None = None, **hf_kwargs: Any) -> nn.Module:
    """Load ``name_or_path`` (hub id or local directory) with transformers and :func:`patch` it.

    ``hf_kwargs`` go to ``from_pretrained`` (``torch_dtype``/``dtype``, ``device_map``,
    ``attn_implementation``, ...). ``model_class=`` picks the transformers class explicitly.
    """
    import transformers

    model_class = hf_kwargs.pop("model_class", None)
    if model_class is None:
        config = transformers.AutoConfig.from_pretrained(name_or_path, **{k: v for k, v in hf_kwargs.items() if k in ("revision", "trust_remote_code", "token", "cache_dir", "local_files_only")})
        model_class = model_class_for(config)
    model = model_class.from_pretrained(name_or_path, **hf_kwargs)
    return patch(model, fused=fused)
