"""Tests of the fused Triton RoPE kernel (``torchembed.kernels.rotary_fused``).

Every result is compared against a float64 oracle written here in plain PyTorch.  On a machine
without CUDA the kernel runs through Triton's interpreter (``TRITON_INTERPRET=1``, set by
conftest.py), so shapes are kept small: B <= 2, S <= ~40, heads <= 5.

Tolerances (inputs and cos/sin are unit-scale, |x| <~ 5): the kernel loads, computes in
float32 and rounds ONCE on store, so the error is about half an ulp of the output dtype:
    fp32: 1e-5 (a few fp32 ulps from the 2 products + 1 add, and the fp32 angle),
    fp16: 1e-3 abs + 1e-3 rel (half-ulp 2**-11 relative),
    bf16: 1e-2 abs + 1e-2 rel (half-ulp 2**-8 relative).

int64 addressing: the kernel casts every index to int64 before multiplying it by a stride (by
construction, see rope_triton.py); a real > 2**31-element tensor is rotated only on a GPU with
the memory for it (``test_tensor_past_2_31_elements``).
"""

import contextlib
import os
import re
import subprocess
import sys

import pytest
import torch

from torchembed.kernels import settings as kernel_settings
from torchembed.kernels.settings import changed
from torch.utils._python_dispatch import TorchDispatchMode

from torchembed.kernels import interpret_mode, kernel_can_run, rotary_fused, triton_available

if not triton_available():
    pytest.skip("triton is not importable", allow_module_level=True)

from torchembed.kernels import launch, rope, rope_triton  # noqa: E402  (imports triton)
from torchembed.kernels.rope import RopeArgs  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
if DEV == "cpu" and not interpret_mode():
    pytest.skip("no CUDA device and TRITON_INTERPRET != 1", allow_module_level=True)

TOL = {
    torch.float64: dict(atol=1e-10, rtol=1e-10),
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=1e-3, rtol=1e-3),
    torch.bfloat16: dict(atol=1e-2, rtol=1e-2),
}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


# ------------------------------------------------------------------------------------------
# float64 oracle
# ------------------------------------------------------------------------------------------


def oracle_cos_sin(B, S, cos=None, sin=None, *, inv_freq=None, scale=1.0, positions=None):
    """Per-token (Bc, S, R/2) float64 cos/sin, following the documented semantics."""
    if positions is None:
        c, s = cos.double(), sin.double()
    else:
        ar = torch.arange(S, device=DEV)
        if isinstance(positions, int):
            pos = (ar + positions)[None]
        elif positions.dim() == 1:
            pos = positions.long()[:, None] + ar
        else:
            pos = positions.long()
        if inv_freq is not None:
            # the angle is defined as a float32 product (as HF computes it); cos/sin exact
            ang = (pos.float()[..., None] * inv_freq.float()).double()
            c, s = ang.cos(), ang.sin()
        else:
            c, s = cos.double()[pos], sin.double()[pos]
    return c * scale, s * scale


def oracle_rotate(x, c, s, interleaved=False, conjugate=False):
    """x (B, H, S, D); c, s (Bc, S, R/2) -> float64 rotated x."""
    x = x.double()
    c, s = c[:, None].double(), s[:, None].double()
    if conjugate:
        s = -s
    half = c.shape[-1]
    r = 2 * half
    if interleaved:
        x1, x2 = x[..., 0:r:2], x[..., 1:r:2]
    else:
        x1, x2 = x[..., :half], x[..., half:r]
    y1, y2 = x1 * c - x2 * s, x2 * c + x1 * s
    y = torch.stack((y1, y2), -1).flatten(-2) if interleaved else torch.cat((y1, y2), -1)
    return torch.cat((y, x[..., r:]), -1)


def oracle(q, k, cos=None, sin=None, *, inv_freq=None, scale=1.0, positions=None, interleaved=False,
           conjugate=False):
    c, s = oracle_cos_sin(q.shape[0], q.shape[2], cos, sin, inv_freq=inv_freq, scale=scale, positions=positions)
    return oracle_rotate(q, c, s, interleaved, conjugate), oracle_rotate(k, c, s, interleaved, conjugate)


# ------------------------------------------------------------------------------------------
# input builders
# ------------------------------------------------------------------------------------------


def make_qk(B, Hq, Hk, S, D, dtype, layout="contig", gen=None):
    """Random q, k in (B, H, S, D) with the requested memory layout."""
    def one(H):
        if layout == "contig":
            return torch.randn(B, H, S, D, generator=gen).to(DEV, dtype)
        if layout == "hf":  # HF: (B, S, H, D) memory viewed as (B, H, S, D)
            return torch.randn(B, S, H, D, generator=gen).to(DEV, dtype).transpose(1, 2)
        if layout == "padded":  # padded last-but-one stride
            return torch.randn(B, H, S, D + 8, generator=gen).to(DEV, dtype)[..., :D]
        if layout == "laststride":  # last dim not unit-stride: the documented copy fallback
            return torch.randn(B, H, S, D, 2, generator=gen).to(DEV, dtype)[..., 0]
        raise AssertionError(layout)
    return one(Hq), one(Hk)


def make_table(rows, half, lead=(), dtype=torch.float32, gen=None):
    """cos/sin of random angles: unit-scale tables of shape (*lead, rows, half)."""
    ang = torch.rand(*lead, rows, half, generator=gen, dtype=torch.float64) * 20 - 10
    return ang.cos().to(DEV, dtype), ang.sin().to(DEV, dtype)


def make_inv_freq(half):
    return (1.0 / (10000.0 ** (torch.arange(half, dtype=torch.float32) / half))).to(DEV)


def make_positions(mode, B, S, T=64, gen=None):
    """(rotary_fused positions argument, table length needed)."""
    if mode == "none":
        return None
    if mode == "int":
        return 5
    if mode == "batch":  # per-batch offsets (B,)
        return torch.randint(0, T - S, (B,), generator=gen).to(DEV)
    if mode == "ids":  # (B, S) position ids
        return torch.randint(0, T, (B, S), generator=gen).to(DEV)
    if mode == "ids1":  # (1, S) broadcast over the batch, int32
        return torch.randint(0, T, (1, S), generator=gen).to(DEV, torch.int32)
    raise AssertionError(mode)


def assert_close(got, want, dtype):
    assert got.dtype == dtype
    torch.testing.assert_close(got.double(), want, **TOL[dtype])


def run_case(B=2, Hq=3, Hk=1, S=7, D=64, R=None, dtype=torch.float32, interleaved=False, pos_mode="none",
             source="table", scale=1.0, inplace=False, conjugate=False, layout="contig", table_dtype=torch.float32,
             bc1=False, gen=None):
    """Build inputs, run rotary_fused, check against the oracle (and that out-of-place calls leave
    their inputs alone); return the outputs.  bc1: per-token tables (1, S, R/2) broadcast over B."""
    R = D if R is None else R
    half = R // 2
    q, k = make_qk(B, Hq, Hk, S, D, dtype, layout, gen)
    positions = make_positions(pos_mode, B, S, gen=gen)
    cos = sin = inv_freq = None
    if source == "inv_freq":
        inv_freq = make_inv_freq(half)
    elif pos_mode == "none":
        cos, sin = make_table(S, half, (1,) if bc1 else (B,), table_dtype, gen)
    else:
        cos, sin = make_table(64, half, (), table_dtype, gen)
    q0, k0 = q.clone(), k.clone()
    want_q, want_k = oracle(q, k, cos, sin, inv_freq=inv_freq, scale=scale, positions=positions,
                            interleaved=interleaved, conjugate=conjugate)
    qo, ko = rotary_fused(q, k, cos, sin, inv_freq=inv_freq, scale=scale, positions=positions,
                          interleaved=interleaved, inplace=inplace, conjugate=conjugate)
    assert qo.shape == q.shape and ko.shape == k.shape
    assert_close(qo, want_q, dtype)
    assert_close(ko, want_k, dtype)
    if inplace:
        assert qo is q and ko is k
    else:
        assert torch.equal(q, q0) and torch.equal(k, k0), "out-of-place call modified its inputs"
    return qo, ko


