"""Fixtures shared by every test folder, and the order tests start in."""

import contextlib

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``slow`` (the suite's longest, tens of seconds to minutes) start first, the rest keep their order:
    under pytest-xdist a long test collected last would otherwise run alone at the end (on a 16-core GPU machine the
    multi-GPU smoke test, 220 s, started after the rest and set the whole run's time)."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # (a stable sort: marked first)


def pytest_configure(config: pytest.Config) -> None:
    """pytest-xdist's ``--dist loadgroup`` (the suite's) hands out groups of tests largest first unless told not to
    (``--loadscope-reorder``, its default): every ungrouped test, the ``slow`` ones included, would wait behind the
    model zoo's groups, as it did on the GPU (the smoke test started last and ran out of time). Keep the order above."""
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


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
