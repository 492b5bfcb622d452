"""Per-family adapters; importing this package registers them all."""

from torchembed.patches.families import alibi, learned, rope  # noqa: F401
