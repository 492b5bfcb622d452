"""Checks that a patched model changes nothing outside itself: process-wide flags, tensors kept by the
library's module-level state, live tensors and memory after forwards."""

from __future__ import annotations

import collections
import gc
import os
import sys
import threading
import types
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch


def global_state() -> tuple:
    """What a library must not change for the whole process: SDPA's backend switches, math and
    determinism flags, the default dtype, intra-op threads, the environment."""
    cuda, cudnn = torch.backends.cuda, torch.backends.cudnn
    return (
        cuda.cudnn_sdp_enabled(), cuda.flash_sdp_enabled(), cuda.mem_efficient_sdp_enabled(), cuda.math_sdp_enabled(),
        cuda.matmul.allow_tf32, cuda.matmul.allow_fp16_reduced_precision_reduction, cudnn.enabled, cudnn.benchmark,
        cudnn.deterministic, cudnn.allow_tf32, torch.get_float32_matmul_precision(),
        torch.are_deterministic_algorithms_enabled(), torch.get_default_dtype(), torch.get_num_threads(),
        tuple(sorted(os.environ.items())),
    )


def compiler_state() -> tuple:
    """dynamo's and inductor's configuration (too slow to sample continuously: read before and after)."""
    import torch._dynamo.config
    import torch._inductor.config

    return tuple(sorted((k, repr(v)) for k, v in torch._dynamo.config.get_config_copy().items())) + tuple(
        sorted((k, repr(v)) for k, v in torch._inductor.config.get_config_copy().items()))


class FlagWatcher:
    """Samples :func:`global_state` in a thread of its own while the block runs: ``states`` counts each
    distinct state seen (one, the state at entry, when nothing changed it)."""

    def __init__(self) -> None:
        self.states: collections.Counter = collections.Counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.states[global_state()] += 1

    def __enter__(self) -> "FlagWatcher":
        self.before = global_state()
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.after = global_state()

    @property
    def changes(self) -> int:
        """Samples that saw a state other than the one at entry, plus one if the state at exit differs."""
        return sum(n for state, n in self.states.items() if state != self.before) + (self.after != self.before)


def _library_modules() -> Iterator[types.ModuleType]:
    for name, module in list(sys.modules.items()):
        if module is not None and (name == "torchembed" or name.startswith("torchembed.")):
            yield module


def _ours(obj: Any) -> bool:
    return type(obj).__module__.startswith("torchembed")


def tensors_in_library_state() -> list[str]:
    """Where tensors are reachable from the library's module-level state: the globals of every
    torchembed module, followed through containers and through instances of torchembed's own classes
    (not into functions, classes, modules or other libraries' objects). Each a path, e.g.
    ``torchembed.kernels.x._TABLE[3]``."""
    found: list[str] = []
    seen: set[int] = set()
    todo: list[tuple[str, Any]] = []
    for module in _library_modules():
        rebound = module.__name__.startswith("torchembed._rebound")  # upstream's namespace with ours inside
        for name, value in vars(module).items():
            if not rebound or _ours(value):
                todo.append((f"{module.__name__}.{name}", value))
    while todo:
        path, obj = todo.pop()
        if id(obj) in seen or isinstance(obj, (types.ModuleType, type, types.FunctionType, types.BuiltinFunctionType,
                                                  str, bytes, int, float, bool)) or obj is None:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            found.append(path)
            continue
        if isinstance(obj, (dict, types.MappingProxyType, weakref.WeakKeyDictionary, weakref.WeakValueDictionary)):
            for key, value in list(obj.items()):
                todo.append((f"{path}[{key!r:.40}]", value))
                todo.append((f"{path}.key({key!r:.40})", key))
        elif isinstance(obj, (list, tuple, set, frozenset, collections.deque)):
            todo.extend((f"{path}[{i}]", value) for i, value in enumerate(obj))
        elif _ours(obj):
            attrs = dict(getattr(obj, "__dict__", {}))
            for cls in type(obj).__mro__:
                for slot in getattr(cls, "__slots__", ()):
                    if hasattr(obj, slot):
                        attrs[slot] = getattr(obj, slot)
            todo.extend((f"{path}.{name}", value) for name, value in attrs.items())
    return found


def live_tensors() -> list[torch.Tensor]:
    """Tensors alive in the process now (after a collection)."""
    gc.collect()
    return [obj for obj in gc.get_objects() if issubclass(type(obj), torch.Tensor)]


class TensorCensus:
    """The tensors alive at its making; :meth:`born_since` names the ones alive now that were not. By identity,
    so a tensor that an unrelated cache lets go of meanwhile neither hides a new one nor counts as one."""

    def __init__(self) -> None:
        self._alive = {id(t): weakref.ref(t) for t in live_tensors()}

    def born_since(self) -> list[str]:
        """``shape dtype`` of each tensor alive now and not at the census."""
        new = [t for t in live_tensors() if (ref := self._alive.get(id(t))) is None or ref() is not t]
        return [f"{tuple(t.shape)} {t.dtype}" for t in new]


def run_threads(jobs: list[Callable[[], Any]], threads: int) -> list[Any]:
    """Run ``jobs`` on ``threads`` threads at once (all started together); their results in order, or
    the first exception raised."""
    results: list[Any] = [None] * len(jobs)
    errors: list[BaseException] = []
    start = threading.Barrier(min(threads, len(jobs)))
    lock = threading.Lock()
    queue = list(range(len(jobs)))

    def worker() -> None:
        try:
            start.wait()
        except threading.BrokenBarrierError:
            return
        while True:
            with lock:
                if not queue:
                    return
                i = queue.pop()
            try:
                results[i] = jobs[i]()
            except BaseException as err:  # noqa: BLE001  (reported below)
                errors.append(err)
                return

    pool = [threading.Thread(target=worker) for _ in range(min(threads, len(jobs)))]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join()
    if errors:
        raise errors[0]
    return results
