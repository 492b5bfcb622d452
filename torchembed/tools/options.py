"""Command-line option types and the parser of every ``torchembed`` command: a bad value is one line.

``count(minimum)`` and ``seconds`` are argparse ``type=`` functions: ``--seq-len -1`` ends as
``torchembed compare: error: argument --seq-len: expected an integer >= 1, got '-1' (see torchembed
compare --help)`` with exit code 2, before anything is loaded.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

__all__ = ["Parser", "count", "seconds"]


class Parser(argparse.ArgumentParser):
    """argparse, with the error in one line saying where to look (exit code 2)."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def count(minimum: int = 1) -> Callable[[str], int]:
    """An integer option of at least ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}")
        return value

    parse.__name__ = f"integer >= {minimum}"  # argparse names the type in its messages
    return parse


def seconds(text: str) -> float:
    """A positive, finite number of seconds (or milliseconds)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value
