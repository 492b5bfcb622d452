"""The kernel tests' shortcut under Triton's interpreter (``tests/kernels/interpreter_calls.py``): a device function
called from a kernel skips re-patching only the language modules its launch already patched, and kernels compute
what they compute without the shortcut."""

from __future__ import annotations

import pytest
import torch

from tests.kernels import interpreter_calls

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the shortcut is for the interpreter (CPU)")


@triton.jit
def _doubled(x):
    return x * 2.0


@triton.jit
def _calls_kernel(X, Y, N, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = tl.load(X + offs, mask=offs < N, other=0.0)
    y = _doubled(_doubled(x))  # device functions that see triton.language only
    total = tl.sum(y, axis=0)  # triton.language.standard's functions, which see triton.language.core
    tl.store(Y + offs, y + tl.max(y, axis=0) + total, mask=offs < N)


def _run(x: torch.Tensor) -> torch.Tensor:
    y = torch.empty_like(x)
    _calls_kernel[(1,)](x, y, x.numel(), BLOCK=64)
    return y


def test_device_calls_skip_only_a_repeated_patch_and_compute_the_same(monkeypatch):
    from triton.runtime import interpreter

    shortcut = interpreter._patch_lang
    assert getattr(shortcut, interpreter_calls.INSTALLED, False), "the conftest installs it under the interpreter"
    x = torch.randn(50, generator=torch.Generator().manual_seed(7))
    expected = x.double() * 4
    expected = (expected + expected.max() + expected.sum()).float()
    _run(x)  # (a first launch: Triton leaves triton.language.core patched after it, whichever way it ran)
    walked = []
    patch_builtin = interpreter._patch_builtin
    monkeypatch.setattr(interpreter, "_patch_builtin", lambda pkg, *a: walked.append(pkg) or patch_builtin(pkg, *a))

    fast = _run(x)
    walked_fast, walked[:] = list(walked), []
    monkeypatch.setattr(interpreter, "_patch_lang", shortcut.original)  # Triton's own: a patch per device call
    slow = _run(x)
    walked_slow = list(walked)

    assert torch.equal(fast, slow)
    torch.testing.assert_close(fast, expected, rtol=1e-6, atol=1e-5)  # float32 sums of 50 values
    # the launch patches the modules it sees; a device call that sees one it did not (triton.language.standard's
    # functions see triton.language.core) patches as Triton does; the other device calls patch nothing
    assert tl.core in walked_fast and walked_fast.count(tl) < walked_slow.count(tl)
    assert len(walked_fast) < len(walked_slow)
    assert interpreter_calls._STATE.patched is None  # (nothing is left marked after a launch)


def test_a_device_function_called_outside_a_launch_patches_as_triton_does(monkeypatch):
    from triton.runtime import interpreter

    walked = []
    patch_builtin = interpreter._patch_builtin
    monkeypatch.setattr(interpreter, "_patch_builtin", lambda pkg, *a: walked.append(pkg) or patch_builtin(pkg, *a))
    x = torch.randn(50, generator=torch.Generator().manual_seed(8))
    scope = interpreter._patch_lang(_doubled.fn)  # what a device function called from the host runs first
    assert tl in walked and interpreter_calls._STATE.patched is None  # (not taken for a launch)
    scope.restore()
    walked.clear()
    _run(x)
    assert tl in walked  # the next launch patches the language as its own
