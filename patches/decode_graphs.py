"""A patched model's decode steps replayed from a CUDA graph: plain ``generate`` without most of its host time.

An eager decode step spends more time on the host than on the GPU: about 40 launches per layer, each some microseconds
of Python (a LLaMA-8B-shaped step of 8 layers over 64k keys on an H100: 4.0 ms of host time for 2.5 ms of GPU work,
``benchmarks/results/decode-step-profile.md``). A CUDA graph replays the launches without the Python, but needs every
tensor at a fixed address and shape, where a ``DynamicCache`` grows by a token per step. So a graphed step runs the model
over each cache layer's room (:func:`torchembed.patches.kv_cache.room_for`: buffers with space to grow), the new token
written at a position held in a device tensor, under a keep mask over the whole room whose empty slots the decode
kernel never reads (:func:`torchembed.kernels.attention.fused_attention`). The first step over a room runs the model
eagerly on a side stream (the warm-up, whose result is that step's) and captures the graph; the next steps copy their
inputs into the graph's and replay it. After every step the cache's layers are views of their room's filled part:
what ``DynamicCache.update`` would hold, for ``generate`` and any other reader; the next step over the same cache finds
those views unchanged by identity (:class:`Handed`, weak references) and skips the per-layer checks.

:func:`decode_graph_step` is the one answer to "is this forward replayed from a graph?"; every other call runs the
model's own forward. Per instance: one captured step at a time lives on the model (``_torchembed_decode_graphs``),
``unpatch`` drops it; ``torchembed.patch(model, cuda_graphs=False)`` leaves every step eager. Nothing process-wide:
capture is thread-local (``capture_error_mode="thread_local"``) on the caller's device, the graph is keyed by the
caller's stream.
"""

from __future__ import annotations

import functools
import inspect
import threading
import types
import weakref
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from torchembed.patches.actions import Component, InstanceMethod, OverrideAttribute
from torchembed.kernels.route import decode_step
from torchembed.patches.kv_cache import hold, room_for, room_replaced
from torchembed.patches.registry import Family, PatchOptions

__all__ = ["GRAPHED_MODEL_TYPES", "PADDING_MASK_TYPES", "DecodeGraphs", "GraphedForward", "ReplayDecodeSteps", "Step", "decode_graph_step",
           "graphed_forward", "keys_limit", "padding_mask_refusal"]

# The decoder-only text models whose decode step is checked to compute upstream's step over a room (tests/patches/
# test_decode_graphs.py): plain full-attention stacks whose forward keeps no Python state between steps.
GRAPHED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "gemma", "phi3", "granite", "olmo2", "bloom", "mpt"})
# Those whose step takes the room as a (b, size) padding mask, from which the model derives its ALiBi positions and, with
# the room's query offset (a device tensor), its causal mask; the rest take a (b, 1, 1, size) keep mask and positions.
PADDING_MASK_TYPES = frozenset({"bloom", "mpt"})
_STATE = "_torchembed_decode_graphs"
_KWARGS = frozenset({"input_ids", "attention_mask", "position_ids", "cache_position", "past_key_values", "use_cache",
                     "return_dict", "logits_to_keep", "inputs_embeds", "output_attentions", "output_hidden_states",
                     "labels"})
_LIBRARIES = ("torch.", "transformers.", "torchembed.")  # where a graphed model's modules come from
_NONE_KWARGS = ("inputs_embeds", "labels")  # taken only when None
_FALSE_KWARGS = ("output_attentions", "output_hidden_states")  # taken only when falsy


@dataclass
class Step:
    """One decode step a graph can run: ``input_ids (b, 1)`` after ``filled`` cached tokens in every layer of
    ``cache`` (a ``DynamicCache``), the caller's ``attention_mask (b, filled + 1)``, ``position_ids``,
    ``cache_position`` (each None where not passed) and ``logits_to_keep``."""

    input_ids: Tensor
    cache: Any
    filled: int
    attention_mask: Tensor | None
    position_ids: Tensor | None
    cache_position: Tensor | None
    logits_to_keep: Any
    takes_cache_position: bool  # the forward has a ``cache_position`` parameter (transformers 4.x)
    args: tuple  # the call as made (what runs where the step is not replayed after all)
    kwargs: dict[str, Any]
    rooms: list[tuple[Tensor, Tensor]] | None = None  # each layer's room, where the cache is as the last step left it
    padding: bool = False  # the model takes the room as a padding mask (:data:`PADDING_MASK_TYPES`)
    limit: int | None = None  # the most keys the model attends (:func:`keys_limit`): no room is seen longer


