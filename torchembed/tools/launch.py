"""Run a multi-process launch (``torchrun`` / ``accelerate launch``) as a child with a time limit.

torchrun starts each worker in a session of its own, so killing the launcher (or its process
group) leaves the workers running, holding the output pipe open. On timeout the launcher gets
SIGTERM instead: it stops its workers (SIGTERM, then SIGKILL after its own grace period) and
exits; only if it is still there after ``grace_s`` is its process group killed.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Finished", "free_port", "hide_gpus", "run_launcher"]


@dataclass
class Finished:
    returncode: int
    output: str  # stdout and stderr, interleaved
    timed_out: bool


def free_port() -> int:
    """A TCP port of 127.0.0.1 that was free a moment ago (for ``--master-port``)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def hide_gpus() -> None:
    """Make this process see no GPU (a worker's ``--cpu``). With GPUs visible, a CPU/gloo run still
    meets CUDA: accelerate's ``wait_for_everyone`` passes ``device_ids=[LOCAL_RANK]`` to the barrier
    and transformers' tensor parallelism picks ``cuda:LOCAL_RANK``, which fails on a machine with
    fewer GPUs than processes. Call it before anything initialises CUDA; the driver reads the variable at its first
    use, which ``torch.cuda.is_available()`` or a Triton import may already have made without ``torch.cuda``
    counting as initialised, so a launcher of CPU workers also sets ``CUDA_VISIBLE_DEVICES=""`` in their
    environment."""
    import torch

    if torch.cuda.is_initialized():
        raise RuntimeError("hide_gpus() after CUDA was initialised in this process: call it first")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""


def run_launcher(cmd: Sequence[str], *, timeout_s: float, env: Mapping[str, str] | None = None,
                 cwd: str | os.PathLike[str] | None = None, grace_s: float = 60.0) -> Finished:
    """Run ``cmd`` to completion or for ``timeout_s`` seconds; on timeout stop it and its workers
    (see the module docstring) and return what it printed, with ``timed_out=True``."""
    proc = subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=None if env is None else dict(env), cwd=None if cwd is None else Path(cwd),
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout_s)
        return Finished(proc.returncode, output, timed_out=False)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        try:
            output, _ = proc.communicate(timeout=grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
        return Finished(proc.returncode, output + f"\n[timed out after {timeout_s:g} s]", timed_out=True)
