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


@pytest.fixture
def kernel_route_on_cpu(monkeypatch):
    """The route (:mod:`torchembed.kernels.route`) answers for CPU tensors as it would for CUDA ones: it sees the
    kernels run on floating 4-D tensors (the queries and keys it decides on). The entries it routes to keep their own
    device check, so on a CPU the kernels' PyTorch implementations run: the route's decisions are exercised there."""
    from torchembed.kernels import route

    real = route.kernel_can_run
    monkeypatch.setattr(route, "kernel_can_run", lambda t: (t.dim() == 4 and t.is_floating_point()) or real(t))
