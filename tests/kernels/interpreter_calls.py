"""Device-function calls under Triton's interpreter without re-patching ``triton.language`` each time (tests only).

Under ``TRITON_INTERPRET=1`` a kernel launch (``GridExecutor``) patches the language modules its function sees
(``triton.language``, ``triton.language.core``) for the launch and restores them after it. Triton 3.x also patches
them again on every call of a device function from inside the kernel (``InterpretedFunction.__call__`` ->
``_patch_lang``), which walks the modules' members with ``inspect.getmembers``: about 2 ms a call on a 2-core CPU,
some 40 % of an interpreted attention kernel's time, for modules the launch already patched (the repeat changes no
member and is never undone). :func:`install` skips that repeat while a launch runs in the thread (marked from its
start to its end); a device function that sees a language module the launch has not patched yet (Triton's own
``triton.language.standard`` sees ``core``) patches as before, and so does a call outside any launch. The kernels run the same operations either way (``test_interpreter_calls.py`` checks it).
"""

from __future__ import annotations

import inspect
import threading
from typing import Any

_STATE = threading.local()  # .launching, .patched: a launch runs in this thread; the language modules it patched
INSTALLED = "_torchembed_tests_skip_repeats"


class _Nothing:
    """The scope of a skipped repeat: nothing to restore."""

    def restore(self) -> None:
        pass


def _shape_expected(interpreter: Any) -> bool:
    """The interpreter calls ``_patch_lang`` as this module expects (else :func:`install` leaves it alone)."""
    try:
        launch = inspect.getsource(interpreter.GridExecutor.__call__)
        call = inspect.getsource(interpreter.InterpretedFunction.__call__)
    except (AttributeError, OSError, TypeError):
        return False
    return ("patch_scope = _patch_lang(self.fn)" in launch and "patch_scope.restore()" in launch
            and "_patch_lang(self.fn)" in call and callable(getattr(interpreter, "_patch_lang", None)))


def install() -> bool:
    """Replace the interpreter's ``_patch_lang`` for this process (the kernel tests' conftest calls it under the
    interpreter). Returns whether it is installed (False: no Triton, or an interpreter of another shape)."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    original = interpreter._patch_lang
    if getattr(original, INSTALLED, False):
        return True
    if not _shape_expected(interpreter):
        return False
    tl = interpreter.tl
    launch = interpreter.GridExecutor.__call__

    def languages(fn: Any) -> set[int]:
        return {id(value) for value in fn.__globals__.values() if value is tl or value is tl.core}

    def marked_launch(self: Any, *args: Any, **kwargs: Any) -> Any:
        _STATE.launching, _STATE.patched = True, None  # (its own _patch_lang comes next in this thread)
        try:
            return launch(self, *args, **kwargs)
        finally:
            _STATE.launching, _STATE.patched = False, None

    def patch_lang(fn: Any) -> Any:
        patched = getattr(_STATE, "patched", None)
        if patched is not None:  # a device function called by the running launch
            seen = languages(fn)
            if seen <= patched:
                return _Nothing()
            patched |= seen
            return original(fn)
        scope = original(fn)  # the launch's own patch, or a call outside any launch (Triton's way)
        if getattr(_STATE, "launching", False):
            _STATE.patched = languages(fn)
        return scope

    setattr(patch_lang, INSTALLED, True)
    patch_lang.original = original  # (Triton's own, for the test that compares with it)
    interpreter._patch_lang = patch_lang
    interpreter.GridExecutor.__call__ = marked_launch
    return True
