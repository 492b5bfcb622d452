"""``scripts/probe_bandwidth.py``: its Triton copy kernels and experimental persistent RoPE kernel
are exact (they are timed against the library's kernel, so they must move the same bytes)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from torchembed.kernels.settings import settings

triton = pytest.importorskip("triton")

from torchembed.functional.rope import rope_cos_sin  # noqa: E402
from torchembed.kernels import rotary_fused  # noqa: E402

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "probe_bandwidth.py"
DEV = "cuda" if torch.cuda.is_available() else "cpu"
# The persistent kernels loop with tl.range(program_id, n, num_programs), which the interpreter of
# older Triton releases cannot run (3.4: "only 0-dimensional arrays can be converted"; 3.8 and 3.9 can).
_OLD_INTERPRETER = DEV == "cpu" and tuple(int(p) for p in triton.__version__.split(".")[:2]) < (3, 8)
persistent = pytest.mark.skipif(_OLD_INTERPRETER, reason="this Triton's interpreter cannot run tl.range from a program id")


def _load():
    spec = importlib.util.spec_from_file_location("probe_bandwidth", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@persistent
def test_copy_kernels_copy_every_element():
    probe = _load()
    n = 5000 + 37  # not a multiple of any block
    x = torch.randint(-2**31, 2**31 - 1, (n,), dtype=torch.int32, device=DEV)
    y = torch.full_like(x, -1)
    probe._copy[(-(-n // 256),)](x, y, n, BLOCK=256)
    assert torch.equal(x, y)
    y.fill_(-1)
    probe._copy_persistent[(3,)](x, y, n, BLOCK=256, STAGES=1)  # 3 programs loop over 20 tiles
    assert torch.equal(x, y)


@persistent
@pytest.mark.parametrize("programs", [1, 7])
def test_persistent_rope_matches_the_library_kernel(programs):
    probe = _load()
    gen = torch.Generator().manual_seed(programs)
    B, S, Hq, Hk, D = 2, 37, 4, 2, 16
    q = torch.randn(B, S, Hq, D, generator=gen).to(DEV, torch.bfloat16).transpose(1, 2)
    k = torch.randn(B, S, Hk, D, generator=gen).to(DEV, torch.bfloat16).transpose(1, 2)
    inv = 1.0 / (10000.0 ** (torch.arange(0, D, 2, device=DEV).float() / D))
    cos, sin = rope_cos_sin(inv, (torch.arange(S, device=DEV) + 5).expand(B, S))
    expected = rotary_fused(q, k, cos, sin)
    got = probe.rope_persistent(q, k, cos, sin, programs, 16, 4, 1)
    for g, e in zip(got, expected):  # same float32 math; the interpreter rounds to bf16 by truncation
        torch.testing.assert_close(g.float(), e.float(), rtol=2**-7, atol=2**-7)


def test_library_settings_restores_the_kernel_module():
    probe = _load()
    before = settings().rope
    with probe.library_settings({"tile_pairs": 512, "grouped_heads": (4,)}):
        now = settings().rope
        assert (now.tile_pairs, now.grouped_heads) == (512, (4,))
        assert now.grouped_min_programs == before.grouped_min_programs  # the fields not named: unchanged
    assert settings().rope == before
    with pytest.raises(TypeError):  # a name that is not a field of RopeTuning
        with probe.library_settings({"heads_per_program": 2}):
            pass
    assert settings().rope == before
