"""``benchmarks/results`` holds what the documentation cites and nothing else: every file there is listed in
the results README (with its command and date) and cited by the README or a page of ``docs/``; every link
of the README, the docs and the results' own pages leads somewhere that exists. Earlier runs live in git's
history, not in the folder."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
#: the hard limit on the folder's size (files, README included)
MAX_FILES = 70


def pages() -> list[Path]:
    """The documentation a user reads: the README and every page of docs/."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _targets(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)  # code blocks hold commands
    return [t for t in re.findall(r"\]\(([^)\s]+)\)", text) if not re.match(r"[a-z]+:", t)]


def links(page: Path) -> list[Path]:
    """The local targets of the markdown links and images of ``page`` (anchors dropped), resolved."""
    return [(page.parent / t.split("#", 1)[0]).resolve() for t in _targets(page) if not t.startswith("#")]


def anchors(page: Path) -> set[str]:
    """The anchors of the headings of ``page``, as GitHub makes them (``## The cache's own copy`` ->
    ``the-caches-own-copy``)."""
    headings = re.findall(r"^#+ (.+)$", re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


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


def not_linked(folder: Path, linked: set[Path]) -> list[str]:
    """The files of ``folder`` (its README aside) no page links: ``x.json`` counts as linked with ``x.md``
    (the JSON beside the table); a plot must be linked itself."""
    missing = []
    for entry in sorted(p for p in folder.rglob("*") if p.is_file()):
        if entry.name == "README.md" and entry.parent == folder:
            continue
        if entry.resolve() in linked or (entry.suffix == ".json" and entry.with_suffix(".md").resolve() in linked):
            continue
        missing.append(str(entry.relative_to(folder)))
    return missing


def broken(pages: list[Path]) -> list[str]:
    """``page: target`` for each local link of ``pages`` whose target does not exist, or whose ``#anchor`` names no
    heading of the markdown page it points into."""
    found = []
    for page in pages:
        for target in _targets(page):
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                found.append(f"{page.name}: {file}")
            elif anchor and file.suffix == ".md" and anchor not in anchors(file):
                found.append(f"{page.name}: {target} (no such heading)")
    return found


def test_every_results_file_is_in_the_results_index():
    assert not uncited(RESULTS), f"results files the results README does not list: {uncited(RESULTS)}"


def test_every_results_file_is_cited_by_the_readme_or_a_doc():
    linked = {target for page in pages() for target in links(page)}
    assert any(t.parent == RESULTS for t in linked), "the documentation links no results"
    assert not_linked(RESULTS, linked) == [], "results files no page of the documentation cites: git rm them"


def test_every_link_of_the_documentation_exists():
    """The README, docs/ and the results' own pages (their links to each other and to their JSON)."""
    assert broken(pages() + sorted(RESULTS.glob("*.md"))) == []


def test_the_results_folder_stays_small():
    files = [p for p in RESULTS.rglob("*") if p.is_file()]
    assert len(files) <= MAX_FILES, f"{len(files)} files in benchmarks/results: keep the newest run of each table"


def test_an_uncited_file_is_found(tmp_path):
    (tmp_path / "README.md").write_text("| `a.md` (+ `.json`) | what |\n| `b.md` | what |\n")
    for name in ("a.md", "a.json", "b.md", "b.json", "c.md"):
        (tmp_path / name).write_text("")
    assert uncited(tmp_path) == ["b.json", "c.md"]


def test_an_unlinked_file_and_a_broken_link_are_found(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    for name in ("README.md", "a.md", "a.json", "b.json", "c.png", "d.md"):
        (results / name).write_text("")
    (results / "a.md").write_text("# A\n\n## The cache's own copy\n")
    page = tmp_path / "page.md"
    page.write_text("# Top\n[a](results/a.md#the-caches-own-copy) ![plot](results/c.png) [gone](results/gone.md#top) "
                    "[web](https://x.org/y.md)\n[here](#top) [there](#nowhere) [bad](results/a.md#nope)\n"
                    "```bash\n[not a link](results/d.md)\n```\n")
    linked = set(links(page))
    assert linked == {(results / n).resolve() for n in ("a.md", "c.png", "gone.md")}
    assert not_linked(results, linked) == ["b.json", "d.md"]
    assert broken([page]) == [f"page.md: {(results / 'gone.md').resolve()}", "page.md: #nowhere (no such heading)",
                              "page.md: results/a.md#nope (no such heading)"]