def _config(B, Hq, Hk, S, D, half, dtype, pos_mode, use_inv_freq, interleaved, conjugate, inplace):
    """``rope._config`` of a call with these facts (meta tensors: only shapes and dtypes matter):
    ``(grid, meta, q head groups, warps)``."""
    q, k = (torch.empty(B, H, S, D, dtype=dtype, device="meta") for H in (Hq, Hk))
    table = torch.empty(half, device="meta") if use_inv_freq else torch.empty(1, S, half, device="meta")
    positions = None if pos_mode == 0 else torch.empty((B,) if pos_mode == 1 else (B, S), dtype=torch.long, device="meta")
    a = RopeArgs(q, k, None if use_inv_freq else table, None if use_inv_freq else table, table if use_inv_freq else None,
                 positions, 0, 1.0, interleaved, conjugate)
    return rope._config(a, inplace)


@pytest.fixture(autouse=True)
def _forget_kept_launches():
    """Kept launches carry the tuning and stand-ins of the test that made them."""
    yield
    rope.clear_launches()


@pytest.fixture
def poisoned(monkeypatch):
    """Out-of-place outputs start as NaN, so any element the kernel does not write shows up."""
    def alloc(x, **kw):
        return torch.empty_like(x, **kw).fill_(float("nan"))

    monkeypatch.setattr(rope, "_empty_like", alloc)


class LaunchCounter:
    """Stand-in for the jitted kernel that counts ``kernel[grid](...)`` launches."""

    def __init__(self, kernel):
        self.kernel, self.grids = kernel, []

    def __getitem__(self, grid):
        self.grids.append(grid)
        return self.kernel[grid]


@pytest.fixture
def launches(monkeypatch):
    counter = LaunchCounter(rope_triton.rope_kernel)
    monkeypatch.setattr(rope_triton, "rope_kernel", counter)
    monkeypatch.setattr(launch, "direct", lambda: False)  # count every launch through kernel[grid]
    return counter


# ------------------------------------------------------------------------------------------
# correctness
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("D", [64, 80, 96, 128, 256])
def test_head_dims_dtypes(D, dtype, interleaved, poisoned):
    run_case(D=D, S=19, dtype=dtype, interleaved=interleaved, bc1=interleaved)  # S > BLOCK_S for D >= 128


# (positions mode, angle source); inv_freq needs positions (its ValueError is tested below)
POS_SOURCE = [("none", "table"), ("none_bc1", "table")] + [
    (mode, source) for mode in ["int", "batch", "ids", "ids1"] for source in ["table", "inv_freq"]
]


@pytest.mark.parametrize("pos_mode,source", POS_SOURCE)
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_position_modes(pos_mode, source, backend, poisoned, monkeypatch):
    bc1 = pos_mode == "none_bc1"
    pos_mode = "none" if bc1 else pos_mode
    if backend == "torch":  # the PyTorch fallback shares the semantics
        monkeypatch.setenv("TORCHEMBED_DISABLE_TRITON", "1")
    scale = 0.75 if source == "inv_freq" else 1.0
    run_case(D=64, R=48, pos_mode=pos_mode, source=source, scale=scale, bc1=bc1)
    run_case(D=64, R=48, pos_mode=pos_mode, source=source, scale=scale, bc1=bc1, interleaved=True,
             dtype=torch.float16)


def test_table_scale_and_half_precision_tables(poisoned):
    # HF passes cos/sin in the activation dtype; scale also applies to tables.
    run_case(D=64, dtype=torch.bfloat16, table_dtype=torch.bfloat16, scale=1.25)
    run_case(D=64, dtype=torch.float16, table_dtype=torch.float16, pos_mode="ids")