def decode_graph_step(model: nn.Module, args: tuple, kwargs: dict[str, Any]) -> Step | str:
    """Whether this forward of a patched model is replayed from a CUDA graph: the :class:`Step` if so, else why not.

    Replayed: a decode step of one token per sequence (``input_ids (b, 1)`` on a CUDA device, no autograd, not in
    training, not while ``torch.compile`` traces or a graph is being captured) of a model type in
    :data:`GRAPHED_MODEL_TYPES` with SDPA attention, over a ``DynamicCache`` of plain layers holding the same number
    of tokens, within any sliding window, with no hooks beyond torchembed's and only the arguments ``generate`` passes.
    """
    if torch.compiler.is_compiling():  # (first: nothing below is traced)
        return "torch.compile traces the forward"
    ids = kwargs.get("input_ids", args[0] if args else None)
    if not isinstance(ids, Tensor) or ids.device.type != "cuda":
        return "the input ids are not a CUDA tensor"
    if torch.cuda.is_current_stream_capturing():
        return "a CUDA graph is being captured"
    return inspect_step(model, args, kwargs)


def inspect_step(model: nn.Module, args: tuple, kwargs: dict[str, Any]) -> Step | str:
    """:func:`decode_graph_step` but for the device (what a graph needs of the call and the model on any device)."""
    if len(args) > 1 or (args and "input_ids" in kwargs):
        return "positional arguments beyond the input ids"
    unknown = sorted(set(kwargs) - _KWARGS)
    if unknown:
        return f"the call passes {', '.join(unknown)}"
    if any(kwargs.get(name) is not None for name in _NONE_KWARGS) or any(kwargs.get(n) for n in _FALSE_KWARGS):
        return "the call asks for embeddings, a loss, attentions or hidden states"
    if kwargs.get("use_cache") is False or kwargs.get("return_dict") is False:
        return "use_cache=False or return_dict=False"
    if torch.is_grad_enabled() or model.training or torch.compiler.is_compiling():
        return "autograd, training or torch.compile"
    config = model.config
    if config.model_type not in GRAPHED_MODEL_TYPES:
        return f"model type {config.model_type!r} is not one whose step is checked over a room"
    padding = config.model_type in PADDING_MASK_TYPES
    if not padding and getattr(config, "_attn_implementation", None) != "sdpa":
        return "the attention implementation is not sdpa"  # (a patched ALiBi model's attention is torchembed's)
    ids = kwargs.get("input_ids", args[0] if args else None)
    if not isinstance(ids, Tensor) or ids.dim() != 2 or ids.shape[1] != 1 or ids.dtype != torch.long:
        return "not one new token per sequence (the one decode step a graph writes: one slot per layer)"
    cache = kwargs.get("past_key_values")
    layers = getattr(cache, "layers", None)
    if type(cache).__name__ != "DynamicCache" or not isinstance(layers, list) or getattr(cache, "offloading", False):
        return "the cache is not a DynamicCache"
    why = padding_mask_refusal() if padding else None
    if why is not None:
        return why
    if len(layers) != config.num_hidden_layers or not layers:
        return "the cache does not hold every layer"
    graphs = model.__dict__.get(_STATE)
    handed = graphs.handed if graphs is not None else None
    found = handed.rooms_if_unchanged(cache, ids) if handed is not None else None
    filled = handed.filled if found is not None else _filled(layers[0], ids)
    for layer in layers if found is None else ():  # (the cache as the last step left it: checked by identity)
        if filled is None or type(layer).__name__ != "DynamicLayer" or _filled(layer, ids) != filled:
            return "the cache's layers are not plain DynamicLayers holding the same tokens on the ids' device"
        if room_replaced(layer):
            return "the cache's tensors were replaced (beam search reorders them every step)"
    if not decode_step(1, filled + 1):  # (always: one query; asked, so that a decode step has one definition)
        return "not a decode step"
    limit = keys_limit(config)
    if limit is not None and filled + 1 > limit:
        return f"the keys exceed the {limit} positions of the model's ALiBi table"
    window = _window(config)
    if window is not None and filled + 1 > window:
        return f"the keys exceed the sliding window ({window})"
    mask = kwargs.get("attention_mask")
    if mask is not None and (mask.dim() != 2 or tuple(mask.shape) != (ids.shape[0], filled + 1)
                             or mask.device != ids.device):
        return "the attention mask is not (batch, cached + 1)"
    positions, cache_position = kwargs.get("position_ids"), kwargs.get("cache_position")
    if positions is not None and (padding or positions.dim() != 2 or positions.shape[1] != 1
                                  or positions.device != ids.device):
        return "the position ids are not (batch or 1, 1)"
    if cache_position is not None and (tuple(cache_position.shape) != (1,) or cache_position.device != ids.device):
        return "the cache position is not (1,)"
    keep = kwargs.get("logits_to_keep", 0)
    if not isinstance(keep, int):
        return "logits_to_keep is not an int"
    why = _modules_checked(model, cache)
    if why is not None:
        return why
    return Step(ids, cache, filled, mask, positions, cache_position, keep, _takes_cache_position(type(model)), args,
                kwargs, found, padding, limit)


