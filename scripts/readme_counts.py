"""Write the README's model-type table from `torchembed list --all`'s survey, one row per transformers.

    python scripts/readme_counts.py .venv/bin/python /path/to/venv-5.25/bin/python /path/to/venv-4.57/bin/python

Each interpreter (one with torchembed and a transformers release installed) runs the survey of every
model type with a rotary component (``torchembed.tools.zoo.survey_counts``: the counts ``torchembed list
--all`` prints, kept in its cache); the rows replace the table between the ``<!-- model-types:begin -->``
and ``<!-- model-types:end -->`` markers of README.md, newest release first. Nothing in the README's
counts is typed by hand: tests/tools/test_readme_counts.py recomputes the row of the installed release.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- model-types:begin -->", "<!-- model-types:end -->"
#: the table's columns after the version, each a key of ``survey_counts``; the first is the sum of the others
COLUMNS = {"model types": "model types", "patched": "patched", "refused": "refused", "no tiny model": "no tiny model",
           "sub-configs (checked within their composite)": "part of", "no rotary component": "no rotary component",
           "partly patched": "partly patched"}
HEADER = "| transformers | " + " | ".join(COLUMNS) + " |\n|---|" + "---:|" * len(COLUMNS)
_SURVEY = """
import json, os, transformers
os.environ.setdefault("USE_HUB_KERNELS", "0")  # (the survey builds models from configs; no loading)
transformers.logging.set_verbosity_error()
from torchembed.tools.zoo import survey_counts
print(json.dumps({"version": transformers.__version__, **survey_counts()}))
"""


def row(version: str, counts: dict[str, int]) -> str:
    """The table's markdown row of one release's ``survey_counts``."""
    return "| " + " | ".join([version, *(str(counts[key]) for key in COLUMNS.values())]) + " |"


def table(readme: str) -> dict[str, dict[str, int]]:
    """The README's table: version -> {``survey_counts`` key: count}."""
    block = readme.split(BEGIN, 1)[1].split(END, 1)[0]
    rows = {}
    for line in block.strip().splitlines()[2:]:
        version, *cells = (cell.strip() for cell in line.strip().strip("|").split("|"))
        rows[version] = dict(zip(COLUMNS.values(), map(int, cells), strict=True))
    return rows


def counts_of(python: str) -> tuple[str, dict[str, int]]:
    """``(version, survey_counts)`` of the transformers that ``python`` has."""
    out = subprocess.run([python, "-c", _SURVEY], capture_output=True, text=True, cwd=ROOT, check=True).stdout
    data = json.loads(out.strip().splitlines()[-1])
    return data.pop("version"), data


def _key(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version)[:3])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("pythons", nargs="+", help="interpreters with torchembed and one transformers release each")
    parser.add_argument("--readme", default=str(ROOT / "README.md"))
    args = parser.parse_args(argv)
    rows = sorted((counts_of(python) for python in args.pythons), key=lambda r: _key(r[0]), reverse=True)
    text = "\n".join([HEADER, *(row(version, counts) for version, counts in rows)])
    readme = Path(args.readme)
    content = readme.read_text(encoding="utf-8")
    if BEGIN not in content or END not in content:
        print(f"{readme}: no {BEGIN} ... {END} block", file=sys.stderr)
        return 1
    head, rest = content.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    readme.write_text(f"{head}{BEGIN}\n{text}\n{END}{tail}", encoding="utf-8")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
