"""Data-parallel training of patched models: ``scripts/train_distributed.py`` run as one plain
process and under ``torchrun --nproc_per_node=2`` (CPU, gloo) must train to the same parameters.

Both see the same global batch per step (each rank a half); DDP averages the two half-batch
gradients. Tolerances:

* parameters, ``PARAM_ATOL`` = 1e-5 absolute. The two runs compute the same gradient in another
  float32 summation order (one GEMM over all B*S tokens vs two halves, then gloo's allreduce
  (g0 + g1) / 2), a few ulp apart. AdamW divides by sqrt(v) + eps, so relative gradient
  differences pass through as relative update differences (~1e-6 of lr), except where a gradient
  is pure rounding noise (e.g. a key bias, whose gradient is analytically zero: softmax ignores it)
  and the noise is normalised to a fraction of lr. Measured worst case over llama/falcon/bloom/gpt2:
  2.8e-6 (gpt2 key bias); llama and bloom <= 4e-7. Training moves parameters by ~lr = 1e-3 per
  step, and a missing gradient sync or a wrong data split moves them by ~lr too, 100x the tolerance.
* losses, rtol 1e-5: a mean over the same tokens in another order (~1e-7 relative measured).
* patch after ``prepare`` vs before: bit-identical (same processes, same ops, same order).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from torchembed.tools.launch import free_port, run_launcher

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
safetensors_torch = pytest.importorskip("safetensors.torch")
pytestmark = pytest.mark.slow  # (every test here starts processes and trains: 15-40 s each)

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "train_distributed.py"
STEPS, BATCH, SEQ, LR, SEED = 3, 4, 16, 1e-3, 0
PARAM_ATOL, LOSS_RTOL = 1e-5, 1e-5
TIMEOUT_S = 60  # one run takes ~4 s (one process) / ~7 s (two) on 2 cores
# launcher variables of an enclosing torchrun/accelerate would make the single process "distributed"
_LAUNCH_ENV = re.compile(r"^(RANK|LOCAL_RANK|WORLD_SIZE|LOCAL_WORLD_SIZE|GROUP_RANK|ROLE_RANK|MASTER_ADDR|MASTER_PORT"
                         r"|TORCHELASTIC_.*|ACCELERATE_.*)$")


@dataclass
class Run:
    returncode: int
    output: str
    params: dict[str, torch.Tensor]
    record: dict[str, Any]


def train(out: Path, procs: int, *options: str) -> Run:
    """Run the script (``procs`` == 1: plain python; else torchrun) with the fixed tiny settings."""
    launcher = [sys.executable]
    if procs > 1:
        launcher += ["-m", "torch.distributed.run", f"--nproc_per_node={procs}", "--master-addr=127.0.0.1",
                     f"--master-port={free_port()}"]
    cmd = [*launcher, str(SCRIPT), "--steps", str(STEPS), "--global-batch", str(BATCH), "--seq-len", str(SEQ),
           "--lr", str(LR), "--seed", str(SEED), "--out", str(out), *options]
    env = {k: v for k, v in os.environ.items() if not _LAUNCH_ENV.match(k)}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if "--cpu" in options:  # gloo on the CPU: no process sees a GPU (torchembed.tools.launch.hide_gpus says why)
        env["CUDA_VISIBLE_DEVICES"] = ""
    run = run_launcher(cmd, timeout_s=TIMEOUT_S, env=env, cwd=out.parent)
    if run.timed_out:
        pytest.fail(f"timed out after {TIMEOUT_S} s: {' '.join(cmd)}\n{run.output[-4000:]}")
    if run.returncode != 0 or not out.exists():
        return Run(run.returncode, run.output, {}, {})
    return Run(0, run.output, safetensors_torch.load_file(str(out)), json.loads(out.with_suffix(".json").read_text()))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Run]:
    """``runs(model, procs, patch, *options, cpu=True)``: each distinct run happens once per module."""
    root = tmp_path_factory.mktemp("train")
    cache: dict[tuple[Any, ...], Run] = {}

    def get(model: str, procs: int, patch: str = "before", *options: str, cpu: bool = True) -> Run:
        options = ("--model", model, "--patch", patch, *options, *(["--cpu"] if cpu else []))
        key = (procs, *options)
        if key not in cache:
            cache[key] = train(root / f"run{len(cache)}.safetensors", procs, *options)
        return cache[key]

    return get


def ok(run: Run) -> Run:
    assert run.returncode == 0, run.output[-4000:]
    return run


def initial_params(model: str) -> dict[str, torch.Tensor]:
    spec = importlib.util.spec_from_file_location("train_distributed", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script.build_model(model, SEQ, SEED).state_dict()


def assert_same_training(single: Run, dist: Run) -> None:
    assert sorted(single.params) == sorted(dist.params)
    for name, value in single.params.items():
        torch.testing.assert_close(dist.params[name], value, atol=PARAM_ATOL, rtol=0, msg=lambda m, n=name: f"{n}: {m}")
    torch.testing.assert_close(torch.tensor(dist.record["losses"]), torch.tensor(single.record["losses"]),
                               atol=0, rtol=LOSS_RTOL)


@pytest.mark.parametrize("model", ["llama", "bloom"])
def test_ddp_matches_single_process(runs: Callable[..., Run], model: str) -> None:
    single, ddp = ok(runs(model, 1)), ok(runs(model, 2))
    assert (single.record["world_size"], ddp.record["world_size"]) == (1, 2)
    assert ddp.record["distributed_type"] == "MULTI_CPU"
    assert single.record["patched"] and ddp.record["patched"]
    assert len(single.record["losses"]) == STEPS
    assert_same_training(single, ddp)
    start = initial_params(model)
    moved = max((single.params[k] - start[k]).abs().max().item() for k in start if k in single.params)
    assert moved > 100 * PARAM_ATOL, f"training barely moved the parameters ({moved:.2e}): the comparison means nothing"


@pytest.mark.parametrize("model", ["llama", "bloom"])
def test_patch_after_prepare_matches_before(runs: Callable[..., Run], model: str) -> None:
    before, after = ok(runs(model, 2, "before")), ok(runs(model, 2, "after"))
    assert after.record["patched"] and after.record["world_size"] == 2
    assert after.record["losses"] == before.record["losses"]
    for name, value in before.params.items():
        assert torch.equal(after.params[name], value), name


def test_fsdp_matches_single_process(runs: Callable[..., Run]) -> None:
    """On CPU (gloo) accelerate does not run FSDP: the script says so and exits 3 -> skip. With two
    CUDA devices both runs go to CUDA (nccl)."""
    cpu = torch.cuda.device_count() < 2
    fsdp = runs("llama", 2, "before", "--fsdp", cpu=cpu)
    if fsdp.returncode != 0:
        reason = next((line.strip() for line in fsdp.output.splitlines() if "FSDP unsupported here" in line), None)
        if reason is not None and re.search(r"exitcode\s*:\s*3\b", fsdp.output):  # torchrun reports the workers' code
            pytest.skip(reason)
    assert ok(fsdp).record["distributed_type"] == "FSDP"
    assert_same_training(ok(runs("llama", 1, "before", cpu=cpu)), fsdp)