@pytest.mark.parametrize("inplace", [False, True], ids=["outofplace", "inplace"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("R", [16, 32, 64])
def test_partial_rotary(R, interleaved, inplace, poisoned):
    run_case(D=80, R=R, interleaved=interleaved, inplace=inplace, pos_mode="int")


@pytest.mark.parametrize("Hq,Hk", [(3, 1), (5, 5), (4, 2), (1, 3)])
@pytest.mark.parametrize("S", [1, 37])  # 37 > BLOCK_S (32 for D=64): several token blocks
def test_heads_and_lengths(Hq, Hk, S, poisoned):
    grid, meta, _, _ = _config(2, Hq, Hk, S, 64, 32, torch.float32, 0, False, False, False, False)
    if S == 37:
        token_axis = 1 if meta["HEADS_FAST"] else 0
        assert grid[token_axis] > 1, "expected S to span several token blocks"
    run_case(B=2, Hq=Hq, Hk=Hk, S=S, D=64)


@pytest.mark.parametrize("heads_fast", [False, True])
def test_grid_orders(poisoned, heads_fast):
    with changed(rope=dict(heads_fast=heads_fast, grouped_heads=(4, 2), grouped_min_programs=0)):  # (kept launches forgotten)
        grid, meta, _, _ = _config(2, 4, 2, 37, 64, 32, torch.float32, 0, False, False, False, False)
        assert meta["HEADS_FAST"] is heads_fast and grid[1 if heads_fast else 0] == 2  # the token blocks' axis
        run_case(B=2, Hq=4, Hk=2, S=37, D=64)
        run_case(B=1, Hq=3, Hk=1, S=1, D=128, pos_mode="ids")


def test_heads_per_program_grouping(poisoned):
    # Prefill-sized grids group several heads per program; force it at a small size.
    with changed(rope=dict(grouped_min_programs=0, grouped_heads=(4, 2), heads_fast=False)):  # (kept launches forgotten)
        grid, meta, nqg, _ = _config(2, 4, 2, 9, 64, 32, torch.float32, 0, False, False, False, False)
        assert meta["HPP"] == 2 and nqg == 2 and grid[1] == 3
        run_case(B=2, Hq=4, Hk=2, S=9, D=64)
        run_case(B=2, Hq=4, Hk=2, S=9, D=64, R=32, interleaved=True, inplace=True, pos_mode="ids")


def test_prefill_grids_group_two_heads_per_program(poisoned):
    # Prefill-sized grids share the cos/sin work (in-kernel angles or table loads) between two
    # heads of a program (8 warps); decode-sized grids keep one head per program. The default
    # candidates, forced at a small size.
    with changed(rope=dict(grouped_min_programs=0)):  # (kept launches forgotten)
        for use_inv_freq in (True, False):
            grid, meta, nqg, warps = _config(2, 4, 2, 9, 64, 32, torch.float32, 1, use_inv_freq, False,
                                             False, False)
            assert meta["HPP"] == 2 and nqg == 2 and warps == kernel_settings.settings().rope.grouped_warps
        with changed(rope=dict(grouped_min_programs=4096)):
            decode = _config(32, 32, 8, 1, 128, 64, torch.bfloat16, 0, False, False, False, True)
        assert decode[1]["HPP"] == 1  # 32 x 40 programs: below the threshold
        run_case(B=2, Hq=4, Hk=2, S=9, D=64)  # tables, two heads per program
        run_case(B=2, Hq=4, Hk=2, S=9, D=64, source="inv_freq", pos_mode="batch")
        run_case(B=2, Hq=4, Hk=2, S=9, D=64, R=32, source="inv_freq", pos_mode="ids", interleaved=True, inplace=True,
                 dtype=torch.bfloat16)
        run_case(B=2, Hq=3, Hk=1, S=9, D=64, source="inv_freq", pos_mode="int")  # 3 and 1 heads: no pair, HPP 1


@pytest.mark.skipif(DEV != "cuda" or not torch.cuda.is_available()
                    or torch.cuda.mem_get_info()[0] < 24 * 2**30, reason="needs a GPU with 24 GB free")
def test_tensor_past_2_31_elements():
    """q of 2**31 + 2**20 bf16 elements (4.3 GB): the rows past 2**31 are rotated like the first."""
    S = (2**31 + 2**20) // (8 * 128)
    q = torch.randn(1, S, 8, 128, device=DEV, dtype=torch.bfloat16).transpose(1, 2)
    k = torch.randn(1, 1, 8, 128, device=DEV, dtype=torch.bfloat16).expand(1, S, 8, 128).transpose(1, 2)
    cos, sin = make_table(1, 64)
    cos, sin = cos.expand(S, 64), sin.expand(S, 64)  # a (T, R/2) cache with stride 0: one angle
    qo, _ = rotary_fused(q, k, cos, sin, positions=0)
    for rows in (slice(0, 64), slice(S - 64, S)):  # first rows and rows past 2**31 elements
        want, _ = oracle(q[:, :, rows], k[:, :, :64], cos[:64], sin[:64], positions=0)
        assert_close(qo[:, :, rows], want, torch.bfloat16)


@pytest.mark.parametrize("layout", ["hf", "padded", "laststride"])
@pytest.mark.parametrize("inplace", [False, True], ids=["outofplace", "inplace"])
def test_strided_inputs(layout, inplace, poisoned):
    qo, ko = run_case(D=64, R=48, layout=layout, inplace=inplace, pos_mode="ids", dtype=torch.float16)
    if not inplace and layout == "hf":
        # documented: dense inputs get outputs with the same strides (HF's (B, S, H, D) memory)
        q, k = make_qk(2, 3, 1, 7, 64, torch.float16, "hf")
        assert qo.stride() == q.stride() and ko.stride() == k.stride()


def test_padded_inplace_leaves_padding_alone():
    base = torch.randn(2, 3, 7, 72, device=DEV)
    q, k = base[..., :64], torch.randn(2, 1, 7, 64, device=DEV)
    pad = base[..., 64:].clone()
    cos, sin = make_table(7, 32, (1,))
    rotary_fused(q, k, cos, sin, inplace=True)
    assert torch.equal(base[..., 64:], pad)


def test_outofplace_never_aliases_and_inplace_writes_storage():
    q, k = make_qk(2, 3, 1, 5, 64, torch.float32, "hf")
    cos, sin = make_table(5, 32, (2,))
    qo, ko = rotary_fused(q, k, cos, sin)
    ptrs_in = {q.untyped_storage().data_ptr(), k.untyped_storage().data_ptr()}
    assert qo.untyped_storage().data_ptr() not in ptrs_in and ko.untyped_storage().data_ptr() not in ptrs_in
    q2, k2 = q.clone(), k.clone()
    qp, kp = q.data_ptr(), k.data_ptr()
    qi, ki = rotary_fused(q, k, cos, sin, inplace=True)
    assert qi is q and ki is k and q.data_ptr() == qp and k.data_ptr() == kp
    assert torch.equal(q, qo) and torch.equal(k, ko)
    assert not torch.equal(q, q2) and not torch.equal(k, k2)


@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("source", ["table", "inv_freq"])
def test_conjugate_inverts(source, interleaved):
    q, k = make_qk(2, 3, 1, 9, 64, torch.float32)
    kw = dict(positions=torch.randint(0, 60, (2, 9), device=DEV), interleaved=interleaved)
    if source == "table":
        kw["cos"], kw["sin"] = make_table(64, 24)
    else:
        kw["inv_freq"] = make_inv_freq(24)
    qr, kr = rotary_fused(q, k, **kw)
    assert not torch.allclose(qr, q)
    qb, kb = rotary_fused(qr, kr, conjugate=True, **kw)
    torch.testing.assert_close(qb, q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kb, k, atol=1e-5, rtol=1e-5)


def test_bf16_not_worse_than_hf_way():
    """Kernel (fp32 math, one rounding) vs HF's bf16 eager formula, both against float64."""
    gen = torch.Generator().manual_seed(0)
    B, H, S, D = 2, 4, 16, 128
    q, k = make_qk(B, H, H, S, D, torch.bfloat16, "hf", gen)
    pos = torch.arange(S, device=DEV)[None].expand(B, S) + 1000
    inv_freq = make_inv_freq(D // 2)
    ang = pos.float()[..., None] * inv_freq
    cos, sin = ang.cos(), ang.sin()  # float32 (B, S, D/2) per-token tables
    want_q, _ = oracle(q, k, cos, sin)
    qo, _ = rotary_fused(q, k, cos, sin)

    def rotate_half(x):
        x1, x2 = x[..., : D // 2], x[..., D // 2:]
        return torch.cat((-x2, x1), dim=-1)

    cos_hf = torch.cat((cos, cos), -1)[:, None].to(torch.bfloat16)
    sin_hf = torch.cat((sin, sin), -1)[:, None].to(torch.bfloat16)
    hf_q = q * cos_hf + rotate_half(q) * sin_hf
    err_kernel = (qo.double() - want_q).abs()
    err_hf = (hf_q.double() - want_q).abs()
    assert err_kernel.max() <= err_hf.max()
    assert err_kernel.mean() <= err_hf.mean()
    assert_close(qo, want_q, torch.bfloat16)


def test_bf16_rounds_to_nearest_even():
    """The bf16 store is ONE round-to-nearest-even of the float32 result (bitwise)."""
    q, k = make_qk(2, 2, 1, 16, 64, torch.bfloat16)
    cos, sin = make_table(16, 32, (2,))
    qo, _ = rotary_fused(q, k, cos, sin)
    x = q.float()
    c, s = cos[:, None], sin[:, None]
    y = torch.cat((x[..., :32] * c - x[..., 32:] * s, x[..., 32:] * c + x[..., :32] * s), -1)
    # FMA contraction on the GPU may move a float32 result by an ulp, which can flip a tie
    mismatch = (qo != y.to(torch.bfloat16)).float().mean().item()
    assert mismatch <= (0.0 if DEV == "cpu" else 0.01)


# ------------------------------------------------------------------------------------------
# launch structure and host fast path
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("B", [1, 2])
def test_decode_is_one_launch(B, launches):
    q, k = make_qk(B, 32, 8, 1, 128, torch.bfloat16, "hf")
    cos, sin = make_table(1, 64, (B,))
    want = oracle(q, k, cos, sin)
    qo, ko = rotary_fused(q, k, cos, sin)
    assert len(launches.grids) == 1, launches.grids
    assert_close(qo, want[0], torch.bfloat16)
    assert_close(ko, want[1], torch.bfloat16)


def test_launch_is_kept(launches, monkeypatch):
    """The second call with the same key launches the kept configuration: nothing is derived again."""
    q, k = make_qk(1, 3, 1, 4, 64, torch.float32)
    cos, sin = make_table(4, 32, (1,))
    want = oracle(q, k, cos, sin)
    rotary_fused(q, k, cos, sin)
    assert rope._key(q, k, cos, sin, None, None, 1.0, False, False, False, 0) in rope.LAUNCHES
    made = []
    monkeypatch.setattr(rope, "_config", lambda *args: made.append(args))
    qo, ko = rotary_fused(q, k, cos, sin)
    assert not made and len(launches.grids) == 2
    assert_close(qo, want[0], torch.float32)
    assert_close(ko, want[1], torch.float32)


class OpLog(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_eager_fast_path_skips_dispatcher():
    q, k = make_qk(1, 3, 1, 2, 64, torch.float32)
    cos, sin = make_table(2, 32, (1,))
    with OpLog() as log:
        rotary_fused(q, k, cos, sin)
        rotary_fused(q, k, cos, sin, inplace=True)
    assert not any("torchembed" in op for op in log.ops), log.ops
    # Eager autograd goes through a plain autograd.Function, not the custom op's dispatcher
    # (the custom ops are what torch.compile traces; see the compile tests).
    q.requires_grad_(True)
    with OpLog() as log:
        qo, _ = rotary_fused(q, k, cos, sin)
    assert not any("torchembed" in op for op in log.ops), log.ops
    assert type(qo.grad_fn).__name__ == "_RotaryBackward"


def test_disable_switch(monkeypatch):
    q = torch.empty(1, device=DEV)
    assert kernel_can_run(q)
    monkeypatch.setenv("TORCHEMBED_DISABLE_TRITON", "1")
    assert not kernel_can_run(q)
    assert not kernel_can_run(torch.empty(1, device="meta"))


def test_import_does_not_import_triton():
    code = "import sys, torchembed.kernels as K; assert 'triton' not in sys.modules, 'triton imported eagerly'"
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert res.returncode == 0, res.stderr


# ------------------------------------------------------------------------------------------
# autograd
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("source", ["table", "inv_freq", "hf_table"])
def test_backward_matches_oracle(source, interleaved, dtype):
    B, Hq, Hk, S, D, half = 2, 3, 1, 6, 48, 16
    q, k = make_qk(B, Hq, Hk, S, D, dtype, "hf")
    kw = dict(interleaved=interleaved)
    if source == "table":
        kw["cos"], kw["sin"] = make_table(32, half)
        kw["positions"] = torch.randint(0, 32, (B, S), device=DEV)
    elif source == "inv_freq":
        kw["inv_freq"], kw["scale"], kw["positions"] = make_inv_freq(half), 0.75, 3
    else:
        kw["cos"], kw["sin"] = make_table(S, half, (B,))
    q.requires_grad_(True)
    k.requires_grad_(True)
    gq, gk = torch.randn_like(q), torch.randn_like(k)
    qo, ko = rotary_fused(q, k, **kw)
    ((qo * gq).sum() + (ko * gk).sum()).backward()

    q64, k64 = q.detach().double().requires_grad_(True), k.detach().double().requires_grad_(True)
    wq, wk = oracle(q64, k64, **kw)
    ((wq * gq.double()).sum() + (wk * gk.double()).sum()).backward()
    tol = TOL[dtype]
    torch.testing.assert_close(q.grad.double(), q64.grad, **tol)
    torch.testing.assert_close(k.grad.double(), k64.grad, **tol)


def test_double_backward_float64():
    # create_graph=True keeps the backward differentiable (eager autograd Function, kernel path)
    q, k = make_qk(1, 2, 1, 3, 8, torch.float64, "hf")
    q.requires_grad_(True)
    k.requires_grad_(True)
    cos, sin = make_table(3, 4, (1,), torch.float64)
    assert torch.autograd.gradgradcheck(lambda a, b: rotary_fused(a, b, cos, sin), (q, k), fast_mode=True)


def test_backward_of_sum_expanded_grad():
    # .sum() hands back stride-0 (expanded) gradients: the last-dim copy fallback handles them.
    q, k = make_qk(1, 2, 1, 3, 16, torch.float32)
    q.requires_grad_(True)
    cos, sin = make_table(3, 8, (1,))
    qo, ko = rotary_fused(q, k, cos, sin)
    qo.sum().backward()
    q64 = q.detach().double().requires_grad_(True)
    oracle(q64, k, cos, sin)[0].sum().backward()
    torch.testing.assert_close(q.grad.double(), q64.grad, **TOL[torch.float32])


def test_inplace_with_grad_goes_through_autograd():
    q, k = make_qk(1, 2, 1, 3, 16, torch.float32)
    cos, sin = make_table(3, 8, (1,))
    leaf = q.clone().requires_grad_(True)
    qn = leaf * 1.0  # non-leaf, so in-place is legal
    qo, ko = rotary_fused(qn, k, cos, sin, inplace=True)
    assert qo is qn
    qo.sum().backward()
    q64 = q.double().requires_grad_(True)
    oracle(q64, k, cos, sin)[0].sum().backward()
    torch.testing.assert_close(leaf.grad.double(), q64.grad, **TOL[torch.float32])


def test_gradcheck_custom_op_float64():
    q, k = make_qk(1, 2, 1, 3, 8, torch.float64, "hf")
    q.requires_grad_(True)
    k.requires_grad_(True)
    cos, sin = make_table(6, 3, (), torch.float64)
    pos = torch.tensor([[0, 4, 2]], device=DEV)

    def f(a, b):
        return torch.ops.torchembed.rotary(a, b, cos, sin, None, pos, 0, 1.0, False, False)

    assert torch.autograd.gradcheck(f, (q, k), fast_mode=True)
    inv = make_inv_freq(3).double()
    assert torch.autograd.gradcheck(
        lambda a, b: torch.ops.torchembed.rotary(a, b, None, None, inv, None, 2, 0.9, True, False), (q, k),
        fast_mode=True,
    )


def test_opcheck():
    q, k = make_qk(1, 2, 1, 3, 8, torch.float32, "hf")
    q.requires_grad_(True)
    k.requires_grad_(True)
    cos, sin = make_table(6, 3)
    pos = torch.tensor([1], device=DEV)
    torch.library.opcheck(torch.ops.torchembed.rotary.default, (q, k, cos, sin, None, pos, 0, 1.0, False, False))
    q2, k2 = q.detach().clone(), k.detach().clone()
    torch.library.opcheck(torch.ops.torchembed.rotary_.default, (q2, k2, cos, sin, None, pos, 0, 1.0, True, False))


# ------------------------------------------------------------------------------------------
# torch.compile
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("inplace", [False, True], ids=["outofplace", "inplace"])
def test_compile_fullgraph_no_graph_break(inplace):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    inv_freq = make_inv_freq(16)

    def f(q, k, pos):
        q = q * 2.0
        qo, ko = rotary_fused(q, k, inv_freq=inv_freq, scale=0.5, positions=pos, inplace=inplace)
        return qo + 1.0, ko

    q, k = make_qk(2, 3, 1, 5, 48, torch.float32, "hf")
    pos = torch.randint(0, 50, (2, 5), device=DEV)
    cf = torch.compile(f, backend="aot_eager", fullgraph=True)
    got = cf(q.clone(), k.clone(), pos)
    want = f(q.clone(), k.clone(), pos)
    assert not counters["graph_break"], dict(counters["graph_break"])
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def test_compile_backward():
    torch._dynamo.reset()
    cos, sin = make_table(5, 16, (2,))

    def f(q, k):
        qo, ko = rotary_fused(q, k, cos, sin)
        return (qo * ko.sum(1, keepdim=True)).sum()

    q, k = make_qk(2, 3, 1, 5, 32, torch.float32)
    q.requires_grad_(True)
    cf = torch.compile(f, backend="aot_eager", fullgraph=True)
    cf(q, k).backward()
    g_compiled = q.grad.clone()
    q.grad = None
    f(q, k).backward()
    torch.testing.assert_close(g_compiled, q.grad)


# ------------------------------------------------------------------------------------------
# errors
# ------------------------------------------------------------------------------------------


def _err_cases():
    q = torch.randn(2, 3, 4, 16, device=DEV)
    k = torch.randn(2, 1, 4, 16, device=DEV)
    cos, sin = torch.randn(2, 4, 8, device=DEV), torch.randn(2, 4, 8, device=DEV)
    tab_c, tab_s = torch.randn(32, 8, device=DEV), torch.randn(32, 8, device=DEV)
    inv = make_inv_freq(8)
    P = torch.zeros(2, 4, dtype=torch.long, device=DEV)
    return [
        ("rank", dict(q=q[0], k=k, cos=cos, sin=sin), "4-D"),
        ("k rank", dict(q=q, k=k[..., None], cos=cos, sin=sin), "4-D"),
        ("batch", dict(q=q, k=k[:1], cos=cos, sin=sin), "same B, S, D"),
        ("seq", dict(q=q, k=k[:, :, :3], cos=cos, sin=sin), "same B, S, D"),
        ("headdim", dict(q=q, k=k[..., :8], cos=cos, sin=sin), "same B, S, D"),
        ("non-floating q", dict(q=q.long(), k=k.long(), cos=cos, sin=sin), "floating dtype"),
        ("dtype mismatch", dict(q=q, k=k.half(), cos=cos, sin=sin), "one floating dtype"),
        ("R > D", dict(q=q, k=k, cos=torch.randn(2, 4, 9, device=DEV), sin=torch.randn(2, 4, 9, device=DEV)), "<= head dim"),
        ("HF full tables", dict(q=q, k=k, cos=torch.cat([cos, cos], -1), sin=torch.cat([sin, sin], -1)),
         "look like HF's full tables (cat(freqs, freqs)): rotary_fused takes half tables (R/2 entries), e.g. cos[..., :8]"),
        ("HF full tables interleaved", dict(q=q, k=k, cos=cos.repeat_interleave(2, -1), sin=sin.repeat_interleave(2, -1),
                                            interleaved=True), "e.g. cos[..., ::2]"),
        ("R == 0", dict(q=q, k=k, cos=cos[..., :0], sin=sin[..., :0]), "positive even"),
        ("cos/sin shape", dict(q=q, k=k, cos=cos, sin=sin[..., :4]), "same shape"),
        ("table batch", dict(q=q, k=k, cos=cos.repeat(2, 1, 1), sin=sin.repeat(2, 1, 1)), "per-token cos/sin"),
        ("table seq", dict(q=q, k=k, cos=cos[:, :3], sin=sin[:, :3]), "per-token cos/sin"),
        ("cache table rank", dict(q=q, k=k, cos=cos, sin=sin, positions=2), "(T, R/2)"),
        ("offset past table", dict(q=q, k=k, cos=tab_c, sin=tab_s, positions=30), "table length"),
        ("negative offset", dict(q=q, k=k, cos=tab_c, sin=tab_s, positions=-1), "non-negative"),
        ("positions shape 1d", dict(q=q, k=k, cos=tab_c, sin=tab_s, positions=P[:, 0].repeat(2)), "positions of shape"),
        ("positions shape 2d", dict(q=q, k=k, cos=tab_c, sin=tab_s, positions=P[:, :3]), "positions of shape"),
        ("positions shape 3d", dict(q=q, k=k, cos=tab_c, sin=tab_s, positions=P[None]), "positions of shape"),
        ("positions dtype", dict(q=q, k=k, cos=tab_c, sin=tab_s, positions=P.float()), "integer positions"),
        ("positions bool", dict(q=q, k=k, cos=tab_c, sin=tab_s, positions=P.bool()), "integer positions"),
        ("positions type", dict(q=q, k=k, cos=tab_c, sin=tab_s, positions=1.5), "positions None"),
        ("device k", dict(q=q, k=k.to("meta"), cos=cos, sin=sin), "device"),
        ("device cos", dict(q=q, k=k, cos=cos.to("meta"), sin=sin.to("meta")), "device"),
        ("device positions", dict(q=q, k=k, cos=tab_c, sin=tab_s, positions=P.to("meta")), "device"),
        ("device inv_freq", dict(q=q, k=k, inv_freq=inv.to("meta"), positions=P), "device"),
        ("both", dict(q=q, k=k, cos=tab_c, sin=tab_s, inv_freq=inv, positions=P), "got both"),
        ("neither", dict(q=q, k=k, positions=P), "got neither"),
        ("cos only", dict(q=q, k=k, cos=cos), "together"),
        ("inv_freq without positions", dict(q=q, k=k, inv_freq=inv), "with inv_freq"),
        ("inv_freq rank", dict(q=q, k=k, inv_freq=inv[None], positions=P), "1-D floating"),
    ]


@pytest.mark.parametrize("case", _err_cases(), ids=lambda c: c[0])
def test_value_errors(case):
    _, kw, match = case
    q, k = kw.pop("q"), kw.pop("k")
    with pytest.raises(ValueError, match=re.escape(match)):
        rotary_fused(q, k, kw.pop("cos", None), kw.pop("sin", None), **kw)


@pytest.mark.skipif(DEV != "cpu", reason="tensor positions are range-checked on the host for CPU tensors only")
@pytest.mark.parametrize(
    "positions, match",
    [
        (torch.tensor([0, -1]), "positions -1..3"),  # (B,) offsets: -1 .. 0 + S - 1
        (torch.tensor([0, 29]), "positions 0..32"),  # 29 + S - 1 = 32 past a 32-row table
        (torch.tensor([[0, 1, 2, -4], [0, 1, 2, 3]]), "positions -4..3"),
        (torch.tensor([[0, 1, 2, 3], [0, 1, 2, 32]]), "positions 0..32"),
    ],
)
def test_table_positions_out_of_range_on_cpu(positions, match):
    """Tensor positions indexing (T, R/2) tables: past either end is a ValueError on CPU tensors
    (the fallback would wrap negative indices silently, the interpreted kernel read out of bounds)."""
    q, k = torch.randn(2, 3, 4, 16), torch.randn(2, 1, 4, 16)
    cos, sin = torch.randn(32, 8), torch.randn(32, 8)
    with pytest.raises(ValueError, match=rf"tensor positions in \[0, table length 32\), got {match}"):
        rotary_fused(q, k, cos, sin, positions=positions)
    ok = positions.clamp(0, 28)  # in range: runs
    assert rotary_fused(q, k, cos, sin, positions=ok)[0].shape == q.shape


# ------------------------------------------------------------------------------------------
# property test
# ------------------------------------------------------------------------------------------

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@st.composite
def _cases(draw):
    D = draw(st.sampled_from([8, 16, 24, 48, 64, 80]))
    half = draw(st.integers(1, D // 2))
    pos_mode = draw(st.sampled_from(["none", "int", "batch", "ids", "ids1"]))
    source = "table" if pos_mode == "none" else draw(st.sampled_from(["table", "inv_freq"]))
    grouped = draw(st.booleans())  # two heads per program, as prefill-sized grids run: even head counts
    return dict(
        B=draw(st.integers(1, 2)),
        Hq=2 * draw(st.integers(1, 2)) if grouped else draw(st.integers(1, 4)),
        Hk=2 if grouped else draw(st.integers(1, 3)),
        grouped=grouped,
        S=draw(st.integers(1, 24)),
        D=D,
        R=2 * half,
        dtype=draw(st.sampled_from(DTYPES)),
        interleaved=draw(st.booleans()),
        pos_mode=pos_mode,
        source=source,
        scale=draw(st.sampled_from([1.0, 0.5, 1.25])),  # exact in float32 (the kernel's scale)
        bc1=draw(st.booleans()),
        inplace=draw(st.booleans()),
        conjugate=draw(st.booleans()),
        layout=draw(st.sampled_from(["contig", "hf", "padded"])),
        seed=draw(st.integers(0, 2**31 - 1)),
        backend=draw(st.sampled_from(["triton", "triton", "torch"])),  # the fallback shares the oracle
    )


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_cases())
def test_hypothesis_random_cases(case):
    seed = case.pop("seed")
    backend = case.pop("backend")
    grouped = case.pop("grouped")
    old = os.environ.get("TORCHEMBED_DISABLE_TRITON")
    if backend == "torch":
        os.environ["TORCHEMBED_DISABLE_TRITON"] = "1"
    rope.clear_launches()  # launch configs are kept per shape, not per tuning
    try:
        with changed(rope=dict(grouped_min_programs=0)) if grouped else contextlib.nullcontext():
            if grouped and backend == "triton":
                grid, meta, _, _ = _config(case["B"], case["Hq"], case["Hk"], case["S"], case["D"],
                                           case["R"] // 2, case["dtype"], 0, False, False, False, False)
                assert meta["HPP"] == 2
            run_case(gen=torch.Generator().manual_seed(seed), **case)
    finally:
        rope.clear_launches()
        if old is None:
            os.environ.pop("TORCHEMBED_DISABLE_TRITON", None)
        else:
            os.environ["TORCHEMBED_DISABLE_TRITON"] = old


def _triton_launch(monkeypatch, call):
    """``call()`` launched through ``kernel[grid]`` (Triton's own binding), nothing kept after; the
    direct launch on for the calls that follow (restored after the test)."""
    with changed(direct_launch=False):
        out = call()
        out = tuple(t.clone() for t in out)
    rope.clear_launches()
    monkeypatch.setattr(launch, "_launcher_fails", False)
    return out


@pytest.mark.skipif(DEV != "cuda", reason="direct launch replays compiled CUDA kernels")
def test_direct_launch_replays_the_compiled_kernel(monkeypatch):
    q, k = make_qk(2, 5, 3, 7, 128, torch.bfloat16)
    cos, sin = make_table(7, 64, (2,))
    expected = _triton_launch(monkeypatch, lambda: rotary_fused(q, k, cos, sin))
    first = rotary_fused(q, k, cos, sin)  # compiles through kernel[grid] and keeps the launch
    assert len(rope.LAUNCHES) == 1
    second = rotary_fused(q, k, cos, sin)  # the kept launch
    assert launch.direct(), "the direct launch failed and switched itself off"
    for out in (first, second):
        assert torch.equal(out[0], expected[0]) and torch.equal(out[1], expected[1])


@pytest.mark.skipif(DEV != "cuda", reason="direct launch replays compiled CUDA kernels")
def test_direct_launch_keys_alignment_and_table_dtype(monkeypatch):
    """A launch compiled for a misaligned view is kept and repeated on views of the same alignment; a
    launch compiled for float32 tables is never used on bfloat16 ones; each call matches Triton's own
    launch."""
    base_q, base_k = make_qk(2, 4, 2, 9, 64 + 1, torch.bfloat16)
    cases = {
        "aligned": (make_qk(2, 4, 2, 9, 64, torch.bfloat16), make_table(9, 32, (2,)), 1),
        "misaligned": ((base_q[..., 1:], base_k[..., 1:]), make_table(9, 32, (2,)), 1),  # data_ptr % 16 == 2
        "bf16 tables": (make_qk(2, 4, 2, 9, 64, torch.bfloat16), make_table(9, 32, (2,), torch.bfloat16), 1),
    }
    for name, ((q, k), (cos, sin), kept) in cases.items():
        expected = _triton_launch(monkeypatch, lambda: rotary_fused(q, k, cos, sin))
        for _ in range(2):  # the first call compiles and keeps the launch, the second uses it
            got = rotary_fused(q, k, cos, sin)
            assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1]), name
        assert launch.direct(), f"{name}: the direct launch failed and switched itself off"
        assert len(rope.LAUNCHES) == kept, name
        rope.clear_launches()
    # one key, two alignments: the launch kept for aligned tables goes through Triton for misaligned
    # ones (and the other way round), each call exact
    (q, k), (cos, sin) = cases["aligned"][:2]
    shifted = torch.empty(cos.numel() + 1, dtype=cos.dtype, device=DEV)[1:].view_as(cos).copy_(cos)  # data_ptr % 16 == 4
    assert shifted.stride() == cos.stride() and shifted.data_ptr() % 16
    for first, then in ((cos, shifted), (shifted, cos)):
        expected = _triton_launch(monkeypatch, lambda: rotary_fused(q, k, cos, sin))
        for table in (first, then, first, then):
            got = rotary_fused(q, k, table, sin)
            assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1]), table.data_ptr() % 16
        assert launch.direct() and len(rope.LAUNCHES) == 1


def _tables_keys() -> int:
    return sum(1 for key in rope.LAUNCHES if key[-3] is True)  # kept in-place launches


@pytest.mark.skipif(DEV != "cuda", reason="the hot path replays compiled CUDA kernels")
def test_hot_path_keeps_one_launch_per_layout_and_matches(monkeypatch):
    """``rotary_fused(..., inplace=True)`` (the patched attention's call at inference) keeps one launch per (shapes,
    strides, dtypes) in the shared cache, a misaligned view's too (compiled for its alignment); each call
    matches Triton's own launch."""
    base_q, base_k = make_qk(2, 4, 2, 9, 64 + 1, torch.bfloat16, layout="hf")
    cases = {
        "hf layout": (make_qk(2, 4, 2, 9, 64, torch.bfloat16, layout="hf"), make_table(9, 32, (2,)), 1),
        "contiguous": (make_qk(2, 4, 2, 9, 64, torch.bfloat16), make_table(9, 32, (1,)), 2),
        "misaligned": ((base_q[..., 1:], base_k[..., 1:]), make_table(9, 32, (2,)), 3),
        "bf16 tables": (make_qk(2, 4, 2, 9, 64, torch.bfloat16), make_table(9, 32, (2,), torch.bfloat16), 4),
    }
    monkeypatch.setattr(launch, "_launcher_fails", False)
    expected = {}
    with changed(direct_launch=False):  # Triton's own launch; leaving the block forgets every kept launch
        for name, ((q, k), (cos, sin), _) in cases.items():
            expected[name] = tuple(t.clone() for t in rotary_fused(q, k, cos, sin))
    assert _tables_keys() == 0
    for name, ((q, k), (cos, sin), entries) in cases.items():
        for call in range(3):  # the first call keeps the launch, the next ones use it
            # clone keeps dense strides; the misaligned view is cut again from a clone of its base
            q_in, k_in = (base_q.clone()[..., 1:], base_k.clone()[..., 1:]) if name == "misaligned" else (q.clone(), k.clone())
            got = rotary_fused(q_in, k_in, cos, sin, inplace=True)
            assert got[0] is q_in and got[1] is k_in
            assert torch.equal(q_in, expected[name][0]) and torch.equal(k_in, expected[name][1]), (name, call)
        assert launch.direct(), f"{name}: the direct launch failed and switched itself off"
        assert _tables_keys() == entries, name


@pytest.mark.skipif(DEV != "cuda", reason="direct launch replays compiled CUDA kernels")
def test_every_position_form_replays_exactly(monkeypatch):
    """Kept launches of every position form and angle source, in and out of place, at decode and
    prefill shapes: each call equals Triton's own launch, also with new values in the same tensors."""
    inv_freq = (1.0 / 10000.0 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64)).to(DEV)
    for S in (1, 9):
        q, k = make_qk(3, 4, 2, S, 64, torch.bfloat16, layout="hf")
        cos, sin = make_table(64, 32, ())
        forms = {
            "int": dict(inv_freq=inv_freq, positions=17),
            "offset 1": dict(inv_freq=inv_freq, positions=1),
            "(b,)": dict(inv_freq=inv_freq, positions=torch.tensor([3, 0, 40], device=DEV)),
            "(b, s)": dict(inv_freq=inv_freq, positions=torch.randint(0, 50, (3, S), device=DEV)),
            "(1, s) int32": dict(inv_freq=inv_freq, positions=torch.randint(0, 50, (1, S), device=DEV).int()),
            "table, int": dict(cos=cos, sin=sin, positions=5),
            "table, (b, s)": dict(cos=cos, sin=sin, positions=torch.randint(0, 50, (3, S), device=DEV)),
            "scaled, conjugate, interleaved": dict(inv_freq=inv_freq, positions=7, scale=0.5, conjugate=True,
                                                   interleaved=True),
        }
        for name, kw in forms.items():
            for inplace in (False, True):
                def call():
                    a, b = q.clone(), k.clone()
                    out = rotary_fused(a, b, inplace=inplace, **kw)
                    return out

                expected = _triton_launch(monkeypatch, call)
                for _ in range(3):
                    got = call()
                    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1]), (S, name, inplace)
                assert launch.direct(), (S, name, inplace)


