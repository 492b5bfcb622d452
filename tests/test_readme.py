"""The README's Python examples, run as written (the lines that need CUDA only where it exists;
names the README leaves to the reader bound to a tiny random-weight LLaMA checkpoint)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

README = Path(__file__).resolve().parents[1] / "README.md"


def python_block(containing: str) -> str:
    """The README's one ```python block that contains ``containing``."""
    blocks = [b for b in re.findall(r"```python\n(.*?)```", README.read_text(), re.S) if containing in b]
    assert len(blocks) == 1, f"{len(blocks)} python blocks of README.md contain {containing!r}"
    return blocks[0]


def runnable_here(code: str) -> str:
    return code if torch.cuda.is_available() else "\n".join(line for line in code.splitlines() if '"cuda"' not in line)


def test_encodings_tour() -> None:
    scope: dict = {}
    exec(runnable_here(python_block("from torchembed.positional import")), scope)
    assert scope["q"].shape == (2, 8, 64, 128) and scope["k"].shape == (2, 2, 64, 128)
    assert scope["q1"].shape == (2, 8, 1, 128)
    assert scope["scores"].shape == scope["out"].shape == (2, 12, 64, 64)
    assert scope["x"].shape == (2, 128, 768)


def test_patching_tour(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    from torchembed.tools.checkpoints import build_checkpoint

    path = build_checkpoint("llama", tmp_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    ids = torch.randint(0, model.config.vocab_size, (1, 12))
    with torch.no_grad():
        before = model(ids).logits
    scope = {"torch": torch, "model": model, "path_or_id": path, "path_or_model": path}
    exec(python_block("torchembed.patch(model)"), scope)
    assert not scope["torchembed"].is_patched(model)  # the block ends unpatched (patched() restores it)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)
    assert scope["torchembed"].is_patched(scope["model"]) and scope["model"] is not model  # from_pretrained's
    assert scope["report"].rows and scope["report"].ok
