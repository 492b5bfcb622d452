"""Every Python block of the README and of docs/*.md runs as written, on this machine (CPU-only lines
included: the pages guard what needs CUDA themselves), each in a fresh namespace; then what the README's
blocks claim holds."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, re.S)


BLOCKS = [(page, i, block) for page in PAGES for i, block in enumerate(python_blocks(page.read_text(encoding="utf-8")))]
README_BLOCKS = [block for page, _, block in BLOCKS if page.name == "README.md"]


def _first_line(block: str) -> str:
    return next(line for line in block.splitlines() if line.strip() and not line.startswith(("import", "from")))


def readme_block(marker: str) -> str:
    """The one README block that contains ``marker``."""
    found = [block for block in README_BLOCKS if marker in block]
    assert len(found) == 1, f"{len(found)} README blocks contain {marker!r}"
    return found[0]


def _needs(block: str) -> None:
    """Skip a block whose optional packages are missing (the bare install runs the encodings only)."""
    if re.search(r"transformers|build_checkpoint|from_pretrained|torchembed\.(patch|compare)\b|smollm2", block):
        pytest.importorskip("transformers")
    if "gguf" in block:
        pytest.importorskip("gguf")


@pytest.fixture
def run(tmp_path, monkeypatch):
    """``run(block) -> namespace``: exec the block verbatim in an empty namespace, in a scratch
    folder, with the tiny checkpoints cached there and no model hub."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TORCHEMBED_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    def _run(block: str, name: str = "README.md") -> dict:
        scope: dict = {"__name__": "readme"}
        exec(compile(block, name, "exec"), scope)
        return scope

    return _run


def test_the_pages_have_the_blocks_this_file_checks():
    assert len(README_BLOCKS) == 5, [_first_line(b) for b in README_BLOCKS]
    assert {page.name for page, _, _ in BLOCKS} >= {"README.md", "patching.md"}


@pytest.mark.parametrize("page, index, block", BLOCKS, ids=[f"{p.name}-{i}" for p, i, _ in BLOCKS])
def test_every_python_block_runs(run, page, index, block):
    _needs(block)
    run(block, f"{page.name} block {index}")


def test_front_block_loads_and_patches(run):
    pytest.importorskip("transformers")
    scope = run(README_BLOCKS[0])
    torchembed = scope["torchembed"]
    assert torchembed.is_patched(scope["model"]) and torchembed.find_positional_components(scope["model"])


def test_patch_block(run):
    pytest.importorskip("transformers")
    scope = run(readme_block("torchembed.patch(plain)"))
    torchembed = scope["torchembed"]
    assert torchembed.is_patched(scope["model"]) and scope["model"].dtype == torch.bfloat16  # from_pretrained's
    assert not torchembed.is_patched(scope["plain"]) and not torchembed.is_patched(scope["transformers"])


def test_compare_block(run):
    pytest.importorskip("transformers")
    scope = run(readme_block("torchembed.compare("))
    report = scope["report"]
    assert report.ok and {row.model for row in report.rows} == {"llama"} and report.rows[0].rel <= 1e-5


def test_inference_block(run):
    pytest.importorskip("transformers")
    scope = run(readme_block("model.generate("))
    assert scope["torchembed"].is_patched(scope["model"])
    out = scope["out"]  # the prompt, then up to 8 new tokens (a tiny random model may end early)
    assert 4 < out.shape[1] <= 4 + 8 and torch.equal(out[:, :4].cpu(), scope["ids"].cpu())


def test_encodings_block(run):
    scope = run(readme_block("RotaryEmbedding(dim=128"))
    assert scope["q"].shape == (2, 8, 64, 128) and scope["k"].shape == (2, 2, 64, 128)
    assert scope["q1"].shape == (2, 8, 1, 128)
    assert scope["scores"].shape == scope["out"].shape == (2, 12, 64, 64)
    assert scope["x"].shape == (2, 128, 768)
