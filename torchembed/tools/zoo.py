"""Tiny random-weight models of every model type with a rotary component in the installed transformers.

Which model types have one is read from the code, not from a list: a model type qualifies when its
modeling code (or that of its default sub-models: the text model of a vision-language model, its
vision tower ...) defines a rotary-embedding class or a rope-named function, and the tiny model
built from it then holds such a module (:func:`rotary_modules`). Causal LMs, vision-language models
(built whole, vision tower included), encoders, MoE, hybrid state-space and latent-attention
models alike.

Configs are made generically from each config class: its defaults, with every size-like attribute
it or its sub-configs have (hidden size, heads, layers, vocabulary, experts, low-rank dims, patch
and image sizes ...) set small, so a model builds and runs on a CPU in milliseconds. The search for
a config that runs is done once per release of transformers and torch (its result is kept in the
cache folder, ``$TORCHEMBED_CACHE/zoo``; ``TORCHEMBED_ZOO_CACHE=0`` searches afresh). Weights are drawn with a variance-preserving init
(:func:`strong_init`) instead of HF's ``initializer_range=0.02``, under which attention is nearly
uniform and a wrong rotation barely moves the logits. Inputs (:func:`tiny_inputs`) are token ids,
plus a tiny image where the model has a vision tower (tiny audio where it has an audio tower), so that
the tower's rotation runs too; an audio model's own inputs are tiny audio in the layout it takes.

Used by ``torchembed list --all`` (what is patched and why not), ``torchembed compare --all`` and
the tests (:func:`zoo_case`: the model and the inputs to run).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import math
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from torchembed.tools.zoo_fixes import INPUTS, RUNS, apply_config_fix
from torchembed.tools.zoo_inputs import _AUDIO, SPECIAL_IDS, _clip, _parts_only, _quiet, _tensors, generic_inputs

__all__ = [
    "SMALL", "FP32_REL_TOL", "ModelTypeStatus", "TinyModelError", "ZooCase", "model_types", "rotary_model_types",
    "rotary_code_of", "text_model_types", "generic_tiny_config", "model_class", "build_tiny", "strong_init",
    "tiny_inputs", "zoo_case", "rotary_modules", "rotation_code", "count_calls", "outputs_of", "matches",
    "status_of", "survey", "survey_counts", "STATES",
]

#: attribute -> small value; an attribute is set only where the config (or a sub-config) has it.
SMALL: dict[str, Any] = {
    "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "num_hidden_layers": 4, "intermediate_size": 128, "vocab_size": 128, "max_position_embeddings": 128,
    # mixture of experts; every token goes to every expert, so that no top-k choice flips between
    # two runs that round differently (bf16 against float64 would then measure the flips)
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 4,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "n_shared_experts": 1,
    "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "moe_num_experts": 4, "moe_k": 4,
    "moe_topk": 4, "moe_top_k": 4, "num_shared_experts": 1, "expert_intermediate_size": 32,
    # multi-head latent attention (DeepSeek-V2/V3 and kin)
    "q_lora_rank": 32, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16,
    # windows and other lengths that must stay below max_position_embeddings
    "sliding_window": 32, "attention_chunk_size": 32, "original_max_position_embeddings": 64,
    "rotary_dim": 8,  # GPT-J / CodeGen: rotated features per head
    # state-space layers of hybrid models (their CPU path materialises chunk x chunk x state tensors)
    "mamba_d_state": 16, "mamba_n_heads": 4, "n_mamba_heads": 4, "mamba_d_head": 16, "mamba_chunk_size": 16, "mamba_d_ssm": 64,
    "mamba_n_groups": 1, "ssm_state_size": 16, "state_size": 16, "chunk_size": 16, "n_groups": 1,
    "mamba_headdim": 16, "time_step_rank": 8, "mamba_expand": 1,
    # hybrid models: attention (and MoE) every other layer of the 4 (Jamba's period 8, offset 4 has none)
    "attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2, "expert_layer_offset": 1,
    # vision and audio towers: width, depth, a 16 x 16 image of 8 x 8 patches
    "depth": 2, "embed_dim": 64, "num_heads": 4, "out_hidden_size": 64, "image_size": 16, "patch_size": 8,
    "vision_output_dim": 64, "projector_input_dim": 64, "projector_output_dim": 64, "mm_tokens_per_image": 4,
    "num_mel_bins": 16, "encoder_layers": 2, "decoder_layers": 2, "encoder_attention_heads": 4,
    "decoder_attention_heads": 4, "d_model": 64, "encoder_ffn_dim": 128, "decoder_ffn_dim": 128,
    "num_filters": 8,  # audio codecs' first convolution (SEANet: Mimi, EnCodec ...), doubled at each downsampling
    # not a size: the LayerScale of Mimi's (and kin's) transformer layers, 0.01 by default, which leaves
    # those layers (and their rotation) almost out of the outputs of a random-weight model
    "layer_scale_initial_scale": 1.0,
    # token ids inside the small vocabulary
    "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
}
FP32_REL_TOL = 1e-5  # float32 logits: patched within this of upstream (relative to the largest |logit|)
MAX_PARAMETERS = 20_000_000  # a tiny model runs in milliseconds on a CPU
MAX_SECONDS = 30.0  # ... its build and one forward well inside this on a busy machine (a slower one: a size not shrunk)
_RECOMPUTED = ("layer_types", "mlp_layer_types", "no_rope_layers", "layers_block_type")  # per-layer lists
_DERIVED = ("per_layer_config",)  # rebuilt by the config class from the (shrunk) layer types: never passed
_ALWAYS = ("head_dim", "num_key_value_heads", "num_experts_per_tok", "vocab_size")
_DEPTHS = ("num_hidden_layers", "depth", "num_layers", "encoder_layers")  # what layer-index lists index
# the last: retrieval models (ColPali, ColQwen2, ColModernVBert) are in no other mapping
_TASKS = ("MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES", "MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES",
          "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "MODEL_FOR_MASKED_LM_MAPPING_NAMES", "MODEL_MAPPING_NAMES",
          "MODEL_FOR_PRETRAINING_MAPPING_NAMES", "MODEL_FOR_DECISION_MAPPING_NAMES",  # JEV's decision head: no other class
          # vision models with a task head and no bare model class (CHMv2, EoMT-DINOv3, PP-DocLayoutV2)
          "MODEL_FOR_DEPTH_ESTIMATION_MAPPING_NAMES", "MODEL_FOR_UNIVERSAL_SEGMENTATION_MAPPING_NAMES",
          "MODEL_FOR_OBJECT_DETECTION_MAPPING_NAMES",
          # 4.x maps Granite Speech and Qwen2.5-Omni only here
          "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES", "MODEL_FOR_TEXT_TO_WAVEFORM_MAPPING_NAMES")


# -- which model types ---------------------------------------------------------------------------------


def model_types() -> list[str]:
    """Every model type (config class) of the installed transformers, sorted."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return sorted(CONFIG_MAPPING_NAMES)


