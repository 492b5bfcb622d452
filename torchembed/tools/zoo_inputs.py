"""The zoo's generic tiny inputs: what :func:`torchembed.tools.zoo.tiny_inputs` runs a tiny model on
where :data:`~torchembed.tools.zoo_fixes.INPUTS` has no entry for its model type.

Token ids, plus a tiny image where the model has a vision tower (tiny audio where it has an audio
tower), in the first layout the tower runs on; a vision or audio model of its own gets just the image
(audio). The per-model-type fixes build on the same pieces (:data:`SPECIAL_IDS`, :data:`AUDIO_FRAMES`,
a speech LM's audio), so this module imports neither :mod:`torchembed.tools.zoo` nor its fixes.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import math
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["SPECIAL_IDS", "AUDIO_FRAMES", "generic_inputs"]

SPECIAL_IDS = 16  # the top of the small vocabulary is kept for special tokens (image, vision start ...)
# where an audio tower's config names no feature (mel) width, or a latent / embedding input's config no
# width: the zoo's tiny ones (``num_mel_bins`` and ``hidden_size`` of :data:`torchembed.tools.zoo.SMALL`)
_MEL_BINS = 16
_WIDTH = 64


def generic_inputs(model: nn.Module, *, seq_len: int = 12, seed: int = 0) -> dict[str, Tensor]:
    """The zoo's generic choice of inputs for ``model``: ``input_ids`` (2 rows of ``seq_len`` ids, none
    of them special), and for a model with a vision tower one tiny image in the layout it takes, its
    image tokens in row 0 (between the vision start/end tokens where the config has them) and the
    token type ids that mark them; for a vision tower of its own, just the image. Likewise for a speech
    LM: tiny audio and its audio tokens in row 0; for an audio model of its own (encoder, codec, time
    series), just the audio. (:func:`torchembed.tools.zoo.tiny_inputs` takes a model type's
    :data:`~torchembed.tools.zoo_fixes.INPUTS` entry instead, where it has one.)

    Raises:
        ValueError: the model takes neither ``input_ids`` nor an image or audio, or no image (audio)
            layout tried runs its vision (audio) tower, or it has no forward of its own (it only
            generates, from its parts).
    """
    config = model.config
    if _parts_only(model):
        raise ValueError(f"{type(model).__name__} has no forward (it only generates, from its parts)")
    params = _forward_parameters(model)
    if "input_ids" not in params:
        if {"pixel_values", "hidden_states"} & params or not set(_AUDIO) & params:
            return _vision_inputs(model, params)
        return _audio_inputs(model, params, seq_len)
    vocab = config.get_text_config().vocab_size
    gen = torch.Generator().manual_seed(seed)
    inputs: dict[str, Tensor] = {}
    if "pixel_values" in params and _vision_config(config) is not None:
        image_id = _special(config, "image_token_id", "image_token_index")
        if image_id is None:
            raise ValueError(f"{type(config).__name__} has a vision tower but no image_token_id")
        first: Exception | None = None
        for images in _image_candidates(config, params):
            try:
                count = _image_tokens(model, images)
            except Exception as err:  # noqa: BLE001 - try the next layout
                first = first or err
                continue
            if count:
                break
        else:
            raise ValueError(f"no tiny image layout runs {type(model).__name__}'s vision tower "
                             f"({type(first).__name__}: {first})" if first else "no get_image_features")
        start, end = _special(config, "vision_start_token_id", "boi_token_id", "boi_token_index"), \
            _special(config, "vision_end_token_id", "eoi_token_id", "eoi_token_index")
        row = [t for t in (start,) if t is not None] + [image_id] * count + [t for t in (end,) if t is not None]
        ids = torch.randint(3, vocab - SPECIAL_IDS, (1, seq_len), generator=gen)
        media = {i for i in (image_id, _special(config, "video_token_id", "video_token_index")) if i is not None}
        spare = next(i for i in range(3, vocab) if i not in media)  # not an image token id in the text (EXAONE 4.5's 67)
        ids[torch.isin(ids, torch.tensor(sorted(media)))] = spare
        ids = torch.cat((ids[:, :3], torch.tensor([row]), ids[:, 3:]), dim=-1)
        inputs.update(images)
        kind = (ids == image_id).int()
        for name in ("mm_token_type_ids", "token_type_ids"):
            if name in params:
                inputs[name] = kind
                break
    elif (set(_AUDIO[:3]) & params and (audio_id := _special(config, "audio_token_id", "audio_token_index")) is not None
          and (speech := _speech(model, params, seq_len)) is not None):
        audio, count = speech  # a speech LM: its audio tokens in row 0, and the audio
        ids = torch.randint(3, vocab - SPECIAL_IDS, (1, seq_len), generator=gen)
        ids = torch.cat((ids[:, :3], torch.full((1, count), audio_id), ids[:, 3:]), dim=-1)
        inputs.update(audio)
    else:  # text alone (also a speech LM whose audio tower no tiny audio runs, or which has none by default)
        ids = torch.randint(3, vocab - SPECIAL_IDS, (2, seq_len), generator=gen)
    inputs["input_ids"] = ids
    if "decoder_input_ids" in params and getattr(config, "is_encoder_decoder", False):
        inputs["decoder_input_ids"] = ids
    if "sample" in params:  # VibeVoice's audio VAE: its mean, not a draw (the same outputs each run)
        inputs["sample"] = torch.tensor(False)
    return inputs


# -- images --------------------------------------------------------------------------------------------


def _forward_parameters(model: nn.Module) -> set[str]:
    return set(inspect.signature(model.forward).parameters)


def _vision_config(config: Any) -> Any:
    return getattr(config, "vision_config", None)


def _first(config: Any, *keys: str, default: Any = None) -> Any:
    for key in keys:
        value = getattr(config, key, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return default


def _image_candidates(config: Any, params: set[str]) -> Iterator[dict[str, Tensor]]:
    """Tiny images in the layouts vision towers take: patches with their (t, h, w) grid, flattened
    (Qwen2-VL and kin) or not, (1, channels, size, size) pixels (with their ``image_sizes`` where the
    forward takes them), or (1, 1, channels, size, size)."""
    vision = _vision_config(config) or config
    gen = torch.Generator().manual_seed(1)
    channels = _first(vision, "in_channels", "num_channels", "in_chans", default=3)
    patch = _first(vision, "patch_size", default=8)
    if "image_grid_thw" in params:
        kernel = getattr(vision, "merge_kernel_size", None)  # Kimi K2.5: (height, width)
        merge = _first(vision, "spatial_merge_size", "merge_size", default=kernel[0] if isinstance(kernel, (list, tuple)) else 1)
        temporal = _first(vision, "temporal_patch_size", "patch_temporal", default=1)  # Muse Spark: patch_temporal
        side = 2 * merge
        flat = torch.randn(side * side, channels * temporal * patch * patch, generator=gen)
        grid = torch.tensor([[1, side, side]])
        yield {"pixel_values": flat, "image_grid_thw": grid}
        if temporal == 1:  # Kimi K2.5, PaddleOCR-VL: each patch as a (channels, patch, patch) image
            yield {"pixel_values": flat.view(-1, channels, patch, patch), "image_grid_thw": grid}
    if "spatial_shapes" in params:  # SigLIP 2's NaFlex (LFM2-VL): flattened patches, their grid, the real ones
        side = 2 * _first(config, "downsample_factor", default=1)
        yield {"pixel_values": torch.randn(1, side * side, channels * patch * patch, generator=gen),
               "spatial_shapes": torch.tensor([[side, side]]),
               "pixel_attention_mask": torch.ones(1, side * side, dtype=torch.long)}
    size = _first(vision, "image_size", default=2 * patch)
    pinpoints = getattr(config, "image_grid_pinpoints", None)
    if "image_sizes" in params and pinpoints:  # anyres: an image of the first resolution, its tiles after the overview
        height, width = pinpoints[0]
        tiles = 1 + (height // size) * (width // size)
        yield {"pixel_values": torch.randn(1, tiles, channels, size, size, generator=gen),
               "image_sizes": torch.tensor([[height, width]])}
    pixels = torch.randn(1, channels, size, size, generator=gen)
    sizes = {"image_sizes": torch.tensor([[size, size]])} if "image_sizes" in params else {}
    high = getattr(config, "high_res_vision_config", None)
    if "high_res_pixel_values" in params and high is not None:  # DeepSeek-VL hybrid: the image again, for its SAM tower
        high_size = _first(high, "image_size", default=size)
        yield {"pixel_values": pixels, "high_res_pixel_values": torch.randn(1, channels, high_size, high_size, generator=gen)}
    for layout in (pixels, pixels[:, None]):  # (batch, images, channels, height, width): Idefics and kin
        yield {"pixel_values": layout, **sizes}
        if sizes:  # image_sizes is optional, and some towers do not take it (LLaVA's CLIP)
            yield {"pixel_values": layout}
    if "pixel_attention_mask" in params:  # Granite-Docling: which of the (batch, tiles) are real
        yield {"pixel_values": pixels[:, None], "pixel_attention_mask": torch.ones(1, 1, dtype=torch.bool)}


def _image_tokens(model: nn.Module, images: dict[str, Tensor]) -> int:
    """How many image-token embeddings the vision tower makes of ``images`` (0 if it has no
    ``get_image_features``, or it fails on them)."""
    # a head without it has its base model's (DeepSeek-VL, ModernVBert's masked LM, PerceptionLM, Janus)
    get = next((g for g in (getattr(model, "get_image_features", None),
                            getattr(getattr(model, "base_model", None), "get_image_features", None),
                            getattr(getattr(model, "model", None), "get_image_features", None)) if g is not None), None)
    if get is None:
        return 0
    hidden = model.config.get_text_config().hidden_size
    with torch.no_grad(), _quiet():
        out = get(**images)
    if isinstance(out, (Tensor, list, tuple)):
        tensors = list(_tensors(out))
    else:  # the pooled features, else the first layer's of per-layer ones (Granite 4 Vision), else the first output
        tensors = list(_tensors(getattr(out, "pooler_output", None)))
        tensors = tensors or list(_tensors(next(iter(getattr(out, "deepstack_features", None) or ()), None)))
        tensors = tensors or list(_tensors(out[0]))
    return sum(t.numel() for t in tensors) // hidden


def _tensors(value: Any) -> Iterator[Tensor]:
    if isinstance(value, Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def _special(config: Any, *names: str) -> int | None:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _vision_inputs(model: nn.Module, params: set[str]) -> dict[str, Tensor]:
    """A vision tower's own inputs: one tiny image in the first layout its forward runs on."""
    pixels = next((name for name in ("pixel_values", "hidden_states") if name in params), None)
    if pixels is None:
        raise ValueError(f"{type(model).__name__}.forward takes neither input_ids nor pixel_values (needs {_required(model)})")
    grid = next((name for name in ("grid_thw", "image_grid_thw") if name in params), None)

    def layouts() -> Iterator[dict[str, Tensor]]:
        for images in _image_candidates(model.config, params | ({"image_grid_thw"} if grid else set())):
            if grid and "image_grid_thw" not in images:
                continue
            inputs = {pixels: images["pixel_values"], **({grid: images["image_grid_thw"]} if grid else {})}
            yield {**inputs, **{k: v for k, v in images.items() if k == "image_sizes"}}

    return _first_that_runs(model, layouts(), "image")


