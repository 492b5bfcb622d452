"""A pytest plugin for ``scripts/test.sh``: a worker of pytest-xdist ends without a stray
``PytestUnraisableExceptionWarning`` (``gc_callback`` ... ``KeyboardInterrupt``).

The cause: when the controller shuts a worker down, execnet gives the worker's main thread 5 s to end
and then sends it SIGINT. After its last test the worker still runs pytest's unraisable-exception
cleanup, five full ``gc.collect()`` passes over every object the suite keeps alive (thousands of tiny
models, on two busy cores that takes longer than 5 s). CPython delivers the signal at the first Python
code it runs, which inside a collection is the gc callback hypothesis installs (``gc_cumulative_time``);
the KeyboardInterrupt raised there cannot propagate, so pytest reports it as unraisable. Nothing failed.

The fix removes the cause instead of filtering the warning: at the end of a worker's session, one
collection finds the garbage (and any real unraisable exception in it, still reported), then
``gc.freeze()`` moves the surviving objects out of the collector's reach, so the cleanup's passes take
milliseconds and the worker ends before the signal is sent.
"""

from __future__ import annotations

import gc

import pytest


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    if hasattr(session.config, "workerinput"):  # an xdist worker (the controller holds no models)
        gc.collect()
        gc.freeze()
