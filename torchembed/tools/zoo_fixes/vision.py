"""Zoo fixes of vision models: detection, segmentation, depth, matching, video trackers, and the
composites whose timm towers are swapped for small ViTs (see :mod:`torchembed.tools.zoo_fixes`).
``RUNS`` runs the models whose forward takes more than tensors (a video tracker's inference session)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from torchembed.tools.zoo_fixes._common import ConfigFix

__all__ = ["CONFIG", "INPUTS", "RUNS"]


def _sub_configs(kwargs: dict[str, Any]) -> list[dict[str, Any]]:
    """``kwargs`` and every sub-config dict in it, recursively."""
    return [kwargs] + [d for value in kwargs.values() if isinstance(value, dict) for d in _sub_configs(value)]


def _vit(**extra: Any) -> Any:
    """A tiny ViT (2 x 2 patches and a class token), with ``num_labels`` or other ``extra`` attributes."""
    from transformers import ViTConfig

    return ViTConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, intermediate_size=128,
                     image_size=16, patch_size=8, **extra)


def _vitdet() -> Any:
    """A tiny ViTDet: its output is a (batch, channels, height, width) map, as hybrid timm towers' are."""
    from transformers import VitDetConfig

    return VitDetConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, mlp_ratio=2, image_size=16,
                        pretrain_image_size=16, patch_size=8)


def _without_timm(tower: Callable[[], Any]) -> Callable[[Any, dict[str, Any]], None]:
    """A fix that makes every timm vision tower in the config tree ``tower()``: timm imports torchvision,
    whose compiled operators (PyPI's wheels link CUDA's torch libraries) do not load beside a CPU torch.
    The rotary parts of these models are elsewhere (their text model, a temporal encoder)."""

    def fix(default: Any, kwargs: dict[str, Any]) -> None:
        for config in _sub_configs(kwargs):
            for key, value in config.items():
                if isinstance(value, dict) and value.get("model_type") == "timm_wrapper":
                    config[key] = tower()

    return fix


def _perception_encoder(default: Any, kwargs: dict[str, Any]) -> None:
    """PE audio / video: a ViT classifier for the per-frame timm tower (its logits are the frame's
    features), and a DAC audio codec of 4 to 64 channels (16 samples a frame) instead of 64 to 1024."""
    _without_timm(lambda: _vit(num_labels=16))(default, kwargs)
    for config in _sub_configs(kwargs):
        if isinstance(config.get("dac_config"), dict):
            config["dac_config"].update(encoder_hidden_size=4, downsampling_ratios=[2, 2, 2, 2], hop_length=16,
                                        codebook_dim=16)


# SAM 3's vision model: the neck's feature sizes are the ViT's grid (image_size / patch_size: 2 x 2)
# times 4, 2, 1; attention windows of 2 x 2 patches; position embeddings pretrained at the tiny size
_SAM3_VISION = {"backbone_feature_sizes": [[8, 8], [4, 4], [2, 2]],
                "backbone_config": {"window_size": 2, "pretrain_image_size": 16}}

# SAM 2 video and kin at 64 x 64 pixels: a Hiera of 4 one-block stages (no global attention: a global
# block that also pools queries has no window to pad to), the neck's feature sizes its stages' grids at
# strides 4, 8, 16, rotary tables of the stride-16 grid. The memory encoder's 64 channels are the image
# cross-attention's fixed key width, and below the hidden width (object pointers are split into
# memory-width tokens only where it is smaller)
_SAM2_VIDEO: dict[str, Any] = {
    "image_size": 64,
    "vision_config": {"backbone_config": {"hidden_size": 16, "num_attention_heads": 1, "image_size": [64, 64],
                                          "window_positional_embedding_background_size": [2, 2],
                                          "blocks_per_stage": [1, 1, 1, 1], "embed_dim_per_stage": [16, 32, 64, 128],
                                          "num_attention_heads_per_stage": [1, 1, 2, 2],
                                          "window_size_per_stage": [4, 4, 4, 4], "global_attention_blocks": []},
                      "backbone_channel_list": [128, 64, 32, 16], "backbone_feature_sizes": [[16, 16], [8, 8], [4, 4]],
                      "fpn_hidden_size": 128},
    "prompt_encoder_config": {"hidden_size": 128, "image_size": 64, "patch_size": 16},
    "mask_decoder_config": {"hidden_size": 128, "mlp_dim": 128, "num_attention_heads": 2, "iou_head_hidden_dim": 32},
    "memory_attention_hidden_size": 128, "memory_attention_num_layers": 2, "memory_attention_rope_feat_sizes": [4, 4],
    "memory_encoder_hidden_size": 128, "memory_encoder_output_channels": 64, "mask_downsampler_embed_dim": 128,
    "memory_fuser_embed_dim": 128, "memory_fuser_intermediate_dim": 128,
}