def _first_that_runs(model: nn.Module, candidates: Iterator[dict[str, Tensor]], kind: str) -> dict[str, Tensor]:
    """The first of ``candidates`` that ``model``'s forward runs on; else a ValueError naming the first error."""
    first: Exception | None = None
    for inputs in candidates:
        try:
            with torch.no_grad(), _quiet():
                model(**inputs)
        except Exception as err:  # noqa: BLE001 - try the next layout
            first = first or err
            continue
        return inputs
    raise ValueError(f"no tiny {kind} layout runs {type(model).__name__} ({type(first).__name__}: {_clip(str(first))})")


def _required(model: nn.Module) -> str:
    sig = inspect.signature(model.forward)
    names = [p.name for p in sig.parameters.values() if p.default is p.empty and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
    return ", ".join(names) or "inputs the zoo does not make"


# -- audio ---------------------------------------------------------------------------------------------


_AUDIO = ("input_features", "audio_mel", "input_values", "past_values", "latents", "inputs_embeds")  # by precedence
_AUDIO_MASKS = ("attention_mask", "input_features_mask", "feature_attention_mask", "padding_mask", "past_values_padding")
# where the feature (mel) width of an audio tower is kept, in its config or a sub-config
_AUDIO_FEATURES = ("num_mel_bins", "input_feat_size", "input_dim", "feature_projection_input_dim", "feature_size")
AUDIO_FRAMES = 64  # feature frames of the tiny audio: a few positions left after 4x or 8x subsampling


def _deep_first(config: Any, keys: tuple[str, ...]) -> int | None:
    """The first of ``keys`` that ``config`` (or else, breadth first, one of its sub-configs) sets to an int."""
    level = [config.to_dict() if hasattr(config, "to_dict") else config]
    while level:
        for key in keys:
            for values in level:
                value = values.get(key)
                if isinstance(value, int) and not isinstance(value, bool):
                    return value
        level = [v for values in level for v in values.values() if isinstance(v, dict)]
    return None


def _hop(config: Any) -> int:
    """Waveform samples per frame of an audio tower: the product of its convolutions' strides (1 where
    its config names none)."""
    level = [config.to_dict()]
    while level:
        for values in level:
            for key in ("downsampling_ratios", "upsampling_ratios", "conv_stride", "patch_sizes", "patch_length"):
                value = values.get(key)
                if isinstance(value, int) and not isinstance(value, bool):  # a time series' patch
                    return value
                if isinstance(value, (list, tuple)) and all(isinstance(v, int) for v in value):
                    return math.prod(value)  # 1 for none
            if isinstance(values.get("hop_length"), int):
                return values["hop_length"]
        level = [v for values in level for v in values.values() if isinstance(v, dict)]
    return 1


def _audio_candidates(model: nn.Module, params: set[str], seq_len: int) -> Iterator[dict[str, Tensor]]:
    """Tiny audio in the layouts audio towers take: log-mel features ``(1, frames, mel)`` or
    ``(1, mel, frames)``, a waveform ``(1, samples)`` or ``(1, channels, samples)`` of a few frames
    of the tower's hop, a time series ``(1, length)``, or latents / embeddings ``(1, frames, width)``
    either way round; each without, then with, all-valid masks (and the decoder's token ids of an
    encoder-decoder)."""
    config = model.config
    gen = torch.Generator().manual_seed(2)
    name = next(n for n in _AUDIO if n in params)
    if name in ("input_features", "audio_mel"):
        width = _deep_first(config, _AUDIO_FEATURES) or _MEL_BINS
        length, first = AUDIO_FRAMES, torch.randn(1, AUDIO_FRAMES, width, generator=gen)
        layouts = [first, first.transpose(1, 2)]
    elif name in ("input_values", "past_values"):
        channels = _first(config, "audio_channels", "channels", "in_channels", default=1)
        hop = _hop(config) if name == "past_values" else max(_hop(config), 320)  # waveforms: 20 ms at 16 kHz or more
        length = 16 * hop  # 16 frames
        wave = torch.randn(1, channels, length, generator=gen) * (0.1 if name == "input_values" else 1.0)  # speech level
        layouts = [wave, wave[:, 0]] if channels > 1 else [wave[:, 0], wave]
    else:  # latents of a codec's decoder, embeddings of an encoder
        width = _first(config, "hidden_size", "d_model", default=_WIDTH)
        length, first = AUDIO_FRAMES // 4, torch.randn(1, AUDIO_FRAMES // 4, width, generator=gen)
        layouts = [first, first.transpose(1, 2)]
    decoder = {}
    if "decoder_input_ids" in params:
        vocab = config.get_text_config(decoder=True).vocab_size
        decoder["decoder_input_ids"] = torch.randint(3, vocab - SPECIAL_IDS, (1, seq_len), generator=gen)
    masks = {m: torch.ones(1, length, dtype=torch.long) for m in _AUDIO_MASKS if m in params}
    for layout in layouts:
        yield {name: layout, **decoder}
        if masks:
            yield {name: layout, **masks, **decoder}


def _speech(model: nn.Module, params: set[str], seq_len: int) -> tuple[dict[str, Tensor], int] | None:
    """A speech LM's tiny audio in the first layout its ``get_audio_features`` runs on, and how many
    audio-token embeddings it makes of it (None if none runs: Gemma 4's default config has no audio tower)."""
    getters = (getattr(m, "get_audio_features", None) for m in (model, getattr(model, "model", None)))
    # the first that names its audio argument (a wrapper passing *args, **kwargs on: its inner model's)
    get = next((g for g in getters if g is not None and set(_AUDIO) & set(inspect.signature(g).parameters)), None)
    if get is None:
        return None
    takes = set(inspect.signature(get).parameters)
    hidden = model.config.get_text_config().hidden_size
    for audio in _audio_candidates(model, params - {"attention_mask"}, seq_len):  # attention_mask: the tokens'
        try:
            with torch.no_grad(), _quiet():
                out = get(**{k: v for k, v in audio.items() if k in takes})
        except Exception:  # noqa: BLE001 - try the next layout
            continue
        found = [out] if isinstance(out, Tensor) else list(_tensors(getattr(out, "pooler_output", None)))
        count = sum(t.numel() for t in found) // hidden
        if count:
            return audio, count
    return None


def _audio_inputs(model: nn.Module, params: set[str], seq_len: int) -> dict[str, Tensor]:
    """An audio model's inputs: the first of :func:`_audio_candidates` its forward runs on."""
    return _first_that_runs(model, _audio_candidates(model, params, seq_len), "audio")


# -- used by the zoo too -------------------------------------------------------------------------------


def _parts_only(model: nn.Module) -> bool:
    """``model`` has no forward of its own: it only generates, calling its parts (Qwen2.5-Omni's thinker,
    talker and token2wav), so the zoo runs those (inputs: ``{part's path: its inputs}``)."""
    return type(model).forward is nn.Module.forward


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """No warnings, no transformers logging or prints (PE video's docstring check at each build), and
    no hub: a default config that would download a part (EdgeTAM's timm backbone) fails at once
    instead of retrying the network."""
    import huggingface_hub.constants
    import transformers.utils.hub
    from transformers.utils import logging

    verbosity = logging.get_verbosity()
    offline = huggingface_hub.constants.HF_HUB_OFFLINE, getattr(transformers.utils.hub, "_is_offline_mode", None)
    logging.set_verbosity_error()
    huggingface_hub.constants.HF_HUB_OFFLINE = True
    if offline[1] is not None:
        transformers.utils.hub._is_offline_mode = True
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.set_verbosity(verbosity)
        huggingface_hub.constants.HF_HUB_OFFLINE = offline[0]
        if offline[1] is not None:
            transformers.utils.hub._is_offline_mode = offline[1]


def _clip(text: str, limit: int = 200) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
