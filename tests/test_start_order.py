"""The order tests start in (tests/conftest.py): those marked ``slow`` first, and pytest-xdist's ``--dist loadgroup``
keeping that order (not handing out the largest groups first), so that none of the suite's longest runs alone at the
end."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests import conftest

pytest_plugins = ["pytester"]


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


INNER = '''
import os

import pytest


def _started(name):  # each worker writes the tests it starts, in order, to its own file
    with open(os.path.join(os.environ["START_LOG"], os.environ.get("PYTEST_XDIST_WORKER", "main")), "a") as log:
        log.write(name + "\\n")


@pytest.mark.parametrize("name", [pytest.param(f"grouped_{group}_{i}", marks=pytest.mark.xdist_group(group))
                                  for group in ("one", "two", "three") for i in (1, 2)])
def test_grouped(name): _started(name)


@pytest.mark.parametrize("name", ["single_1", "single_2"])
def test_single(name): _started(name)


@pytest.mark.slow
def test_z_slow_collected_last(): _started("z_slow_collected_last")
'''


def test_under_xdist_loadgroup_a_slow_test_collected_last_is_the_first_its_worker_runs(pytester, monkeypatch):
    """The suite's own scheduling (``-n N --dist loadgroup``, as scripts/test.sh and benchmarks/gpu_suite.py run it)
    with this folder's conftest hooks: the slow test, collected last after groups of two, is the first test on its
    worker. Without the sort it would be collected last; with xdist reordering groups by size, run after them."""
    pytest.importorskip("xdist")
    root = Path(__file__).resolve().parents[1]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])))
    logs = pytester.mkdir("started")
    monkeypatch.setenv("START_LOG", str(logs))
    pytester.makeini("[pytest]\nmarkers =\n    slow: long\n")
    pytester.makepyfile(test_inner=INNER)
    result = pytester.runpytest_subprocess("-p", "tests.conftest", "-p", "no:cacheprovider", "-p", "no:randomly",
                                           "-n", "2", "--dist", "loadgroup")
    result.assert_outcomes(passed=9)
    firsts = {path.name: path.read_text().split()[0] for path in logs.iterdir()}
    assert len(firsts) == 2 and "z_slow_collected_last" in firsts.values(), firsts