class _FakeKernel:
    """Stands in for the jitted kernel on any machine: ``kernel[grid](*args, **meta)`` records the
    launch and returns a compiled kernel whose launcher records its calls."""

    def __init__(self, packed=False):
        self.launches, self.entries, self.fail = [], [], False
        fake = self

        class Run:
            global_scratch_size = profile_scratch_size = 0
            launch_cooperative_grid, launch_pdl = "coop", "pdl"

            def launch(self, *args):
                if fake.fail:
                    raise TypeError("launcher changed")
                fake.entries.append(args)

            def __call__(self, *args):  # the Python wrapper: (grid, stream, function, metadata, hooks, args)
                fake.entries.append(("wrapper",) + args)

        if packed:  # a launcher whose C entry takes the arguments packed (Triton 3.9)
            Run.kernel_signature = "packed"

        class Compiled:
            function, packed_metadata, run = "function", "metadata", Run()

        self.compiled = Compiled()

    def __getitem__(self, grid):
        def go(*args, **meta):
            self.launches.append((grid, args, meta))
            return self.compiled

        return go


# The kernel's constexprs in the order of ``rope._config``'s meta dict: the order a kept launch passes
# them to the launcher of a kernel without ``arg_names`` (the stand-in below; Triton's kernels: their
# signature's order).
_CONSTEXPRS = ("HALF", "D", "BLOCK_D", "BLOCK_P", "BLOCK_S", "HPP", "POS_MODE", "USE_INV_FREQ", "INTERLEAVED",
               "CONJUGATE", "HALVES", "HAS_PASS", "CDT", "EMULATE_RTNE", "HEADS_FAST")


