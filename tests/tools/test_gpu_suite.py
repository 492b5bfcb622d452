"""``benchmarks/gpu_suite.py``: the GPU suite's record (counts per directory and file, failures, skips, the tests that
ran only on CUDA) and its status line (current while the tested commit holds the newest change to the core, or the
core is the tested one again)."""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("gpu_suite", ROOT / "benchmarks" / "gpu_suite.py")
gpu_suite = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_suite)


def _record(tests, commit="abc1234"):
    return {"commit": commit, "date": "2026-12-06 12:00 UTC", "wall_seconds": 12.0, "exit_code": 1, "command": "pytest",
            "python": "3.12", "torch": "2.11", "triton": "3.6", "transformers": "5.17", "gpu": "NVIDIA H100", "tests": tests}


def test_the_markdown_counts_per_directory_and_file_and_names_failures_skips_and_cuda_only_tests():
    tests = [{"test": "tests/kernels/test_a.py::t1", "outcome": "passed", "seconds": 2.0},
             {"test": "tests/kernels/test_a.py::t2", "outcome": "failed", "seconds": 1.0, "message": "E  assert 1 == 2"},
             {"test": "tests/kernels/test_b.py::t3", "outcome": "skipped", "seconds": 0.0, "reason": "needs two CUDA devices"},
             {"test": "tests/patches/test_c.py::t4", "outcome": "passed", "seconds": 5.0}]
    cpu = _record([{"test": "tests/kernels/test_a.py::t1", "outcome": "skipped", "seconds": 0.0, "reason": "needs CUDA"},
                   {"test": "tests/patches/test_c.py::t4", "outcome": "passed", "seconds": 5.0}])
    text = gpu_suite.markdown(_record(tests), cpu)
    assert "- commit: abc1234" in text and "**2 passed, 1 failed, 0 errors, 1 skipped**" in text
    assert "| `tests/kernels` | 1 | 1 | 0 | 1 | 3.0 |" in text and "| `tests/patches/test_c.py` | 1 | 0 | 0 | 0 | 5.0 |" in text
    assert "| `tests/kernels/test_a.py::t2` | failed | E  assert 1 == 2 |" in text
    assert "| 1 | needs two CUDA devices |" in text
    assert "- 1 tests ran here that skip on a machine without CUDA" in text
    assert text.index("tests/patches/test_c.py::t4") < text.index("tests/kernels/test_a.py::t1` | 2.0")  # slowest first


def _git(root, *args):
    subprocess.run(["git", *args], cwd=root, check=True, capture_output=True,
                   env={"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
                        "GIT_COMMITTER_EMAIL": "t@t", "PATH": "/usr/bin:/bin"})
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True).stdout.strip()


def test_the_status_is_current_while_the_tested_commit_holds_the_newest_core_change_or_its_content(tmp_path):
    _git(tmp_path, "init", "-q")
    (tmp_path / "patches").mkdir()
    (tmp_path / "patches" / "x.py").write_text("a = 1\n")
    _git(tmp_path, "add", "-A")
    tested = _git(tmp_path, "commit", "-qm", "core")
    assert gpu_suite.status(tmp_path)[1].startswith("GPU suite: stale: never recorded")
    record = tmp_path / "benchmarks" / "results" / "gpu-suite.md"
    record.parent.mkdir(parents=True)
    record.write_text(f"# The whole test suite on a GPU\n\n- commit: {tested}\n")
    _git(tmp_path, "add", "-A")
    _git(tmp_path, "commit", "-qm", "the record")  # (a commit after the tested one, outside the core)
    current, line = gpu_suite.status(tmp_path)
    assert current and line.startswith(f"GPU suite: current: gpu-suite.md tested {tested[:9]}")
    record.write_text(f"- commit: {tested}\n- **9 passed, 1 failed, 0 errors, 2 skipped**\n")  # a run with a failure
    current, line = gpu_suite.status(tmp_path)
    assert not current and line.startswith("GPU suite: failing (1 failed, 0 errors)"), line
    record.write_text(f"- commit: {tested}\n- command: `python benchmarks/gpu_suite.py run` (`(cut short: the tests that "
                      f"finished)`), 0 s wall, pytest exit code -1\n- **9 passed, 0 failed, 0 errors, 2 skipped**\n")
    current, line = gpu_suite.status(tmp_path)  # a run stopped at its time limit is not a green record
    assert not current and line.startswith("GPU suite: cut short (some tests never ended)"), line
    record.write_text(record.read_text().replace("0 failed", "1 failed"))
    assert gpu_suite.status(tmp_path)[1].startswith("GPU suite: failing (1 failed, 0 errors; cut short)")
    record.write_text(f"- commit: {tested}\n- **9 passed, 0 failed, 0 errors, 2 skipped**\n")
    assert gpu_suite.status(tmp_path)[0]
    (tmp_path / "patches" / "x.py").write_text("a = 2\n")
    _git(tmp_path, "add", "-A")
    changed = _git(tmp_path, "commit", "-qm", "core again")
    current, line = gpu_suite.status(tmp_path)
    assert not current and "stale" in line and changed[:9] in line
    (tmp_path / "patches" / "x.py").write_text("a = 1\n")  # the change reverted: the core is the tested one again
    _git(tmp_path, "add", "-A")
    reverted = _git(tmp_path, "commit", "-qm", "core reverted")
    current, line = gpu_suite.status(tmp_path)
    assert current and line.startswith(f"GPU suite: current: gpu-suite.md tested {tested[:9]}") and reverted[:9] in line
    record.write_text("- commit: 0000000\n")
    assert "names no commit of this history" in gpu_suite.status(tmp_path)[1]


def test_the_run_gives_each_test_process_one_thread(monkeypatch, tmp_path):
    """Workers inherit one intra-op thread each (as scripts/test.sh sets): many workers with every core's threads
    oversubscribe the host (the model-zoo tests ran 60-180 s each on a 16-core GPU machine, and the run outran its
    call); a value the caller set is kept."""
    import argparse

    import pytest

    seen = {}

    def main(args, plugins=()):
        seen.update(omp=gpu_suite.os.environ.get("OMP_NUM_THREADS"), args=args)
        return 0

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(pytest, "main", main)
    monkeypatch.chdir(tmp_path)
    args = argparse.Namespace(out=str(tmp_path / "out"), commit="abc1234", workers=3, timeout=60, cpu_record=None)
    assert gpu_suite.run(args, ["tests/functional"]) == 0
    assert seen["omp"] == "1" and seen["args"][-1] == "tests/functional" and "-n" in seen["args"]
    assert (tmp_path / "out" / "gpu-suite.md").exists()
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    gpu_suite.run(args, ["tests/functional"])
    assert seen["omp"] == "4"
