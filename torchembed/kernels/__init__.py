"""Fused Triton kernels, registered as PyTorch custom ops (optional dependency: ``triton``).

``import torchembed.kernels`` never imports Triton: :func:`triton_available` imports it on its first
call, and a kernel module is imported only when its kernel launches.

* :mod:`~torchembed.kernels.launch`: where the kernels run and the one meaning of ``fused``
  (``use_kernel``), ``triton_available()``, ``interpret_mode()``, ``kernel_can_run(t)``
  (``TORCHEMBED_DISABLE_TRITON=1`` switches every kernel off), and how every kernel is launched;
  :mod:`~torchembed.kernels.settings`: their configuration, in one object.
* ``rotary_fused(q, k, cos, sin, *, inv_freq, scale, positions, interleaved, inplace, conjugate)``:
  RoPE on q and k in one launch (:mod:`~torchembed.kernels.rope`; custom ops ``torchembed::rotary`` /
  ``torchembed::rotary_``), the one route into the RoPE kernel; ``rotary_fused_usual(q, k, cos,
  sin)``: HF's usual call through it, or None where the kernel does not take the call.
* ALiBi (:mod:`~torchembed.kernels.alibi`, device code in ``alibi_triton``): the attention's one
  dispatch (``alibi_attention``), the fused attention kernel (``alibi_flash``, custom ops
  ``torchembed::alibi_flash``, ``torchembed::alibi_flash_backward``; its mask summary ``mask_rows``) and the
  prefill bias in one write (``prefill_bias``, custom op ``torchembed::alibi_prefill_bias``).
"""

from torchembed.kernels.launch import (
    FusedUnavailableError,
    interpret_mode,
    kernel_can_run,
    triton_available,
    use_kernel,
)
from torchembed.kernels.rope import rotary_fused, rotary_fused_usual, use_rope_kernel

__all__ = ["FusedUnavailableError", "interpret_mode", "kernel_can_run", "rotary_fused", "rotary_fused_usual",
           "triton_available", "use_kernel", "use_rope_kernel"]