def _stand_in_gpu(monkeypatch, kernel):
    """``kernel`` for the RoPE kernel, tensors taken for a GPU's, the direct launch on."""
    monkeypatch.setattr(rope_triton, "rope_kernel", kernel)
    monkeypatch.setattr(launch, "_launcher_fails", False)
    monkeypatch.setattr(launch, "_on_gpu", lambda t: True)
    monkeypatch.setattr(launch, "raw_stream", lambda index: "stream")
    rope.clear_launches()


def _constexprs(meta):
    assert set(meta) == {*_CONSTEXPRS, "num_warps"}, sorted(meta)
    return tuple(meta[name] for name in _CONSTEXPRS)


def test_kept_launches_replay_what_was_launched(monkeypatch):
    """Plumbing of the launch cache, on any machine (stand-ins for the compiled kernel and the GPU): a
    miss launches through ``kernel[grid]`` and keeps the launch under its key; the next call with that
    key calls the launcher's entry point with this call's pointers (ints) and the kept arguments; a
    call whose pointers' alignment differs from the one the kept launch was compiled with goes through
    ``kernel[grid]`` (a launch compiled for misaligned pointers is kept, and repeated directly for
    pointers of that alignment only); a launcher that raises switches the direct launch off, and
    Triton's own launch takes over."""
    kernel = _FakeKernel()
    _stand_in_gpu(monkeypatch, kernel)
    monkeypatch.setattr(rope, "kernel_can_run", lambda t: True)
    q, k = make_qk(1, 4, 2, 3, 16, torch.float32, layout="hf")
    cos, sin = make_table(3, 8, (1,))

    def expect_entry(pointers):
        grid, args, meta = kernel.launches[-1]
        got = kernel.entries[-1]
        assert got[:13] == (*grid, "stream", "function", "coop", "pdl", None, None, "metadata", None, None, None)
        assert got[13:21] == tuple(t.data_ptr() for t in pointers)
        assert got[21:] == tuple(args[8:]) + _constexprs(meta)

    rotary_fused(q, k, cos, sin, inplace=True)  # miss: kernel[grid], kept
    assert len(kernel.launches) == 1 and not kernel.entries and _tables_keys() == 1
    rotary_fused(q, k, cos, sin, inplace=True)  # hit: the launcher's entry point, no kernel[grid]
    assert len(kernel.launches) == 1 and len(kernel.entries) == 1
    expect_entry((q, k, q, k, cos, sin, q, q))  # unused positions / inv_freq: q, as the first launch

    inv_freq, positions = torch.rand(8, device=DEV), torch.arange(3, device=DEV)[None]
    qo, ko = rotary_fused(q, k, inv_freq=inv_freq, positions=positions)
    assert len(kernel.launches) == 2 and len(kernel.entries) == 1
    qo, ko = rotary_fused(q, k, inv_freq=inv_freq, positions=positions)
    assert len(kernel.launches) == 2 and len(kernel.entries) == 2
    expect_entry((q, k, qo, ko, inv_freq, inv_freq, positions, inv_freq))

    base = torch.empty(2 * 3 * 8 + 1, device=DEV)
    shifted = base[1:25].view(1, 3, 8)  # cos's key, data_ptr % 16 == 4
    assert rope._key(q, k, shifted, sin, None, None, 1.0, False, True, False, 0) == rope._key(
        q, k, cos, sin, None, None, 1.0, False, True, False, 0)
    for _ in range(2):  # cos misaligned: the launch kept for aligned tables goes through Triton each time
        rotary_fused(q, k, shifted, sin, inplace=True)
        assert kernel.launches[-1][1][4] is shifted  # this call's table
    assert len(kernel.launches) == 4 and len(kernel.entries) == 2 and _tables_keys() == 1
    rotary_fused(q, k, cos, sin, inplace=True)  # aligned again: the launch kept before, directly
    assert len(kernel.launches) == 4 and len(kernel.entries) == 3

    rope.clear_launches()  # now compiled first for the misaligned table: kept, direct for that alignment only
    rotary_fused(q, k, shifted, sin, inplace=True)
    assert len(kernel.launches) == 5 and len(kernel.entries) == 3 and _tables_keys() == 1
    rotary_fused(q, k, shifted, sin, inplace=True)
    assert len(kernel.launches) == 5 and len(kernel.entries) == 4
    expect_entry((q, k, q, k, shifted, sin, q, q))
    rotary_fused(q, k, cos, sin, inplace=True)  # aligned: through Triton, the kept launch unchanged
    assert len(kernel.launches) == 6 and len(kernel.entries) == 4 and kernel.launches[-1][1][4] is cos
    rotary_fused(q, k, shifted, sin, inplace=True)
    assert len(kernel.launches) == 6 and len(kernel.entries) == 5 and _tables_keys() == 1

    kernel.fail = True
    rotary_fused(q, k, shifted, sin, inplace=True)  # the launcher raises: direct launch off, Triton's launch instead
    assert not launch.direct() and len(kernel.launches) == 7 and len(kernel.entries) == 5
    rotary_fused(q, k, shifted, sin, inplace=True)  # kept still, as a kernel[grid] launch
    assert len(kernel.launches) == 8 and len(kernel.entries) == 5


