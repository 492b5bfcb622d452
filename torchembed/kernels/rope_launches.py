"""The one launch cache of the fused RoPE kernel, and the typed argument group of a rotation.

A call of the kernel is set up once per *key* -- what the call's tensors are (shapes, strides,
dtypes, devices), its position form and its flags, never their values -- and kept here as a
:data:`Launch`: a function that launches the same kernel again with another call's pointers,
int offset and scale. Every route to the kernel (the public ``rotary_fused``, its autograd
backward, ``RotaryEmbedding``, the patched HF attention's in-place call) looks its key up here
first; a miss validates, launches through Triton and stores the launch
(``rope_triton.launch``). This module imports neither Triton nor the kernel.

A key determines everything validation checks, so a hit needs no validation: an int offset
enters the key as the facts Triton specialises on (== 1, divisible by 16, int32 range) after its
own range check, tensors by ``(shape, stride, dtype, device)``.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import NamedTuple, Optional

from torch import Tensor

__all__ = ["LAUNCHES", "Launch", "RopeArgs", "clear", "key_of", "store"]


class RopeArgs(NamedTuple):
    """The arguments of one rotation (the custom ops' schema, in order).

    ``q (B, Hq, S, D)`` and ``k (B, Hk, S, D)``; angles from ``cos``/``sin`` tables (per-token
    ``(B or 1, S, R/2)`` with ``positions`` None and ``offset`` 0, or position-indexed
    ``(T, R/2)``) or from ``inv_freq (R/2,)``; ``positions`` an integer ``(B,)`` (per-sequence
    offsets) or ``(B or 1, S)`` (position ids) tensor, else the position of token ``s`` is
    ``offset + s``; ``scale`` multiplies cos and sin; ``interleaved`` pairs ``(2j, 2j + 1)``;
    ``conjugate`` rotates by the negative angle.
    """

    q: Tensor
    k: Tensor
    cos: Optional[Tensor]
    sin: Optional[Tensor]
    inv_freq: Optional[Tensor]
    positions: Optional[Tensor]
    offset: int
    scale: float
    interleaved: bool
    conjugate: bool


# launch(q, k, q_out, k_out, cos, sin, inv_freq, positions, offset, scale) -> launched?
# False (nothing launched) where the kept launch does not apply to these tensors (a pointer that
# is not 16-byte aligned, the direct launch switched off): the caller launches through Triton.
Launch = Callable[..., bool]

LAUNCHES: dict[Hashable, Launch] = {}
_MAX = 4096  # prefill with many lengths: cleared when full
_I32 = 2**31


def store(key: Hashable, launch: Launch) -> None:
    if len(LAUNCHES) >= _MAX:
        LAUNCHES.clear()
    LAUNCHES[key] = launch


def clear() -> None:
    """Forget every kept launch (after changing a tuning knob or switching the direct launch)."""
    LAUNCHES.clear()


def _tensor(t: Tensor) -> tuple:
    return t.shape, t.stride(), t.dtype, t.device


def key_of(q, k, cos, sin, inv_freq, positions, scale, interleaved, inplace, conjugate) -> Optional[tuple]:
    """The key of a ``rotary_fused`` call with these arguments, as given by the user (before
    validation); None for calls that are never kept: tensor subclasses, flags that are not bools,
    a scale that is not a Python number, a negative int offset or one past the end of a cache
    table, tensor positions indexing a CPU table (range-checked on the host on every call).

    ``positions``: None (per-token tables), an int offset, or an integer tensor."""
    if type(q) is not Tensor or type(k) is not Tensor or q.dim() != 4:
        return None
    if type(interleaved) is not bool or type(inplace) is not bool or type(conjugate) is not bool:
        return None
    if type(scale) is not float and type(scale) is not int:
        return None
    if positions is None:
        pos = None
    elif type(positions) is int:
        if positions < 0 or (type(cos) is Tensor and positions + q.shape[2] > cos.shape[0]):
            return None
        pos = (positions == 1, positions % 16 == 0, positions < _I32)
    elif type(positions) is Tensor:
        if cos is not None and not q.is_cuda:
            return None
        pos = _tensor(positions)
    else:
        return None
    if inv_freq is not None:
        if cos is not None or sin is not None or type(inv_freq) is not Tensor:
            return None
        angles = _tensor(inv_freq)
    elif type(cos) is Tensor and type(sin) is Tensor:
        angles = (_tensor(cos), _tensor(sin))
    else:
        return None
    return (q.shape, k.shape, q.stride(), k.stride(), q.dtype, k.dtype, q.device, k.device, angles, pos,
            interleaved, inplace, conjugate)
