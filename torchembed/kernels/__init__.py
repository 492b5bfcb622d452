"""Fused Triton kernels, registered as PyTorch custom ops (optional dependency: ``triton``).

``import torchembed.kernels`` never imports Triton: ``triton_available()`` imports it on its
first call, and the kernel module (``rope_triton``) is imported only when a kernel launches.

* ``triton_available()``: Triton importable (cached).
* ``interpret_mode()``: ``TRITON_INTERPRET=1`` (kernels run on CPU tensors, slowly; for tests).
* ``kernel_can_run(t)``: Triton available and ``t`` on CUDA (or on CPU in interpret mode);
  ``TORCHEMBED_DISABLE_TRITON=1`` forces False.
* ``rotary_fused(q, k, cos, sin, *, inv_freq, scale, positions, interleaved, inplace,
  conjugate)``: RoPE on q and k in one launch (custom ops ``torchembed::rotary`` /
  ``torchembed::rotary_``).
* ``rotary_tables_(q, k, cos, sin)``: the unchecked in-place call the patched HF attention
  makes at inference (per-token tables; no autograd).

Every route to the RoPE kernel shares one launch cache (``rope_launches``). ALiBi: the fused
attention kernel (``alibi_flash.alibi_flash``, custom ops ``torchembed::alibi_flash``,
``torchembed::alibi_flash_backward``, ``torchembed::alibi_mask_rows``), the prefill bias in one write
(``alibi_bias.prefill_bias``, custom op ``torchembed::alibi_prefill_bias``) and the dispatch between
them (``alibi_attention``).
"""

from torchembed.kernels.rope_op import (
    interpret_mode,
    kernel_can_run,
    rotary_fused,
    rotary_tables_,
    triton_available,
)

__all__ = ["interpret_mode", "kernel_can_run", "rotary_fused", "rotary_tables_", "triton_available"]
