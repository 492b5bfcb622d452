"""Decode steps without a per-length cuDNN plan build: SDPA's backend choice for a patched model.

On Hopper GPUs PyTorch's ``scaled_dot_product_attention`` prefers its cuDNN backend for half-precision
attention, and cuDNN builds a new execution plan for every new key length: a decode loop meets a new
length at every step. Measured on an H200 (torch 2.11, transformers 5.17): a plain loop
(``model(next_token, past_key_values=cache)``), two layers of LLaMA-3.1-8B's shape at 32k keys, 38-40 ms
per step against 2.8 ms with cuDNN left out (a patched MPT: 40 against 4.6 ms); ``generate`` with its
attention mask (transformers drops an all-ones mask and SDPA takes cuDNN again), four layers at 64k keys,
65 ms per token against 7 ms once the lengths' plans exist (``benchmarks/results/long-context.md``).

A patched model therefore runs a forward of its base model (what the task model and ``generate`` call,
and what a loop may call directly) that is a CUDA decode step (at most :data:`DECODE_QUERIES` queries,
with or without an attention mask) with SDPA restricted to flash, memory-efficient and math attention
(the same function; numerics within bf16 rounding of cuDNN's): a forward pre-hook enters
``torch.nn.attention.sdpa_kernel`` and a forward hook that runs also when the forward raises leaves it.
Per instance and switchable: ``torchembed.patch(model, cudnn_decode=True)`` keeps SDPA's own choice.
The hooks hold no reference to the model (``nn.DataParallel`` replicas share them) and are not a
positional component (``find_positional_components`` does not list them).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from torchembed.patches.actions import Component

__all__ = ["DECODE_QUERIES", "DecodeBackendHooks", "EnterDecodeBackends", "LeaveDecodeBackends", "trapped"]

DECODE_QUERIES = 16  # a decode step, speculative ones included: at most this many new tokens


def trapped(args: tuple, kwargs: dict) -> bool:
    """Whether a model's forward call is a CUDA decode step (where SDPA would take cuDNN and build a plan
    for the new key length), with or without an attention mask. Reads ``input_ids`` (keyword or first
    positional argument) or ``inputs_embeds`` (keyword)."""
    x = kwargs.get("input_ids")
    if x is None and args and isinstance(args[0], torch.Tensor):
        x = args[0]
    if isinstance(x, torch.Tensor) and x.dim() == 2:
        length = x.shape[1]
    else:
        x = kwargs.get("inputs_embeds")
        if not isinstance(x, torch.Tensor) or x.dim() != 3:
            return False
        length = x.shape[1]
    return length <= DECODE_QUERIES and _on_cuda(x)


def _on_cuda(t: torch.Tensor) -> bool:  # (a function, so that tests can stand in a GPU)
    return t.is_cuda


class _Open(threading.local):
    """Per thread: for each hooked forward running now (nested models: several), innermost last, the
    backend context it entered, or None."""

    def __init__(self) -> None:
        self.contexts: list[Any] = []


_OPEN = _Open()


def _no_cudnn() -> Any:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


class EnterDecodeBackends:
    """Forward pre-hook (with kwargs): for a :func:`trapped` call, SDPA without cuDNN until the forward ends."""

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        context = None
        if not torch.compiler.is_compiling() and trapped(args, kwargs):
            context = _no_cudnn()
            context.__enter__()
        _OPEN.contexts.append(context)


class LeaveDecodeBackends:
    """Forward hook (always called, also when the forward raised): SDPA's previous choice again."""

    def __call__(self, module: nn.Module, args: tuple, output: Any) -> None:
        if _OPEN.contexts:
            context = _OPEN.contexts.pop()
            if context is not None:
                context.__exit__(None, None, None)


@dataclass
class DecodeBackendHooks:
    """The two hooks on ``module`` (a patched model); undo removes them. Ids kept as plain data, so a
    deep copy removes the hooks from its own module."""

    component: Component
    module: nn.Module
    ids: tuple[int, int] | None = None

    def apply(self) -> None:
        enter = self.module.register_forward_pre_hook(EnterDecodeBackends(), with_kwargs=True, prepend=True)
        leave = self.module.register_forward_hook(LeaveDecodeBackends(), always_call=True)
        self.ids = (enter.id, leave.id)

    def undo(self) -> None:
        if self.ids is not None:
            enter, leave = self.ids
            self.module._forward_pre_hooks.pop(enter, None)
            self.module._forward_pre_hooks_with_kwargs.pop(enter, None)
            self.module._forward_hooks.pop(leave, None)
            self.module._forward_hooks_always_called.pop(leave, None)
            self.ids = None
