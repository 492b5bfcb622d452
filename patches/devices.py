"""Layers of a model split over devices share one copy of the mask and bias per device.

accelerate's ``device_map`` dispatch gives every layer an ``AlignDevicesHook`` that moves the layer's arguments to its
device on every call: each layer past the first device receives a fresh copy of the attention mask and the ALiBi bias,
and torchembed's ALiBi attention, which derives its masks (the kernel's row summary, the decode mask) once per mask
*tensor*, would derive them once per layer. The pre-hook below runs before accelerate's and moves those keyword
arguments itself, through a per-model cache keyed by (source tensor, its version, device), so the derived masks are
built once per device and forward. Only arguments that torchembed's attention reads and nothing writes are shared (a
layer changing one in place would change it for the next ones). A copy lives as long as its source tensor; an in-place
change of the source (a new version) makes a new copy.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import Tensor, nn

from torchembed.patches.actions import AddForwardPreHook, Component
from torchembed.patches.registry import Family, PatchOptions

__all__ = ["AddForwardPreHook", "DeviceCopies", "ShareDeviceCopies", "SHARED_KWARGS"]


def execution_device(module: nn.Module) -> torch.device | None:
    """The device accelerate runs ``module`` on, or None when no dispatch hook says so."""
    device = getattr(getattr(module, "_hf_hook", None), "execution_device", None)
    if device is None:
        return None
    return torch.device("cuda", device) if isinstance(device, int) else torch.device(device)


SHARED_KWARGS = ("attention_mask", "alibi", "position_bias")  # read-only inputs of the ALiBi attention


class DeviceCopies:
    """Forward pre-hook (``with_kwargs=True``): the keyword arguments named in ``SHARED_KWARGS`` that are tensors not on
    the module's execution device are moved there once per (tensor, version, device) and shared by all layers."""

    def __init__(self) -> None:
        self._copies: dict[tuple[int, int, torch.device], tuple[weakref.ref, Tensor]] = {}

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        device = execution_device(module)
        names = [name for name in SHARED_KWARGS if name in kwargs]
        if device is None or not names:
            return None  # arguments unchanged
        return args, {**kwargs, **{name: self.to(kwargs[name], device) for name in names}}

    def to(self, value: Any, device: torch.device) -> Any:
        if not isinstance(value, Tensor) or not self._elsewhere(value, device):
            return value
        # inference tensors have no version counter (and cannot be changed outside inference mode)
        key = (id(value), 0 if value.is_inference() else value._version, device)
        entry = self._copies.get(key)
        if entry is not None and entry[0]() is value:
            return entry[1]
        copy = self._move(value, device)
        self._copies[key] = (weakref.ref(value, lambda _, key=key: self._copies.pop(key, None)), copy)
        return copy

    @staticmethod
    def _elsewhere(value: Tensor, device: torch.device) -> bool:
        return value.device != device

    @staticmethod
    def _move(value: Tensor, device: torch.device) -> Tensor:
        return value.to(device)

    def __deepcopy__(self, memo: dict) -> "DeviceCopies":
        return DeviceCopies()  # copies belong to this model's live tensors, not to a copy's

    def __reduce__(self) -> tuple:
        return (DeviceCopies, ())  # likewise when pickled


class ShareDeviceCopies:
    """On a model dispatched over two or more devices, one :class:`DeviceCopies` pre-hook (per
    model) on every dispatched submodule; nothing on a model that runs on one device."""

    def plan(self, model: nn.Module, config: Any, options: PatchOptions, family: Family) -> list[AddForwardPreHook]:
        dispatched = [(path, module) for path, module in model.named_modules()
                      if path and execution_device(module) is not None]
        if len({execution_device(module) for _, module in dispatched}) < 2:
            return []
        copies = DeviceCopies()
        upstream = "accelerate AlignDevicesHook (a copy per layer)"
        replacement = "torchembed.patches.devices.DeviceCopies (a copy per device and forward)"
        return [AddForwardPreHook(Component(path, "device-copies", upstream, replacement), module, copies)
                for path, module in dispatched]
