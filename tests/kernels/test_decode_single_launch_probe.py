"""``benchmarks/probes/decode_single_launch.py``: its one-launch split decode (parts merged by the program holding
the last ticket) computes the library's decode attention, and leaves its counter zeroed for the next call (it is
timed against the library's decode, so it must compute the same thing)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from torchembed.kernels.attention import fused_attention  # noqa: E402

PROBE = Path(__file__).resolve().parents[2] / "benchmarks" / "probes" / "decode_single_launch.py"
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _load():
    spec = importlib.util.spec_from_file_location("decode_single_launch", PROBE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("keys, splits", [(300, 5), (257, 3), (64, 1)])
def test_one_launch_matches_the_library_twice(keys, splits):
    """Grouped heads (8 query / 2 kv heads), batch 2, a key count that is no multiple of the parts or the tile;
    called twice on fresh inputs written into the same buffers, so a counter left non-zero would show."""
    probe = _load()
    gen = torch.Generator().manual_seed(keys)
    q = torch.empty(2, 1, 8, 64).transpose(1, 2).to(DEV)
    k = torch.empty(2, 2, keys, 64, device=DEV)
    v = torch.empty_like(k)
    call = probe.single_launch(q, k, v, splits, block_n=16, warps=4, stages=1)
    for _ in range(2):
        for t in (q, k, v):
            t.copy_(torch.randn(t.shape, generator=gen))
        got = call().clone()
        want = fused_attention(q, k, v, None, scale=64 ** -0.5)
        torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-5)