def text_model_types() -> list[str]:
    """Every model type with a causal-LM class in the installed transformers, sorted."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


_ROTARY_CLASS = re.compile(r"^class\s+(\w*(?:Rotary|RoPE|Rope(?![a-z]))\w*)\s*[(:]", re.M)
_ROTARY_FUNCTION = re.compile(r"^\s*def\s+(\w*(?:rotary|(?:^|_)rope(?:_|\b))\w*)\s*\(", re.M | re.I)


@functools.lru_cache(maxsize=None)
def _rotary_code(module_name: str) -> tuple[str, ...]:
    """Rotary classes and rope-named functions defined in the modeling files of a models package
    (read as text: importing every modeling module would take minutes)."""
    source = _modeling_text(module_name)
    return tuple(dict.fromkeys(_ROTARY_CLASS.findall(source) + _ROTARY_FUNCTION.findall(source)))


@functools.lru_cache(maxsize=None)
def _sub_model_types(model_type: str) -> tuple[str, ...]:
    """The model types of a composite config's default sub-configs (text model, vision tower ...)."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    try:
        cls = CONFIG_MAPPING[model_type]
        if not getattr(cls, "sub_configs", None):
            return ()
        with _quiet():
            config = AutoConfig.for_model(model_type)
    except Exception:  # noqa: BLE001 - a config class that cannot be made with its defaults
        return ()
    # an optional sub-config (None by default: Gemma 4 unified's vision and audio towers) by its class
    subs = (getattr(config, key, None) or config.sub_configs[key] for key in config.sub_configs)
    return tuple(dict.fromkeys(t for t in (getattr(s, "model_type", None) for s in subs) if t and t != model_type))


@functools.lru_cache(maxsize=None)
def rotary_code_of(model_type: str) -> tuple[str, ...]:
    """The rotary classes/functions in the modeling code of ``model_type`` and its default sub-models."""
    from transformers.models.auto.configuration_auto import model_type_to_module_name

    module_name = model_type_to_module_name(model_type)
    names = list(_rotary_code(module_name))
    if not _modeling_text(module_name):  # no modeling code of its own (param2moe: Glm4Moe's classes)
        for other in _class_lenders(model_type):
            names += _rotary_code(model_type_to_module_name(other))
    for sub in _sub_model_types(model_type):
        names += rotary_code_of(sub)
    return tuple(dict.fromkeys(names))


@functools.lru_cache(maxsize=None)
def _class_lenders(model_type: str) -> tuple[str, ...]:
    """Other model types whose model classes transformers' auto mappings give ``model_type`` (a type
    with a config and no modeling code of its own: 5.25's param2moe is built as Glm4MoeForCausalLM)."""
    from transformers.models.auto import modeling_auto

    lenders = []
    for task in _TASKS:
        names = getattr(modeling_auto, task, None) or {}
        mine = names.get(model_type)
        if mine is not None:
            lenders += [t for t, cls in names.items() if cls == mine and t != model_type]
    return tuple(dict.fromkeys(lenders))


@functools.lru_cache(maxsize=None)
def rotary_model_types() -> tuple[str, ...]:
    """Every model type whose modeling code (or its default sub-models') has a rotary component."""
    return tuple(t for t in model_types() if rotary_code_of(t))


