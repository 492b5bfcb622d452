"""``torchembed.tools.launch.run_launcher``: a torchrun launch past its time limit is stopped with
its workers (which torchrun starts in sessions of their own) and reported, output included."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from torchembed.tools.launch import free_port, run_launcher

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "train_distributed.py"


def _processes_naming(arg: str, grace_s: float = 10.0) -> list[int]:
    """Live processes whose command line contains ``arg`` (a signal lands asynchronously: those
    still there after ``grace_s``)."""
    deadline = time.monotonic() + grace_s
    while True:
        alive = []
        for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
            try:
                if arg in cmdline.read_bytes().decode(errors="replace"):
                    alive.append(int(cmdline.parent.name))
            except OSError:  # exited meanwhile
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="lists processes through /proc")
def test_timed_out_launch_stops_its_workers(tmp_path: Path) -> None:
    out = tmp_path / "run.safetensors"
    # 5000 steps (~80 s on 2 CPU cores, the first after ~10 s): the workers are training when the limit
    # hits, and would write `out` if they were left to finish.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master-addr=127.0.0.1",
           f"--master-port={free_port()}", str(SCRIPT), "--model", "llama", "--steps", "5000", "--global-batch", "2",
           "--cpu", "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    run = run_launcher(cmd, timeout_s=25, env=env)
    assert run.timed_out and run.returncode != 0 and run.output.endswith("[timed out after 25 s]")
    assert "step 0 loss" in run.output, "the workers had not started training: the limit came too early"
    assert not _processes_naming(str(out)), "workers outlived the launch"
    assert not out.exists()


def test_finished_launch_returns_its_output_and_code() -> None:
    run = run_launcher([sys.executable, "-c", "import sys; print('hello'); sys.exit(3)"], timeout_s=60)
    assert (run.returncode, run.output, run.timed_out) == (3, "hello\n", False)


def test_hide_gpus_leaves_the_process_no_gpu() -> None:
    """What a worker's ``--cpu`` relies on (a machine with fewer GPUs than processes failed in
    accelerate's barrier before): after ``hide_gpus`` torch sees no GPU; once CUDA is up it refuses."""
    import subprocess

    import torch

    code = ("import os, torch; from torchembed.tools.launch import hide_gpus; hide_gpus(); "
            "assert os.environ['CUDA_VISIBLE_DEVICES'] == '' and not torch.cuda.is_available() "
            "and torch.cuda.device_count() == 0; print('ok')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]
    if torch.cuda.is_available():  # only a GPU machine can initialise CUDA first
        late = "import torch; torch.zeros(1, device='cuda'); from torchembed.tools.launch import hide_gpus; hide_gpus()"
        proc = subprocess.run([sys.executable, "-c", late], capture_output=True, text=True, timeout=120)
        assert proc.returncode != 0 and "after CUDA was initialised" in proc.stderr
