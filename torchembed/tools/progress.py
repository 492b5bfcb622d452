"""Progress of a long step on stderr: a rich bar on a terminal, else a line now and then.

A log (CI, ``| tee``, ``2> file``) gets ``what: 12/427 (0:41 elapsed, about 23:40 left) llama`` at most every
``interval`` seconds and after the last step, so a step of minutes never runs silent and never floods the log.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any, TextIO

__all__ = ["progress", "clock"]

#: seconds between two progress lines in a log
LINE_INTERVAL = 10.0


def clock(seconds: float) -> str:
    """``754.2 -> '12:34'``, ``3723 -> '1:02:03'``."""
    seconds = max(0, round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


class _Lines:
    """``advance(label)``: one step done; a line when ``interval`` seconds passed since the last one, or at the end."""

    def __init__(self, total: int, what: str, stream: TextIO, interval: float,
                 now: Callable[[], float] = time.monotonic) -> None:
        self.total, self.what, self.stream, self.interval, self.now = total, what, stream, interval, now
        self.start = self.last = now()
        self.done = 0

    def __call__(self, label: str = "") -> None:
        self.done += 1
        t = self.now()
        if self.done < self.total and t - self.last < self.interval:
            return
        self.last = t
        elapsed = t - self.start
        left = f", about {clock(elapsed / self.done * (self.total - self.done))} left" if self.done < self.total else ""
        print(f"{self.what}: {self.done}/{self.total} ({clock(elapsed)} elapsed{left})" + (f" {label}" if label else ""),
              file=self.stream, flush=True)


@contextlib.contextmanager
def progress(total: int, what: str, enabled: bool = True, *, stream: TextIO | None = None,
             interval: float = LINE_INTERVAL) -> Iterator[Callable[[str], Any]]:
    """``advance(label)`` for each of ``total`` steps: a transient rich bar when ``stream`` (default stderr) is a
    terminal and rich is installed, else progress lines (:class:`_Lines`); nothing when not ``enabled``."""
    stream = sys.stderr if stream is None else stream
    if not enabled or total <= 0:
        yield lambda label="": None
        return
    if stream.isatty():
        try:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
        except ImportError:
            pass
        else:
            columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                       TextColumn("{task.fields[label]}"))
            with Progress(*columns, console=Console(file=stream), transient=True) as bar:
                task = bar.add_task(what, total=total, label="")
                yield lambda label="": bar.update(task, advance=1, label=label)
            return
    yield _Lines(total, what, stream, interval)
