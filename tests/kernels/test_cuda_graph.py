"""CUDA graph capture of the fused RoPE entry points.

``RotaryEmbedding(fused=None)`` (int offset, per-sequence offsets, ``(s,)`` and ``(b, s)``
position ids) and ``rotary_fused`` (per-token tables, in-kernel angles from every position form)
are captured at a decode shape; capture fails on a host sync or a host-to-device copy. Each graph
is replayed with new values copied into its static inputs and must equal the eager call on them.
"""

import pytest
import torch

from torchembed import kernels
from torchembed.positional import RotaryEmbedding

if not torch.cuda.is_available():
    pytest.skip("CUDA graphs need a CUDA device", allow_module_level=True)
if not kernels.triton_available():
    pytest.skip("triton is not importable", allow_module_level=True)

B, HQ, HK, S, D = 2, 8, 2, 1, 128
DEV = "cuda"


def _qk(gen: torch.Generator) -> list[torch.Tensor]:
    q = torch.randn(B, HQ, S, D, generator=gen, device=DEV).to(torch.bfloat16)
    k = torch.randn(B, HK, S, D, generator=gen, device=DEV).to(torch.bfloat16)
    return [q, k]


def _ids(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randint(0, 4096, shape, generator=gen, device=DEV)


def _tables(gen: torch.Generator) -> list[torch.Tensor]:
    return [torch.randn(1, S, D // 2, generator=gen, device=DEV) for _ in range(2)]


def _cases() -> dict:
    """Name -> (call on the static inputs, maker of those inputs from a generator)."""
    rope = RotaryEmbedding(D, fused=None, device=DEV)
    inv_freq = rope.inv_freq
    return {
        "module, int offset": (lambda q, k: rope(q, k, offset=1000), lambda gen: _qk(gen)),
        "module, (b,) offsets": (lambda q, k, o: rope(q, k, offset=o), lambda gen: _qk(gen) + [_ids(gen, B)]),
        "module, (s,) position ids": (lambda q, k, p: rope(q, k, position_ids=p), lambda gen: _qk(gen) + [_ids(gen, S)]),
        "module, (b, s) position ids": (lambda q, k, p: rope(q, k, position_ids=p),
                                        lambda gen: _qk(gen) + [_ids(gen, B, S)]),
        "rotary_fused, tables": (lambda q, k, c, s: kernels.rotary_fused(q, k, c, s), lambda gen: _qk(gen) + _tables(gen)),
        "rotary_fused, int offset": (lambda q, k: kernels.rotary_fused(q, k, inv_freq=inv_freq, positions=1000),
                                     lambda gen: _qk(gen)),
        "rotary_fused, (b,) offsets": (lambda q, k, o: kernels.rotary_fused(q, k, inv_freq=inv_freq, positions=o),
                                       lambda gen: _qk(gen) + [_ids(gen, B)]),
        "rotary_fused, (b, s) position ids": (lambda q, k, p: kernels.rotary_fused(q, k, inv_freq=inv_freq, positions=p),
                                              lambda gen: _qk(gen) + [_ids(gen, B, S)]),
    }


CASES = list(_cases())


@pytest.mark.parametrize("case", CASES)
def test_capture_and_replay_match_eager(case):
    fn, make = _cases()[case]
    static = make(torch.Generator(DEV).manual_seed(0))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (compile, keep the launch) outside the capture
        for _ in range(3):
            fn(*static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(*static)
    for seed in (1, 2):
        new = make(torch.Generator(DEV).manual_seed(seed))
        for s, n in zip(static, new):
            s.copy_(n)
        graph.replay()
        want = fn(*new)
        torch.cuda.synchronize()
        for o, w in zip(out, want):
            assert torch.equal(o, w), case