@functools.cache
def padding_mask_refusal() -> str | None:
    """Why this transformers release cannot replay a step that takes its room as a padding mask
    (:data:`PADDING_MASK_TYPES`), or None: 4.x builds the causal mask from the cache's length, which a graph cannot
    follow; before 5.21 the eager causal mask (BLOOM's and MPT's) is made from a host scalar, a host-to-device copy
    that a CUDA graph cannot capture."""
    import transformers
    from packaging.version import Version

    if not hasattr(transformers.DynamicCache, "get_query_offset"):
        return "this transformers release builds the causal mask from the cache's length, which a graph cannot follow"
    if Version(transformers.__version__).release < (5, 21):
        return (f"transformers {transformers.__version__} builds the eager causal mask from a host scalar, a copy a "
                "CUDA graph cannot capture (5.21 and later build it on the device)")
    return None


def keys_limit(config: Any) -> int | None:
    """The most keys a step of the model may attend, where its positions end: MPT's ALiBi table of
    ``config.max_seq_len`` keys (upstream's attention fails past it; a graphed step's room is cut there); None for the
    rest."""
    return getattr(config, "max_seq_len", None) if config.model_type == "mpt" else None


@functools.cache
def _takes_cache_position(cls: type) -> bool:
    return "cache_position" in inspect.signature(cls.forward).parameters


def _filled(layer: Any, ids: Tensor) -> int | None:
    keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
    if (not getattr(layer, "is_initialized", False) or not isinstance(keys, Tensor) or not isinstance(values, Tensor)
            or keys.dim() != 4 or values.dim() != 4 or keys.shape[0] != ids.shape[0] or keys.device != ids.device
            or keys.shape[-2] == 0 or values.shape[-2] != keys.shape[-2]):
        return None
    return keys.shape[-2]


