"""Zoo fixes of vision-language models and their vision towers (see :mod:`torchembed.tools.zoo_fixes`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from torchembed.tools.zoo_fixes._common import ConfigFix, merge
from torchembed.tools.zoo_inputs import SPECIAL_IDS

__all__ = ["CONFIG", "INPUTS"]


def _mllama_config(default: Any, kwargs: dict[str, Any]) -> None:
    """Mllama: one tile per image (its tile embeddings are per aspect ratio of max_num_tiles), the tower's
    output the last hidden state and each of intermediate_layers_indices' stacked, and self-attention (the
    rotary layers) between the cross-attention ones; 4.x's rotary embedding reads rope_scaling["rope_type"],
    None by default."""
    merge(kwargs, {"vision_config": {"max_num_tiles": 1, "supported_aspect_ratios": [[1, 1]], "attention_heads": 4,
                                      "num_global_layers": 2, "intermediate_layers_indices": [1, 3], "vision_output_dim": 3 * 64},
                    "text_config": {"cross_attention_layers": [1, 3]}})
    if getattr(default.text_config, "rope_scaling", {}) is None:
        kwargs["text_config"]["rope_scaling"] = {"rope_type": "default"}


CONFIG: dict[str, ConfigFix] = {
    # Apertus 1.5 (5.24): the visual then the audio codebook's tokens end the vocabulary (offsets and codebooks
    # checked against it): 64 text ids, 32 visual, 32 audio
    "apertus1p5": {"image_token_offset": 64, "audio_token_offset": 96, "vision_config": {"codebook_size": 32},
                   "audio_config": {"codebook_size": 32}},
    # Aria: its projector has learned queries per number of patches (1225 or 4900); the tiny image has 4
    "aria": {"projector_patch_to_query_dict": {4: 4}},
    # DeepSeek-OCR-2: the decoder reads mlp_layer_types and num_experts_per_tok (both default None);
    # SAM's downsampling neck must end at the vision encoder's width (its MLP width is not derived)
    "deepseek_ocr2": {
        "text_config": {"mlp_layer_types": ["dense", "sparse", "sparse", "sparse"], "num_experts_per_tok": 4},
        "vision_config": {"sam_config": {"output_channels": 32, "downsample_channels": [32, 64], "mlp_dim": 128}},
    },
    # DeepSeek-VL hybrid: its SAM tower's neck and projection widths (256, then x 2 and x 4) follow output_channels
    "deepseek_vl_hybrid": {"high_res_vision_config": {"output_channels": 16}},
    # ERNIE 4.5 VL: M-RoPE sections are (h, w, t) with h == w (upstream's default [22, 22, 20]); the
    # MoE width is a list (text experts, vision experts) that the generic rules leave full-size
    "ernie4_5_vl_moe": {
        "text_config": {"rope_parameters": {"mrope_section": [3, 3, 2]}, "moe_intermediate_size": [32, 32]},
    },
    # Gemma 4's vision tower: a learned (2, position_embedding_size, hidden) position table, 10240 rows by default
    "gemma4_vision": {"position_embedding_size": 16},
    # GLM-Image: the VQ codebook's ids are written into input_ids, so they must fit the text vocabulary
    "glm_image": {"vq_config": {"num_embeddings": 64}},
    # Granite 4 Vision: its Q-Former projectors need a window rate and which vision layers feed which
    # LLM layers (no defaults); the 2 x 2 patches of the tiny image make one window, pooled to 1 x 1
    "granite4_vision": {"downsample_rate": "1/2", "deepstack_layer_map": [[-1, 0], [-2, 2]],
                        "spatial_target_layers": [0, 1, 2, 3]},
    # HunYuanVL: the attention reads text_config.head_dim as is (default None); the vision tower's learned
    # position grid is (max_image_size / patch_size)^2 rows (65536 by default)
    "hunyuan_vl": {"text_config": {"head_dim": 16}, "vision_config": {"max_image_size": 64}},
    # Inkling 2: the sliding-window layers have their own head counts and width, the relative-position
    # tables their own extents; the vision merger's hidden width is not a width the generic rules know
    "inkling2": {
        "text_config": {"swa_num_attention_heads": 4, "swa_num_key_value_heads": 2, "swa_head_dim": 16,
                        "sliding_window_size": 32, "rel_extent": 64, "n_layers_per_attn_res_block": 2},
        "vision_config": {"projection_hidden_dim": 64},
    },
    "inkling2_loop": {
        "text_config": {"swa_num_attention_heads": 4, "swa_num_key_value_heads": 2, "swa_head_dim": 16,
                        "sliding_window_size": 32, "rel_extent": 64, "n_layers_per_attn_res_block": 2},
        "vision_config": {"projection_hidden_dim": 64},
    },  # (5.24) Inkling 2's towers in a looped text model
    "inkling2_vision": {"projection_hidden_dim": 64, "text_hidden_size": 64},
    # InternVL: image and patch sizes are (height, width) pairs, which the generic rules leave at 448 / 14
    "internvl": {"vision_config": {"image_size": 16, "patch_size": 8}},
    # MiniCPM-V: the window merger follows vision layer insert_layer_id (6 by default, past the tiny tower's 4)
    "minicpmv4_6": {"insert_layer_id": 1},
    # ... and 4.7's canvas M-RoPE finds each image by its marker tokens, whose ids the tokenizer gives (None
    # by default): here ids among the small vocabulary's top 16, which the zoo keeps for special tokens
    "minicpmv4_7": {"insert_layer_id": 1, "image_start_id": 120, "image_end_id": 121, "slice_start_id": 122,
                    "slice_end_id": 123, "newline_id": 124},
    "minicpmv4_7_vision": {"insert_layer_id": 1},
    # Mistral 3: its projector squeezes the merged patches of one image, so it needs more than one (a 4 x 4 grid)
    "mistral3": {"vision_config": {"image_size": 32}},
    "mistral_large4": {"vision_config": {"image_size": 32}},  # Mistral 3's tower and projector
    "mllama": _mllama_config,  # tiles, tower outputs, cross-attention layers (see there)
    # Molmo 2: the adapter pools the outputs of the vision layers it lists ([24, 18] by default) into a width
    # the generic rules do not know; the vision tower's image size is a list, and its learned position table
    # one row per patch of it; the image token's id (image_patch_id, not named like a token id) among the
    # small vocabulary's top 16
    "molmo2": {
        "image_patch_id": 122,
        "adapter_config": {"vision_feature_layer": [3, 2], "text_hidden_size": 64},
        "vision_config": {"image_size": [16, 16], "num_position_embeddings": 4},
    },
    # Muse Glimmer: as Muse Spark (below), without the audio tower and the MoE
    "muse_glimmer": {
        "out_hidden_size": 256, "projector_hidden_size": 64,
        "vision_config": {"pos_emb_height": 2, "pos_emb_width": 2, "max_position_embeddings": 4},
    },
    "muse_glimmer_vision": {"pos_emb_height": 2, "pos_emb_width": 2, "max_position_embeddings": 4},
    # Muse Spark: the vision adapter's input is the tower's width after its 2 x 2 pixel shuffle (4 x 64); its
    # hidden width and the MoE's are not ones the generic rules know, nor the audio tower's per-stage widths
    # (a list); the vision tower's window is its position grid (32 x 32 patches by default)
    "muse_spark": {
        "out_hidden_size": 256, "projector_hidden_size": 64, "text_config": {"moe_hidden_size": 64},
        "vision_config": {"pos_emb_height": 2, "pos_emb_width": 2, "max_position_embeddings": 4},
        "audio_config": {"hidden_sizes": [8, 16, 32, 64], "depths": [1, 1, 1, 1], "out_hidden_size": 64},
    },
    "muse_spark_vision": {"pos_emb_height": 2, "pos_emb_width": 2, "max_position_embeddings": 4},
    # Nemotron-H Omni: RADIO's learned position grid is (max_img_size / patch_size)^2 rows (65536 by default);
    # its Mamba mixer's heads go by names the generic rules do not know
    "nemotron_h_omni": {"vision_config": {"max_img_size": 64},
                        "text_config": {"mamba_num_heads": 4, "mamba_head_dim": 16}},
    # PaddleOCR-VL: the text model's M-RoPE sections default to [16, 24, 24] in its modeling code, not its config
    "paddleocr_vl": {"text_config": {"rope_parameters": {"mrope_section": [2, 3, 3]}}},
    # Qianfan-OCR: InternVL's tower
    "qianfan_ocr": {"vision_config": {"image_size": 16, "patch_size": 8}},
    # Unlimited OCR: as DeepSeek-OCR-2's, SAM's downsampling neck feeds the CLIP encoder, so ends at its width;
    # the text model's eager attention does not repeat kv heads (its default has as many as query heads)
    "unlimited_ocr": {
        "text_config": {"num_key_value_heads": 4},
        "vision_config": {"sam_config": {"output_channels": 32, "downsample_channels": [32, 64], "mlp_dim": 128}},
    },
    # VipLLaVA: the tower's hidden states it concatenates, [-2, -5, -8, -11, 6] of 24 layers; 5 of the tiny 4 layers'
    "vipllava": {"vision_feature_layers": [-1, -2, -3, -4, 1]},
}


def _text_ids(model: nn.Module, *parts: list[int] | int, seed: int = 0) -> Tensor:
    """One row of token ids: each int in ``parts`` that many random ordinary ids (none special),
    each list those ids as they are."""
    vocab = model.config.get_text_config().vocab_size
    gen = torch.Generator().manual_seed(seed)
    row = [torch.randint(3, vocab - SPECIAL_IDS, (part,), generator=gen) if isinstance(part, int)
           else torch.tensor(part) for part in parts]
    return torch.cat(row)[None]


def _flat_patches(vision: Any, count: int) -> Tensor:
    """``count`` flattened patches of ``vision``'s (channels * patch^2) pixels."""
    gen = torch.Generator().manual_seed(1)
    return torch.randn(count, vision.num_channels * vision.patch_size**2, generator=gen)


