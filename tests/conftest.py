"""Fixtures shared by every test folder."""

import contextlib

import pytest


@pytest.fixture
def alibi_policy():
    """``alibi_policy(**changes)``: the ALiBi attention policy with ``changes`` for the rest of the test
    (``torchembed.kernels.settings.changed(policy=...)``), restored after it."""
    from torchembed.kernels.settings import changed

    with contextlib.ExitStack() as stack:
        yield lambda **changes: stack.enter_context(changed(policy=changes))
