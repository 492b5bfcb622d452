"""Where the tools keep what they build: tiny checkpoints, the zoo's searches, ``list --all``'s survey."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["default_cache_dir"]


def default_cache_dir() -> Path:
    """``$TORCHEMBED_CACHE`` or ``~/.cache/torchembed``."""
    return Path(os.environ.get("TORCHEMBED_CACHE", Path.home() / ".cache" / "torchembed"))