def _gemma4_vision(model: nn.Module) -> dict[str, Tensor]:
    # a (k * 2) x (k * 2) grid of patches with their (x, y) positions: the pooler averages k x k of them
    side = 2 * model.config.pooling_kernel_size
    ys, xs = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
    pixels = torch.rand(1, side * side, 3 * model.config.patch_size**2, generator=torch.Generator().manual_seed(1))
    return {"pixel_values": pixels, "pixel_position_ids": torch.stack((xs.flatten(), ys.flatten()), dim=-1)[None]}


def _glm_image(model: nn.Module) -> dict[str, Tensor]:
    # image to image: the source image's tokens between image start and end, the target's grid last
    # (upstream takes every grid but the last as a source image)
    config, vision = model.config, model.config.vision_config
    gen = torch.Generator().manual_seed(1)
    pixels = torch.randn(4, vision.in_channels * vision.patch_size**2, generator=gen)
    start, end = config.image_start_token_id, config.image_end_token_id
    ids = _text_ids(model, 3, [start] + [config.image_token_id] * 4 + [end], 6, [start])
    return {"input_ids": ids, "pixel_values": pixels, "image_grid_thw": torch.tensor([[1, 2, 2], [1, 2, 2]])}


def _inkling2_image(vision: Any) -> dict[str, Tensor]:
    # one 2 x 2-token image: each token's (merge * patch)^2 pixels channels last, the grid counted in tokens
    side = vision.spatial_merge_size * vision.patch_size
    pixels = torch.rand(4, side, side, vision.num_channels, generator=torch.Generator().manual_seed(1)) * 2 - 1
    return {"pixel_values": pixels, "image_grid_thw": torch.tensor([[1, 2, 2]])}