def test_kept_launch_calls_the_python_wrapper_of_a_packed_launcher(monkeypatch):
    """Where the launcher's C entry takes its arguments packed (a later Triton), the kept launch
    calls the launcher's Python wrapper, with the arguments Triton's own launch passes it."""
    kernel = _FakeKernel(packed=True)
    _stand_in_gpu(monkeypatch, kernel)
    q, k = make_qk(1, 4, 2, 3, 16, torch.float32, layout="hf")
    cos, sin = make_table(3, 8, (1,))
    rotary_fused(q, k, cos, sin, inplace=True)
    rotary_fused(q, k, cos, sin, inplace=True)
    grid, args, meta = kernel.launches[-1]
    got = kernel.entries[-1]
    assert len(kernel.launches) == 1 and got[0] == "wrapper"
    assert got[1:10] == (*grid, "stream", "function", "metadata", None, None, None)
    assert got[10:18] == tuple(t.data_ptr() for t in (q, k, q, k, cos, sin, q, q))
    assert got[18:] == tuple(args[8:]) + _constexprs(meta)


# ------------------------------------------------------------------------------------------
# halves: full-width table rows whose two halves differ (HF's arithmetic with its own tables)
# ------------------------------------------------------------------------------------------


def _oracle_halves(x, cos, sin, conjugate=False):
    """float64 ``x * cos + rotate_half(x) * sin`` over the first ``R`` features with full-width
    ``(Bc, S, R)`` tables (HF's formula), the rest passed through."""
    x, c, s = x.double(), cos.double()[:, None], sin.double()[:, None]
    s = -s if conjugate else s
    rot = c.shape[-1]
    h = rot // 2
    x1, x2 = x[..., :h], x[..., h:rot]
    y = torch.cat((x1 * c[..., :h] - x2 * s[..., :h], x2 * c[..., h:] + x1 * s[..., h:]), dim=-1)
    return torch.cat((y, x[..., rot:]), dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("rot, dim", [(16, 16), (8, 16)])
@pytest.mark.parametrize("conjugate", [False, True])
def test_halves_read_each_features_own_entries(dtype, inplace, rot, dim, conjugate):
    """``halves=True``: full-width table rows whose halves differ (HunYuan-VL's M-RoPE at image
    tokens): the second feature of each pair takes its own entries."""
    gen = torch.Generator().manual_seed(rot + dim + inplace)
    B, Hq, Hk, S = 2, 3, 1, 7
    q = torch.randn(B, S, Hq, dim, generator=gen).to(DEV, dtype).transpose(1, 2)
    k = torch.randn(B, S, Hk, dim, generator=gen).to(DEV, dtype).transpose(1, 2)
    angles = torch.rand(B, S, rot, generator=gen) * 6 - 3  # every entry its own angle: the halves differ
    cos, sin = angles.cos().to(DEV), angles.sin().to(DEV)
    want_q, want_k = _oracle_halves(q, cos, sin, conjugate), _oracle_halves(k, cos, sin, conjugate)
    qo, ko = rotary_fused(q.clone() if inplace else q, k.clone() if inplace else k, cos, sin, halves=True,
                          inplace=inplace, conjugate=conjugate)
    torch.testing.assert_close(qo.double(), want_q, **TOL[dtype])
    torch.testing.assert_close(ko.double(), want_k, **TOL[dtype])
    # without halves the kernel reads one entry per pair: here a different function
    plain, _ = rotary_fused(q, k, cos[..., : rot // 2], sin[..., : rot // 2], conjugate=conjugate)
    assert (plain.double() - want_q).abs().max() > 1e-2


def test_halves_backward_is_the_transpose():
    """The gradient of the halves map is its transpose (the two halves' sines exchanged), against
    float64 autograd of HF's formula."""
    gen = torch.Generator().manual_seed(5)
    B, H, S, D = 1, 2, 5, 8
    q = torch.randn(B, H, S, D, generator=gen, dtype=torch.float32).to(DEV).requires_grad_()
    k = torch.randn(B, H, S, D, generator=gen, dtype=torch.float32).to(DEV).requires_grad_()
    angles = torch.rand(B, S, D, generator=gen) * 6 - 3
    cos, sin = angles.cos().to(DEV), angles.sin().to(DEV)
    qo, ko = rotary_fused(q, k, cos, sin, halves=True)
    gq, gk = torch.randn_like(qo), torch.randn_like(ko)
    (qo * gq + ko * gk).sum().backward()
    qd, kd = (t.detach().double().requires_grad_() for t in (q, k))
    (_oracle_halves(qd, cos, sin) * gq.double() + _oracle_halves(kd, cos, sin) * gk.double()).sum().backward()
    torch.testing.assert_close(q.grad.double(), qd.grad, **TOL[torch.float32])
    torch.testing.assert_close(k.grad.double(), kd.grad, **TOL[torch.float32])


def test_halves_needs_full_width_rows_and_half_split_pairing():
    """Rows of an odd width, or interleaved pairing, with ``halves`` are a clear ValueError."""
    q = torch.randn(1, 2, 4, 8, device=DEV)
    with pytest.raises(ValueError, match="full-width cos/sin rows"):
        rotary_fused(q, q.clone(), torch.ones(1, 4, 5, device=DEV), torch.zeros(1, 4, 5, device=DEV), halves=True)
    with pytest.raises(ValueError, match="full-width cos/sin rows"):
        rotary_fused(q, q.clone(), torch.ones(1, 4, 8, device=DEV), torch.zeros(1, 4, 8, device=DEV), halves=True,
                     interleaved=True)


@pytest.mark.skipif(not hasattr(torch, "compile"), reason="torch.compile")
def test_halves_tables_made_inside_a_compiled_graph():
    """Tables computed inside a ``torch.compile`` graph (a model's rotary module compiled with its
    attention) reach the kernel as the compiler lays them out: ``halves`` reads only the rows given."""
    inv = 1.0 / (10000 ** (torch.arange(0, 16, 2, device=DEV).float() / 16))

    def rotate(q, k, pos):
        freqs = pos[:, :, None].float() * inv
        emb = torch.cat((freqs, freqs * 1.5), -1)  # the halves differ
        return rotary_fused(q, k, emb.cos(), emb.sin(), halves=True)

    gen = torch.Generator().manual_seed(11)
    q, k = torch.randn(2, 4, 3, 16, generator=gen).to(DEV), torch.randn(2, 2, 3, 16, generator=gen).to(DEV)
    pos = torch.arange(3, device=DEV)[None].expand(2, 3) + 5
    freqs = pos[:, :, None].float() * inv
    emb = torch.cat((freqs, freqs * 1.5), -1)
    want = [_oracle_halves(x, emb.cos(), emb.sin()) for x in (q, k)]
    torch._dynamo.reset()
    got = torch.compile(rotate, fullgraph=True, backend="inductor")(q, k, pos)
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double(), w, **TOL[torch.float32])


def _full_tables_forms():
    """(name, q, k, cos, sin): HF's usual call and the ways a call can miss it."""
    gen = torch.Generator().manual_seed(5)
    r = lambda *shape, dtype=torch.float32: torch.randn(*shape, generator=gen).to(DEV, dtype)  # noqa: E731
    q, k, t = r(2, 4, 5, 8), r(2, 2, 5, 8), r(1, 5, 8)
    yield "usual", q, k, t, t.clone()
    yield "batched tables", q, k, r(2, 5, 8), r(2, 5, 8)
    yield "2-D tables", q, k, r(5, 8), r(5, 8)
    yield "tables of another batch", q, k, r(3, 5, 8), r(3, 5, 8)
    yield "tables of other tokens", q, k, r(1, 6, 8), r(1, 6, 8)
    yield "k with other tokens", q, r(2, 2, 6, 8), t, t
    yield "k of another batch", q, r(1, 2, 5, 8), t, t
    yield "k of another dtype", q, r(2, 2, 5, 8, dtype=torch.float64), t, t
    yield "sin of another shape", q, k, t, r(2, 5, 8)
    yield "odd head dim", r(2, 4, 5, 7), r(2, 2, 5, 7), r(1, 5, 7), r(1, 5, 7)
    yield "integer tables", q, k, t.long(), t.long()
    yield "3-D q", q[0], k[0], t, t


@pytest.mark.parametrize("form", [f[0] for f in _full_tables_forms()])
def test_the_usual_call_takes_what_rotary_fused_takes(form):
    """``rotary_fused_usual`` (a patched helper's usual call) rotates exactly what ``rotary_fused(...,
    halves=True)`` takes, in place at inference, also through the kept launch, and answers None for the
    rest, never raising."""
    _, q, k, cos, sin = next(f for f in _full_tables_forms() if f[0] == form)
    taken = form in ("usual", "batched tables")
    if taken:
        want = [_oracle_halves(x, cos, sin) for x in (q, k)]
        for _ in range(2):  # the second time through the kept launch
            for qo, ko in (rotary_fused(q, k, cos, sin, halves=True), rope.rotary_fused_usual(q.clone(), k.clone(), cos, sin)):
                for got, w in zip((qo, ko), want):
                    torch.testing.assert_close(got.double(), w, **TOL[torch.float32])
        qi, ki = q.clone(), k.clone()
        assert all(o is i for o, i in zip(rope.rotary_fused_usual(qi, ki, cos, sin), (qi, ki)))  # in place
    else:
        with pytest.raises(ValueError, match="rotary_fused"):
            rotary_fused(q, k, cos, sin, halves=True)
        before = q.clone()
        assert rope.rotary_fused_usual(q, k, cos, sin) is None  # refused before any launch
        assert torch.equal(q, before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("B,S,Hq,Hk,D", [(2, 17, 32, 8, 64), (3, 23, 7, 13, 92)])
def test_peer_matrix_forward_and_backward_against_hf_in_float64(B, S, Hq, Hk, D, dtype):
    """Shapes of the kind peer RoPE kernels test (more kv heads than query heads, neither a multiple of
    the other, a head dim of 92): HF's usual call, q and k in HF's ``(B, S, H, D)`` memory, LLaMA's own
    tables, values and gradients against HF's helper in float64."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    gen = torch.Generator().manual_seed(B * S + D)
    q = torch.randn(B, S, Hq, D, generator=gen).to(DEV, dtype).transpose(1, 2).requires_grad_()
    k = torch.randn(B, S, Hk, D, generator=gen).to(DEV, dtype).transpose(1, 2).requires_grad_()
    positions = torch.randint(0, 4096, (B, S), generator=gen).to(DEV)
    rope = LlamaRotaryEmbedding(LlamaConfig(hidden_size=Hq * D, num_attention_heads=Hq, head_dim=D)).to(DEV)
    cos, sin = (t.to(dtype) for t in rope(q.float(), positions))
    q64, k64 = (x.detach().double().requires_grad_() for x in (q, k))
    want = apply_rotary_pos_emb(q64, k64, cos.double(), sin.double())
    got = rotary_fused(q, k, cos, sin, halves=True)
    grads = [torch.randn(x.shape, generator=gen).to(DEV, dtype) for x in got]
    torch.autograd.backward(want, [g.double() for g in grads])
    torch.autograd.backward(got, grads)
    for ours, truth in ((got[0], want[0]), (got[1], want[1]), (q.grad, q64.grad), (k.grad, k64.grad)):
        torch.testing.assert_close(ours.double(), truth.detach(), **TOL[dtype])