# SAM 3 tracker video at 32 x 32 pixels: the memory's sizes as _SAM2_VIDEO's; the ViT's grid of 4 x 4
# patches is the memory's grid (the masks are downsampled 16 times from 4 x the grid)
_SAM3_TRACKER_VIDEO: dict[str, Any] = {
    "image_size": 32,
    "vision_config": {"backbone_config": {"image_size": 32, "patch_size": 8, "window_size": 2,
                                          "pretrain_image_size": 32},
                      "backbone_feature_sizes": [[16, 16], [8, 8], [4, 4]], "fpn_hidden_size": 128},
    "prompt_encoder_config": {"hidden_size": 128, "image_size": 32, "patch_size": 8},
    "mask_decoder_config": _SAM2_VIDEO["mask_decoder_config"],
    **{k: v for k, v in _SAM2_VIDEO.items() if k.startswith(("memory_", "mask_downsampler"))},
    "memory_attention_feed_forward_hidden_size": 128,
}

CONFIG: dict[str, ConfigFix] = {
    # CHMv2: its DPT head's widths are lists and sizes of its own (1024-channel 3 x 3 convolutions)
    "chmv2": {"post_process_channels": [8, 16, 32, 64], "fusion_hidden_size": 32, "head_hidden_size": 16,
              "number_output_channels": 16},
    # EdgeTAM video (see _SAM2_VIDEO): its perceiver resampler's 2-D latents are the memory's rotary
    # key grid (2 x 2)
    "edgetam_video": {**_SAM2_VIDEO, "memory_attention_mlp_hidden_size": 128, "memory_attention_rope_k_sizes": [2, 2],
                      "perceiver_resampler_num_latents": 4, "perceiver_resampler_num_latents_2d": 4,
                      "perceiver_resampler_mlp_intermediate_size": 128},
    # EfficientLoFTR: hidden_size is the last stage's channels; its rotary table is hidden_size / 2 wide and
    # rotates all heads' features at once, so the rotated dims (head_dim x partial_rotary_factor 4) must be
    # hidden_size / 4: 8 heads of 8, and as many kv heads (keys are viewed hidden_size wide too). Its
    # BatchNorm scales are drawn N(0, initializer_range): at 0.02 the image's detail is lost, leaving
    # features that differ little between positions; attention over the unaggregated features (1 x 1)
    "efficientloftr": {"out_features": [16, 16, 32, 64], "stage_num_blocks": [1, 1, 1, 1],
                       "num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 8, "initializer_range": 0.5,
                       "q_aggregation_kernel_size": 1, "q_aggregation_stride": 1,
                       "kv_aggregation_kernel_size": 1, "kv_aggregation_stride": 1},
    # FastVLM: its timm FastViT tower (see _without_timm) makes a (batch, channels, height, width) map
    "fast_vlm": _without_timm(_vitdet),
    # LightGlue: its width is descriptor_dim (hidden_size follows it); its SuperPoint detector's widths are
    # lists; no early stop or pruning of keypoints (thresholds on confidences), every mutual match kept
    "lightglue": {"descriptor_dim": 64, "depth_confidence": 0.0, "width_confidence": 0.0, "filter_threshold": 0.0,
                  "keypoint_detector_config": {"encoder_hidden_sizes": [8, 8, 16, 16], "decoder_hidden_size": 32,
                                               "descriptor_decoder_dim": 32}},
    # PE audio / video (see _perception_encoder)
    "pe_audio_video": _perception_encoder,
    "pe_audio_video_encoder": _perception_encoder,
    "pe_video": _perception_encoder,
    "pe_video_encoder": _perception_encoder,
    # PerceptionLM: its timm tower (see _without_timm) makes a class token and patch tokens, of the width
    # named in its model_args
    "perception_lm": _without_timm(lambda: _vit(model_args={"embed_dim": 64})),
    # PP-DocLayoutV2: an HGNetV2 backbone of lists of channels, a decoder fed its stages 2-4 and the encoder's
    # width; the detections' thresholds and reading order are per class (None by default: no checkpoint)
    "pp_doclayout_v2": {
        "backbone_config": {"stem_channels": [3, 8, 8], "stage_in_channels": [8, 16, 32, 64],
                            "stage_mid_channels": [8, 16, 32, 32], "stage_out_channels": [16, 32, 64, 128],
                            "hidden_sizes": [16, 32, 64, 128], "stage_num_blocks": [1, 1, 1, 1],
                            "stage_numb_of_layers": [2, 2, 2, 2]},
        "encoder_in_channels": [32, 64, 128], "decoder_in_channels": [64, 64, 64], "num_queries": 8,
        "class_thresholds": [0.0, 0.0], "class_order": [0, 1],
        "reading_order_config": {"coordinate_size": 16, "shape_size": 16, "global_pointer_head_size": 16},
    },
    # SAM 2 video (see _SAM2_VIDEO)
    "sam2_video": {**_SAM2_VIDEO, "memory_attention_feed_forward_hidden_size": 128},
    # SAM 3 (see _SAM3_VISION)
    "sam3": {"vision_config": _SAM3_VISION},
    "sam3_lite_text": {"vision_config": _SAM3_VISION},
    "sam3_tracker": {"vision_config": _SAM3_VISION, "mask_decoder_config": {"mlp_dim": 128}},
    # SAM 3 tracker video (see _SAM3_TRACKER_VIDEO)
    "sam3_tracker_video": _SAM3_TRACKER_VIDEO,
    # SAM 3 video: SAM 3's detector (see _SAM3_VISION) at the tracker's 32 x 32 pixels and its hidden width
    # (the tracker's neck is built from the detector's vision config), 4 queries; every query is a
    # detection (a score threshold of 0: random weights score near 0); the masks at 4 x the grid
    "sam3_video": {
        "image_size": 32, "low_res_mask_size": 16, "score_threshold_detection": 0.0, "new_det_thresh": 0.0,
        "detector_config": {
            "image_size": 32,
            "vision_config": {"backbone_config": {"patch_size": 8, "window_size": 2, "pretrain_image_size": 32},
                              "backbone_feature_sizes": [[16, 16], [8, 8], [4, 4]], "fpn_hidden_size": 128},
            "detr_encoder_config": {"hidden_size": 128}, "detr_decoder_config": {"hidden_size": 128, "num_queries": 4},
            "geometry_encoder_config": {"hidden_size": 128, "roi_size": 2}, "mask_decoder_config": {"hidden_size": 128},
        },
        "tracker_config": _SAM3_TRACKER_VIDEO,
    },
    # V-JEPA 2: its predictor's sizes are pred_*; the rotary grid is crop_size / patch_size square and
    # frames_per_clip / tubelet_size deep (positions of a larger clip would wrap around it)
    "vjepa2": {"pred_hidden_size": 48, "pred_num_attention_heads": 4, "pred_num_hidden_layers": 2,
               "crop_size": 16, "frames_per_clip": 4, "num_pooler_layers": 1},
}