def has_model_class(model_type: str) -> bool:
    """Whether transformers' auto mappings map a model class to ``model_type`` (sub-configs such as a
    vision tower's often have none: they exist only inside their composite model)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    try:  # a mapped class that its package does not define (5.23's VoxtralRealtimeTextModel) is none
        _mapped_class(CONFIG_MAPPING[model_type], own=False)
    except KeyError:
        return False
    except Exception:  # noqa: BLE001 - one that does not import here: reported when the zoo builds it
        return True
    return True


@functools.lru_cache(maxsize=None)
def composites_of(model_type: str) -> tuple[str, ...]:
    """The model types whose default config holds ``model_type`` as a sub-config, or whose config class
    takes it as an optional one (None by default: Gemma 4 unified's audio embedder)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    def optional(parent: str) -> tuple[str, ...]:
        classes = (getattr(CONFIG_MAPPING[parent], "sub_configs", None) or {}).values()
        return tuple(getattr(c, "model_type", None) for c in classes)

    return tuple(t for t in model_types() if rotary_code_of(t) and model_type in _sub_model_types(t) + optional(t))


def rotary_modules(model: nn.Module) -> list[str]:
    """Paths of the modules of ``model`` that are rotary: a class named for it (``...Rotary...``,
    ``...RoPE...``) or a forward that calls a rope-named module-level function."""
    from torchembed.patches.rope.families import class_rotations

    found = []
    for path, module in model.named_modules():
        rotations = class_rotations(type(module))
        if (re.search(r"Rotary|RoPE|Rope(?![a-z])", type(module).__name__) or rotations.recognized
                or rotations.unrecognized or rotations.via_attribute):
            found.append(path)
    return found


def rotation_code(model: nn.Module) -> dict[Any, str]:
    """``{code object: name}`` of every rope-named module-level function that a forward of a module
    of ``model`` calls (upstream's rotation helpers, recognised or not), each function of its
    decorator chain included."""
    from torchembed.patches.rebind import chain, find_globals
    from torchembed.patches.rope.recognition import is_rotation_name, upstream_function

    def candidate(name: str, value: Any) -> bool:
        return is_rotation_name(name) and callable(value) and not isinstance(value, type)

    codes: dict[Any, str] = {}
    for cls in {type(module) for module in model.modules()}:
        forward = inspect.getattr_static(cls, "forward", None)
        if not callable(forward) or isinstance(forward, (staticmethod, classmethod)):
            continue
        for name, uses in find_globals(forward, candidate).items():
            for _, helper in uses:
                helper = upstream_function(helper)
                target = helper.forward if isinstance(helper, nn.Module) else helper
                codes.update({f.__code__: name for f in chain(target)})
    return codes


@contextlib.contextmanager
def count_calls(codes: dict[Any, str]) -> Iterator[dict[str, int]]:
    """``{name: calls}`` of the functions whose code is in ``codes``, counted while the block runs,
    whatever route calls them (a profile hook sees every Python frame)."""
    import sys

    counts: dict[str, int] = {}

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code in codes:
            name = codes[frame.f_code]
            counts[name] = counts.get(name, 0) + 1

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        yield counts
    finally:
        sys.setprofile(previous)


# -- configs -------------------------------------------------------------------------------------------


def generic_tiny_config(model_type: str) -> Any:
    """A small config of ``model_type``: the class defaults with :data:`SMALL` where it applies
    (a fresh copy; the search for a config that runs is done once per process, or read from disk).

    Raises:
        Exception: whatever the config class or upstream's forward raises for these values.
    """
    return copy.deepcopy(_tiny_config(model_type))


@functools.lru_cache(maxsize=None)
def _tiny_config(model_type: str) -> Any:
    return _build(model_type, _tiny_kwargs(model_type))


def _tiny_kwargs(model_type: str) -> dict[str, Any]:
    from transformers import AutoConfig

    with _quiet():
        default = AutoConfig.for_model(model_type)
    kwargs = _small_kwargs(default)
    for key in ("position_embedding_type", "position_embeddings_type"):
        kind = _attr(default, key)
        if isinstance(kind, str) and "rot" not in kind and "rope" not in kind and rotary_code_of(model_type):
            # ESM's default is absolute, Wav2Vec2-Conformer's relative; their checkpoints (some) rotate
            kwargs[key] = "rotary"
    apply_config_fix(model_type, default, kwargs)
    return kwargs


def _builds_without_rotary(model_type: str) -> bool:
    """Whether the model of the tiny config builds (on the meta device, not run) and holds no rotary
    module (GLM-Image's VQ-VAE, which shares its modeling file with GLM-Image, and has no forward)."""
    from transformers import AutoConfig

    try:
        with _quiet(), torch.device("meta"):
            config = AutoConfig.for_model(model_type, **_tiny_kwargs(model_type))
            model = model_class(config)(config)
    except Exception:  # noqa: BLE001 - no answer: the reason stays upstream's error
        return False
    return not rotary_modules(model)


def _small_kwargs(default: Any) -> dict[str, Any]:
    """Keyword arguments that make ``default``'s config class small (sub-configs as dicts)."""
    kwargs = {key: value for key, value in SMALL.items() if _has(default, key)}
    values = default.to_dict()
    for key, value in values.items():
        if _is_vocab(key, value):  # every other vocabulary (hash, byte-group, ...)
            kwargs.setdefault(key, SMALL["vocab_size"])
        elif isinstance(value, dict) and _is_sub_config(value):  # a sub-config (text, vision, encoder ...)
            kwargs[key] = _shrink(value)
    for key in _ALWAYS:  # None in some defaults, and read as is by the model
        if key not in kwargs and _settable(default, key) and _attr(default, key, missing := object()) is not missing:
            kwargs[key] = SMALL[key]
    if _attr(default, "head_dim") is not None and _attr(default, "head_dim") == _attr(default, "qk_rope_head_dim"):
        kwargs["head_dim"] = SMALL["qk_rope_head_dim"]  # MLA models: head_dim is the rotary part
    layers = SMALL["num_hidden_layers"]
    for key in _RECOMPUTED:
        value = _attr(default, key)
        if isinstance(value, (list, tuple)) and len(value) != layers and _settable(default, key):
            kinds = list(dict.fromkeys(value))  # every kind of layer the default has, in turn
            kwargs[key] = (kinds * layers)[:layers]
    _fit(values, kwargs)
    _follow(values, kwargs, _shrunk_sizes(values, kwargs, {}))
    for key in _DERIVED:
        kwargs.pop(key, None)
    if "attn_layer_indices" in values and not values["attn_layer_indices"]:  # Bamba's default: no attention layer
        kwargs["attn_layer_indices"] = [1, 3]
    return kwargs


_WIDTHS = ("hidden_size", "d_model", "embed_dim", "out_hidden_size", "intermediate_size")  # first: the widths
_DEPENDENT = re.compile(r"hidden|_dim$|_size$|channels|features|_groups$")  # groups: a depthwise convolution's


def _shrunk_sizes(original: dict[str, Any], small: dict[str, Any], sizes: dict[int, int]) -> dict[int, int]:
    """``{full-size value: tiny value}`` of the widths shrunk anywhere in the config tree."""
    for key in _WIDTHS:
        old, new = original.get(key), small.get(key)
        if isinstance(old, int) and isinstance(new, int) and old != new and old > SMALL["vocab_size"]:
            sizes.setdefault(old, new)
    for key, value in original.items():
        if isinstance(value, dict) and isinstance(small.get(key), dict):
            _shrunk_sizes(value, small[key], sizes)
    return sizes


def _follow(original: dict[str, Any], small: dict[str, Any], sizes: dict[int, int]) -> None:
    """Sizes left at a full-size width elsewhere in the tree (a projector's ``text_hidden_size``, a
    head's ``audio_hidden_size``, a ``condition_dim``) follow that width, in place."""
    for key, value in original.items():
        if isinstance(value, dict) and isinstance(small.get(key), dict):
            _follow(value, small[key], sizes)
        elif (isinstance(value, int) and not isinstance(value, bool) and value in sizes and key not in SMALL
                and small.get(key, value) == value and _DEPENDENT.search(key) and not _is_vocab(key, value)):
            small[key] = sizes[value]


def _is_sub_config(value: dict[str, Any]) -> bool:
    return any(k in SMALL for k in value) or "model_type" in value


def _shrink(values: dict[str, Any]) -> dict[str, Any]:
    """A sub-config's dict with :data:`SMALL` applied (recursively)."""
    out = {}
    layers = SMALL["num_hidden_layers"]
    for key, value in values.items():
        if key in _DERIVED:
            continue
        if key in SMALL and value is not None and not isinstance(value, (list, dict, bool)):
            out[key] = SMALL[key]
        elif _is_vocab(key, value):
            out[key] = SMALL["vocab_size"]
        elif isinstance(value, dict) and _is_sub_config(value):
            out[key] = _shrink(value)
        elif key in _RECOMPUTED and isinstance(value, list) and len(value) != layers:
            out[key] = (list(dict.fromkeys(value)) * layers)[:layers]
        else:
            out[key] = value
    # the text model of a composite uses multi-head latent attention (Kimi K2.5, Mistral Large 4): as many kv
    # heads as query heads (the variants of a top-level config try that), and head_dim the rotary part
    if "kv_lora_rank" in values and isinstance(out.get("num_key_value_heads"), int):
        out["num_key_value_heads"] = out.get("num_attention_heads", SMALL["num_attention_heads"])
    if isinstance(values.get("head_dim"), int) and values["head_dim"] == values.get("qk_rope_head_dim"):
        out["head_dim"] = SMALL["qk_rope_head_dim"]
    _fit(values, out)
    return out


def _fit(original: dict[str, Any], small: dict[str, Any]) -> None:
    """Make the values that depend on the sizes agree with the shrunk ones, in place: lists of layer
    indices, sections of the rotary features (M-RoPE), head counts, special token ids."""
    old_depth = next((original[k] for k in _DEPTHS if isinstance(original.get(k), int) and original[k] > 0), None)
    new_depth = next((small[k] for k in _DEPTHS if isinstance(small.get(k), int) and small[k] > 0), None)
    names = original.get("stage_names")
    if isinstance(names, list) and old_depth and new_depth and len(names) == old_depth + 1 != new_depth + 1:
        # a ViT backbone's stages are its stem and layers (DINOv3 in CHMv2): the class names the new
        # stages; its outputs are the same share of them
        small.pop("stage_names", None)
        small.pop("out_features", None)
        if isinstance(original.get("out_indices"), list):
            small["out_indices"] = sorted({max(1, v * new_depth // old_depth) for v in original["out_indices"]})
    for key, value in original.items():
        if (key not in small or small[key] is value) and _is_index_list(key, value, old_depth) and new_depth:
            # layer indices (deepstack, full-attention blocks, MoE layers): the same share of the new depth
            small[key] = sorted({min(new_depth - 1, v * new_depth // old_depth) for v in value})
        elif (old_depth and new_depth and old_depth > new_depth and isinstance(value, list) and len(value) == old_depth
                and key not in _RECOMPUTED and (key not in small or small[key] is value)
                and (key in SMALL or not any(isinstance(v, int) for v in value))):
            # one size (in SMALL) or rate per layer (Gemma 3n's intermediate sizes, activation sparsity): one per
            # tiny layer; other per-layer integers (Sapiens2's kv heads) are left to the model
            small[key] = [SMALL[key]] * new_depth if key in SMALL else [value[i * old_depth // new_depth] for i in range(new_depth)]
    shared = original.get("num_kv_shared_layers")
    if isinstance(shared, int) and 0 < shared < (old_depth or 0) and new_depth:  # Gemma 3n: the last layers reuse
        small["num_kv_shared_layers"] = new_depth // 2  # the kv of the first, which must hold every layer type
    vision, tiny_vision = original.get("vision_config"), small.get("vision_config")
    factor = next((original[k] for k in ("scale_factor", "pixel_shuffle_factor") if isinstance(original.get(k), int)), 1)
    tower = tiny_vision if isinstance(tiny_vision, dict) else small
    if factor > 1 and isinstance(tower.get("image_size"), int) and isinstance(tower.get("patch_size"), int):
        if (tower["image_size"] // tower["patch_size"]) % factor:  # a pixel shuffle folds factor x factor patches
            tower["image_size"] = tower["patch_size"] * factor
    pinpoints = original.get("image_grid_pinpoints")
    if isinstance(vision, dict) and isinstance(tiny_vision, dict) and isinstance(pinpoints, list) and pinpoints:
        # LLaVA-Next's anyres: the image resolutions it tiles, whole multiples of the tower's image size
        old_size, new_size = vision.get("image_size"), tiny_vision.get("image_size")
        if isinstance(old_size, int) and isinstance(new_size, int) and old_size != new_size:
            small["image_grid_pinpoints"] = [[max(1, round(v / old_size)) * new_size for v in point] for point in pinpoints]
    ratio = original.get("pixel_shuffle_ratio")
    if isinstance(ratio, float) and 0 < ratio < 1 and isinstance(small.get("hidden_size"), int) and "intermediate_size" in small:
        small["intermediate_size"] = int(small["hidden_size"] / ratio**2)  # Llama 4: the shuffled patches' width
    if isinstance(original.get("downsampling_ratios"), list):  # an audio codec's convolutional encoder
        for key in ("encoder_hidden_size", "num_filters"):  # its first convolution (DAC, X-Codec 2, VibeVoice)
            if isinstance(original.get(key), int):  # ... doubled at each downsampling: 128 at most at the end
                small[key] = max(1, 128 >> len(original["downsampling_ratios"]))
        if isinstance(original.get("depths"), list):
            small["depths"] = [1] * len(original["depths"])  # blocks per stage (VibeVoice's tokenizers)
    heads = small.get("num_attention_heads") or small.get("num_heads")
    for key in ("num_key_value_heads",):
        if isinstance(small.get(key), int) and heads and heads % small[key]:
            small[key] = heads
    if ("rope_scaling" in original and original["rope_scaling"] is None and "rope_parameters" not in original
            and "mrope_section" in _source_of(_config_class_of(original))):  # 4.x M-RoPE: sections in rope_scaling, no default
        small["rope_scaling"] = {"rope_type": "default", "mrope_section": [2, 3, 3]}
    rope_key = next((k for k in ("rope_parameters", "rope_scaling") if isinstance(small.get(k, original.get(k)), dict)), None)
    rope = small.get(rope_key, original.get(rope_key)) if rope_key else None
    head_dim = _head_dim({**original, **small})
    if head_dim:  # attention scales written for the full-size head dim: the tiny one's instead
        if isinstance(original.get("query_pre_attn_scalar"), (int, float)):
            small["query_pre_attn_scalar"] = head_dim
        if isinstance(original.get("attention_multiplier"), float):
            small["attention_multiplier"] = head_dim**-0.5
    for key, value in original.items():  # a rotary embedding the default config switches off (Zamba2's use_mem_rope)
        if key.startswith("use_") and ("rope" in key or "rotary" in key) and value is False:
            small[key] = True
    if isinstance(rope, dict) and head_dim:
        rope = small[rope_key] = dict(rope)
        factor = rope.get("partial_rotary_factor", original.get("partial_rotary_factor", 1.0))
        factor = factor if isinstance(factor, (int, float)) and 0 < factor <= 1 else 1.0
        sectioned = any("section" in k for k in rope) or any(
            "section" in k for k in getattr(_config_class_of(original), "ignore_keys_at_rope_validation", None) or ())
        if sectioned and factor < 1 and "head_dim" in small:  # room for three sections in the rotated part
            small["head_dim"] = head_dim = max(head_dim, int(SMALL["head_dim"] / factor))
        rotary = int(head_dim * factor)
        cls = _config_class_of(original)
        for key in getattr(cls, "ignore_keys_at_rope_validation", None) or ():
            if "section" in key and key not in rope:  # left to the modeling code's full-size default
                rope[key] = _sections([2, 3, 3], rotary // 2)  # (t, h, w) as Qwen2-VL's [16, 24, 24]
        for key, value in list(rope.items()):
            if "section" in key and isinstance(value, list) and value and all(isinstance(v, int) for v in value):
                rope[key] = _sections(value, rotary // 2)  # M-RoPE: the sections split the rotated features / 2
    vocab = small.get("vocab_size") if isinstance(small.get("vocab_size"), int) else SMALL["vocab_size"]
    taken = {i for k, v in small.items() if k in ("pad_token_id", "bos_token_id", "eos_token_id")
             for i in (v if isinstance(v, list) else [v])}  # a list of eos ids: GLM-ASR's text model
    spare = iter(i for i in range(vocab - 1, vocab - SPECIAL_IDS - 1, -1) if i not in taken)
    for key, value in original.items():  # image, video, audio, vision-start ... token ids
        # (an image token id left to the processor, MiniCPM-V's None, gets one too: the zoo writes the prompt)
        unset = value is None and key == "image_token_id" and "vision_config" in original
        large = (key.endswith(("token_id", "token_index")) and isinstance(value, int) and not isinstance(value, bool)
                 and value >= vocab)
        if (unset or large) and small.get(key, value) == value:
            small[key] = next(spare, vocab - 1)


def _source_of(config_class: Any) -> str:
    """The modeling files' text of the models package a config class belongs to ("" if none)."""
    module = getattr(config_class, "__module__", "") or ""
    parts = module.split(".")
    if len(parts) < 3 or parts[-3] != "models":
        return ""
    return _modeling_text(parts[-2])


@functools.lru_cache(maxsize=None)
def _modeling_text(module_name: str) -> str:
    import transformers

    folder = os.path.join(os.path.dirname(transformers.__file__), "models", module_name)
    texts = []
    with contextlib.suppress(OSError):
        for file in sorted(os.listdir(folder)):
            if file.startswith("modeling_") and file.endswith(".py"):
                with open(os.path.join(folder, file), encoding="utf-8") as f:
                    texts.append(f.read())
    return "\n".join(texts)


def _config_class_of(values: dict[str, Any]) -> Any:
    """The config class of a config dict (by its ``model_type``), or None."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    model_type = values.get("model_type")
    return _config_class(model_type) if model_type in CONFIG_MAPPING_NAMES else None


def _config_class(model_type: str) -> Any:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return CONFIG_MAPPING[model_type]


def _is_index_list(key: str, value: Any, depth: int | None) -> bool:
    return (depth is not None and isinstance(value, list) and value and ("index" in key or "indic" in key or "layers" in key)
            and key not in _RECOMPUTED and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
            and len(set(value)) == len(value) and max(value) < depth and (max(value) >= SMALL["num_hidden_layers"] or len(value) > 2))


def _head_dim(config: dict[str, Any]) -> int | None:
    if isinstance(config.get("head_dim"), int):
        return config["head_dim"]
    hidden, heads = config.get("hidden_size"), config.get("num_attention_heads")
    return hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads else None


def _sections(sections: list[int], total: int) -> list[int]:
    """``sections`` rescaled to add up to ``total`` (each at least 1)."""
    scale = total / sum(sections)
    out = [max(1, int(s * scale)) for s in sections]
    out[-1] += total - sum(out)
    if out[-1] < 1:  # more sections than features
        out = [1] * total
    return out


def _is_vocab(key: str, value: Any) -> bool:
    return "vocab" in key and isinstance(value, int) and not isinstance(value, bool) and value > SMALL["vocab_size"]


def _attr(config: Any, key: str, default: Any = None) -> Any:
    """``getattr`` that also answers ``default`` where reading raises (a per-layer attribute of a
    heterogeneous config)."""
    try:
        return getattr(config, key, default)
    except Exception:  # noqa: BLE001
        return default


def _settable(config: Any, key: str) -> bool:
    """Not a read-only property derived from other attributes."""
    attr = getattr(type(config), config.attribute_map.get(key, key), None)
    return not (isinstance(attr, property) and attr.fset is None)


def _has(config: Any, key: str) -> bool:
    """``config`` has ``key`` set, and it can be set."""
    if not _settable(config, key):
        return False
    return _attr(config, key) is not None


class TinyModelError(ValueError):
    """No generic tiny config of a model type runs upstream (the message is upstream's first error)."""


def _variants(kwargs: dict[str, Any]) -> list[dict[str, Any]]:
    """``kwargs`` and variants of it that drop what some classes refuse or derive themselves
    (per-layer attributes), or use as many kv heads as query heads (multi-head latent attention),
    each once."""
    mha = {**kwargs, "num_key_value_heads": kwargs.get("num_attention_heads", SMALL["num_attention_heads"])}
    variants = [kwargs, {k: v for k, v in kwargs.items() if k not in _ALWAYS},
                {k: v for k, v in kwargs.items() if k not in _RECOMPUTED},
                {k: v for k, v in kwargs.items() if k not in _ALWAYS + _RECOMPUTED}]
    if "num_key_value_heads" in kwargs:
        variants += [mha, {k: v for k, v in mha.items() if k not in _RECOMPUTED}]
    # models that read token ids their config class does not define (5.0's Phi, StableLM, EXAONE 4)
    variants.append({**kwargs, **{k: SMALL[k] for k in ("pad_token_id", "bos_token_id", "eos_token_id") if k not in kwargs}})
    # ... and in every sub-config too (Nemotron 3 diarization's audio tower projects values to every query head)
    variants.append(_all_heads(kwargs))
    unique: list[dict[str, Any]] = []
    for variant in variants:
        if variant not in unique:
            unique.append(variant)
    return unique


def _all_heads(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` with as many kv heads as query heads wherever (in it or a sub-config) both are set."""
    out = {k: _all_heads(v) if isinstance(v, dict) else v for k, v in kwargs.items()}
    if isinstance(out.get("num_key_value_heads"), int) and isinstance(out.get("num_attention_heads"), int):
        out["num_key_value_heads"] = out["num_attention_heads"]
    return out


def _build(model_type: str, kwargs: dict[str, Any]) -> Any:
    """The first config of :func:`_variants` whose model builds, is small and runs a forward of its
    tiny inputs. Which one it was (or the first error, if none runs) is kept on disk per
    transformers release and version of this module, of :mod:`torchembed.tools.zoo_inputs` and of the
    fixes, so that a later process builds it at once.

    Raises:
        TinyModelError: no variant runs; the message is the first variant's error.
    """
    from transformers import AutoConfig

    variants = _variants(kwargs)
    known = _search_cache().get(model_type)
    if known is not None and "error" in known:
        raise TinyModelError(known["error"])
    if known is not None and known.get("variant", -1) < len(variants):
        with _quiet():
            return AutoConfig.for_model(model_type, **copy.deepcopy(variants[known["variant"]]))
    first: Exception | None = None
    for index, variant in enumerate(variants):
        try:
            with _quiet():
                config = AutoConfig.for_model(model_type, **copy.deepcopy(variant))
            size, largest = _size(config)
            if size > MAX_PARAMETERS:
                raise ValueError(f"the smallest config found still has {size / 1e6:.0f}M parameters; "
                                 f"the largest is {largest} (a size the zoo does not shrink)")
            _runs(config)
        except Exception as err:  # noqa: BLE001 - try the next variant
            first = first or err
            continue
        _remember(model_type, {"variant": index})
        return config
    message = f"{type(first).__name__}: {_clip(str(first))}"
    _remember(model_type, {"error": message})
    raise TinyModelError(message) from first


def _cache_file() -> str:
    import hashlib

    import transformers

    from torchembed.tools import zoo_fixes, zoo_inputs
    from torchembed.tools.cache import default_cache_dir

    fixes = os.path.dirname(zoo_fixes.__file__)
    digest = hashlib.sha256()
    sources = (__file__, zoo_inputs.__file__, *sorted(os.path.join(fixes, f) for f in os.listdir(fixes) if f.endswith(".py")))
    for file in sources:
        with open(file, "rb") as f:  # a change to any searches afresh
            digest.update(f.read())
    digest = digest.hexdigest()[:12]
    return str(default_cache_dir() / "zoo" / f"transformers{transformers.__version__}-torch{torch.__version__}-{digest}.json")


@functools.lru_cache(maxsize=None)
def _search_cache() -> dict[str, dict[str, Any]]:
    """What earlier processes found (``{model_type: {"variant": i} | {"error": why}}``)."""
    import json

    if os.environ.get("TORCHEMBED_ZOO_CACHE", "1") == "0":
        return {}
    try:
        with open(_cache_file(), encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def _remember(model_type: str, result: dict[str, Any]) -> None:
    """Add one result to the file (merged with what other processes wrote meanwhile; atomic)."""
    import json

    cache = _search_cache()
    cache[model_type] = result
    if os.environ.get("TORCHEMBED_ZOO_CACHE", "1") == "0":
        return
    path = _cache_file()
    with contextlib.suppress(OSError, ValueError), open(path, encoding="utf-8") as f:
        cache.update({k: v for k, v in json.load(f).items() if k not in cache})
    _write_json(path, cache)


def model_class(config: Any) -> type:
    """The class the zoo builds for ``config``: the whole vision-language model where there is one
    (vision tower included), else the causal LM, the masked LM, or the bare model.

    Raises:
        KeyError: transformers maps no model class to this config class.
    """
    return _mapped_class(type(config))


def _mapped_class(config_class: type, own: bool = True) -> type:
    from transformers.models.auto import modeling_auto
    from transformers.models.auto.auto_factory import _LazyAutoMapping
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    model_type = config_class.model_type
    if model_type not in CONFIG_MAPPING_NAMES:  # 4.x's LFM2-VL config says "lfm2-vl", its mappings "lfm2_vl"
        model_type = next((k for k, v in CONFIG_MAPPING_NAMES.items() if v == config_class.__name__), model_type)
    for task in _TASKS:
        names = getattr(modeling_auto, task, None)
        if names and model_type in names:
            mapping = _LazyAutoMapping(CONFIG_MAPPING_NAMES, names)
            with contextlib.suppress(KeyError, ValueError):  # ValueError: a mapped name its package lacks
                return mapping[config_class]
    classes = _own_model_classes(config_class) if own else []
    if classes:  # a sub-config's model, not in the auto mappings (Qwen3-Omni's talker text model, code predictor)
        return classes[0]
    raise KeyError(f"transformers maps no model class to {config_class.__name__} ({config_class.model_type!r})")


def _own_model_classes(config_class: type) -> list[type]:
    """The model classes that the modeling module of ``config_class``'s package builds from that class
    alone, heads first (``...ForConditionalGeneration``, ``...ForCausalLM``), base pretrained classes left out."""
    import importlib

    from transformers import PreTrainedModel

    name = config_class.__module__.replace(".configuration_", ".modeling_")
    try:
        module = importlib.import_module(name)
    except ImportError:
        return []
    found = [c for c in vars(module).values() if isinstance(c, type) and issubclass(c, PreTrainedModel)
             and c.__module__ == name and getattr(c, "config_class", None) is config_class
             and not c.__name__.endswith("PreTrainedModel")]
    return sorted(found, key=lambda c: ("For" not in c.__name__, c.__name__))


def _size(config: Any) -> tuple[int, str]:
    """Parameters of the model built from ``config``, and its largest one (name and shape): on the
    meta device (no memory), or, for a model whose construction reads values (5.0's Apertus
    activation), on the CPU once the meta build ran into that."""
    def count(model: nn.Module) -> tuple[int, str]:
        params = list(model.named_parameters())
        name, largest = max(params, key=lambda item: item[1].numel(), default=("none", torch.empty(0)))
        return sum(p.numel() for _, p in params), f"{name} {tuple(largest.shape)}"

    try:
        with torch.device("meta"), _quiet():
            return count(model_class(config)(config))
    except NotImplementedError as err:
        if "meta" not in str(err):
            raise
    with _quiet():
        return count(model_class(config)(config))


def _runs(config: Any) -> None:
    """Upstream runs a forward of the tiny model on its tiny inputs, in its default attention and in
    eager attention, in a fraction of a second (a slow one means a size this module does not shrink
    yet), with finite outputs."""
    import time

    for impl in (None, "eager"):  # torchembed compare runs both
        candidate = copy.deepcopy(config)
        if impl is not None:
            candidate._attn_implementation = impl
        start = time.perf_counter()
        with _quiet(), torch.no_grad():
            model = _construct(candidate, 0, torch.float32)
            out = outputs_of(model, tiny_inputs(model))
        if not torch.isfinite(out).all():
            raise ValueError("upstream's outputs of the tiny model are not finite")
        if time.perf_counter() - start > MAX_SECONDS:
            raise ValueError(f"a forward of the smallest config found takes over {MAX_SECONDS:g} s")


# -- models ------------------------------------------------------------------------------------------


def strong_init(model: nn.Module, seed: int = 0, gain: float = 2.0) -> nn.Module:
    """Draw every weight matrix (and convolution kernel, expert stack) of ``model`` from
    ``N(0, gain^2 / fan_in)`` and every embedding from ``N(0, 1)``, in place; vectors (norm
    scales, biases, state-space decay rates) keep upstream's init, except those it leaves all zero
    (a key temperature, a gate, a bias): ``N(0, 0.25)``, so that none switches a path off. A vector
    quantizer's codebook kept as a buffer and all zero until trained (Mimi's ``embed_sum``) is drawn
    from ``N(0, 1)`` like an embedding (its own random stream), so that its decoder does not decode silence.

    HF's default ``initializer_range=0.02`` leaves tiny models with nearly uniform attention, where
    a wrong rotation moves the logits by less than float32's check can see; this init keeps the
    activations of every layer at unit scale and the attention scores at a few units.
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            for name, param in module.named_parameters(recurse=False):
                if not param.is_floating_point() or param.numel() == 0:
                    continue
                if param.dim() < 2:
                    if not param.any():  # a zero gate, temperature, bias or (1 + w) scale: not zero here
                        param.copy_((torch.randn(param.shape, generator=gen) * 0.5).to(param.dtype))
                    continue
                if isinstance(module, nn.Embedding) or "embed" in name:
                    std = 1.0
                elif isinstance(module, nn.modules.conv._ConvNd):
                    std = gain / math.sqrt(math.prod(param.shape[1:]))
                else:
                    std = gain / math.sqrt(param.shape[-1])
                values = torch.randn(param.shape, generator=gen, dtype=torch.float32) * std
                param.copy_(values.to(param.dtype))
        codebooks = torch.Generator().manual_seed(seed + 1)
        for name, buffer in model.named_buffers():
            codebook = "embed" in name.rsplit(".", 1)[-1] and buffer.is_floating_point() and buffer.dim() == 2
            if codebook and not buffer.any():
                buffer.copy_(torch.randn(buffer.shape, generator=codebooks).to(buffer.dtype))
    return model


def _construct(config: Any, seed: int, dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(seed)
    with _quiet():
        model = model_class(config)._from_config(config, dtype=dtype)
    can_set = getattr(type(model), "_can_set_experts_implementation", None)
    if can_set is not None and can_set():  # a loop over 4 tiny experts: no grouped-matmul warm-up per shape
        model.set_experts_implementation("eager")
    return strong_init(model, seed).eval()


def build_tiny(model_type: str, *, seed: int = 0, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> nn.Module:
    """A tiny random-weight model of ``model_type`` (eval mode, :func:`strong_init` weights)."""
    return _construct(generic_tiny_config(model_type), seed, dtype).to(device)


def tiny_inputs(model: nn.Module, *, seq_len: int = 12, seed: int = 0) -> dict[str, Tensor]:
    """The inputs the zoo runs ``model`` on: its model type's :data:`~torchembed.tools.zoo_fixes.INPUTS`
    entry where it has one, else :func:`~torchembed.tools.zoo_inputs.generic_inputs`' choice: ``input_ids``
    (2 rows of ``seq_len`` ids, none of them special), plus one tiny image (tiny audio) and its image
    (audio) tokens in row 0 where the model has a vision (audio) tower; for a vision tower or audio model
    of its own, just the image (audio).

    Raises:
        ValueError: the model takes neither ``input_ids`` nor an image or audio, or no image (audio)
            layout tried runs its vision (audio) tower.
    """
    fix = INPUTS.get(getattr(model.config, "model_type", None))
    if fix is not None:
        return fix(model)
    return generic_inputs(model, seq_len=seq_len, seed=seed)


def outputs_of(model: nn.Module, inputs: dict[str, Tensor]) -> Tensor:
    """The model's main output on ``inputs``: logits where it has them, else the last hidden state
    (or the tensor it returns: JEV's decision scores, Qwen2.5-Omni's DiT; or predicted masks), else its
    first floating-point output. (A model whose forward takes more than tensors is run by its
    :data:`~torchembed.tools.zoo_fixes.RUNS` entry.)

    The forward runs with the global generator seeded (and restored after), so that a model that draws
    from it (ESMFold2's initial pair state) draws the same numbers in every run."""
    if _parts_only(model):  # a generate-only composite (Qwen2.5-Omni): its parts' outputs, in turn, flattened
        return torch.cat([outputs_of(model.get_submodule(path), part).flatten() for path, part in inputs.items()])
    device = next(model.parameters()).device
    inputs = _to(inputs, device)
    run = RUNS.get(getattr(getattr(model, "config", None), "model_type", None))
    with torch.no_grad(), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(0)
        out = model(**inputs) if run is None else run(model, inputs)
    if isinstance(out, Tensor):
        return out
    for name in ("logits", "last_hidden_state", "prediction_logits", "pred_masks"):  # pred_masks: SAM's
        value = getattr(out, name, None)
        if isinstance(value, Tensor):
            return value
    tensors = list(_tensors(out if isinstance(out, tuple) else out.to_tuple()))
    # the first floating one: integer outputs (LightGlue's matched indices, a codec's codes) cannot show a
    # small error
    return next((t for t in tensors if t.is_floating_point()), tensors[0])


def _to(value: Any, device: torch.device | str) -> Any:
    """A copy of ``value`` on ``device`` (Qwen2.5-Omni's talker adds to its ``inputs_embeds`` in place): a
    tensor, a dict of values (inputs; a composite's parts' inputs), or a dataclass of tensors (ESMFold2's
    atom inputs)."""
    import dataclasses

    if isinstance(value, dict):
        return {k: _to(v, device) for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.replace(value, **{f.name: _to(getattr(value, f.name), device) for f in dataclasses.fields(value)})
    return value.to(device, copy=True)


def matches(out: Tensor, ref: Tensor, rel: float = FP32_REL_TOL) -> bool:
    """The zoo's equivalence check: every element within ``rel`` relative, or ``rel`` times the
    largest ``|ref|`` absolute (float32 against float32: rounding differences are ~1e-7 relative)."""
    if out.shape != ref.shape:
        return False
    return bool(torch.isclose(out.double(), ref.double(), rtol=rel, atol=rel * ref.abs().max().item()).all())


@dataclass
class ZooCase:
    """A tiny model of one model type, the inputs the zoo runs it on, and the prompt it generates
    from (None where upstream's ``generate`` does not run it: no generation head, or upstream fails)."""

    model_type: str
    model: nn.Module
    inputs: dict[str, Any]  # tensors (a generate-only composite's: each part's path -> its tensors)
    prompt: dict[str, Tensor] | None = None


def _prompt(model: nn.Module, inputs: dict[str, Tensor]) -> dict[str, Tensor] | None:
    """Row 0 of the inputs (its first 6 tokens for text), if upstream generates from it."""
    can = getattr(model, "can_generate", None)
    if not (can and can()) or getattr(model.config, "is_encoder_decoder", False) or _parts_only(model):
        return None
    if "pixel_values" in inputs or set(_AUDIO[:3]) & set(inputs):  # one row already, its image (audio) tokens complete
        prompt = dict(inputs)
    else:
        prompt = {k: v[:1, :6] if v.dim() > 1 else v for k, v in inputs.items()}  # a 0-d step stays
    try:
        with torch.no_grad(), _quiet():
            model.generate(**prompt, max_new_tokens=2, do_sample=False, pad_token_id=0)
    except Exception:  # noqa: BLE001 - upstream's generate does not run this tiny model
        return None
    return prompt


@functools.lru_cache(maxsize=None)
def _case(model_type: str) -> ZooCase:
    model = build_tiny(model_type)
    inputs = tiny_inputs(model)
    return ZooCase(model_type, model, inputs, _prompt(model, inputs))


def zoo_case(model_type: str, device: str | torch.device = "cpu") -> ZooCase:
    """The tiny model of ``model_type`` (built once per process: copy it before patching) and its
    inputs, on ``device``.

    Raises:
        Exception: why no tiny model of this type runs (what the config class or upstream raised).
    """
    case = _case(model_type)
    if torch.device(device) == torch.device("cpu"):
        return case
    move = (lambda values: None if values is None else _to(values, device))
    model = copy.deepcopy(case.model).to(device)
    for module in model.modules():  # tensors kept outside parameters and buffers (CLVP's cached rotary
        for name, value in list(vars(module).items()):  # table, filled by the CPU run that qualified the case)
            if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
                setattr(module, name, value.to(device))
    return ZooCase(model_type, model, move(case.inputs), move(case.prompt))


# -- status ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelTypeStatus:
    """Whether torchembed patches a model type, and how or why not.

    ``state``: ``"patched"``; ``"refused"`` (the patch layer's reason); ``"no tiny model"`` (it has
    a rotary component but no tiny model of it runs: the reason names the attribute or upstream's
    error); ``"partly patched"`` (the patch leaves some of upstream's rotations running, or its
    forward fails where upstream's runs: a bug, named); ``"part of"`` (a sub-config with no model
    class of its own, checked within its composite model); ``"no rotary component"``.
    """

    model_type: str
    state: str
    how: str  # family and what is swapped, or the reason it is not patched

    def __post_init__(self) -> None:
        object.__setattr__(self, "how", " ".join(self.how.split()))  # one line

    @property
    def supported(self) -> bool:
        return self.state == "patched"

    @property
    def rotary(self) -> bool:
        return self.state != "no rotary component"

    def row(self) -> list[str]:
        return [self.model_type, self.state, self.how]


@functools.lru_cache(maxsize=None)
def status_of(model_type: str) -> ModelTypeStatus:
    """Build the tiny model, check that upstream runs it, and ask the patch layer (cached)."""
    from torchembed.patches.core import find_positional_components
    from torchembed.patches.errors import PatchError, StructureError
    from torchembed.patches.registry import family_for

    code = rotary_code_of(model_type)
    if not code:
        return ModelTypeStatus(model_type, "no rotary component", "its modeling code defines no rotary class or function")
    if not has_model_class(model_type):
        parents = composites_of(model_type)
        # checked within a composite that the zoo runs; else on its own, where its package has a class for it
        # (Qwen3-Omni's talker: the composite only generates)
        checked = next((p for p in parents if status_of(p).state != "no tiny model"), None)
        if checked is not None or (parents and not _own_model_classes(_config_class(model_type))):
            within = checked or parents[0]
            return ModelTypeStatus(model_type, "part of", f"a sub-config of {', '.join(parents)} with no model class of "
                                   f"its own; checked within {within} ({status_of(within).state})")
    try:
        case = zoo_case(model_type)
    except Exception as err:  # noqa: BLE001 - reported, not raised
        why = str(err) if isinstance(err, TinyModelError) else f"{type(err).__name__}: {_clip(str(err))}"
        if _builds_without_rotary(model_type):
            return ModelTypeStatus(model_type, "no rotary component", f"its tiny model (built, not run: {why}) "
                                   f"uses none of {', '.join(code[:3])} (default config)")
        return ModelTypeStatus(model_type, "no tiny model", why)
    model = case.model
    if not rotary_modules(model):
        return ModelTypeStatus(model_type, "no rotary component",
                               f"its tiny model uses none of {', '.join(code[:3])} (default config)")
    try:
        components = find_positional_components(model)
    except StructureError as err:
        return ModelTypeStatus(model_type, "refused", f"{err.where}: expected {err.expected}; found {err.found}")
    except PatchError as err:
        message = str(err)
        return ModelTypeStatus(model_type, "refused", message.split("): ", 1)[-1] if "cannot patch" in message else message)
    from torchembed.patches.core import patch
    from torchembed.patches.rope.families import discover

    codes = rotation_code(model)
    try:
        with count_calls(codes) as ran:
            outputs_of(model, case.inputs)
    except Exception as err:  # noqa: BLE001 - reported: upstream itself does not run these inputs
        return ModelTypeStatus(model_type, "no tiny model", f"upstream's forward fails on the tiny inputs "
                               f"({type(err).__name__}: {str(err)[:120]})")
    if not ran:  # e.g. an audio tower, given token ids only
        where = sorted({path.rsplit(".", 2)[0] for path, _, _ in discover(model).attentions})
        return ModelTypeStatus(model_type, "no tiny model", "upstream's rotations do not run on the tiny inputs ("
                               f"{', '.join(sorted(case.inputs))}); they are in {', '.join(where[:3]) or 'modules not run'}")
    patched = patch(copy.deepcopy(model))
    failed: Exception | None = None
    try:
        with count_calls(codes) as left:
            outputs_of(patched, case.inputs)
    except Exception as err:  # noqa: BLE001 - a patch that breaks upstream's forward: a bug, reported
        failed = err
    family = family_for(model.config)
    kinds = sorted({c.kind for c in components})
    how = ("discovered: " if family.discovered else "") + f"{family.encoding}; " + ", ".join(
        f"{sum(c.kind == kind for c in components)} x {kind}" for kind in kinds
    )
    rotations = sorted({c.replacement.split("(", 1)[-1].rstrip(")") for c in components if c.kind == "rope-apply"})
    how += f" ({'; '.join(rotations)})" if rotations else ""
    if failed is not None:  # never reported as patched (nor left to crash the survey)
        return ModelTypeStatus(model_type, "partly patched", f"the patched forward fails on the tiny inputs, where "
                               f"upstream's runs ({type(failed).__name__}: {_clip(str(failed), 120)}); {how}")
    if left:  # a rotation the patch left to upstream (or handed back to it): never reported as patched
        calls = ", ".join(f"{name} ({n} calls)" for name, n in sorted(left.items()))
        return ModelTypeStatus(model_type, "partly patched", f"upstream's {calls} still run(s) in a patched forward; {how}")
    return ModelTypeStatus(model_type, "patched", how)


def survey(types: list[str] | None = None, *, progress: bool = False) -> list[ModelTypeStatus]:
    """:func:`status_of` for each model type (default: every model type with a rotary component).

    Results are kept in a file per transformers and torch release and per torchembed source
    (:func:`survey_cache_file`): a second survey reads them instead of building ~450 models again.
    ``progress``: progress on stderr while models are checked (a bar on a terminal, else a line every 10 s).
    """
    import json

    types = list(types or rotary_model_types())
    path = survey_cache_file()
    try:
        with open(path, encoding="utf-8") as f:
            known = json.load(f)
    except (OSError, ValueError):
        known = {}
    todo = [t for t in types if t not in known]
    with _progress_bar(len(todo), "checking model types", enabled=progress and bool(todo)) as advance:
        for model_type in todo:
            status = status_of(model_type)
            known[model_type] = [status.state, status.how]
            advance(model_type)
    if todo:
        _write_json(path, known)
    return [ModelTypeStatus(t, *known[t]) for t in types]


#: the states of a model type with a rotary component, in the order ``torchembed list --all`` prints them
STATES = ("patched", "partly patched", "refused", "no tiny model", "part of")


def survey_counts(statuses: list[ModelTypeStatus] | None = None) -> dict[str, int]:
    """Model types per state, as ``torchembed list --all`` and the README count them: each of :data:`STATES`
    among ``statuses`` (default: the whole :func:`survey`), ``"no rotary component"`` for every other model
    type of the installed transformers (its code has none, or its tiny model uses none) and ``"model types"``
    for all of them."""
    statuses = survey() if statuses is None else statuses
    counts = {state: sum(s.state == state for s in statuses) for state in STATES}
    counts["no rotary component"] = len(model_types()) - sum(counts.values())
    counts["model types"] = len(model_types())
    return counts


def survey_cache_file() -> str:
    """Where :func:`survey` keeps its results: one file per transformers and torch release and per
    content of torchembed's own sources (a changed patch layer or zoo checks afresh)."""
    import hashlib

    import transformers

    import torchembed.patches
    from torchembed.tools.cache import default_cache_dir

    digest = hashlib.sha256()
    # torchembed's own folder is this module's grandparent (``import torchembed`` here would close an import
    # circle: the package's lazy ``torchembed.compare`` imports this module)
    for root in (os.path.dirname(os.path.dirname(__file__)), os.path.dirname(torchembed.patches.__file__)):
        for folder, dirs, files in sorted(os.walk(root)):
            dirs.sort()
            for name in sorted(files):
                if name.endswith(".py"):
                    with open(os.path.join(folder, name), "rb") as f:
                        digest.update(f.read())
    key = f"transformers{transformers.__version__}-torch{torch.__version__}-{digest.hexdigest()[:12]}"
    return str(default_cache_dir() / "survey" / f"{key}.json")


def _write_json(path: str, data: dict[str, Any]) -> None:
    """Write ``data`` to ``path`` atomically (a reader never sees half a file); best effort."""
    import json
    import tempfile

    with contextlib.suppress(OSError):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, sort_keys=True)
        os.replace(tmp, path)


def _progress_bar(total: int, what: str, enabled: bool) -> Any:
    """``advance(label)`` for each of ``total`` steps: a rich bar on a terminal, progress lines in a log."""
    from torchembed.tools.progress import progress

    return progress(total, what, enabled)
