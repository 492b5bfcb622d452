"""A pytest plugin that patches every HF model a test session builds, as soon as it is built.

Run transformers' own model tests (from a transformers source checkout of the installed version) on
patched models, and compare with the same tests unpatched::

    python -m pytest tests/models/llama/test_modeling_llama.py -p torchembed.tools.patch_every_model
    python -m pytest tests/models/llama/test_modeling_llama.py          # upstream, for the difference

A model is complete when the outermost ``PreTrainedModel.__init__`` reaches its ``post_init`` (every
model calls it last; an inner model's own ``post_init`` comes first); there ``torchembed.patch(model)``
runs when :func:`torchembed.find_positional_components` finds something (a model it has no adapter for
is left as built), before ``from_pretrained`` loads the weights (which patching leaves as they are). A
patch that raises fails the test that built the model. The session ends with one line: models built,
patched, left unpatched (summed over pytest-xdist workers); "0 patched" means nothing here was tested.

The plugin wraps ``PreTrainedModel.__init__`` and ``post_init`` for the session (a test process's
choice, undone when the session ends); the library itself changes no class.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

import pytest

import torchembed
from torchembed.patches.errors import UnsupportedModelError

__all__ = ["COUNTS"]

COUNTS: Counter = Counter()  # "built", "patched", "unpatched": models of this process
_state = threading.local()  # depth: PreTrainedModel.__init__ calls in progress (per thread)
_originals: dict[str, Any] = {}


def _depth() -> int:
    return getattr(_state, "depth", 0)


def _complete(model: Any) -> None:
    """The outermost model is built: patch it where it has positional components."""
    COUNTS["built"] += 1
    try:
        found = torchembed.find_positional_components(model)
    except UnsupportedModelError:  # no adapter (no positional component, or none torchembed swaps)
        found = []
    if not found:
        COUNTS["unpatched"] += 1
        return
    torchembed.patch(model)
    COUNTS["patched"] += 1


def _install() -> None:
    from transformers import PreTrainedModel

    init, post_init = PreTrainedModel.__init__, PreTrainedModel.post_init
    _originals.update(__init__=init, post_init=post_init)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        _state.depth = _depth() + 1
        try:
            init(self, *args, **kwargs)
        except BaseException:
            _state.depth = max(0, _depth() - 1)
            raise

    def patched_post_init(self, *args: Any, **kwargs: Any) -> Any:
        out = post_init(self, *args, **kwargs)
        _state.depth = max(0, _depth() - 1)
        if _state.depth == 0:
            _complete(self)
        return out

    PreTrainedModel.__init__ = __init__
    PreTrainedModel.post_init = patched_post_init


def pytest_configure(config: Any) -> None:
    _install()


def pytest_unconfigure(config: Any) -> None:
    from transformers import PreTrainedModel

    for name, original in _originals.items():
        setattr(PreTrainedModel, name, original)
    _originals.clear()


def pytest_runtest_setup(item: Any) -> None:
    _state.depth = 0  # a model whose __init__ never reached post_init does not hold up the next test's


def pytest_sessionfinish(session: Any) -> None:
    output = getattr(session.config, "workeroutput", None)  # a pytest-xdist worker: to the controller
    if output is not None:
        output["torchembed_counts"] = dict(COUNTS)


@pytest.hookimpl(optionalhook=True)  # (pytest-xdist's controller, as each worker ends)
def pytest_testnodedown(node: Any, error: Any) -> None:
    COUNTS.update(getattr(node, "workeroutput", {}).get("torchembed_counts", {}))


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if getattr(terminalreporter.config, "workeroutput", None) is not None:
        return
    terminalreporter.write_line(f"torchembed: {COUNTS['built']} models built, {COUNTS['patched']} patched, "
                                f"{COUNTS['unpatched']} left unpatched (nothing torchembed swaps)")