def _image(size: int, channels: int = 3, seed: int = 1) -> Tensor:
    return torch.randn(1, channels, size, size, generator=torch.Generator().manual_seed(seed))


def _image_pair(size: int) -> dict[str, Tensor]:
    """Keypoint matchers' input: (batch, 2 images, channels, height, width)."""
    return {"pixel_values": torch.stack((_image(size, seed=1), _image(size, seed=2)), dim=1)}


def _video(frames: int = 4, size: int = 16) -> Tensor:
    return torch.randn(1, frames, 3, size, size, generator=torch.Generator().manual_seed(3))


def _ids(rows: int = 2, length: int = 12, vocab: int = 100) -> Tensor:
    return torch.randint(3, vocab, (rows, length), generator=torch.Generator().manual_seed(0))


def _audio(samples: int = 128) -> Tensor:
    """(batch, 1 channel, samples) of a waveform: 8 frames of _perception_encoder's DAC codec."""
    return torch.randn(1, 1, samples, generator=torch.Generator().manual_seed(4))


def _point_prompt(size: int) -> dict[str, Tensor]:
    """One positive point (a tracker's prompt) at a third of an image of ``size`` pixels."""
    return {"input_points": torch.tensor([[[[size / 4, size / 3]]]]),
            "input_labels": torch.tensor([[[1]]], dtype=torch.int32)}


