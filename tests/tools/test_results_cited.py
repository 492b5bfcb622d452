"""Every file under ``benchmarks/results`` is one the results README cites (with its command and date), and
every results file the main README links exists: earlier runs live in git's history, not in the folder."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"


def uncited(folder: Path) -> list[str]:
    """The entries of ``folder`` its README.md does not name; ``x.json`` counts as named on a row that names
    ``x.md`` with ``(+ `.json`)``; an empty folder (left by a run, not in git) is no entry."""
    text = (folder / "README.md").read_text(encoding="utf-8")
    rows = [line for line in text.splitlines() if line.startswith("|")]
    missing = []
    for entry in sorted(folder.iterdir()):
        name = entry.name
        if name == "README.md" or name in text or (entry.is_dir() and not any(entry.iterdir())):
            continue
        md = f"`{entry.stem}.md`"
        if entry.suffix == ".json" and any(md in row and "(+ `.json`)" in row for row in rows):
            continue
        missing.append(name)
    return missing


def test_every_results_file_is_cited():
    assert not uncited(RESULTS), f"results files the results README does not cite: {uncited(RESULTS)}"


def test_an_uncited_file_is_found(tmp_path):
    (tmp_path / "README.md").write_text("| `a.md` (+ `.json`) | what |\n| `b.md` | what |\n")
    for name in ("a.md", "a.json", "b.md", "b.json", "c.md"):
        (tmp_path / name).write_text("")
    assert uncited(tmp_path) == ["b.json", "c.md"]


def test_the_readme_links_only_results_that_exist():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    linked = set(re.findall(r"benchmarks/results/([\w.\-/]+\.(?:md|json|png))", readme))
    assert linked, "the README links no results"
    assert not [name for name in sorted(linked) if not (RESULTS / name).exists()]
