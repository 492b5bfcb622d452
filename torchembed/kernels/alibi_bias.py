"""The ALiBi prefill bias as one fused write (custom op ``torchembed::alibi_prefill_bias``).

:func:`prefill_bias` is :func:`torchembed.functional.alibi.alibi_prefill_bias` (the PyTorch
reference: a subtraction, then a masking pass) in one Triton launch where the kernel can run:
each ``(b, h, q, k)`` element is written once, nothing else of that size is read or written.
Press et al., arXiv:2108.12409. Triton is imported on the first launch.
"""

from __future__ import annotations

import torch
from torch import Tensor

from torchembed.functional.alibi import alibi_prefill_bias
from torchembed.kernels.availability import kernel_can_run

__all__ = ["prefill_bias"]

_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MAX_PROGRAMS_Z = 65535  # grid axis 2 of the kernel is b * h


def _shape(key_bias: Tensor, keep: Tensor) -> tuple[int, int, int, int]:
    """``(b, h, q, k)`` of the bias; ValueError naming the shapes that do not fit."""
    if key_bias.dim() != 3 or keep.dim() != 4 or keep.shape[1] != 1:
        raise ValueError(
            f"prefill_bias: key_bias must be (b or 1, h, k) and keep (b or 1, 1, q, k), got "
            f"{tuple(key_bias.shape)} and {tuple(keep.shape)}"
        )
    kb, heads, k_len = key_bias.shape
    mb, _, q_len, mk = keep.shape
    if mk != k_len or q_len > k_len or (kb != mb and 1 not in (kb, mb)):
        raise ValueError(
            f"prefill_bias: keep (b or 1, 1, q, k) must match key_bias (b or 1, h, k) with q <= k, got "
            f"{tuple(keep.shape)} and {tuple(key_bias.shape)}"
        )
    return max(kb, mb), heads, q_len, k_len


@torch.library.custom_op("torchembed::alibi_prefill_bias", mutates_args=())
def _bias_op(key_bias: Tensor, keep: Tensor, dtype: torch.dtype) -> Tensor:
    shape = _shape(key_bias, keep)
    if not kernel_can_run(key_bias):
        return alibi_prefill_bias(key_bias, keep, dtype)  # (b, h, q, k) already: keep is given
    from torchembed.kernels import alibi_bias_triton

    return alibi_bias_triton.write(key_bias, keep, torch.empty(shape, dtype=dtype, device=key_bias.device))


@_bias_op.register_fake
def _bias_fake(key_bias: Tensor, keep: Tensor, dtype: torch.dtype) -> Tensor:
    return key_bias.new_empty(_shape(key_bias, keep), dtype=dtype)


def prefill_bias(key_bias: Tensor, keep: Tensor | None, dtype: torch.dtype) -> Tensor:
    """The SDPA mask of an ALiBi prefill, as :func:`torchembed.functional.alibi.alibi_prefill_bias`.

    Args:
        key_bias: ``(b or 1, h, k)`` float.
        keep: ``(b or 1, 1, q, k)`` bool (True = attend), or None (the reference's one-row form).
        dtype: of the result.

    Returns:
        ``(b, h, q, k)`` in ``dtype``: ``key_bias[j] - key_bias[k - q + i]`` where ``keep``, the
        finite minimum of ``dtype`` elsewhere; the subtraction in float32, rounded once. The Triton
        kernel where it can run (CUDA, or CPU under ``TRITON_INTERPRET=1``; float16/bfloat16/float32
        results), else the PyTorch reference, with equal results. No gradient (ALiBi learns nothing).
    """
    if keep is None or dtype not in _KERNEL_DTYPES or not kernel_can_run(key_bias):
        return alibi_prefill_bias(key_bias, keep, dtype)
    shape = _shape(key_bias, keep)
    if (keep.dtype != torch.bool or keep.device != key_bias.device or not key_bias.is_floating_point()
            or shape[0] * shape[1] > _MAX_PROGRAMS_Z):
        return alibi_prefill_bias(key_bias, keep, dtype)
    if torch.compiler.is_compiling():
        return torch.ops.torchembed.alibi_prefill_bias(key_bias, keep, dtype)
    from torchembed.kernels import alibi_bias_triton  # (the op's dispatch costs host time in eager)

    return alibi_bias_triton.write(key_bias, keep, torch.empty(shape, dtype=dtype, device=key_bias.device))
