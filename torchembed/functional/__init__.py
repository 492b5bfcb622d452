"""Pure-PyTorch reference math: the ground truth the kernels are tested against, and the CPU path."""

from torchembed.functional.alibi import alibi_attention_reference, alibi_bias, alibi_key_bias, alibi_slopes
from torchembed.functional.rope import (
    ROPE_TYPES,
    apply_rotary,
    apply_rotary_qk,
    rope_cos_sin,
    rope_inv_freq,
    rope_positions,
)
from torchembed.functional.sinusoidal import sinusoidal_table

__all__ = ["ROPE_TYPES", "alibi_attention_reference", "alibi_bias", "alibi_key_bias", "alibi_slopes", "apply_rotary",
           "apply_rotary_qk", "rope_cos_sin", "rope_inv_freq", "rope_positions", "sinusoidal_table"]
