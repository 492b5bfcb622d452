"""Zoo fixes of text models: causal and masked LMs, MoE, hybrid state-space, latent attention, and the
text-led composites (see :mod:`torchembed.tools.zoo_fixes`). ``INPUTS`` may return a dataclass of
tensors where the forward takes one."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from torchembed.tools.zoo_fixes._common import ConfigFix

__all__ = ["CONFIG", "INPUTS"]


def _cohere_compass_text(default: Any, kwargs: dict[str, Any]) -> None:
    """Cohere Compass: no default rope_parameters; its rotary reads them per layer type, M-RoPE sections included."""
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
    kwargs["layer_types"] = ["sliding_attention", "full_attention"] * 2
    kwargs["rope_parameters"] = {"sliding_attention": dict(rope), "full_attention": {**rope, "rope_theta": 50000.0}}


def _granitemoehybrid(default: Any, kwargs: dict[str, Any]) -> None:
    """Granite 4.0 hybrid: all-Mamba and no rotation by default; its checkpoints with attention layers set
    position_embedding_type="rope". Mamba and attention layers alternate, named as the release names them
    (4.x: "mamba" / "attention"; 5.x: "linear_attention" / any other, here "full_attention")."""
    mamba = (default.layers_block_type or ["mamba"])[0]  # 4.x: None by default
    kinds = [mamba, "attention" if mamba == "mamba" else "full_attention"] * 2
    kwargs.update(position_embedding_type="rope", shared_intermediate_size=64, layer_types=kinds, layers_block_type=kinds)


# image tokenizers (VQ-GAN) of Chameleon, Emu3 and Janus: narrow convolutions (at least GroupNorm's 32 groups), one
# residual block a level
_VQ = {"base_channels": 32, "embed_dim": 8, "latent_channels": 8, "num_res_blocks": 1}

# CLVP's encoders rotate at least 32 features per head: heads wider than 32
_CLVP_ENCODER = {"hidden_size": 128, "num_attention_heads": 2, "projection_dim": 64}

# dots3 Note: per-layer latent attention, its sizes not readable from the class defaults (the sliding layers'
# come as swa_* keys); as many kv heads as query heads, and an indexer no narrower than the rotated part
_DOTS3_NOTE_TEXT = {
    "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8,
    "head_dim": 16, "v_head_dim": 16, "index_topk": 4, "index_head_dim": 16, "index_n_heads": 2,
    "shared_experts_intermediate_size": 32, "swa_num_attention_heads": 4, "swa_num_key_value_heads": 4,
    "swa_q_lora_rank": 32, "swa_kv_lora_rank": 16, "swa_head_dim": 16, "swa_qk_nope_head_dim": 8, "swa_v_head_dim": 16,
}

# ESMFold2's atom encoders: the 3D rotation's pairs (3 axes and the atom's group id) fit in a 16-wide head
_ESMFOLD2_ATOMS = {"num_spatial_rope_pairs_per_axis": 2, "num_uid_rope_pairs": 1}

# GLM-5-Next: its latent attention is NoPE (qk_rope_head_dim 0) with as many kv heads as query heads, and
# its DSA indexer selects index_topk positions in pools of index_kpool
_GLM5_NEXT_TEXT = {"qk_rope_head_dim": 0, "num_key_value_heads": 4, "index_topk": 4, "index_kpool": 2,
                   "index_n_heads": 2, "index_head_dim": 16, "linear_head_dim": 16, "linear_num_heads": 4}

# Qwen4-Exp: every full-attention layer has a QSA indexer, which needs all five indexer sizes (its
# rotary part no wider than the indexer's heads); a budget of 2 blocks of 2 tokens of 12 selects some
_QWEN4_EXP_TEXT = {"indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 16, "indexer_budget": 4,
                   "indexer_compress_ratio": 2, "hc_lowrank": 8,
                   "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_num_key_heads": 2,
                   "linear_num_value_heads": 4}

CONFIG: dict[str, ConfigFix] = {
    # BLT: its forward makes DynamicCache(config=BltConfig), which reads num_hidden_layers (BltConfig has none);
    # the local models' hidden_size_global is the global transformer's width
    "blt": {"num_hidden_layers": 4, "encoder_config": {"hidden_size_global": 64},
            "decoder_config": {"hidden_size_global": 64}},
    # Chameleon: the model maps VQ codes to BPE ids through vocabulary_map (None by default); no image tokens
    # in it, as the logits of image tokens are set to the float minimum (text inputs only)
    "chameleon": {"vocabulary_map": {"<image>": 127}, "vq_config": {**_VQ, "num_embeddings": 16, "resolution": 16}},
    # CLVP: the encoders rotate max(projection_dim // (2 * heads), 32) features of each head (partially, as its
    # checkpoints' 64-wide heads): heads wider than 32
    "clvp": {"text_config": _CLVP_ENCODER, "speech_config": _CLVP_ENCODER},
    # Cohere Compass: see _cohere_compass_text
    "cohere_compass": lambda default, kwargs: _cohere_compass_text(default.text_config, kwargs["text_config"]),
    "cohere_compass_text": _cohere_compass_text,
    # CSM: its Mimi codec's upsampling convolution has upsample_groups groups, one per channel of its width;
    # a narrow SEANet (num_filters) and quantizer
    "csm": {"codec_config": {"upsample_groups": 64, "num_filters": 8, "codebook_dim": 16,
                             "vector_quantization_hidden_dimension": 16}},
    # DBRX: the attention reads rope_theta from attn_config, whose class does not define it, and clamps q, k, v
    # to clip_qkv, None by default (checkpoints set both)
    "dbrx": {"attn_config": {"rope_theta": 10000.0, "clip_qkv": 8.0}, "ffn_config": {"ffn_hidden_size": 128}},
    # Dia: the decoder's cross-attention has its own head count and width
    "dia": {"decoder_config": {"cross_num_attention_heads": 4, "cross_head_dim": 16, "cross_num_key_value_heads": 4}},
    # DiffusionGemma: every layer has a router and experts, whose counts default to None; the full-attention
    # layers' head dim is global_head_dim (512 by default)
    "diffusion_gemma": {"text_config": {"num_experts": 4, "top_k_experts": 4, "moe_intermediate_size": 32,
                                        "global_head_dim": 32}},
    # Dory (5.24): 16 input, 40 recurrent (looped twice) and 16 output layers, counted apart from num_hidden_layers
    "dory": {"n_input_layers": 1, "n_recurrent_layers": 2, "n_output_layers": 1},
    # dots.llm1: the expert counts default to None (its checkpoints set them)
    "dots1": {"n_routed_experts": 4, "n_shared_experts": 1},
    # dots3 Note: see _DOTS3_NOTE_TEXT; the towers' adapters project to the text width, and the audio stem's
    # conv_output_size (downsample_hidden_size * ceil(feature_size / 8)) is kept as given
    "dots3_note": {"text_config": _DOTS3_NOTE_TEXT, "vision_config": {"adapter_out_dim": 64},
                   "audio_config": {"adapter_out_dim": 64, "feature_size": 16, "downsample_hidden_size": 32,
                                    "conv_output_size": 64}},
    "dots3_note_text": _DOTS3_NOTE_TEXT,
    # Emu3: as Chameleon, and its end-of-line token
    "emu3": {"vocabulary_map": {"<image>": 127, "<|extra_200|>": 126}, "vq_config": {**_VQ, "codebook_size": 16}},
    # ESMFold2: its ESMC backbone has no grouped-query attention; the single inputs are the atom encoder's
    # output and the residue features (single_inputs_size = output_dim + 2 * num_res_types + 1); one trunk
    # loop of a shallow trunk, and no LM dropout (resampled in every loop, even in eval mode); see _ESMFOLD2_ATOMS
    "esmfold2": {"esmc_config": {"num_key_value_heads": 4}, "single_inputs_size": 64 + 2 * 33 + 1, "num_loops": 0,
                 "folding_trunk_num_hidden_layers": 2, "parcae_num_coda_layers": 1,
                 "pair_transition_intermediate_size": 128, "lm_encoder": {"lm_dropout": 0.0},
                 "msa_encoder": {"outer_hidden_size": 8},
                 "atom_encoder": _ESMFOLD2_ATOMS, "structure_head": {"diffusion_module": {"atom_encoder": _ESMFOLD2_ATOMS}}},
    # GLM-5-Next: see _GLM5_NEXT_TEXT; the vision merger's width
    "glm5_next": {"text_config": _GLM5_NEXT_TEXT, "vision_config": {"projection_intermediate_size": 128}},
    "glm5_next_text": _GLM5_NEXT_TEXT,
    # Granite 4.0 hybrid: see _granitemoehybrid
    "granitemoehybrid": _granitemoehybrid,
    # Janus: the aligners and the generation head project to the text width (projection_dim,
    # image_token_embed_dim); one image's token count (num_image_tokens) is the tiny image's patch count
    "janus": {"vision_config": {"projection_dim": 64, "num_image_tokens": 4},
              "vq_config": {**_VQ, "num_embeddings": 16, "projection_dim": 64, "image_token_embed_dim": 64,
                            "num_patches": 2}},
    # LFM2-MoE: no default layer_types (its checkpoints list them: short convolutions and attention)
    "lfm2_moe": {"layer_types": ["conv", "full_attention"] * 2, "num_dense_layers": 1},
    # Qwen3-Omni: the talker's shared expert reads shared_expert_intermediate_size, and the talker
    # spatial_merge_size, which their config classes do not define (checkpoints set them); a narrow
    # code2wav decoder (decoder_dim) and codebook
    "qwen3_omni_moe": {"talker_config": {"text_config": {"shared_expert_intermediate_size": 32},
                                         "spatial_merge_size": 2},
                       "code2wav_config": {"decoder_dim": 32, "codebook_size": 16}},
    "qwen3_omni_moe_talker_text": {"shared_expert_intermediate_size": 32},
    # Qwen4-Exp: see _QWEN4_EXP_TEXT
    "qwen4_exp": {"text_config": _QWEN4_EXP_TEXT},
    # Kolibri 1.1: sliding layers and, every fifth, indexed attention whose indexer layers must be indexed
    # ones; two layers, one of each, the indexed one its own indexer and K/V source, small indexer sizes
    "kolibri1_1": {"num_hidden_layers": 2, "layer_types": ["sliding_attention", "indexed_attention"],
                   "index_layers": [1], "kv_source_layers": [0, 1], "mlp_only_layers": [0], "sliding_window": 8,
                   "index_topk": 4, "index_pool_size": 8, "index_compression": 2, "index_num_heads": 2,
                   "index_num_local_tokens": 2, "index_num_sink_tokens": 1},
    "qwen4_exp_text": _QWEN4_EXP_TEXT,
    # Step 3.7: its text model always builds a sliding-window mask, so sliding_window must be set (its
    # checkpoints alternate sliding and full attention, the sliding layers with their own head count)
    "step3p7": {"text_config": {"sliding_window": 32, "layer_types": ["sliding_attention", "full_attention"] * 2,
                                "num_sliding_attention_heads": 4, "share_expert_dim": 32}},
    # T5Gemma 2 encoder: its text model reads dropout_rate, which only the composite T5Gemma2Config sets
    "t5gemma2_encoder": {"text_config": {"dropout_rate": 0.0}},
}


def _clvp_inputs(model: nn.Module) -> dict[str, Tensor]:
    """CLVP: text ids and the log-mel frames of the speech that conditions its decoder."""
    gen = torch.Generator().manual_seed(0)
    config = model.config
    return {"input_ids": torch.randint(3, config.text_config.vocab_size - 16, (2, 12), generator=gen),
            "input_features": torch.randn(2, config.decoder_config.feature_size, 16, generator=gen)}


def _dia_inputs(model: nn.Module) -> dict[str, Tensor]:
    """Dia: byte ids for the encoder, and audio codes of every channel (batch, frames, channels) for the
    decoder, below its special ids."""
    gen = torch.Generator().manual_seed(0)
    decoder = model.config.decoder_config
    return {"input_ids": torch.randint(3, model.config.encoder_config.vocab_size - 16, (2, 12), generator=gen),
            "decoder_input_ids": torch.randint(3, decoder.vocab_size - 16, (2, 6, decoder.num_channels), generator=gen)}


def _diffusion_gemma_inputs(model: nn.Module) -> dict[str, Tensor]:
    """DiffusionGemma: a prompt for the encoder and a canvas for the decoder to refine (drawn at random
    from the global generator when not given)."""
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.text_config.vocab_size
    return {"input_ids": torch.randint(3, vocab - 16, (2, 12), generator=gen),
            "decoder_input_ids": torch.randint(3, vocab - 16, (2, 8), generator=gen)}


def _dots3_note_inputs(model: nn.Module) -> dict[str, Tensor]:
    """dots3 Note: one tiny image (flattened patches and their grid) and one tiny audio chunk (log-mel frames
    and its sample count), their placeholder tokens in the ids (its ForConditionalGeneration has no
    get_image_features for the generic builder to count them with)."""
    config, gen = model.config, torch.Generator().manual_seed(1)
    vision, audio = config.vision_config, config.audio_config
    side = 2 * vision.spatial_merge_size
    pixels = torch.randn(side * side, vision.num_channels * vision.patch_size**2, generator=gen)
    grid = torch.tensor([[1, side, side]])
    features = torch.randn(1, audio.feature_size, 16, generator=gen)
    samples = torch.tensor([16 * audio.hop_length])
    with torch.no_grad():
        images = sum(len(t) for t in model.model.get_image_features(pixels, grid).pooler_output)
        sounds = len(model.get_audio_features(features, samples).pooler_output)
    ids = torch.randint(3, config.text_config.vocab_size - 16, (1, 12), generator=gen)
    special = torch.tensor([[config.image_token_id] * images + [config.audio_token_id] * sounds])
    ids = torch.cat((ids[:, :3], special, ids[:, 3:]), dim=-1)
    return {"input_ids": ids, "pixel_values": pixels, "image_grid_thw": grid, "input_features": features,
            "chunk_sample_lengths": samples}


def _esmfold2_inputs(model: nn.Module) -> dict[str, Any]:
    """ESMFold2: one protein chain of 6 residues of 2 atoms each, its sequence (for the ESMC backbone) and
    its reference-conformer atoms (their positions feed the atom encoder's spatial rotation)."""
    from transformers.models.esmfold2.modeling_esmfold2 import EsmFold2AtomInputs

    config, gen = model.config, torch.Generator().manual_seed(0)
    tokens, atoms = 6, 12
    index = torch.arange(tokens)[None]
    zeros = torch.zeros(1, tokens, dtype=torch.long)
    owner = torch.arange(tokens).repeat_interleave(atoms // tokens)[None]
    atom_inputs = EsmFold2AtomInputs(
        ref_pos=torch.randn(1, atoms, 3, generator=gen), ref_charge=torch.zeros(1, atoms),
        atom_attention_mask=torch.ones(1, atoms, dtype=torch.bool),
        ref_element=torch.randint(1, 10, (1, atoms), generator=gen),
        ref_atom_name_chars=torch.randint(0, config.char_vocab_size, (1, atoms, config.max_chars), generator=gen),
        ref_space_uid=owner, atom_to_token=owner)
    return {"token_index": index, "residue_index": index, "asym_id": zeros, "sym_id": zeros, "entity_id": zeros,
            "mol_type": zeros, "res_type": torch.randint(0, 20, (1, tokens), generator=gen),
            "token_bonds": torch.zeros(1, tokens, tokens, 1), "attention_mask": torch.ones(1, tokens, dtype=torch.long),
            "atom_inputs": atom_inputs,
            "input_ids": torch.randint(3, config.esmc_config.vocab_size - 16, (1, tokens), generator=gen)}


def _pi0_inputs(model: nn.Module) -> dict[str, Tensor]:
    """PI0: a robot state, the noisy action chunk and its flow-matching time (fixed: else drawn at random),
    and a prompt of one camera image's tokens and text, the image flagged present in pixel_attention_mask."""
    config, gen = model.config, torch.Generator().manual_seed(1)
    vlm = config.vlm_config
    size = vlm.vision_config.image_size
    pixels = torch.randn(2, 1, vlm.vision_config.num_channels, size, size, generator=gen)
    with torch.no_grad():
        tokens = model.model.vlm.get_image_features(pixels[:, 0]).pooler_output.shape[1]
    text = torch.randint(3, vlm.text_config.vocab_size - 16, (2, 8), generator=gen)
    ids = torch.cat((torch.full((2, tokens), vlm.image_token_id), text), dim=-1)
    return {"input_ids": ids, "pixel_values": pixels, "pixel_attention_mask": torch.ones(2, 1, dtype=torch.bool),
            "state": torch.randn(2, config.max_state_dim, generator=gen),
            "noise": torch.randn(2, config.chunk_size, config.max_action_dim, generator=gen),
            "timestep": torch.tensor([0.3, 0.7])}


def _qwen3_omni_inputs(model: nn.Module) -> dict[str, Tensor]:
    """Qwen3-Omni as a whole: none; its parts are checked as model types of their own (qwen3_omni_moe_thinker,
    qwen3_omni_moe_talker_text, qwen3_omni_moe_talker_code_predictor)."""
    raise ValueError(f"{type(model).__name__} has no forward, only generate; its thinker, talker text model "
                     "and code predictor are checked as model types of their own")


def _qwen3_omni_code_predictor_inputs(model: nn.Module) -> dict[str, Tensor]:
    """Qwen3-Omni's code predictor: codes of one codebook and the generation step that picks the codebook's
    embedding (step - 1) and head (step), as its generate passes it (an integer; a 0-d tensor indexes alike)."""
    gen = torch.Generator().manual_seed(0)
    return {"input_ids": torch.randint(3, model.config.vocab_size - 16, (2, 12), generator=gen),
            "generation_steps": torch.tensor(1)}


def _qwen3_omni_talker_inputs(model: nn.Module) -> dict[str, Tensor]:
    """Qwen3-Omni's talker text model: it embeds nothing itself (its caller projects the thinker's states), so
    input embeddings."""
    gen = torch.Generator().manual_seed(0)
    return {"inputs_embeds": torch.randn(2, 12, model.config.hidden_size, generator=gen)}


INPUTS: dict[str, Callable[[nn.Module], dict[str, Any]]] = {  # tensors (or a dataclass of them)
    "clvp": _clvp_inputs,
    "dia": _dia_inputs,
    "diffusion_gemma": _diffusion_gemma_inputs,
    "dots3_note": _dots3_note_inputs,
    "esmfold2": _esmfold2_inputs,
    "pi0": _pi0_inputs,
    "qwen3_omni_moe": _qwen3_omni_inputs,
    "qwen3_omni_moe_talker_code_predictor": _qwen3_omni_code_predictor_inputs,
    "qwen3_omni_moe_talker_text": _qwen3_omni_talker_inputs,
}
