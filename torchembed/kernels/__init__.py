"""Fused Triton kernels, registered as PyTorch custom ops (optional dependency: ``triton``; imported on first launch).

:mod:`~torchembed.kernels.route` decides which implementation runs (the one meaning of ``fused``, the one decode step);
:mod:`~torchembed.kernels.rope` is the RoPE kernel, :mod:`~torchembed.kernels.attention` the attention kernel (an ALiBi
bias or none), :mod:`~torchembed.kernels.alibi` the ALiBi attention's entry; ``*_triton`` modules hold device code.
"""

from torchembed.kernels.launch import interpret_mode, kernel_can_run, triton_available
from torchembed.kernels.rope import rotary_fused, rotary_fused_usual
from torchembed.kernels.route import FusedUnavailableError, decode_step, use_kernel, use_rope_kernel

__all__ = ["FusedUnavailableError", "decode_step", "interpret_mode", "kernel_can_run", "rotary_fused",
           "rotary_fused_usual", "triton_available", "use_kernel", "use_rope_kernel"]
