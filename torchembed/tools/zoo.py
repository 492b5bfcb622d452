"""Tiny random-weight models of every text model type in the installed transformers.

Configs are made generically from each config class: its defaults, with every size-like attribute
it has (hidden size, heads, layers, vocabulary, experts, low-rank dims ...) set small, so a model
builds and runs on a CPU in milliseconds. Nothing is written per model type. Used by
``torchembed list --all`` (what is supported and why not) and ``torchembed compare --all``.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["SMALL", "ModelTypeStatus", "text_model_types", "generic_tiny_config", "build_tiny", "status_of", "survey"]

#: attribute -> small value; an attribute is set only where the config class has it.
SMALL: dict[str, Any] = {
    "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "num_hidden_layers": 4, "intermediate_size": 128, "vocab_size": 128, "max_position_embeddings": 128,
    # mixture of experts; every token goes to every expert, so that no top-k choice flips between
    # two runs that round differently (bf16 against float64 would then measure the flips)
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 4,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "n_shared_experts": 1,
    "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "moe_num_experts": 4, "moe_k": 4,
    "moe_topk": 4, "num_shared_experts": 1, "expert_intermediate_size": 32,
    # multi-head latent attention (DeepSeek-V2/V3 and kin)
    "q_lora_rank": 32, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16,
    # windows and other lengths that must stay below max_position_embeddings
    "sliding_window": 32, "attention_chunk_size": 32, "original_max_position_embeddings": 64,
    "rotary_dim": 8,  # GPT-J / CodeGen: rotated features per head
    # state-space layers of hybrid models (their CPU path materialises chunk x chunk x state tensors)
    "mamba_d_state": 16, "mamba_n_heads": 4, "mamba_d_head": 16, "mamba_chunk_size": 16, "mamba_d_ssm": 64,
    "mamba_n_groups": 1, "ssm_state_size": 16, "state_size": 16, "chunk_size": 16, "n_groups": 1,
    "mamba_headdim": 16, "time_step_rank": 8,
    # token ids inside the small vocabulary
    "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
}
MAX_PARAMETERS = 20_000_000  # a tiny model runs in milliseconds on a CPU
MAX_SECONDS = 3.0  # ... its build and one forward well inside this
_RECOMPUTED = ("layer_types", "mlp_layer_types", "no_rope_layers", "layers_block_type")  # per-layer lists
_ALWAYS = ("head_dim", "num_key_value_heads")


def text_model_types() -> list[str]:
    """Every model type with a causal-LM class in the installed transformers, sorted."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def generic_tiny_config(model_type: str) -> Any:
    """A small config of ``model_type``: the class defaults with :data:`SMALL` where it applies
    (a fresh copy; the search for a config that runs is done once per process).

    Raises:
        Exception: whatever the config class or upstream's forward raises for these values.
    """
    import copy

    return copy.deepcopy(_tiny_config(model_type))


@functools.lru_cache(maxsize=None)
def _tiny_config(model_type: str) -> Any:
    from transformers import AutoConfig

    default = AutoConfig.for_model(model_type)
    kwargs = {key: value for key, value in SMALL.items() if _has(default, key)}
    for key, value in default.to_dict().items():
        if _is_vocab(key, value):  # every other vocabulary (hash, byte-group, ...)
            kwargs.setdefault(key, SMALL["vocab_size"])
        elif isinstance(value, dict) and any(k in SMALL for k in value):  # a sub-config (text, encoder ...)
            kwargs[key] = _shrink(value)
    for key in _ALWAYS:  # None in some defaults, and read as is by the model
        if key not in kwargs and _settable(default, key) and hasattr(default, key):
            kwargs[key] = SMALL[key]
    if getattr(default, "head_dim", None) is not None and default.head_dim == getattr(default, "qk_rope_head_dim", None):
        kwargs["head_dim"] = SMALL["qk_rope_head_dim"]  # MLA models: head_dim is the rotary part
    layers = SMALL["num_hidden_layers"]
    for key in _RECOMPUTED:
        value = getattr(default, key, None)
        if isinstance(value, (list, tuple)) and len(value) != layers and _settable(default, key):
            kinds = list(dict.fromkeys(value))  # every kind of layer the default has, in turn
            kwargs[key] = (kinds * layers)[:layers]
    return _build(model_type, kwargs)


def _is_vocab(key: str, value: Any) -> bool:
    return "vocab" in key and isinstance(value, int) and not isinstance(value, bool) and value > SMALL["vocab_size"]


def _shrink(values: dict[str, Any]) -> dict[str, Any]:
    """A sub-config's dict with :data:`SMALL` applied (recursively)."""
    out = {}
    for key, value in values.items():
        if key in SMALL and value is not None and not isinstance(value, (list, dict)):
            out[key] = SMALL[key]
        elif _is_vocab(key, value):
            out[key] = SMALL["vocab_size"]
        elif isinstance(value, dict) and any(k in SMALL for k in value):
            out[key] = _shrink(value)
        else:
            out[key] = value
    return out


def _settable(config: Any, key: str) -> bool:
    """Not a read-only property derived from other attributes."""
    attr = getattr(type(config), config.attribute_map.get(key, key), None)
    return not (isinstance(attr, property) and attr.fset is None)


def _has(config: Any, key: str) -> bool:
    """``config`` has ``key`` set, and it can be set."""
    if not _settable(config, key):
        return False
    try:
        return getattr(config, key, None) is not None
    except Exception:
        return False