def _inkling2(model: nn.Module) -> dict[str, Tensor]:
    image = _inkling2_image(model.config.vision_config)
    return {"input_ids": _text_ids(model, 3, [model.config.image_token_id] * 4, 9), **image}


def _jev(model: nn.Module) -> dict[str, Tensor]:
    # a prompt with a choice question (type 1 of noul, choice, score) marked after each of its tokens:
    # the head scores 16 options from each mark's previous token
    marks = torch.arange(2, 17)[None]
    return {"input_ids": _text_ids(model, 16), "marks": marks, "num_options": torch.full_like(marks, 16),
            "question_type_ids": torch.ones_like(marks)}


def _minicpm_v_image(vision: Any) -> dict[str, Tensor]:
    # one 8 x 8-patch image, NaViT-packed as the processor packs it: (1, channels, patch, patches * patch);
    # the merger merges 2 x 2 of it, and in "16x" mode the window merger 2 x 2 before
    patch = vision.patch_size
    gen = torch.Generator().manual_seed(1)
    return {"pixel_values": torch.randn(1, vision.num_channels, patch, 64 * patch, generator=gen),
            "target_sizes": torch.tensor([[8, 8]])}


def _minicpm_v(model: nn.Module) -> dict[str, Tensor]:
    config = model.config
    marks = [getattr(config, name, None) for name in ("image_start_id", "image_end_id")]
    image = [config.image_token_id] * (4 if config.downsample_mode == "16x" else 16)
    row = _text_ids(model, 3, marks[:1] + image + marks[1:] if None not in marks else image, 8)
    return {"input_ids": row, "mm_token_type_ids": (row == config.image_token_id).int(),
            **_minicpm_v_image(config.vision_config)}


def _molmo2(model: nn.Module) -> dict[str, Tensor]:
    # one crop of 2 x 2 patches (one per position-table row), pooled two patches per image token;
    # image_grids gives each image's (low-res h, w, high-res h, w) token grids
    image_id = model.config.image_token_id
    row = _text_ids(model, 3, [image_id] * 2, 9)
    return {"input_ids": row, "pixel_values": _flat_patches(model.config.vision_config, 4)[None],
            "image_token_pooling": torch.tensor([[0, 1], [2, 3]]), "image_grids": torch.tensor([[1, 1, 1, 1]]),
            "mm_token_type_ids": (row == image_id).long()}


