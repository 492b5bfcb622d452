"""A patched model's forward keeps what it derives once for its layers, for that forward only.

Two hooks on the patched model's base model (what the task model, ``generate`` and a hand-written decode loop all call)
open a :class:`~torchembed.kernels.per_forward.PerForward` for the thread and close it, also when the forward raises.
They hold no reference to the model (``nn.DataParallel`` replicas share them), are not a positional component
(``find_positional_components`` does not list them) and do nothing inside a graph that ``torch.compile`` traces.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from torchembed.kernels.per_forward import close_forward, open_forward
from torchembed.patches.actions import Component

__all__ = ["ForwardScopeHooks", "OpenForward", "CloseForward"]


class OpenForward:
    """Forward pre-hook: open this thread's :class:`~torchembed.kernels.per_forward.PerForward` of the module."""

    replayable = True  # (a graphed decode step may run without it: see torchembed.patches.decode_graphs)

    def __call__(self, module: nn.Module, args: tuple) -> None:
        if not torch.compiler.is_compiling():
            open_forward(module)


class CloseForward:
    """Forward hook (always called, also when the forward raised): close it."""

    replayable = True

    def __call__(self, module: nn.Module, args: tuple, output: Any) -> None:
        if not torch.compiler.is_compiling():
            close_forward(module)


@dataclass
class ForwardScopeHooks:
    """The two hooks on ``module`` (a patched model's base model); undo removes them. Ids kept as plain
    data, so a deep copy removes the hooks from its own module."""

    component: Component
    module: nn.Module
    ids: tuple[int, int] | None = None

    def apply(self) -> None:
        enter = self.module.register_forward_pre_hook(OpenForward(), prepend=True)
        leave = self.module.register_forward_hook(CloseForward(), always_call=True)
        self.ids = (enter.id, leave.id)

    def undo(self) -> None:
        if self.ids is not None:
            enter, leave = self.ids
            self.module._forward_pre_hooks.pop(enter, None)
            self.module._forward_hooks.pop(leave, None)
            self.module._forward_hooks_always_called.pop(leave, None)
            self.ids = None
