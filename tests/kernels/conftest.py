"""Kernel tests run on CUDA when present, else on CPU through Triton's interpreter.

``triton.jit`` decides between compiling and interpreting when it decorates a kernel, so
TRITON_INTERPRET=1 is set here, at conftest import -- before triton is imported -- and the
kernel module is imported right away, fixing its (interpreted) mode for the session.

The variable is process-wide, and other test directories (e.g. the module/patch layers) must
not silently switch to the slow interpreted fused path, so after collection it is restored to
its previous value and re-set only around each test of this directory (autouse fixture).
"""

import os

import pytest
import torch

_INTERPRET = not torch.cuda.is_available()
# The value before this conftest set it. pytest-xdist's controller imports this conftest too when the
# command names files below tests/kernels, and its workers inherit its environment: the original
# value travels with them under a name of its own, so each worker restores the user's, not "1".
_ORIGINAL = "TORCHEMBED_TESTS_TRITON_INTERPRET_BEFORE"
if _ORIGINAL not in os.environ:
    os.environ[_ORIGINAL] = os.environ.get("TRITON_INTERPRET", "")
_SAVED = os.environ[_ORIGINAL] or None

if _INTERPRET:
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import torchembed.kernels.rope_triton  # noqa: F401  (decorate the kernels as interpreted)
    except ImportError:  # no triton: the test module skips itself
        pass
    else:
        from tests.kernels import interpreter_calls

        interpreter_calls.install()  # (device-function calls without re-patching triton.language: its docstring)


def pytest_collection_finish(session):
    if _INTERPRET:
        if _SAVED is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = _SAVED


@pytest.fixture(autouse=True)
def _triton_interpret(monkeypatch):
    if _INTERPRET:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