def _muse_glimmer_assistant(model: nn.Module) -> dict[str, Tensor]:
    # a block of noise embeddings to denoise after the context (the target model's hidden states at the
    # layers target_layer_ids names, concatenated): keys run over context and block, queries over the block
    config = model.config
    gen = torch.Generator().manual_seed(1)
    context = torch.randn(1, 8, len(config.target_layer_ids) * config.hidden_size, generator=gen)
    return {"noise_embeds": torch.randn(1, config.block_size, config.hidden_size, generator=gen),
            "context_hidden_states": context}


def _nemotron_h_omni(model: nn.Module) -> dict[str, Tensor]:
    # one 4 x 4-patch image as flattened patches with its (h, w) grid; the 2 x 2 pixel shuffle makes 4 tokens
    return {"input_ids": _text_ids(model, 3, [model.config.image_token_id] * 4, 9),
            "pixel_values": _flat_patches(model.config.vision_config, 16), "image_grid_hw": torch.tensor([[4, 4]])}


def _video_llama_3_image(vision: Any) -> dict[str, Tensor]:
    # one image of 4 x 4 flattened patches with its (t, h, w) grid, merged 2 x 2 into 4 tokens
    return {"pixel_values": _flat_patches(vision, 16), "grid_thw": torch.tensor([[1, 4, 4]]),
            "merge_sizes": torch.tensor([2])}


def _video_llama_3(model: nn.Module) -> dict[str, Tensor]:
    image = _video_llama_3_image(model.config.vision_config)
    return {"input_ids": _text_ids(model, 3, [model.config.image_token_id] * 4, 9),
            "pixel_values": image["pixel_values"], "image_grid_thw": image["grid_thw"],
            "image_merge_sizes": image["merge_sizes"]}


def _idefics(model: nn.Module) -> dict[str, Tensor]:
    """IDEFICS' images enter by cross-attention (no image token): one image, and which tokens attend to it (all)."""
    config, gen = model.config, torch.Generator().manual_seed(0)
    size, seq_len = config.vision_config.image_size, 12
    return {"input_ids": torch.randint(3, config.vocab_size - SPECIAL_IDS, (1, seq_len), generator=gen),
            "pixel_values": torch.randn(1, 1, config.vision_config.num_channels, size, size, generator=gen),
            "image_attention_mask": torch.ones(1, seq_len, 1, dtype=torch.long)}


def _mllama(model: nn.Module) -> dict[str, Tensor]:
    """Mllama's images enter by cross-attention: one image of one tile, its aspect ratio (id 1: 1 x 1)
    and which tokens attend to it (all), after its image token."""
    config, gen = model.config, torch.Generator().manual_seed(0)
    size, seq_len = config.vision_config.image_size, 12
    ids = torch.randint(3, config.text_config.vocab_size - SPECIAL_IDS, (1, seq_len), generator=gen)
    ids[0, 2] = config.image_token_id
    return {"input_ids": ids, "pixel_values": torch.randn(1, 1, 1, config.vision_config.num_channels, size, size, generator=gen),
            "aspect_ratio_ids": torch.tensor([[1]]), "aspect_ratio_mask": torch.ones(1, 1, 1, dtype=torch.long),
            "cross_attention_mask": torch.ones(1, seq_len, 1, 1, dtype=torch.long)}


INPUTS: dict[str, Callable[[nn.Module], dict[str, Tensor]]] = {
    "gemma4_vision": _gemma4_vision,  # Gemma 4: flattened patches with their (x, y) positions
    "glm_image": _glm_image,  # GLM-Image: a source image and the grid of the one to generate
    "idefics": _idefics,
    "inkling2": _inkling2,  # Inkling 2: pixels per image token, channels last, in a grid of tokens
    "inkling2_loop": _inkling2,
    "inkling2_vision": lambda model: _inkling2_image(model.config),
    "jev": _jev,  # JEV: a decision head, scoring the options of questions at their marks
    "minicpm_ocr": _minicpm_v,  # MiniCPM-V: NaViT-packed patches with their grid (target_sizes)
    "minicpmv4_6": _minicpm_v,
    "minicpmv4_7": _minicpm_v,
    "minicpmv4_7_vision": lambda model: _minicpm_v_image(model.config),
    "mllama": _mllama,
    "molmo2": _molmo2,  # Molmo 2: patches per crop, and which of them each image token pools
    "muse_glimmer_assistant": _muse_glimmer_assistant,  # a drafter: noise embeddings and the target's context
    "nemotron_h_omni": _nemotron_h_omni,  # RADIO's flattened patches, with an (h, w) grid
    "video_llama_3": _video_llama_3,  # VideoLLaMA 3: flattened patches with their grid and merge size per image
    "video_llama_3_vision": lambda model: _video_llama_3_image(model.config),
}
