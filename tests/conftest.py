"""Fixtures shared by every test folder."""

import contextlib

import pytest


@pytest.fixture
def alibi_policy():
    """``alibi_policy(**changes)``: the ALiBi attention policy with ``changes`` for the rest of the test
    (:func:`torchembed.kernels.alibi_attention.policy_changed`), restored after it."""
    from torchembed.kernels.alibi_attention import policy_changed

    with contextlib.ExitStack() as stack:
        yield lambda **changes: stack.enter_context(policy_changed(**changes))
