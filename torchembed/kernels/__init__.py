"""Fused Triton kernels, registered as PyTorch custom ops (optional dependency: ``triton``).

``import torchembed.kernels`` never imports Triton: :func:`triton_available` imports it on its first call, and a
kernel's device code is imported only when the kernel first launches.

* :mod:`~torchembed.kernels.route`: which implementation runs, for every caller: the one meaning of ``fused``
  (``use_kernel``, ``FusedUnavailableError``), the rotation's choice (``use_rope_kernel``), the one definition of a
  decode step (``decode_step``), the ALiBi attention's path (``alibi_path``), a patched RoPE model's decode attention
  (``decode_attention_on_kernel``).
* :mod:`~torchembed.kernels.rope` (device code ``rope_triton``): ``rotary_fused(q, k, cos, sin, *, inv_freq, scale,
  positions, interleaved, inplace, conjugate)``, RoPE on q and k in one launch (custom ops ``torchembed::rotary`` /
  ``torchembed::rotary_``); ``rotary_fused_usual(q, k, cos, sin)``: HF's usual call through it, or None where the
  kernel does not take the call.
* :mod:`~torchembed.kernels.attention` (plans ``attention_plan``, device code ``attention_triton``): the fused
  attention kernel with an ALiBi bias or none, grouped kv heads, any mask, split-key decode (``alibi_flash``,
  ``fused_attention``; custom ops ``torchembed::alibi_flash``, ``torchembed::alibi_flash_backward``).
* :mod:`~torchembed.kernels.alibi` (device code ``alibi_triton``): the ALiBi attention's entry (``alibi_attention``),
  the masks SDPA takes and the prefill bias in one write (custom op ``torchembed::alibi_prefill_bias``).
* :mod:`~torchembed.kernels.launch`: where kernels can run (``kernel_can_run``, ``triton_available``,
  ``interpret_mode``) and how every kernel is launched; :mod:`~torchembed.kernels.settings`: their configuration.
"""

from torchembed.kernels.launch import interpret_mode, kernel_can_run, triton_available
from torchembed.kernels.rope import rotary_fused, rotary_fused_usual
from torchembed.kernels.route import FusedUnavailableError, decode_step, use_kernel, use_rope_kernel

__all__ = ["FusedUnavailableError", "decode_step", "interpret_mode", "kernel_can_run", "rotary_fused",
           "rotary_fused_usual", "triton_available", "use_kernel", "use_rope_kernel"]