INPUTS: dict[str, Callable[[nn.Module], dict[str, Tensor]]] = {
    # EdgeTAM video: 3 frames of 64 x 64 pixels and a point on the first (run by _track)
    "edgetam_video": lambda model: {"pixel_values_videos": _video(frames=3, size=64), **_point_prompt(64)},
    # EfficientLoFTR: its coarse features (stride 8) are the tokens: 64 per image of 64 x 64
    "efficientloftr": lambda model: _image_pair(64),
    # LightGlue: SuperPoint finds some 50 keypoints per random image of 64 x 64 (stride 8, NMS radius 4)
    "lightglue": lambda model: _image_pair(64),
    # PE audio / video: a video of 4 frames, 8 frames of audio, and (to the models with a text model) text
    "pe_audio_video": lambda model: {"input_ids": _ids(rows=1), "pixel_values_videos": _video(),
                                     "input_values": _audio()},
    "pe_audio_video_encoder": lambda model: {"pixel_values_videos": _video(), "input_values": _audio()},
    "pe_video": lambda model: {"input_ids": _ids(rows=4), "pixel_values_videos": _video()},
    "pe_video_encoder": lambda model: {"pixel_values_videos": _video()},
    # PP-DocLayoutV2: its feature pyramid (strides 8, 16, 32) needs an image of at least 32 x 32 pixels
    "pp_doclayout_v2": lambda model: {"pixel_values": _image(32)},
    # SAM 2 video: 3 frames of 64 x 64 pixels and a point on the first (run by _track)
    "sam2_video": lambda model: {"pixel_values_videos": _video(frames=3, size=64), **_point_prompt(64)},
    # SAM 3: an image and a text prompt (its token ids)
    "sam3": lambda model: {"pixel_values": _image(16), "input_ids": _ids(rows=1, length=8)},
    "sam3_lite_text": lambda model: {"pixel_values": _image(16), "input_ids": _ids(rows=1, length=8)},
    # SAM 3 tracker video: 3 frames of 32 x 32 pixels and a point on the first (run by _track)
    "sam3_tracker_video": lambda model: {"pixel_values_videos": _video(frames=3, size=32), **_point_prompt(32)},
    # SAM 3 video: 3 frames of 32 x 32 pixels and a text prompt (run by _detect_and_track)
    "sam3_video": lambda model: {"pixel_values_videos": _video(frames=3, size=32), "input_ids": _ids(rows=1, length=8)},
    # V-JEPA 2: a video (batch, frames, channels, height, width) of 2 tubelets of 2 x 2 patches
    "vjepa2": lambda model: {"pixel_values_videos": _video()},
}


def _session(model: nn.Module, video: Tensor) -> Any:
    """A fresh inference session of a video model (the class its forward takes) on ``video``'s frames:
    a fresh one each call, so that every call computes the same."""
    session_class = inspect.signature(type(model).forward).parameters["inference_session"].annotation
    device = video.device
    return session_class(video=video, video_height=video.shape[-2], video_width=video.shape[-1], dtype=video.dtype,
                         inference_device=device, inference_state_device=device, video_storage_device=device)


def _track(model: nn.Module, inputs: dict[str, Tensor]) -> Tensor:
    """A video tracker's masks of every frame of ``inputs``' video, from a point prompt on its first
    frame (the frames after it run the memory attention, where the rotary embedding is)."""
    video = inputs["pixel_values_videos"][0]
    session = _session(model, video)
    obj_idx = session.obj_id_to_idx(1)
    prompt = {"point_coords": inputs["input_points"], "point_labels": inputs["input_labels"]}
    session.add_point_inputs(obj_idx, 0, prompt)
    session.obj_with_new_inputs = [1]
    return torch.stack([model(inference_session=session, frame_idx=i).pred_masks for i in range(len(video))])


def _detect_and_track(model: nn.Module, inputs: dict[str, Tensor]) -> Tensor:
    """SAM 3 video's masks of every object in every frame of ``inputs``' video, found by its text prompt
    (token ids) and tracked (flattened: the number of objects varies)."""
    video = inputs["pixel_values_videos"][0]
    session = _session(model, video)
    prompt = session.add_prompt("tiny")
    session.prompt_input_ids[prompt] = inputs["input_ids"]
    session.prompt_attention_masks[prompt] = torch.ones_like(inputs["input_ids"])
    masks = []
    for i in range(len(video)):
        out = model(inference_session=session, frame_idx=i)
        masks += [mask.flatten() for mask in out.obj_id_to_mask.values()]
    return torch.cat(masks)


RUNS: dict[str, Callable[[nn.Module, dict[str, Tensor]], Tensor]] = {
    # video models: their forward takes an inference session (see _session)
    "edgetam_video": _track,
    "sam2_video": _track,
    "sam3_tracker_video": _track,
    "sam3_video": _detect_and_track,
}