def _build(model_type: str, kwargs: dict[str, Any]) -> Any:
    """The first config, from ``kwargs`` and variants of it, whose model builds, is small and runs
    a forward in eager and in the default attention. Variants drop what some classes refuse or
    derive themselves (per-layer attributes), or use as many kv heads as query heads (multi-head
    latent attention). The first error is raised if every variant fails."""
    from transformers import AutoConfig

    mha = {**kwargs, "num_key_value_heads": kwargs.get("num_attention_heads", SMALL["num_attention_heads"])}
    variants = [kwargs, {k: v for k, v in kwargs.items() if k not in _ALWAYS},
                {k: v for k, v in kwargs.items() if k not in _RECOMPUTED},
                {k: v for k, v in kwargs.items() if k not in _ALWAYS + _RECOMPUTED}]
    if "num_key_value_heads" in kwargs:
        variants += [mha, {k: v for k, v in mha.items() if k not in _RECOMPUTED}]
    # models that read token ids their config class does not define (5.0's Phi, StableLM, EXAONE 4)
    variants.append({**kwargs, **{k: SMALL[k] for k in ("pad_token_id", "bos_token_id", "eos_token_id") if k not in kwargs}})
    first: Exception | None = None
    for variant in variants:
        try:
            config = AutoConfig.for_model(model_type, **variant)
            if _size(config) > MAX_PARAMETERS:
                raise ValueError(f"the smallest config found still has {_size(config) / 1e6:.0f}M parameters")
            _runs(config)
            return config
        except Exception as err:  # noqa: BLE001 - try the next variant
            first = first or err
    raise first  # type: ignore[misc]


def _size(config: Any) -> int:
    """Parameters of the model built from ``config``: on the meta device (no memory), or, for a
    model whose construction reads values (5.0's Apertus activation), on the CPU once the meta
    build ran into that."""
    try:
        with torch.device("meta"), _quiet():
            return sum(p.numel() for p in _causal_lm_class(config)(config).parameters())
    except NotImplementedError as err:
        if "meta" not in str(err):
            raise
    with _quiet():
        return sum(p.numel() for p in _causal_lm_class(config)(config).parameters())


def _runs(config: Any) -> None:
    """Upstream runs a forward of the tiny model, with eager attention and the default one, in a
    fraction of a second (a slow one means a size this module does not shrink yet)."""
    import copy
    import time

    ids = torch.tensor([[3, 4, 5, 6, 7]])
    for impl in ("eager", None):
        candidate = copy.deepcopy(config)
        if impl is not None:
            candidate._attn_implementation = impl
        torch.manual_seed(0)
        start = time.perf_counter()
        with _quiet(), torch.no_grad():
            _causal_lm_class(candidate)(candidate).eval()(input_ids=ids)
        if time.perf_counter() - start > MAX_SECONDS:
            raise ValueError(f"a forward of the smallest config found takes over {MAX_SECONDS:g} s")


def _causal_lm_class(config: Any) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM._model_mapping[type(config)]


def build_tiny(model_type: str, *, seed: int = 0, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> nn.Module:
    """A tiny random-weight causal LM of ``model_type`` (eval mode)."""
    from transformers import AutoModelForCausalLM

    config = generic_tiny_config(model_type)
    torch.manual_seed(seed)
    with _quiet():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.to(device).eval()


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


@dataclass(frozen=True)
class ModelTypeStatus:
    """Whether torchembed patches a model type, and why not."""

    model_type: str
    supported: bool
    how: str  # family and what is swapped, or the reason it is not supported

    def __post_init__(self) -> None:
        object.__setattr__(self, "how", " ".join(self.how.split()))  # one line

    def row(self) -> list[str]:
        return [self.model_type, "yes" if self.supported else "no", self.how]


@functools.lru_cache(maxsize=None)
def status_of(model_type: str) -> ModelTypeStatus:
    """Build the tiny model, check that upstream runs it, and ask the patch layer (cached)."""
    from torchembed.patches.core import find_positional_components
    from torchembed.patches.errors import PatchError, StructureError
    from torchembed.patches.registry import family_for

    try:
        config = generic_tiny_config(model_type)
        model = build_tiny(model_type)
    except Exception as err:  # noqa: BLE001 - reported, not raised
        return ModelTypeStatus(model_type, False, "not checked: no generic tiny config that upstream runs "
                               f"({type(err).__name__}: {str(err)[:120]})")
    try:
        components = find_positional_components(model)
    except StructureError as err:
        return ModelTypeStatus(model_type, False, f"{err.where}: expected {err.expected}; found {err.found}")
    except PatchError as err:
        message = str(err)
        return ModelTypeStatus(model_type, False, message.split("): ", 1)[-1] if "cannot patch" in message else message)
    family = family_for(config)
    kinds = sorted({c.kind for c in components})
    how = ("discovered: " if family.discovered else "") + f"{family.encoding}; " + ", ".join(
        f"{sum(c.kind == kind for c in components)} x {kind}" for kind in kinds
    )
    rotations = sorted({c.replacement.split("(", 1)[-1].rstrip(")") for c in components if c.kind == "rope-apply"})
    return ModelTypeStatus(model_type, True, how + (f" ({'; '.join(rotations)})" if rotations else ""))


def survey(model_types: list[str] | None = None) -> list[ModelTypeStatus]:
    """:func:`status_of` for each model type (default: every text model type)."""
    return [status_of(model_type) for model_type in (model_types or text_model_types())]
