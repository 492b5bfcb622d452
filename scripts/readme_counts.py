"""Write the README's model-type table from `torchembed list --all`'s survey, one row per transformers.

    python scripts/readme_counts.py .venv/bin/python /path/to/venv-5.25/bin/python /path/to/venv-4.57/bin/python

Each interpreter (one with torchembed and a transformers release installed) runs the survey of every
model type with a rotary component (the same as ``torchembed list --all``, kept in its cache); the
rows replace the table between the ``<!-- model-types:begin -->`` and ``<!-- model-types:end -->``
markers of README.md, newest release first. Nothing in the README's counts is typed by hand.
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
STATES = ("patched", "refused", "no tiny model", "part of")
HEADER = ("| transformers | model types | patched | refused | no tiny model | sub-configs (checked within their "
          "composite) | no rotary component | partly patched |\n|---|---:|---:|---:|---:|---:|---:|---:|")
_SURVEY = """
import json, os, transformers
os.environ.setdefault("USE_HUB_KERNELS", "0")  # (the survey builds models from configs; no loading)
transformers.logging.set_verbosity_error()
from torchembed.tools.zoo import model_types, survey
statuses = survey()
print(json.dumps({"version": transformers.__version__, "types": len(model_types()),
                  "states": [s.state for s in statuses]}))
"""


def row_of(python: str) -> tuple[str, str]:
    """``(version, markdown row)`` of the survey run by ``python``."""
    out = subprocess.run([python, "-c", _SURVEY], capture_output=True, text=True, cwd=ROOT, check=True).stdout
    data = json.loads(out.strip().splitlines()[-1])
    counts = {state: data["states"].count(state) for state in (*STATES, "partly patched")}
    without = data["types"] - len(data["states"])
    cells = [data["version"], data["types"], *(counts[s] for s in STATES), without, counts["partly patched"]]
    return data["version"], "| " + " | ".join(str(c) for c in cells) + " |"


def _key(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version)[:3])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("pythons", nargs="+", help="interpreters with torchembed and one transformers release each")
    parser.add_argument("--readme", default=str(ROOT / "README.md"))
    args = parser.parse_args(argv)
    rows = sorted((row_of(python) for python in args.pythons), key=lambda r: _key(r[0]), reverse=True)
    table = "\n".join([HEADER, *(row for _, row in rows)])
    readme = Path(args.readme)
    text = readme.read_text(encoding="utf-8")
    if BEGIN not in text or END not in text:
        print(f"{readme}: no {BEGIN} ... {END} block", file=sys.stderr)
        return 1
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    readme.write_text(f"{head}{BEGIN}\n{table}\n{END}{tail}", encoding="utf-8")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
