"""``torchembed.patches`` where Python runs inside the checkout without an editable install
pointing at it (a plain ``pip install .``, or none): ``torchembed`` then comes from the checkout,
where ``torchembed/patches`` is a symbolic link to the top-level ``patches/`` (installed, the
``[tool.setuptools.package-dir]`` mapping puts the same files there). No import hook."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Drop the finders of an editable install (they would map the name wherever they were made).
CODE = """
import sys
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in (f.__module__ + getattr(f, "__name__", "")).lower()]
assert not [f for f in sys.meta_path if "editable" in repr(f).lower()], sys.meta_path
import torchembed
from torchembed import patches
from torchembed.patches import core
print(torchembed.__file__)
print(patches.__file__)
print(core.__file__)
print(torchembed.patch is patches.patch)
"""


def test_patches_import_from_the_checkout_itself() -> None:
    proc = subprocess.run([sys.executable, "-c", CODE], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    package, patches, core, same = proc.stdout.split()
    assert Path(package) == ROOT / "torchembed" / "__init__.py"
    assert Path(patches).resolve() == ROOT / "patches" / "__init__.py"
    assert Path(core).resolve() == ROOT / "patches" / "core.py"
    assert same == "True"


def test_no_import_hook() -> None:
    code = "import sys, torchembed.patches; print([type(f).__module__ for f in sys.meta_path])"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "torchembed" not in proc.stdout, proc.stdout + proc.stderr[-2000:]


def test_import_torchembed_does_not_import_transformers() -> None:
    code = "import sys, torchembed; print('transformers' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "False", proc.stderr[-3000:]