def _window(config: Any) -> int | None:
    """The sliding window some layer attends within, None where every layer attends to all keys."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types is not None:
        return window if any(t != "full_attention" for t in types) else None
    return window if getattr(config, "use_sliding_window", True) else None


def _modules_checked(model: nn.Module, cache: Any) -> str | None:
    """:func:`_modules_differ` for ``model``, scanned again where the cache is not the one last scanned for (a new
    ``generate`` call) or a hook was registered anywhere since (torch numbers every hook handle)."""
    graphs = model.__dict__.get(_STATE)
    if graphs is None:
        graphs = model.__dict__[_STATE] = DecodeGraphs()
    stamp = RemovableHandle.next_id
    last = graphs.scanned
    if last is not None and last[0]() is cache and last[1] == stamp:
        return last[2]
    why = _modules_differ(model)
    graphs.scanned = (weakref.ref(cache), stamp, why)
    return why


def _modules_differ(model: nn.Module) -> str | None:
    """Why a graph could replay something other than what the model's forward runs, or None: a module hook (a graph
    runs it only at its capture), on any module, but torchembed's that declare ``replayable`` (the per-forward pair,
    MPT's attention-weights flag: the same effect in every graphed step), or a global one; a module whose
    ``forward`` is an instance attribute (an adapter's, accelerate's); a module from outside torch, transformers and
    torchembed (PEFT's LoRA layers, a user's module: their Python may change what they compute between calls)."""
    from torch.nn.modules import module as torch_module

    if (torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks
            or torch_module._global_backward_hooks or torch_module._global_backward_pre_hooks):
        return "global module hooks are registered"
    for module in model.modules():
        if not type(module).__module__.startswith(_LIBRARIES):
            return f"the model holds a {type(module).__qualname__} (from {type(module).__module__})"
        hooks = list(module._forward_pre_hooks.values()) + list(module._forward_hooks.values())
        if any(not getattr(hook, "replayable", False) for hook in hooks):  # (torchembed's that declare it)
            return f"the model's {type(module).__qualname__} has hooks"
        if module is not model and "forward" in module.__dict__ and not isinstance(module.__dict__["forward"], InstanceMethod):
            return f"the model's {type(module).__qualname__} has a forward of its own instance"
    return None


class Handed:
    """What the last replayed or captured step left in the cache, held weakly (never the cache or its tensors): the
    cache, its layers, the views of the rooms each layer holds, and the rooms. Where the next step finds every one
    unchanged (by identity), the cache holds ``filled`` tokens in every layer's room and none was replaced: the
    per-layer checks of :func:`inspect_step` are skipped."""

    __slots__ = ("cache", "filled", "batch", "device", "layers")

    def __init__(self, cache: Any, filled: int, rooms: list[tuple[Tensor, Tensor]]) -> None:
        self.cache, self.filled = weakref.ref(cache), filled
        first = cache.layers[0].keys
        self.batch, self.device = first.shape[0], first.device
        self.layers = [tuple(map(weakref.ref, (layer, layer.keys, layer.values, keys, values)))
                       for layer, (keys, values) in zip(cache.layers, rooms)]

    def rooms_if_unchanged(self, cache: Any, ids: Tensor) -> list[tuple[Tensor, Tensor]] | None:
        """Each layer's room where ``cache`` is the one handed back and each layer still holds the views it was given
        (a crop, beam search's reordering, an eager step's update replace them), else None."""
        layers = cache.layers
        if self.cache() is not cache or len(layers) != len(self.layers) or ids.shape[0] != self.batch or ids.device != self.device:
            return None
        rooms = []
        for layer, (held, keys, values, room_keys, room_values) in zip(layers, self.layers):
            k, v = room_keys(), room_values()
            if layer is not held() or layer.keys is not keys() or layer.values is not values() or k is None or v is None:
                return None
            rooms.append((k, v))
        return rooms


class RoomView:
    """The cache as a graphed step sees it: each layer's room ``(b, hk, size, d)``, the step's keys and values written
    at ``slot`` (a ``(1,)`` device tensor) by ``update``, which returns the whole room."""

    def __init__(self, rooms: list[tuple[Tensor, Tensor]], slot: Tensor) -> None:
        self.rooms, self.slot = rooms, slot

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[Tensor, Tensor]:
        keys, values = self.rooms[layer_idx]
        keys.index_copy_(2, self.slot, key_states)
        values.index_copy_(2, self.slot, value_states)
        return keys, values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        raise RuntimeError("a graphed decode step passes its positions; nothing should ask the cache's length")


class PaddedRoomView(RoomView):
    """:class:`RoomView` for a model that takes the room as a padding mask (:data:`PADDING_MASK_TYPES`): transformers'
    causal mask asks the cache where the query stands (the write ``slot``, a device tensor, as a static cache answers
    under ``torch.compile``) and how many keys it covers (the room's size)."""

    def get_query_offset(self, layer_idx: int | None = None) -> Tensor:
        return self.slot

    def get_mask_sizes(self, query_length: Any, layer_idx: int | None = None) -> tuple[int, int]:
        return self.rooms[0][0].shape[-2], 0

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """The room's last slot: BLOOM's forward asks it, and reads it only where no mask is passed (a graphed step
        always passes one)."""
        return self.rooms[0][0].shape[-2] - 1


@dataclass
class FixedShapeStep:
    """The tensors one graphed step reads, at fixed addresses: the ids, the positions (where upstream derives them
    from the cache's length: ``(1, 1)``), the cache position (where passed), the write ``slot`` and the keep mask
    ``(b, 1, 1, size)`` over the rooms (for :data:`PADDING_MASK_TYPES`: a ``(b, size)`` padding mask, no positions)."""

    rooms: list[tuple[Tensor, Tensor]]
    input_ids: Tensor
    slot: Tensor
    mask: Tensor
    position_ids: Tensor | None
    cache_position: Tensor | None
    logits_to_keep: Any
    padding: bool = False

    @classmethod
    def for_step(cls, step: Step, rooms: list[tuple[Tensor, Tensor]]) -> "FixedShapeStep":
        ids = step.input_ids
        size = rooms[0][0].shape[-2]
        slot = torch.zeros(1, dtype=torch.long, device=ids.device)
        if step.padding:
            mask = torch.zeros(ids.shape[0], size, dtype=torch.long, device=ids.device)
            return cls(rooms, torch.zeros_like(ids), slot, mask, None, None, step.logits_to_keep, True)
        mask = torch.zeros(ids.shape[0], 1, 1, size, dtype=torch.bool, device=ids.device)
        cache_position = None if not step.takes_cache_position else torch.zeros(1, dtype=torch.long, device=ids.device)
        positions = (torch.zeros_like(step.position_ids) if step.position_ids is not None
                     else None if cache_position is not None  # (upstream derives them from the cache position)
                     else torch.zeros(1, 1, dtype=torch.long, device=ids.device))
        return cls(rooms, torch.zeros_like(ids), slot, mask, positions, cache_position, step.logits_to_keep)

    def load(self, step: Step) -> None:
        """Copy ``step``'s inputs into these tensors (device copies and fills, no host sync)."""
        n = step.filled
        self.input_ids.copy_(step.input_ids)
        self.slot.fill_(n)
        filled = self.mask[..., : n + 1]  # ((b, 1, 1, n + 1) or (b, n + 1))
        if step.attention_mask is None:
            filled.fill_(1)
        else:
            filled.copy_(step.attention_mask.view(filled.shape))
        self.mask[..., n + 1:].fill_(0)
        if self.cache_position is not None:
            if step.cache_position is not None:
                self.cache_position.copy_(step.cache_position)
            else:
                self.cache_position.fill_(n)
        if self.position_ids is not None:
            if step.position_ids is not None:
                self.position_ids.copy_(step.position_ids)
            else:
                self.position_ids.fill_(n)

    def run(self, model: nn.Module) -> Any:
        """The model's own forward over the rooms (what a graph captures)."""
        view = (PaddedRoomView if self.padding else RoomView)(self.rooms, self.slot)
        kwargs: dict[str, Any] = {"input_ids": self.input_ids, "attention_mask": self.mask, "use_cache": True,
                                  "past_key_values": view, "return_dict": True}
        if self.position_ids is not None:
            kwargs["position_ids"] = self.position_ids
        if self.cache_position is not None:
            kwargs["cache_position"] = self.cache_position
        if self.logits_to_keep:
            kwargs["logits_to_keep"] = self.logits_to_keep
        return type(model).forward(model, **kwargs)


@dataclass
class _Captured:
    key: tuple
    inputs: FixedShapeStep
    graph: Any  # torch.cuda.CUDAGraph
    kind: type  # the forward's output class
    logits: Tensor  # the captured forward's logits, rewritten by every replay (nothing else of its output is kept)


@dataclass
class DecodeGraphs:
    """A patched model's captured decode step (one at a time) and the keys that failed to capture (bounded)."""

    captured: _Captured | None = None
    failed: set = field(default_factory=set)
    scanned: tuple | None = None  # (the cache, hook handle count, verdict) of the last module scan
    handed: Handed | None = None  # what the last step left in the cache (held weakly)
    captures: int = 0  # graphs captured
    replays: int = 0  # steps replayed
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __deepcopy__(self, memo: dict) -> "DecodeGraphs":
        return DecodeGraphs()  # a copy of the model captures its own

    def __reduce__(self) -> tuple:
        return (DecodeGraphs, ())

    def step(self, model: nn.Module, step: Step) -> Any:
        """``model``'s forward of ``step``: replayed where this step's key was captured, else run over the rooms
        eagerly (on a side stream) and captured for the next steps."""
        if not self.lock.acquire(blocking=False):  # another thread is in a step of this model: eager
            return type(model).forward(model, *step.args, **step.kwargs)
        try:
            rooms = self.rooms_for(step)
            if len({keys.shape[-2] for keys, _ in rooms} | {values.shape[-2] for _, values in rooms}) != 1:
                return type(model).forward(model, *step.args, **step.kwargs)  # (rooms made apart: the cache's update)
            key = _key(model, step, rooms)
            if key in self.failed:
                return type(model).forward(model, *step.args, **step.kwargs)
            captured = self.captured if self.captured is not None and self.captured.key == key else None
            if captured is None:
                self.captured = None  # (its inputs and pool go before the next capture's)
                kind, logits = self._capture(model, step, rooms, key)
            else:
                captured.inputs.load(step)
                captured.graph.replay()
                self.replays += 1
                kind, logits = captured.kind, captured.logits
            self.hand_back(step, rooms)
            return kind(logits=logits.clone(), past_key_values=step.cache)  # (a copy: the next replay rewrites it)
        finally:
            self.lock.release()

    @staticmethod
    def rooms_for(step: Step) -> list[tuple[Tensor, Tensor]]:
        """Each cache layer's room with space for the step's token: those :func:`inspect_step` found as the last step
        left them where they fit, else each layer's made or moved (:func:`~torchembed.patches.kv_cache.room_for`), cut
        to the step's :attr:`~Step.limit` of keys (views of the rooms' first part)."""
        rooms = step.rooms
        if rooms is None or step.filled + 1 > rooms[0][0].shape[-2]:
            rooms = [room_for(layer, 1) for layer in step.cache.layers]
            if step.limit is not None and rooms[0][0].shape[-2] > step.limit:
                rooms = [(keys.narrow(2, 0, step.limit), values.narrow(2, 0, step.limit)) for keys, values in rooms]
        return rooms

    def hand_back(self, step: Step, rooms: list[tuple[Tensor, Tensor]]) -> None:
        """After a step over the rooms: the cache's layers made views of their filled part (what ``DynamicCache.update``
        would hold), and what they were given remembered weakly (:class:`Handed`)."""
        n = step.filled + 1
        for layer, room in zip(step.cache.layers, rooms):
            hold(layer, room, n)
        self.handed = Handed(step.cache, n, rooms)

    def _capture(self, model: nn.Module, step: Step, rooms: list[tuple[Tensor, Tensor]],
                 key: tuple) -> tuple[type, Tensor]:
        """The step run eagerly (its output class and logits), then captured for the next steps with its key."""
        inputs = FixedShapeStep.for_step(step, rooms)
        inputs.load(step)
        caller = torch.cuda.current_stream(step.input_ids.device)
        side = torch.cuda.Stream(step.input_ids.device)
        side.wait_stream(caller)
        with torch.cuda.stream(side):
            out = inputs.run(model)  # the warm-up: this step's result
        caller.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:  # (not torch.cuda.graph, which collects garbage and empties the allocator's cache for the process)
            with torch.cuda.stream(side):
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    captured_out = inputs.run(model)
                finally:
                    graph.capture_end()
        except Exception as err:  # a model the graph cannot take: every step with this key eager
            if len(self.failed) >= 64:
                self.failed.clear()
            self.failed.add(key)
            warnings.warn(f"torchembed: a decode step of this {type(model).__name__} could not be captured as a CUDA "
                          f"graph ({type(err).__name__}: {err}); its steps run eagerly", stacklevel=4)
            return type(out), out.logits
        caller.wait_stream(side)
        inputs.rooms = []  # the graph holds their addresses; the cache holds them
        self.captured = _Captured(key, inputs, graph, type(captured_out), captured_out.logits)
        self.captures += 1
        return type(out), out.logits


def _key(model: nn.Module, step: Step, rooms: list[tuple[Tensor, Tensor]]) -> tuple:
    """What a captured step depends on beyond its inputs' values: the rooms (addresses and shapes), the weights'
    addresses (a model moved or cast is captured again), the caller's stream, inference mode (its tensors take no
    copies outside it) and autocast (the casts a graph bakes in), the arguments' form."""
    first, head = next(model.parameters()), model.lm_head.weight
    ids = step.input_ids
    autocast = torch.is_autocast_enabled(ids.device.type) and torch.get_autocast_dtype(ids.device.type)
    return (tuple((k.data_ptr(), v.data_ptr()) for k, v in rooms), tuple(rooms[0][0].shape), rooms[0][0].dtype,
            tuple(ids.shape), ids.device, torch.cuda.current_stream(ids.device).cuda_stream, first.data_ptr(),
            head.data_ptr(), torch.is_inference_mode_enabled(), autocast, step.attention_mask is None,
            None if step.position_ids is None else tuple(step.position_ids.shape), step.cache_position is None,
            step.takes_cache_position, step.logits_to_keep)


def graphed_forward(model: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """A patched model's forward: decode steps :func:`decode_graph_step` takes from a CUDA graph, every other call
    the model's own forward."""
    step = decode_graph_step(model, args, kwargs)
    if isinstance(step, str):
        return type(model).forward(model, *args, **kwargs)
    return model.__dict__[_STATE].step(model, step)


class GraphedForward(InstanceMethod):
    """:func:`graphed_forward` installed on one model: an :class:`InstanceMethod` whose signature and
    ``__wrapped__`` are the model class's ``forward`` (what ``Trainer`` and ``generate`` inspect)."""

    __slots__ = ()

    @property
    def __wrapped__(self) -> types.MethodType:
        return types.MethodType(type(self.__self__).forward, self.__self__)

    @property
    def __signature__(self) -> inspect.Signature:
        return _bound_signature(type(self.__self__))


@functools.cache
def _bound_signature(cls: type) -> inspect.Signature:
    """The signature of ``cls.forward`` bound to an instance (``self`` left out): what ``inspect.signature`` gives for
    ``model.forward``, made once per class (``generate`` asks it at every step)."""
    signature = inspect.signature(cls.forward)
    return signature.replace(parameters=list(signature.parameters.values())[1:])


@dataclass
class _DropGraphs:
    """``unpatch``: the model's captured step goes with the forward."""

    component: Component
    model: nn.Module

    def apply(self) -> None:
        pass

    def undo(self) -> None:
        self.model.__dict__.pop(_STATE, None)


class ReplayDecodeSteps:
    """Adapter: a causal LM of :data:`GRAPHED_MODEL_TYPES` gets :func:`graphed_forward` as its forward (instance
    only), unless ``patch(..., cuda_graphs=False)``."""

    def plan(self, model: nn.Module, config: Any, options: PatchOptions, family: Family) -> list[Any]:
        if (not options.cuda_graphs or getattr(config, "model_type", None) not in GRAPHED_MODEL_TYPES
                or not hasattr(model, "generate") or getattr(model, "lm_head", None) is None):
            return []
        component = Component("", "decode-graphs", f"{type(model).__qualname__}.forward",
                              "torchembed.patches.decode_graphs.graphed_forward (CUDA decode steps replayed from a "
                              "graph)")
        return [_DropGraphs(component, model),
                OverrideAttribute(component, model, "forward", GraphedForward(model, graphed_forward))]
