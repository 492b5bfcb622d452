"""The order tests start in (``pytest_collection_modifyitems`` in tests/conftest.py): those marked ``slow`` first, so
that under pytest-xdist none of the suite's longest runs alone at the end."""

from __future__ import annotations

import pytest

from tests import conftest


class _Item:
    def __init__(self, name: str, slow: bool) -> None:
        self.name, self.slow = name, slow

    def get_closest_marker(self, name: str) -> object | None:
        return object() if name == "slow" and self.slow else None


def test_tests_marked_slow_start_first_and_the_rest_keep_their_order() -> None:
    items = [_Item("a", False), _Item("b", True), _Item("c", False), _Item("d", True), _Item("e", False)]
    conftest.pytest_collection_modifyitems(None, items)  # type: ignore[arg-type]
    assert [item.name for item in items] == ["b", "d", "a", "c", "e"]


def test_the_longest_test_is_collected_before_the_rest(request: pytest.FixtureRequest) -> None:
    """In this session's collection the multi-GPU smoke test (the longest, minutes on a busy machine) comes before
    this test, which is collected before it alphabetically and is not marked."""
    names = [item.nodeid for item in request.session.items]
    smoke = [i for i, name in enumerate(names) if name.endswith("test_multi_gpu_smoke.py::test_multi_gpu_smoke")]
    if not smoke:
        pytest.skip("the multi-GPU smoke test is not collected in this session")
    assert smoke[0] < names.index(request.node.nodeid)
