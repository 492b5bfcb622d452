"""``benchmarks/pool_paired.py``: pooling the per-repeat upstream / patched ratios of e2e result files."""

from __future__ import annotations

import importlib.util
import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from torchembed.tools import bench

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "pool_paired.py"


def _load():
    spec = importlib.util.spec_from_file_location("pool_paired", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _write(path: Path, upstream: list[float], patched: list[float], with_values: bool = True) -> Path:
    """An e2e result file as ``bench e2e`` writes it (``with_values=False``: as older runs did)."""
    base = {"phase": "decode", "model": "llama", "batch": 1, "prompt_len": 512}
    up, pa = (bench.stats(values) for values in (upstream, patched))
    records = [{**base, "variant": "upstream", "ms": up}, {**base, "variant": "patched", "ms": pa}]
    if with_values:
        records[1]["paired_speedup"] = bench.paired_ratio(up, pa)
    else:
        for r in records:
            del r["ms"]["values"]
    skipped = {**base, "model": "falcon", "variant": "patched", "ms": "skipped: time budget"}
    path.write_text(json.dumps({"results": [*records, skipped]}))
    return path


def test_pools_pairs_across_files(tmp_path: Path) -> None:
    pool = _load()
    a = _write(tmp_path / "a.json", [12.0, 30.0, 11.0], [10.0, 20.0, 10.0])
    b = _write(tmp_path / "b.json", [9.0], [10.0])
    old = _write(tmp_path / "old.json", [50.0], [10.0], with_values=False)  # no raw values: skipped
    pooled = pool.paired_samples([a, b, old])
    assert list(pooled) == [("decode", "llama", 1, 512)]
    per_file = pooled["decode", "llama", 1, 512]
    assert per_file["a"] == pytest.approx([1.2, 1.5, 1.1]) and per_file["b"] == pytest.approx([0.9])
    assert "old" not in per_file
    low, high = pool.bootstrap_median([1.2, 1.5, 1.1, 0.9])
    assert 0.9 <= low <= statistics.median([1.2, 1.5, 1.1, 0.9]) <= high <= 1.5


def test_script_prints_and_writes_the_table(tmp_path: Path) -> None:
    a = _write(tmp_path / "a.json", [12.0, 30.0, 11.0], [10.0, 20.0, 10.0])
    out = tmp_path / "pooled.md"
    run = subprocess.run([sys.executable, str(SCRIPT), str(a), "--out", str(out)], capture_output=True, text=True,
                         check=True)
    row = next(line for line in out.read_text().splitlines() if line.startswith("| decode"))
    assert "| llama | 1 x 512 |" in row and "| 3 | 1.200x |" in row and "| 0.833 |" in row
    assert row in run.stdout
