"""``torchembed bench train --smoke``: runs on CPU in seconds and writes JSON and markdown with one
finite entry per variant x model x shape. No timing assertions."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from torchembed.tools import bench

pytest.importorskip("transformers")


def _finite(x: Any) -> bool:
    if isinstance(x, dict):
        return all(_finite(x[k]) for k in ("median", "min", "max"))
    return isinstance(x, (int, float)) and math.isfinite(x)


@pytest.mark.parametrize("grad_checkpointing", [False, True])
def test_train_smoke(tmp_path: Path, grad_checkpointing: bool) -> None:
    extra = ["--grad-checkpointing"] if grad_checkpointing else []
    assert bench.main(["train", "--smoke", "--out", str(tmp_path), *extra]) == 0
    name = "train-gc-smoke" if grad_checkpointing else "train-smoke"
    data = json.loads((tmp_path / f"{name}.json").read_text())
    md = (tmp_path / f"{name}.md").read_text()
    assert data["benchmark"].startswith("train") and data["variants"] == ["upstream", "patched"]
    assert not data["skipped"]
    records = data["results"]
    for model in ("llama", "falcon"):
        assert 0 < data["params_b"][model] < 1e-3  # the tiny config
        losses = []
        for variant in ("upstream", "patched"):
            found = [r for r in records if r["model"] == model and r["variant"] == variant]
            assert len(found) == 1, found
            rec = found[0]
            assert (rec["batch"], rec["seq_len"], rec["grad_checkpointing"]) == (2, 16, grad_checkpointing)
            assert _finite(rec["ms"]) and _finite(rec["tokens_per_s"]) and _finite(rec["first_loss"]), rec
            losses.append(rec["first_loss"])
        assert losses[0] == pytest.approx(losses[1], rel=1e-5)  # same weights and tokens, float32
    assert "training step" in md and "2 x 16" in md


def test_train_validation(tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        bench.main(["train", "--smoke", "--out", str(tmp_path), "--seq-lens", "1"])
    assert exit_.value.code == 2
    assert "argument --seq-lens: expected an integer >= 2, got '1'" in capsys.readouterr().err
