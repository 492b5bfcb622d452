"""Zoo fixes of audio, speech and codec models (speech LMs, ASR encoders, codecs, a time-series model):
their sizes the generic rules do not know, and inputs beyond the generic audio ones."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from torchembed.tools.zoo_fixes._common import ConfigFix, merge
from torchembed.tools.zoo_inputs import AUDIO_FRAMES, SPECIAL_IDS, _forward_parameters, _speech, generic_inputs

# Granite Speech: its Conformer encoder's sizes are hidden_dim / num_layers / dim_head, and its Q-Former
# projector cross-attends to the encoder's output (encoder_hidden_size = the encoder's hidden_dim)
_GRANITE_SPEECH = {"encoder_config": {"hidden_dim": 64, "num_layers": 2, "num_heads": 4, "dim_head": 16},
                   "projector_config": {"encoder_hidden_size": 64}}

# NeMo's streaming Fast Conformer: its eager attention fills -inf where the float (additive) mask is *not*
# zero, which leaves a row with nothing masked all -inf (NaN); chunks of 2 frames (lookahead 1) and a left
# context of 2 chunks (sliding window 5) mask some frames in every row of the tiny audio's 9 frames
_NEMO_STREAMING = {"sliding_window": 5, "default_num_lookahead_tokens": 1}

# PE Audio: its DAC front end has no normalisation, and each downsampling block's 3 residual units grow a
# random-weight model's activations about 100-fold, until its transformer's layers (and their rotation) are
# lost in float32 next to them: no downsampling block (waveform samples are the transformer's frames)
_PE_AUDIO_DAC = {"downsampling_ratios": [], "hop_length": 1}


def _qwen2_5_omni_config(default: Any, kwargs: dict[str, Any]) -> None:
    # its token2wav: a DiT (codec vocabulary num_embeds, an ECAPA speaker encoder enc_*) and a BigVGAN
    # vocoder, whose width halves at each of its 6 upsamplings from upsample_initial_channel
    merge(kwargs, {"token2wav_config": {
        "dit_config": {"num_embeds": 128, "emb_dim": 32, "enc_emb_dim": 32, "enc_dim": 32,
                       "enc_channels": [32, 32, 32, 32, 96], "enc_attention_channels": 16, "enc_se_channels": 16},
        "bigvgan_config": {"upsample_initial_channel": 64}}})
    talker = kwargs["talker_config"]
    if "rope_scaling" in talker and talker["rope_scaling"] is None:  # 4.x: its talker's M-RoPE sections, no default
        talker["rope_scaling"] = {"rope_type": "default", "mrope_section": [2, 3, 3]}


CONFIG: dict[str, ConfigFix] = {
    # Fun-ASR-Nano: its config requires adaptor_config.intermediate_size == text_config.hidden_size // 4; its
    # audio tower takes num_mel_bins x num_stacked_frames features a frame (one frame: the generic audio's width)
    "fun_asr_nano": {"adaptor_config": {"intermediate_size": 16}, "audio_config": {"num_stacked_frames": 1}},
    # Gemma 4 audio: the mel width is subsampling_conv_channels[0] (the projection takes channels[0] // 4 x
    # channels[1] features after two stride-2 convolutions); 16 mel bins, as the generic audio has
    "gemma4_audio": {"subsampling_conv_channels": [16, 8]},
    "granite_speech": _GRANITE_SPEECH,
    "granite_speech_plus": _GRANITE_SPEECH,
    # Kyutai STT: its decoder's MLP width is ffn_dim (a GLU: fc2 takes ffn_dim // 2)
    "kyutai_speech_to_text": {"ffn_dim": 256},
    # Moonshine Streaming: its decoder reads num_key_value_heads, which its config class does not define
    "moonshine_streaming": {"num_key_value_heads": 4},
    # Muse Spark audio: a convolutional tower, its stages' widths and depths in hidden_sizes / depths
    "muse_spark_audio": {"hidden_sizes": [8, 16, 32, 64], "depths": [1, 1, 1, 1]},
    "nemotron3_5_asr": {"encoder_config": _NEMO_STREAMING},  # NeMo's streaming Fast Conformer encoder
    # Nemotron 3.5 word timestamps: its output is inputs_embeds + residual_scale x its layers' (0.1 by default,
    # under which a random-weight model's layers, and their rotation, barely move the output)
    "nemotron3_5_transcribe_word_timestamp": {"residual_scale": 10.0},
    "nemotron_asr_streaming": {"encoder_config": _NEMO_STREAMING},
    "nemotron_asr_streaming_encoder": _NEMO_STREAMING,
    # NeuCodec: its quantizer's width is the acoustic plus the semantic encoder's hidden_size (64 + 64)
    "neucodec": {"quantization_dim": 128},
    "pe_audio": {"audio_config": {"dac_config": _PE_AUDIO_DAC}},
    "pe_audio_encoder": {"dac_config": _PE_AUDIO_DAC},
    "qwen2_5_omni": _qwen2_5_omni_config,
    # SeamlessM4T: the speech encoder's, text-to-unit model's and vocoder's sizes have their own prefixed names
    "seamless_m4t": {
        "speech_encoder_layers": 2, "speech_encoder_attention_heads": 4, "speech_encoder_intermediate_size": 128,
        "t2u_encoder_layers": 1, "t2u_encoder_ffn_dim": 128, "t2u_encoder_attention_heads": 4,
        "t2u_decoder_layers": 1, "t2u_decoder_ffn_dim": 128, "t2u_decoder_attention_heads": 4,
        "upsample_initial_channel": 32, "unit_embed_dim": 32, "lang_embed_dim": 16, "spkr_embed_dim": 16,
    },
    "xcodec2": {"quantization_dim": 128},  # X-Codec 2: as NeuCodec
}


def _codec_with_semantics(model: nn.Module) -> dict[str, Tensor]:
    gen, config = torch.Generator().manual_seed(2), model.config
    frames, width = 16, config.semantic_model_config.feature_projection_input_dim
    return {"input_values": torch.randn(1, 1, frames * config.hop_length, generator=gen) * 0.1,
            "input_features": torch.randn(1, frames, width, generator=gen)}


def _gemma3n_audio(model: nn.Module) -> dict[str, Tensor]:
    mel = torch.randn(1, AUDIO_FRAMES, model.config.input_feat_size, generator=torch.Generator().manual_seed(2))
    return {"audio_mel": mel, "audio_mel_mask": torch.zeros(1, AUDIO_FRAMES, dtype=torch.bool)}


def _kyutai_speech_to_text(model: nn.Module) -> dict[str, Tensor]:
    config, gen = model.config, torch.Generator().manual_seed(0)
    text = torch.randint(3, config.vocab_size - SPECIAL_IDS, (2, 12, 1), generator=gen)
    codes = torch.randint(0, config.codebook_vocab_size - 1, (2, 12, config.num_codebooks), generator=gen)
    return {"input_ids": torch.cat((text, codes), dim=-1)}


def _pe_audio(model: nn.Module) -> dict[str, Tensor]:
    vocab = model.config.text_config.vocab_size
    ids = torch.randint(3, vocab - SPECIAL_IDS, (2, 12), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, **_pe_audio_encoder(model.audio_encoder)}


def _pe_audio_encoder(model: nn.Module) -> dict[str, Tensor]:
    return {"input_values": torch.randn(1, 1, 16, generator=torch.Generator().manual_seed(2)) * 0.1}


def _qwen2_5_omni(model: nn.Module) -> dict[str, Any]:
    gen, config, length = torch.Generator().manual_seed(0), model.config, 12
    talker, dit = config.talker_config, config.token2wav_config.dit_config
    text_vocab = config.thinker_config.text_config.vocab_size
    return {
        "thinker": generic_inputs(model.thinker),  # no fix of its own
        # the thinker's embedded prompt (its text ids place the M-RoPE positions), as the talker's first step
        "talker": {"inputs_embeds": torch.randn(1, length, talker.embedding_size, generator=gen),
                   "input_text_ids": torch.randint(3, text_vocab - SPECIAL_IDS, (1, length), generator=gen),
                   "attention_mask": torch.ones(1, length, dtype=torch.long)},
        # one step of token2wav's flow matching: a noisy mel, a reference mel, the speaker, codec codes, the time
        "token2wav.code2wav_dit_model": {
            "hidden_states": torch.randn(1, length * dit.repeats, dit.mel_dim, generator=gen),
            "condition_vector": torch.randn(1, length * dit.repeats, dit.mel_dim, generator=gen),
            "speaker_embedding": torch.randn(1, length * dit.repeats, dit.enc_emb_dim, generator=gen),
            "quantized_code": torch.randint(0, dit.num_embeds, (1, length), generator=gen),
            "time_step": torch.tensor(0.5)},
    }


def _voxtral_realtime(model: nn.Module) -> dict[str, Tensor]:
    speech = _speech(model, _forward_parameters(model), 12)
    if speech is None:
        raise ValueError("no tiny audio layout runs Voxtral Realtime's audio tower")
    audio, count = speech
    ids = torch.randint(3, model.config.get_text_config().vocab_size - SPECIAL_IDS, (1, count),
                        generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, **audio}


INPUTS: dict[str, Callable[[nn.Module], dict[str, Any]]] = {
    "gemma3n_audio": _gemma3n_audio,  # Gemma 3n's audio encoder: a required audio_mel_mask, True where padded
    # Kyutai STT: each position's ids are a text token and one audio code per codebook, (batch, seq, 1 + codebooks)
    "kyutai_speech_to_text": _kyutai_speech_to_text,
    # NeuCodec: a waveform and, for its semantic (Wav2Vec2-BERT) encoder, features at the acoustic frame rate
    "neucodec": _codec_with_semantics,
    # PE Audio: a text-audio dual encoder, which takes both: text, and its audio tower's own tiny audio
    "pe_audio": _pe_audio,
    "pe_audio_encoder": _pe_audio_encoder,  # PE Audio's encoder: 16 samples, 16 frames without a downsampling block
    # Qwen2.5-Omni only generates: the zoo runs its parts (thinker, talker, token2wav's DiT), each on its inputs
    "qwen2_5_omni": _qwen2_5_omni,
    # Voxtral Realtime: one audio embedding is added to each token's (no audio tokens): as many tokens as frames
    "voxtral_realtime": _voxtral_realtime,
    "xcodec2": _codec_with_semantics,  # X-Codec 2: as NeuCodec
}
