"""``torchembed bench {rope,e2e,alibi} --smoke``: each runs on CPU in seconds and writes JSON and
markdown with one finite entry per provider (variant) x shape. No timing assertions."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from torchembed.tools import bench


def _run(what: str, tmp_path: Path, *extra: str) -> tuple[dict[str, Any], str]:
    assert bench.main([what, "--smoke", "--out", str(tmp_path), *extra]) == 0
    name = f"{what}-smoke"
    json_path, md_path = tmp_path / f"{name}.json", tmp_path / f"{name}.md"
    assert json_path.is_file() and md_path.is_file()
    data = json.loads(json_path.read_text())
    md = md_path.read_text()
    for key in ("date", "gpu", "torch", "python"):
        assert data["env"][key]
    assert "- date:" in md and "torch" in md
    return data, md


def _finite(x: Any) -> bool:
    if isinstance(x, dict):
        return all(_finite(x[k]) for k in ("median", "min", "max"))
    return isinstance(x, (int, float)) and math.isfinite(x)


def _one(records: list[dict[str, Any]], **match: Any) -> dict[str, Any]:
    found = [r for r in records if all(r.get(k) == v for k, v in match.items())]
    assert len(found) == 1, (match, found)
    return found[0]


def test_rope_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data, md = _run("rope", tmp_path)
    providers, shapes, records = data["providers"], data["shapes"], data["results"]
    assert {"torchembed", "torchembed-angles"} <= set(providers) and shapes
    assert data["env"]["copy_bandwidth_gbs"] > 0
    for shape in shapes:
        assert _finite(_one(records, section="forward", provider="floor", shape_label=shape)["ms"])
        assert _finite(_one(records, section="forward", provider="copy", shape_label=shape)["ms"])
        for provider in providers:
            for section in ("forward", "forward+backward"):
                assert _finite(_one(records, section=section, provider=provider, shape_label=shape)["ms"])
            err = _one(records, section="accuracy", provider=provider, shape_label=shape)["max_abs_err"]
            assert _finite(err) and err < 0.1  # bf16 rounding of unit-scale values
        assert shape in md
    decode = [s for s in shapes if s.split()[0].endswith("x1")]
    for shape in decode:
        for provider in providers:
            assert _finite(_one(records, section="host", provider=provider, shape_label=shape)["us_per_call"])
    assert "% of floor" in md
    assert "liger" in data["skipped"] or "liger" in providers
    assert capsys.readouterr().out.strip().endswith(md.strip().splitlines()[-1])  # markdown printed last


def test_e2e_smoke(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    data, md = _run("e2e", tmp_path)
    records = data["results"]
    variants = [v for v in data["variants"] if any(r["variant"] == v for r in records)]
    assert {"upstream", "patched"} <= set(variants)
    for model in ("llama", "mistral", "falcon"):
        for batch in (1, 2):
            for phase in ("prefill", "decode"):
                for variant in variants:
                    rec = _one(records, model=model, batch=batch, phase=phase, variant=variant)
                    assert _finite(rec["ms"]), rec
                    if phase == "decode":
                        assert _finite(rec["tokens_per_s"])
                    if variant == "patched":  # per-repeat upstream / patched, from the recorded runs
                        up = _one(records, model=model, batch=batch, phase=phase, variant="upstream")["ms"]
                        pairs = [u / p for u, p in zip(up["values"], rec["ms"]["values"])]
                        assert rec["paired_speedup"]["values"] == pytest.approx(pairs) and len(pairs) == 2
    assert "prefill latency" in md and "eager decode" in md and "paired" in md


def test_paired_ratio() -> None:
    a, b = bench.stats([2.0, 9.0, 3.0]), bench.stats([1.0, 3.0, 6.0])
    assert bench.paired_ratio(a, b) == bench.stats([2.0, 3.0, 0.5])
    assert bench.paired_ratio(bench.stats([1.0, math.nan]), bench.stats([2.0, 1.0]))["values"] == [0.5]
    assert bench.paired_ratio(a, {}) is None


def test_alibi_smoke(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    data, md = _run("alibi", tmp_path, "--seq-lens", "16", "--batch-sizes", "1", "2",
                    "--variants", "upstream", "patched", "patched-kernel")
    records = data["results"]
    for model in ("bloom", "mpt", "falcon"):
        for variant in ("upstream", "patched", "patched-kernel"):
            for batch in (1, 2):
                assert _finite(_one(records, model=model, phase="prefill", batch=batch, seq_len=16, variant=variant)["ms"])
                assert _finite(_one(records, model=model, phase="decode", batch=batch, variant=variant)["ms"])
    assert "prefill latency" in md and "Falcon `sdpa`" in md
    assert "upstream / patched |" in md and "upstream / patched-kernel |" in md
    assert "tanh-GELU" in md  # BLOOM's own activation is named as what is left


def test_alibi_kernel_smoke(tmp_path: Path) -> None:
    assert bench.main(["alibi", "--kernel", "--smoke", "--out", str(tmp_path), "--passes", "forward"]) == 0
    data = json.loads((tmp_path / "alibi-kernel-smoke.json").read_text())
    md = (tmp_path / "alibi-kernel-smoke.md").read_text()
    by = {(r["label"], r["impl"]): r for r in data["results"]}
    for label in ("prefill 1,2,64,16", "decode 1,2,1x64,16"):
        for impl in ("floor", "torchembed", "sdpa-bias"):
            assert _finite(by[(label, impl)]["ms"]), (label, impl)
        assert by[(label, "torchembed")]["max_err"] < 1e-5
    assert "## prefill, forward" in md and "## decode" in md and "not installed" in md


def test_dispatch_and_validation(tmp_path: Path) -> None:
    assert bench.main(["nope"]) == 2
    with pytest.raises(ValueError, match="B,S,HQ,HK,D"):
        bench.main(["rope", "--smoke", "--out", str(tmp_path), "--shapes", "1,2,3"])
