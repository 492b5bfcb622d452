"""``torchembed.patches`` from a source checkout.

Installed, the repository's top-level ``patches/`` folder is the subpackage ``torchembed.patches``
(``[tool.setuptools.package-dir]``: copied into the wheel, or mapped by an editable install's
finder). Python started inside the checkout imports ``torchembed`` from the checkout instead of
the installed copy (the current directory comes first on ``sys.path``), and there ``patches/`` is
not inside ``torchembed/``: this finder maps the name to the ``patches/`` beside the imported
``torchembed`` (first, so that an editable install of another checkout does not mix the two).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from importlib.machinery import ModuleSpec
from pathlib import Path

NAME = "torchembed.patches"
_PACKAGE = Path(__file__).resolve().parent
_SOURCE = _PACKAGE.parent / "patches"


class _CheckoutPatchesFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: object = None, target: object = None) -> ModuleSpec | None:
        if name != NAME:
            return None
        return importlib.util.spec_from_file_location(NAME, _SOURCE / "__init__.py",
                                                      submodule_search_locations=[str(_SOURCE)])


def install() -> None:
    """Add the finder where ``torchembed`` is a checkout's (``../patches`` beside it, none inside)."""
    inside = (_PACKAGE / "patches" / "__init__.py").is_file()
    if inside or not (_SOURCE / "__init__.py").is_file():
        return
    if not any(isinstance(f, _CheckoutPatchesFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _CheckoutPatchesFinder())


install()
