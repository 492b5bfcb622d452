"""``RotaryEmbedding(fused=None)`` on the kernel path: every way of giving positions, partial and
interleaved rotary, frequency scaling, agrees with the module's PyTorch path (fresh random inputs).

Tolerances: both paths compute in float32; the kernel rounds once on store, the PyTorch path rounds
its float32 result once, so outputs differ by a few float32 ulps (fp32: 1e-5) or by one rounding
step of the output dtype (bf16: 1e-2 abs + rel).
"""

import pytest
import torch

from torchembed import kernels
from torchembed.kernels import rope
from torchembed.positional import RotaryEmbedding

if not kernels.triton_available():
    pytest.skip("triton is not importable", allow_module_level=True)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1e-2, rtol=1e-2)}
S = 9
CALLS = {
    "offset 0": lambda b: {},
    "int offset": lambda b: dict(offset=37),
    "per-sequence offsets": lambda b: dict(offset=torch.tensor([0, 1500])[:b].to(DEV)),
    "position ids (s,)": lambda b: dict(position_ids=torch.randperm(50)[:S].to(DEV)),
    "position ids (b, s)": lambda b: dict(position_ids=torch.randint(0, 3000, (b, S)).to(DEV)),
}
CONFIGS = {
    "default": dict(dim=32),
    "partial, interleaved": dict(dim=32, rotary_dim=16, interleaved=True),
    "yarn (attention scaling)": dict(dim=32, rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                                              "original_max_position_embeddings": 64}),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("call", list(CALLS))
def test_fused_module_matches_its_pytorch_path(call, config, dtype, monkeypatch):
    fused = RotaryEmbedding(**CONFIGS[config], fused=None, device=DEV)
    reference = RotaryEmbedding(**CONFIGS[config], device=DEV)
    q = torch.randn(2, 4, S, 32, device=DEV).to(dtype)
    k = torch.randn(2, 2, S, 32, device=DEV).to(dtype)
    kwargs = CALLS[call](2)
    launches = []
    original = kernels.rotary_fused
    monkeypatch.setattr(kernels, "rotary_fused", lambda *a, **kw: launches.append(kw) or original(*a, **kw))
    rope.clear_launches()
    got = fused(q, k, **kwargs)  # checked, then the kernel: its launch is kept
    assert len(launches) == 1 and launches[0]["inv_freq"] is fused.inv_freq  # angles computed in the kernel
    assert len(rope.LAUNCHES) == 1
    q2, k2 = torch.randn_like(q), torch.randn_like(k)
    got_kept = fused(q2, k2, **kwargs)  # a call like it: the same key, the kept launch
    assert len(launches) == 2 and len(rope.LAUNCHES) == 1
    monkeypatch.setattr(kernels, "rotary_fused", original)
    for out, (qi, ki) in ((got, (q, k)), (got_kept, (q2, k2))):
        want = reference(qi.float(), ki.float(), **kwargs)
        for g, w in zip(out, want):
            assert g.dtype == dtype and g.shape == w.shape
            torch.testing.assert_close(g.float(), w, **TOL[dtype])


def test_fused_module_with_sequence_first_layout_and_gradients():
    """``(s, b, h, d)`` inputs (``seq_dim=0``) and autograd: gradients as the PyTorch path's."""
    fused = RotaryEmbedding(dim=16, fused=None, device=DEV)
    reference = RotaryEmbedding(dim=16, device=DEV)
    q = torch.randn(S, 2, 3, 16, device=DEV, requires_grad=True)
    k = torch.randn(S, 2, 1, 16, device=DEV, requires_grad=True)
    grads = torch.randn_like(q), torch.randn_like(k)
    outs = {}
    for name, module in (("fused", fused), ("reference", reference)):
        q.grad = k.grad = None
        out = module(q, k, seq_dim=0, offset=5)
        torch.autograd.backward(out, grads)
        outs[name] = (*out, q.grad.clone(), k.grad.clone())
    for g, w in zip(outs["fused"], outs["reference"]):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


def test_position_ids_of_one_dim_and_offsets_keep_their_own_meanings():
    """``(s,)`` position ids and ``(b,)`` offsets are alike tensors when ``b == s``; the module hands the
    ids to the kernel as ``(1, s)``, so each form keeps its own launch and meaning."""
    fused = RotaryEmbedding(dim=32, fused=None, device=DEV)
    reference = RotaryEmbedding(dim=32, device=DEV)
    q, k = torch.randn(S, 4, S, 32, device=DEV), torch.randn(S, 2, S, 32, device=DEV)
    ids = torch.randperm(50)[:S].to(DEV)
    offsets = torch.randint(0, 100, (S,)).to(DEV)
    rope.clear_launches()
    with torch.no_grad():
        for _ in range(2):  # checked and kept, then the kept launches
            for kwargs in (dict(position_ids=ids), dict(offset=offsets)):
                got, want = fused(q, k, **kwargs), reference(q, k, **kwargs)
                for g, w in zip(got, want):
                    torch.testing.assert_close(g, w, **TOL[torch.float32])
    assert len(rope.LAUNCHES) == 2


def test_pairs_of_other_batch_sizes_or_dtypes_rotate_one_launch_each(monkeypatch):
    """Shared positions allow q and k of different batch sizes or dtypes; the kernel rotates them one
    launch each, as the PyTorch path does."""
    calls = []
    original = kernels.rotary_fused
    monkeypatch.setattr(kernels, "rotary_fused", lambda *a, **kw: calls.append(a) or original(*a, **kw))
    fused, reference = RotaryEmbedding(dim=8, fused=None, device=DEV), RotaryEmbedding(dim=8, device=DEV)
    for q, k in (
        (torch.randn(2, 3, 8, device=DEV), torch.randn(1, 3, 8, device=DEV)),
        (torch.randn(2, 3, 8, device=DEV), torch.randn(2, 3, 8, dtype=torch.float64, device=DEV)),
    ):
        calls.clear()
        got, want = fused(q, k, offset=2), reference(q, k, offset=2)
        assert len(calls) == 2 and all(a[1].shape[1] == 0 for a in calls)
        for g, w in zip(got, want):
            assert g.dtype == w.dtype
            torch.testing.assert_close(g, w, **TOL[torch.float32])
