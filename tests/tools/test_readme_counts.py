"""The README's model-type counts are the survey's (``torchembed list --all``, written by
``scripts/readme_counts.py``): every row of its table adds up to its model types, the counts its prose
names are the table's, and the row of the installed transformers is what a survey finds now.

The survey builds ~430 tiny models (about 1.5 minutes on one core); it keeps its result in the cache
folder, where ``torchembed compare --all`` (CI's next step) reads it back instead of building them again.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType

import pytest

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]


def _readme_counts() -> ModuleType:
    spec = importlib.util.spec_from_file_location("readme_counts", ROOT / "scripts" / "readme_counts.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


readme_counts = _readme_counts()
README = (ROOT / "README.md").read_text(encoding="utf-8")
TABLE = readme_counts.table(README)


def _row(version: str) -> dict[str, int]:
    """The table's row of ``version`` ("5.23" names the table's 5.23.x)."""
    found = [v for v in TABLE if v == version or v.startswith(version + ".")]
    assert len(found) == 1, f"the README names transformers {version}; its table has {', '.join(TABLE)}"
    return TABLE[found[0]]


def test_every_row_adds_up_to_its_model_types() -> None:
    assert len(TABLE) >= 2
    for version, row in TABLE.items():
        parts = {key: n for key, n in row.items() if key != "model types"}
        assert sum(parts.values()) == row["model types"], (version, row)


def test_the_counts_in_the_prose_are_the_tables() -> None:
    named = re.findall(r"(\d+)\s+model\s+types\s+of\s+transformers\s+(\d+\.\d+(?:\.\d+)?)\s+patched", README)
    assert named, "the README's opening names how many model types are patched"
    for count, version in named:
        assert int(count) == _row(version)["patched"], f"the prose says {count} patched on {version}"


def _refused_in_readme() -> tuple[set[str], list[str]]:
    """The model types of the README's table of refusals (first column, comma-separated) and the
    releases its caption names ("5.23", ...)."""
    caption, table = README.split("Refused, with the reason", 1)[1].split("| model types | reason |", 1)
    versions = re.findall(r"\d+\.\d+", caption.split(";", 1)[0])
    rows = table.split("\n\n", 1)[0].strip().splitlines()[1:]
    return {name.strip() for row in rows for name in row.split("|")[1].split(",")}, versions


@pytest.mark.slow
def test_the_row_of_the_installed_transformers_is_the_survey() -> None:
    from torchembed.tools.zoo import survey, survey_counts

    version = transformers.__version__
    if version not in TABLE:
        pytest.skip(f"the README's table has no row for transformers {version} ({', '.join(TABLE)})")
    if _torchvision_imports():
        pytest.skip("torchvision imports here, so timm's backbones (gemma3n's vision tower) build: the README's counts "
                    "are a survey where it does not (beside the CPU build of torch, as `pip install .[hf,dev]` gives)")
    statuses = survey()
    assert TABLE[version] == survey_counts(statuses), (
        f"the README's counts for transformers {version} are not the survey's: python scripts/readme_counts.py "
        "PYTHON ... writes them"
    )
    refused, versions = _refused_in_readme()
    if ".".join(version.split(".")[:2]) in versions:
        assert refused == {s.model_type for s in statuses if s.state == "refused"}


def _torchvision_imports() -> bool:
    try:
        import torchvision  # noqa: F401
    except Exception:  # (not installed, or built for another torch: it fails at import)
        return False
    return True
