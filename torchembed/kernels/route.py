"""Which implementation runs: every kernel-or-PyTorch decision of the library, and the one meaning of ``fused``.

``fused`` means the same for every component (a rotation, an ALiBi attention, a patched RoPE model's decode-step
attention): ``None`` the kernel wherever it runs (CUDA tensors and Triton; CPU tensors under ``TRITON_INTERPRET=1``)
and takes the call, PyTorch elsewhere, quietly (under ``torch.compile`` the rotation and the mask summary take PyTorch
operations, which inductor fuses); ``True`` the kernel for every call the component computes, or
:class:`FusedUnavailableError` naming why and the fix (a RoPE model's attention is replaced for decode steps only:
its prefill stays upstream's); ``False`` PyTorch only. ``patch(model, cudnn_decode=True)`` is the one switch beside
it: one-query decode steps go to SDPA, whatever ``fused`` says.

A decode step has one definition, :func:`decode_step`. The entries routed to trust the answers given here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

import torch
from torch import Tensor

from torchembed.kernels.launch import kernel_can_run, triton_available, triton_disabled
from torchembed.kernels.settings import AlibiPolicy, settings

__all__ = ["ATTENTION_DTYPES", "DECODE_QUERIES", "MAX_HEAD_DIM", "FusedUnavailableError", "alibi_path", "bias_on_kernel",
           "check_fused", "decode_attention_on_kernel", "decode_step", "flash_unsupported", "mask_summary_on_kernel",
           "refuse", "use_kernel", "use_rope_kernel", "why_not"]

DECODE_QUERIES = 16  # a decode step: at most this many new queries (speculative decoding included) over a KV cache
ATTENTION_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256
_MAX_PROGRAMS = 65535  # the attention kernels' grid axis 1 holds batch x heads

_ROPE = "the fused RoPE kernel"
_ATTENTION = "the fused attention kernel"


# --- fused: one meaning ---------------------------------------------------------------------------


class FusedUnavailableError(RuntimeError):
    """``fused=True`` was asked for where the Triton kernel cannot run or take the call."""


def refuse(what: str, why: str) -> FusedUnavailableError:
    """Every refusal, in one form (``what`` cannot run here, ``why``; or ``fused=None``)."""
    return FusedUnavailableError(f"fused=True: {what} cannot run here: {why}; or pass fused=None (the kernel where it "
                                 "runs, PyTorch elsewhere)")


def check_fused(fused: Any, where: str = "fused") -> Optional[bool]:
    """``fused`` if it is None, True or False; else a TypeError naming ``where``."""
    if fused is None or fused is True or fused is False:
        return fused
    raise TypeError(f"{where} must be None (the kernel where it can run), True (require it) or False (never), "
                    f"got {fused!r}")


def why_not(t: Optional[Tensor] = None) -> str:
    """What keeps the kernels from running (on ``t``), as the fix to make."""
    if triton_disabled():
        return "TORCHEMBED_DISABLE_TRITON=1 switches the Triton kernels off (unset it)"
    if not triton_available():
        return "it needs Triton: pip install triton"
    if t is not None and not kernel_can_run(t):
        return f"it runs on CUDA tensors (these are on {t.device}): move them with .to('cuda')"
    return "it cannot run here"


def use_kernel(fused: Optional[bool], t: Tensor, what: str = "the fused kernel") -> bool:
    """Whether a kernel runs on ``t`` for this ``fused``, the device being the only question.

    Raises:
        FusedUnavailableError: ``fused=True`` where the kernel cannot run, naming the fix.
    """
    if fused is False:
        return False
    if kernel_can_run(t):
        return True
    if fused:
        raise refuse(what, why_not(t))
    return False


# --- a decode step: one definition --------------------------------------------------------------


def decode_step(q_len: int, k_len: int) -> bool:
    """Whether attention of ``q_len`` new queries over ``k_len`` keys is a decode step: one query, or up to
    :data:`DECODE_QUERIES` over more keys than queries (a KV cache holds the rest)."""
    return q_len == 1 or q_len <= DECODE_QUERIES and q_len < k_len


# --- the rotation ---------------------------------------------------------------------------------


def use_rope_kernel(fused: Optional[bool], x: Tensor) -> bool:
    """Whether to rotate ``x`` on the kernel (:func:`~torchembed.kernels.rope.rotary_fused`) or with PyTorch operations
    (:func:`torchembed.functional.apply_rotary`). While ``torch.compile`` traces, ``fused=None`` takes PyTorch
    operations, which inductor fuses with the neighbouring norms and projections (an opaque op measured slower).

    Raises:
        FusedUnavailableError: ``fused=True`` where the kernel cannot run, naming the fix.
    """
    if fused is None and torch.compiler.is_compiling():
        return False
    return use_kernel(fused, x, _ROPE)


# --- attention ------------------------------------------------------------------------------------


def flash_unsupported(q: Tensor, k: Tensor, v: Tensor, keep: Optional[Tensor] = None) -> Optional[str]:
    """Why the attention kernel cannot take these inputs, or None when it can (device aside: see
    :func:`~torchembed.kernels.launch.kernel_can_run`). Python compares only (no tensor op, no sync)."""
    qs, ks, vs = q.shape, k.shape, v.shape
    if len(qs) != 4 or len(ks) != 4 or len(vs) != 4:
        return f"it takes 4-D (batch, heads, seq, dim) q, k, v, got {tuple(qs)}, {tuple(ks)}, {tuple(vs)}"
    dtype = q.dtype
    if dtype not in ATTENTION_DTYPES or k.dtype != dtype or v.dtype != dtype:
        return f"it takes q, k, v of one dtype in float16/bfloat16/float32, got {dtype}, {k.dtype}, {v.dtype}"
    batch, heads, q_len, dim = qs
    kv_batch, kv_heads, k_len, kv_dim = ks
    if kv_batch != batch or kv_dim != dim or vs != ks:
        return f"it takes k, v (batch, kv_heads, seq_k, dim) matching q {tuple(qs)}, got {tuple(ks)}, {tuple(vs)}"
    if kv_heads == 0 or heads % kv_heads:
        return f"its query heads ({heads}) must be a multiple of the key/value heads ({kv_heads})"
    if not 1 <= dim <= MAX_HEAD_DIM:
        return f"it takes head dims 1..{MAX_HEAD_DIM}, got {dim}"
    if batch * heads > _MAX_PROGRAMS:
        return f"it takes batch x heads <= {_MAX_PROGRAMS}, got {batch * heads}"
    device = q.device
    if keep is None:
        if q_len > k_len:
            return f"causal attention needs seq_q <= seq_k (queries are the last keys), got {q_len} > {k_len}"
    else:
        ms = keep.shape
        if len(ms) != 4 or ms[1] != 1 or (ms[0] != 1 and ms[0] != batch) or ms[2] != q_len or ms[3] != k_len:
            return f"it takes keep (batch or 1, 1, {q_len}, {k_len}), got {tuple(ms)}"
        if keep.dtype != torch.bool:
            return f"it takes a bool keep mask, got {keep.dtype}"
    if k.device != device or v.device != device or (keep is not None and keep.device != device):
        return "it takes q, k, v (and keep) on one device"
    return None


def mask_summary_on_kernel(keep: Tensor) -> bool:
    """Whether a keep mask is summarised by its kernel: where it runs, outside ``torch.compile`` (there tensor ops)."""
    return not torch.compiler.is_compiling() and kernel_can_run(keep)


def bias_on_kernel(key_bias: Tensor, keep: Tensor, dtype: torch.dtype) -> bool:
    """Whether an ALiBi prefill's SDPA mask (``key_bias (b or 1, h, k)``, ``keep (b or 1, 1, q, k)``) is written by its
    kernel (where it runs and takes the inputs; the entry then checks the shapes); else by PyTorch operations."""
    if not (kernel_can_run(key_bias) and dtype in ATTENTION_DTYPES and keep.dtype == torch.bool
            and keep.device == key_bias.device and key_bias.is_floating_point()):
        return False
    if key_bias.dim() != 3 or keep.dim() != 4:
        return True  # (shapes it does not take: the entry's check names them)
    return max(key_bias.shape[0], keep.shape[0]) * key_bias.shape[1] <= _MAX_PROGRAMS


def alibi_path(q: Tensor, k: Tensor, v: Tensor, keep: Tensor | None, *, fused: bool | None, dropout_p: float,
               layer: bool, sdpa_decode: bool = False) -> str:
    """Where an ALiBi attention of ``q (b, h, q, d)`` over ``k, v (b, hk, k, d)`` runs:

    * ``"kernel"``: the fused attention kernel: a model layer's decode steps, prefills above the
      :class:`~torchembed.kernels.settings.AlibiPolicy` bound (``fused=None``), every call (``fused=True``);
    * ``"dense"``: a layer's small prefill, or any without the kernel, on CUDA or the CPU: SDPA with the bias;
    * ``"decode"``: a layer's one-query decode step with ``sdpa_decode`` (the patch's ``cudnn_decode``), without a
      kernel or with ``fused=False``: SDPA with the decode mask built once per forward;
    * ``"reference"``: everything else (``fused=False``, compiled without the kernel): the PyTorch reference.

    ``layer``: a model layer's call (its forward shares what it derives across its layers).

    Raises:
        FusedUnavailableError: ``fused=True`` where the kernel cannot run or take the inputs (dropout included).
    """
    q_len = q.shape[-2]
    decode = layer and not dropout_p and decode_step(q_len, k.shape[-2])
    if fused is False:
        return "decode" if decode and q_len == 1 else "reference"
    if fused and sdpa_decode and decode and q_len == 1:
        return "decode"
    why = flash_unsupported(q, k, v, keep) if kernel_can_run(q) else why_not(q)
    if dropout_p and why is None:
        why = "it has no dropout (dropout_p > 0)"
    if fused:
        if why is not None:
            raise refuse(_ATTENTION, why)
        return "kernel"
    if decode:
        if why is None and not sdpa_decode:
            return "kernel"
        if q_len == 1:
            return "decode"
    policy = settings().policy
    if layer and _dense(q, k, policy):
        return "dense"
    if why is None and policy.prefill != "dense":
        return "kernel"
    if q_len != 1 and q.device.type in policy.dense_devices and not torch.compiler.is_compiling():
        return "dense"
    return "reference"


def _dense(q: Tensor, k: Tensor, policy: AlibiPolicy) -> bool:
    """A model layer's prefill materialises the bias: a prefill on a dense device (outside ``torch.compile``) within
    the policy's bound (any size under ``prefill="dense"``)."""
    q_len = q.shape[-2]
    if q_len == 1 or q.device.type not in policy.dense_devices or torch.compiler.is_compiling() or policy.prefill == "kernel":
        return False
    if policy.prefill == "dense":
        return True
    elements = q.shape[0] * q.shape[1] * q_len * k.shape[-2]
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad)
    return elements <= (policy.dense_grad_max_elements if grad else policy.dense_max_elements)


