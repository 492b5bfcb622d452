"""A patched layer's KV cache: a long ``DynamicCache`` layer grows in place instead of by concatenation.

transformers' ``DynamicLayer.update`` appends each decode step's keys and values with ``torch.cat`` of the whole cache:
per step it reads and writes twice the cache's bytes, more than the attention itself reads. From :data:`IN_PLACE_BYTES`
of keys a patched layer's cache lives in buffers with room for 1/8 more tokens (at least 256); the layer holds views of
their filled part and a step writes its tokens into the room (:func:`append_in_place`). When the room is used up, or the
layer's tensors were replaced (beam search reorders them, a crop), the filled part moves to new buffers once. What the
cache holds, and what every reader sees, is upstream's.

ALiBi layers update their cache themselves (:mod:`torchembed.patches.alibi.families`); a patched RoPE attention's
upstream forward calls ``past_key_values.update`` on :class:`GrowInPlace`, a per-call view of the caller's
``DynamicCache``. Only a ``DynamicCache`` of plain ``DynamicLayer`` layers (no sliding window, quantisation or
offloading) grows in place, never inside a graph that ``torch.compile`` traces.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["CACHE_KEYWORDS", "IN_PLACE_BYTES", "GrowInPlace", "append_in_place", "growing_layer", "grow_in_place", "has_room", "hold",
           "move_into", "room_for", "room_replaced", "update"]

CACHE_KEYWORDS = ("cache", "past_key_values", "layer_past", "past_key_value")  # an attention's KV cache, by release

# From this many bytes of keys a layer's cache grows in place: below, the concatenation's copy costs less
# device time than the host time of the extra operations (a few microseconds each, per layer and step).
IN_PLACE_BYTES = 16 * 2**20
_ROOM = "_torchembed_room"  # a DynamicLayer's key and value buffers with room to grow (per cache layer)
EMPTY = "empty"  # growing_layer's answer for a DynamicLayer that holds no tokens yet


def growing_layer(cache: Any, layer_idx: int) -> Any:
    """The cache's ``DynamicLayer`` at ``layer_idx`` (exactly that class) when it grows in place: it holds
    :data:`IN_PLACE_BYTES` of keys or more, or room already; :data:`EMPTY` when it holds no tokens yet (a cache made
    without a config adds its layers at their first update); else None (the cache's own update runs)."""
    layers = getattr(cache, "layers", None)
    if (torch.compiler.is_compiling() or not isinstance(layers, list) or not 0 <= layer_idx <= len(layers)
            or getattr(cache, "offloading", False)):
        return None
    layer = layers[layer_idx] if layer_idx < len(layers) else None
    if layer is None or not getattr(layer, "is_initialized", False) or type(layer).__name__ != "DynamicLayer":
        return EMPTY if layer is None or type(layer).__name__ == "DynamicLayer" else None
    keys = getattr(layer, "keys", None)
    if not isinstance(keys, Tensor) or keys.dim() != 4:
        return EMPTY if isinstance(keys, Tensor) and keys.numel() == 0 else None
    return layer if _ROOM in layer.__dict__ or keys.numel() * keys.element_size() >= IN_PLACE_BYTES else None


def append_in_place(layer: Any, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """``DynamicLayer.update`` of ``k``, ``v`` ``(b, h, new, d)`` into the room of a :func:`growing_layer` (the module
    docstring), without the concatenation of the whole cache. Returns the layer's keys and values as its update does."""
    filled, new = layer.keys.shape[-2], k.shape[-2]
    room = room_for(layer, new)
    room[0][..., filled:filled + new, :].copy_(k)
    room[1][..., filled:filled + new, :].copy_(v)
    return hold(layer, room, filled + new)


def hold(layer: Any, room: tuple[Tensor, Tensor], n: int) -> tuple[Tensor, Tensor]:
    """The layer's keys and values made views of the first ``n`` tokens of ``room`` (``(b, h, size, d)`` buffers): what
    ``DynamicLayer.update`` would hold, returned as it returns them."""
    layer.keys, layer.values = room[0].narrow(-2, 0, n), room[1].narrow(-2, 0, n)
    return layer.keys, layer.values


def room_for(layer: Any, new: int) -> tuple[Tensor, Tensor]:
    """The key and value buffers ``(b, h, size, d)`` of a ``DynamicLayer`` holding ``(b, h, filled, d)``, whose first
    ``filled`` tokens are the layer's and which have space for ``new`` more: the layer's room where it has one that fits,
    else new buffers with 1/8 more space than needed (at least 256 tokens), the filled part moved there once, the
    space zeroed and the layer's keys and values made views of the filled part (its old tensors let go at once: a
    cache moved layer by layer is never held twice)."""
    keys, values = layer.keys, layer.values
    filled = keys.shape[-2]
    room = layer.__dict__.get(_ROOM)
    if room is None or not has_room(layer) or filled + new > room[0].shape[-2]:
        size = filled + new + max(256, (filled + new) // 8)
        room = tuple(t.new_empty(*t.shape[:-2], size, t.shape[-1]) for t in (keys, values))
        for buffer, held in zip(room, (keys, values)):
            move_into(buffer, held)
        layer.__dict__[_ROOM] = room
        hold(layer, room, filled)
    return room


def move_into(buffer: Tensor, held: Tensor) -> None:
    """``buffer (b, h, size, d)``'s first ``filled`` tokens made ``held (b, h, filled, d)``'s, the rest zeroed (a step
    over the whole room masks the space: never NaN from new memory). Both copies read the tensors as 16-byte elements
    where their layout allows (a strided copy of 2-byte elements runs at about half the copy bandwidth on CUDA; of
    16-byte ones near it: LLaMA-3.1-8B's layer at 128k tokens 0.46 against 0.79 ms on an H100,
    ``benchmarks/probes/room_move.py``); the bytes are the same."""
    filled = held.shape[-2]
    target, space = buffer[..., :filled, :], buffer[..., filled:, :]
    if _widens(target, held):
        target, held = _wide(target), _wide(held)
    target.copy_(held)
    (_wide(space) if _widens(space) else space).zero_()


def _widens(*tensors: Tensor) -> bool:
    """Every tensor can be read as 16-byte elements along its last dimension (contiguous there, every stride, size
    and offset a whole number of them), as one dtype, on a CUDA or CPU device (MPS has no 16-byte dtype)."""
    return len({t.dtype for t in tensors}) == 1 and all(_wide_layout(t) for t in tensors)


def _wide_layout(t: Tensor) -> bool:
    size = t.element_size()
    return (t.device.type in ("cuda", "cpu") and t.dim() > 0 and t.stride(-1) == 1 and t.data_ptr() % 16 == 0
            and all(n * size % 16 == 0 for n in (t.shape[-1], t.storage_offset(), *t.stride()[:-1])))


def _wide(t: Tensor) -> Tensor:
    return t.view(torch.complex128)  # (bytes only: nothing is computed in this dtype)


def room_replaced(layer: Any) -> bool:
    """The layer had a room, and its keys or values are no longer views of it (beam search reorders them)."""
    return layer.__dict__.get(_ROOM) is not None and not has_room(layer)


def has_room(layer: Any) -> bool:
    """The layer's keys and values are views of its room from its start (False where it has none, or they were
    replaced since: beam search reorders them)."""
    room = layer.__dict__.get(_ROOM)
    return room is not None and _prefix(layer.keys, room[0]) and _prefix(layer.values, room[1])


def update(cache: Any, k: Tensor, v: Tensor, layer_idx: int, *args: Any, strided_copy: bool = False,
           **kwargs: Any) -> tuple[Tensor, Tensor]:
    """``cache.update(k, v, layer_idx, *args, **kwargs)``, in place where :func:`growing_layer` finds the layer: the
    one way a patched layer's cache takes new keys and values. ``strided_copy``: ``k``, ``v`` may be strided views,
    made contiguous before the cache concatenates them to tokens it holds (a strided input sends CUDA's concatenation
    of the whole cache down its slow copy path; BLOOM-7B1 shape at 65k tokens on an H200: 1.7 ms per layer and
    tensor, ``benchmarks/results/long-context.md``); a layer's first tokens are copied once by its update anyway."""
    layer = growing_layer(cache, layer_idx)
    if layer is not None and layer is not EMPTY:
        return append_in_place(layer, k, v)
    copy = strided_copy and layer is not EMPTY
    return cache.update(k.contiguous() if copy else k, v.contiguous() if copy else v, layer_idx, *args, **kwargs)


def _prefix(t: Tensor, buffer: Tensor) -> bool:
    """``t`` is the first rows (along the tokens) of ``buffer``: a view of it from its start."""
    return (t.data_ptr() == buffer.data_ptr() and t.stride() == buffer.stride() and t.dtype == buffer.dtype
            and t.shape[:-2] == buffer.shape[:-2] and t.shape[-1] == buffer.shape[-1])


class GrowInPlace:
    """The caller's ``DynamicCache`` for one attention call, whose ``update(k, v, layer_idx, ...)`` appends in
    place where :func:`growing_layer` finds the layer (else it is the cache's own update); every other
    attribute, read or written, is the cache's."""

    __slots__ = ("_cache",)

    def __init__(self, cache: Any) -> None:
        object.__setattr__(self, "_cache", cache)

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[Tensor, Tensor]:
        return update(self._cache, key_states, value_states, layer_idx, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cache, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._cache, name, value)

    def __len__(self) -> int:
        return len(self._cache)

    def __getitem__(self, index: Any) -> Any:
        return self._cache[index]

    def __iter__(self) -> Any:
        return iter(self._cache)


def grow_in_place(cache: Any) -> Any:
    """``cache`` for one patched attention call: a :class:`GrowInPlace` view of a ``DynamicCache`` (outside
    ``torch.compile``), anything else as it is."""
    if type(cache).__name__ != "DynamicCache" or torch.compiler.is_compiling():
        return cache
    return GrowInPlace(cache)
