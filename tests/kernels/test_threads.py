"""Kernels launched from several threads at once compute what the same launches compute one after another.

On the CPU the kernels run under Triton's interpreter (this directory's conftest), which swaps the functions of
``triton.language`` for the whole process while a kernel runs; the library's launches take turns there. On CUDA the
compiled launches run concurrently, each on its own inputs and kept launch.
"""

from __future__ import annotations

import pytest
import torch

from tests.isolation import run_threads

pytest.importorskip("triton")

from torchembed.functional.alibi import alibi_slopes  # noqa: E402
from torchembed.kernels import interpret_mode, launch, rotary_fused  # noqa: E402
from torchembed.kernels.attention import alibi_flash  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
if DEV == "cpu" and not interpret_mode():
    pytest.skip("no CUDA device and TRITON_INTERPRET != 1", allow_module_level=True)


def _jobs() -> list:
    """RoPE launches (decode and a short prefill) and split-key ALiBi decodes, each on its own random inputs."""
    gen = torch.Generator().manual_seed(0)
    jobs = []
    for i in range(6):
        q = torch.randn(2, 4, 1 + 3 * (i % 2), 32, generator=gen).to(DEV)
        k = torch.randn(2, 2, q.shape[2], 32, generator=gen).to(DEV)
        cos, sin = torch.randn(2, 1, q.shape[2], 16, generator=gen).to(DEV).unbind(0)  # (1, S, D/2)
        jobs.append(lambda q=q, k=k, cos=cos, sin=sin: torch.cat([t.flatten() for t in rotary_fused(q, k, cos, sin)]))
        qa = torch.randn(1, 4, 1, 32, generator=gen).to(DEV)
        ka, va = torch.randn(2, 1, 2, 150, 32, generator=gen).to(DEV).unbind(0)
        slopes = alibi_slopes(4, DEV)
        jobs.append(lambda q=qa, k=ka, v=va, s=slopes: alibi_flash(q, k, v, s, scale=32 ** -0.5))
    return jobs


def test_kernels_on_threads_compute_what_they_compute_in_turn():
    jobs = _jobs()
    alone = [job() for job in jobs]
    together = run_threads(jobs * 3, threads=4)
    differ = [i for i, got in enumerate(together) if not torch.equal(got, alone[i % len(jobs)])]
    assert not differ, f"{len(differ)} of {len(together)} launches made on threads differ from the same launches alone"


def test_interpreted_launches_break_each_other_without_their_turns(monkeypatch):
    """Why interpreted launches take turns: without the lock, threads interpreting kernels at once fail (or compute
    wrong numbers), so the check above can fail."""
    if DEV == "cuda":
        pytest.skip("the interpreter's rebinding is a CPU matter")

    class NoTurns:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(launch, "_INTERPRETER_TURN", NoTurns())
    jobs = _jobs()
    alone = [job() for job in jobs]
    with pytest.raises(Exception):  # noqa: B017  (Triton raises its InterpreterError; or the numbers differ)
        together = run_threads(jobs * 4, threads=4)
        differ = [i for i, got in enumerate(together) if not torch.equal(got, alone[i % len(jobs)])]
        assert not differ