# Keyword arguments of transformers' SDPA function that do not change what it computes (it ignores them, or the mask
# already carries them); a call with any other non-None keyword is one the kernel does not compute as upstream does.
_IGNORED_KWARGS = frozenset({"position_ids", "cache_position", "output_attentions", "use_cache", "sliding_window",
                             "layer_idx", "past_key_values", "past_key_value", "token_type_ids", "is_causal"})


def decode_attention_on_kernel(fused: bool | None, query: Tensor, key: Tensor, value: Tensor,
                               attention_mask: Tensor | None, dropout: float, kwargs: Mapping[str, Any]) -> bool:
    """Whether a patched RoPE model's SDPA call (HF's convention: ``query (b, h, q, d)``, ``key``/``value``
    ``(b, hk, k, d)``, a bool keep mask ``(b or 1, 1, q, k)`` or None) runs on the attention kernel without a bias; else
    upstream's SDPA function runs it. Only decode steps (:func:`decode_step`; several queries without a mask are a
    prefill: upstream aligns them to the first keys) are the kernel's: ``fused=None`` takes
    those the kernel runs and computes as upstream does, ``fused=True`` every one (else :class:`FusedUnavailableError`),
    ``False`` none.

    Raises:
        FusedUnavailableError: ``fused=True`` and a decode step the kernel cannot run or compute as upstream does.
    """
    if fused is False or query.dim() != 4 or not decode_step(query.shape[2], key.shape[-2]):
        return False
    if attention_mask is None and query.shape[2] != 1:
        return False  # a prefill: without a mask upstream aligns the queries to the first keys (a static cache's prompt)
    why = None if kernel_can_run(query) else why_not(query)
    if why is None:
        why = _decode_unsupported(query, key, value, attention_mask, dropout, kwargs)
    if why is not None and fused:
        raise refuse(f"{_ATTENTION} (a decode step's attention)", why)
    return why is None


def _decode_unsupported(query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None, dropout: float,
                        kwargs: Mapping[str, Any]) -> Optional[str]:
    """Why the kernel does not compute this decode step as upstream's SDPA does, or None."""
    if dropout:
        return "it has no dropout (dropout > 0)"
    if value.shape[-1] != query.shape[-1]:
        return f"it takes values of the queries' head dim {query.shape[-1]}, got {value.shape[-1]}"
    changing = sorted(name for name, given in kwargs.items() if given is not None and name not in _IGNORED_KWARGS)
    if changing:
        return f"the call passes {', '.join(changing)}, which changes what upstream computes"
    return flash_unsupported(query, key, value, attention_mask)
