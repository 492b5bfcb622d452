"""What the scripts leave behind: ``train_distributed.py --out DIR`` writes inside DIR (never the
working folder), and ``scripts/test.sh`` loads the plugin that lets xdist workers end before they are
interrupted (``tests/tools/xdist_quiet_exit.py`` says why)."""

from __future__ import annotations

import gc
import importlib.util
import types
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _train_distributed() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("train_distributed", ROOT / "scripts" / "train_distributed.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_train_distributed_writes_into_the_out_folder(tmp_path: Path, monkeypatch) -> None:
    pytest.importorskip("accelerate")
    pytest.importorskip("safetensors")
    script = _train_distributed()
    monkeypatch.chdir(tmp_path)
    for out in (tmp_path / "run", tmp_path):  # a new folder, an existing one
        args = script.parse_args(["--out", str(out)])
        assert args.out == out / "params.safetensors"
        script.save(args.out, {"w": torch.ones(2)}, {"losses": [1.0]})
        assert (out / "params.safetensors").is_file() and (out / "params.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["params.json", "params.safetensors", "run"]
    assert script.parse_args(["--out", str(tmp_path / "a.safetensors")]).out == tmp_path / "a.safetensors"
    with pytest.raises(ValueError, match="losses go next to the parameters"):
        script.parse_args(["--out", str(tmp_path / "a.json")])


def test_the_docs_train_into_a_temporary_folder() -> None:
    text = "\n".join(p.read_text(encoding="utf-8") for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])
    text = text.replace("\\\n", " ")  # a command continued on the next line is one line
    commands = [line for line in text.splitlines() if "train_distributed.py" in line and "--out" in line]
    assert commands and all("--out $OUT/" in line for line in commands), commands
    assert "OUT=$(mktemp -d)" in text


def test_an_xdist_worker_freezes_what_is_left_after_its_session() -> None:
    from tests.tools import xdist_quiet_exit

    controller = types.SimpleNamespace(config=types.SimpleNamespace())
    worker = types.SimpleNamespace(config=types.SimpleNamespace(workerinput={"workerid": "gw0"}))
    before = gc.get_freeze_count()  # (not always 0: a library the worker imported may have frozen objects already)
    try:
        xdist_quiet_exit.pytest_sessionfinish(controller)
        assert gc.get_freeze_count() == before
        xdist_quiet_exit.pytest_sessionfinish(worker)
        assert gc.get_freeze_count() > before
    finally:
        if before == 0:
            gc.unfreeze()


def test_test_sh_loads_the_plugin() -> None:
    assert "-p tests.tools.xdist_quiet_exit" in (ROOT / "scripts" / "test.sh").read_text(encoding="utf-8")
