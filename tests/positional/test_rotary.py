import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers import TOL, rope_oracle
from torchembed.positional import RotaryEmbedding


def test_no_parameters_and_empty_state_dict():
    rope = RotaryEmbedding(dim=32)
    assert list(rope.parameters()) == []
    assert rope.state_dict() == {}


def test_meta_device_construction():
    rope = RotaryEmbedding(dim=32, max_seq_len=16, device="meta")
    assert rope.inv_freq.is_meta and rope.cos_cached.shape == (16, 16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_matches_float64_and_keeps_dtype(dtype):
    rope = RotaryEmbedding(dim=64, base=500000)
    q, k = torch.randn(2, 4, 33, 64).to(dtype), torch.randn(2, 2, 33, 64).to(dtype)
    qo, ko = rope(q, k)
    assert qo.dtype == dtype and ko.dtype == dtype
    positions = torch.arange(33)
    torch.testing.assert_close(qo.double(), rope_oracle(q, positions, rope.inv_freq), **TOL[dtype])
    torch.testing.assert_close(ko.double(), rope_oracle(k, positions, rope.inv_freq), **TOL[dtype])


def test_preserves_norms():
    rope = RotaryEmbedding(dim=64)
    q = torch.randn(3, 5, 64)
    qo, _ = rope(q, q)
    torch.testing.assert_close(qo.norm(dim=-1), q.norm(dim=-1))


def test_position_zero_is_identity():
    rope = RotaryEmbedding(dim=16)
    q = torch.randn(1, 16)
    qo, ko = rope(q, q)
    assert torch.equal(qo, q) and torch.equal(ko, q)


def test_relative_property_through_module():
    rope = RotaryEmbedding(dim=32)
    q, k = torch.randn(1, 1, 32), torch.randn(1, 1, 32)
    dots = []
    for m in (0, 10, 100):
        qm, _ = rope(q, q, offset=m + 5)
        kn, _ = rope(k, k, offset=m)
        dots.append((qm * kn).sum().item())
    assert dots[1] == pytest.approx(dots[0], abs=1e-4) and dots[2] == pytest.approx(dots[0], abs=1e-4)


def test_extends_cache_past_max_seq_len():
    rope = RotaryEmbedding(dim=16, max_seq_len=8)
    q = torch.randn(2, 20, 16)
    qo, _ = rope(q, q)
    assert rope.cos_cached.shape[0] >= 20
    torch.testing.assert_close(qo.double(), rope_oracle(q, torch.arange(20), rope.inv_freq), **TOL[torch.float32])
    qo2, _ = rope(q[:, :1], q[:, :1], offset=30)
    torch.testing.assert_close(qo2.double(), rope_oracle(q[:, :1], torch.tensor([30]), rope.inv_freq), **TOL[torch.float32])


def test_seq_dim_and_leading_dims():
    rope = RotaryEmbedding(dim=16)
    q = torch.randn(2, 7, 3, 16)  # (b, s, h, d)
    qo, ko = rope(q, q, seq_dim=1)
    ref, _ = rope(q.transpose(1, 2), q.transpose(1, 2))
    torch.testing.assert_close(qo, ref.transpose(1, 2))
    q5 = torch.randn(2, 2, 3, 5, 16)
    qo5, _ = rope(q5, q5)
    torch.testing.assert_close(qo5.double(), rope_oracle(q5, torch.arange(5), rope.inv_freq), **TOL[torch.float32])


def test_offset_tensor_and_position_ids():
    rope = RotaryEmbedding(dim=16)
    q = torch.randn(2, 3, 4, 16)
    offsets = torch.tensor([0, 7])
    qo, _ = rope(q, q, offset=offsets)
    for b in range(2):
        expected = rope_oracle(q[b], torch.arange(offsets[b], offsets[b] + 4), rope.inv_freq)
        torch.testing.assert_close(qo[b].double(), expected, **TOL[torch.float32])
    pos = torch.tensor([[3, 1, 4, 1], [5, 9, 2, 6]])
    qo, _ = rope(q, q, position_ids=pos)
    for b in range(2):
        torch.testing.assert_close(qo[b].double(), rope_oracle(q[b], pos[b], rope.inv_freq), **TOL[torch.float32])


def test_partial_and_interleaved():
    rope = RotaryEmbedding(dim=32, rotary_dim=16, interleaved=True)
    q = torch.randn(2, 6, 32)
    qo, _ = rope(q, q)
    torch.testing.assert_close(qo.double(), rope_oracle(q, torch.arange(6), rope.inv_freq, interleaved=True), **TOL[torch.float32])
    assert torch.equal(qo[..., 16:], q[..., 16:])


def test_rope_scaling_parameters():
    params = {"rope_type": "linear", "factor": 4.0}
    rope = RotaryEmbedding(dim=16, rope_parameters=params)
    plain = RotaryEmbedding(dim=16)
    torch.testing.assert_close(rope.inv_freq, plain.inv_freq / 4)


def test_gradcheck_float64():
    rope = RotaryEmbedding(dim=8, max_seq_len=8)
    q = torch.randn(1, 2, 3, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 1, 3, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: rope(a, b, offset=2), (q, k))


def test_fused_option_on_cpu(monkeypatch):
    """``fused=None`` on CPU tensors (no interpreter): the PyTorch path, no kernel call; ``fused=True``:
    FusedUnavailableError naming the fix; ``use_fused`` is the deprecated spelling of None / False."""
    from torchembed import kernels
    from torchembed.kernels import FusedUnavailableError

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    calls = []
    original = kernels.rotary_fused
    monkeypatch.setattr(kernels, "rotary_fused", lambda *a, **kw: calls.append(a) or original(*a, **kw))
    q = torch.randn(1, 2, 5, 16)
    qo, _ = RotaryEmbedding(dim=16, fused=None)(q, q)
    torch.testing.assert_close(qo.double(), rope_oracle(q, torch.arange(5), RotaryEmbedding(16).inv_freq),
                               **TOL[torch.float32])
    assert not calls
    if kernels.triton_available():
        with pytest.raises(FusedUnavailableError, match="CUDA"):
            RotaryEmbedding(dim=16, fused=True)(q, q)
    else:
        with pytest.raises(FusedUnavailableError, match="pip install triton"):
            RotaryEmbedding(dim=16, fused=True)
    with pytest.warns(DeprecationWarning, match="fused=None"):
        assert RotaryEmbedding(dim=16, use_fused=True).fused is None
    with pytest.warns(DeprecationWarning, match="fused=False"):
        assert RotaryEmbedding(dim=16, use_fused=False).fused is False
    with pytest.raises(TypeError, match="fused"):
        RotaryEmbedding(dim=16, fused="yes")
    with pytest.raises(TypeError, match="fused= only"):
        RotaryEmbedding(dim=16, fused=True, use_fused=True)


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(dim=7), ValueError, "positive even"),
        (dict(dim=0), ValueError, "positive even"),
        (dict(dim=16, rotary_dim=18), ValueError, "rotary_dim"),
        (dict(dim=16, max_seq_len=0), ValueError, "max_seq_len"),
    ],
)
def test_constructor_errors(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        RotaryEmbedding(**kwargs)


@pytest.mark.parametrize(
    "q, k, call, match",
    [
        (torch.randn(2, 3, 16), torch.randn(2, 4, 16), {}, "same sequence length"),
        (torch.randn(2, 3, 8), torch.randn(2, 3, 8), {}, "dim=16"),
        (torch.randn(16), torch.randn(16), {}, r"\(\.\.\., seq_len, dim\)"),
        (torch.randn(2, 3, 16), torch.randn(3, 16), {}, "same rank"),
        (torch.randn(2, 3, 16), torch.randn(2, 3, 16), {"seq_dim": -1}, "seq_dim"),
        (torch.randn(2, 3, 16), torch.randn(2, 3, 16), {"offset": -1}, "offset"),
        (torch.randn(2, 3, 16), torch.randn(2, 3, 16), {"offset": torch.tensor([1, 2, 3])}, "offset tensor"),
        (torch.randn(2, 3, 16), torch.randn(2, 3, 16), {"position_ids": torch.zeros(2, 4, dtype=torch.long)}, "position_ids"),
        (torch.randn(2, 3, 16), torch.randn(2, 3, 16), {"position_ids": torch.zeros(3), "offset": 1}, "either"),
    ],
)
def test_forward_errors(q, k, call, match):
    rope = RotaryEmbedding(dim=16)
    with pytest.raises(ValueError, match=match):
        rope(q, k, **call)


def test_integer_input_is_type_error():
    rope = RotaryEmbedding(dim=16)
    with pytest.raises(TypeError, match="floating-point"):
        rope(torch.ones(2, 16, dtype=torch.long), torch.ones(2, 16, dtype=torch.long))


@settings(max_examples=20, deadline=None)
@given(
    lead=st.lists(st.integers(1, 3), min_size=0, max_size=2),
    seq=st.integers(1, 17),
    half=st.integers(1, 16),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    offset=st.integers(0, 100),
)
def test_module_property(lead, seq, half, dtype, offset):
    rope = RotaryEmbedding(dim=2 * half, max_seq_len=8)
    q = torch.randn(*lead, seq, 2 * half).to(dtype)
    qo, ko = rope(q, q, offset=offset)
    assert qo.shape == q.shape and qo.dtype == dtype
    tol = dict(TOL[dtype])
    tol["atol"] += 2 * (offset + seq) * 2**-24 * q.abs().max().item()
    torch.testing.assert_close(qo.double(), rope_oracle(q, torch.arange(offset, offset + seq), rope.inv_freq), **tol)


# ------------------------------------------------------------------------------------------
# bad inputs: a clear error naming what was expected and what was given
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(dim=16, base=0), ValueError, r"base must be a finite number > 0, got 0"),
        (dict(dim=16, base=-10000), ValueError, r"base must be a finite number > 0, got -10000"),
        (dict(dim=16, base=float("nan")), ValueError, r"base must be a finite number > 0, got nan"),
        (dict(dim=16, base=float("inf")), ValueError, r"base must be a finite number > 0, got inf"),
        (dict(dim=16, base="10000"), TypeError, r"base must be a real number.*got str"),
        (dict(dim=16, base=True), TypeError, r"base must be a real number.*got bool"),
        (dict(dim=-2), ValueError, "positive even int, got -2"),
        (dict(dim=16, max_seq_len=-1), ValueError, "max_seq_len must be a positive int, got -1"),
        (dict(dim=16, max_seq_len=True), ValueError, "max_seq_len must be a positive int, got True"),
        (dict(dim=16, rope_parameters={"rope_type": "default", "rope_theta": 0.0}), ValueError, r"rope_theta'\] must be"),
        (dict(dim=16, rope_parameters={"rope_type": "linear", "factor": 0.0}), ValueError, r"'factor'\] must be a finite number > 0, got 0.0"),
    ],
)
def test_constructor_rejects_bad_base_and_sizes(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        RotaryEmbedding(**kwargs)


def test_valid_bases_give_finite_frequencies():
    for base in (10000, 500000.0, 2, 1.5):
        rope = RotaryEmbedding(dim=16, base=base)
        assert torch.isfinite(rope.inv_freq).all() and torch.isfinite(rope.cos_cached).all()


@pytest.mark.parametrize(
    "call",
    [dict(offset=torch.tensor([0, 1])), dict(position_ids=torch.tensor([[0, 1, 2], [3, 4, 5]]))],
    ids=["offset tensor", "position_ids (b, s)"],
)
@pytest.mark.parametrize("k_batch", [1, 3])
def test_per_sequence_positions_need_matching_batch(call, k_batch):
    """k is neither broadcast to q's batch (k batch 1) nor failing deep in torch (k batch 3)."""
    rope = RotaryEmbedding(dim=8)
    q, k = torch.randn(2, 3, 8), torch.randn(k_batch, 3, 8)
    with pytest.raises(ValueError, match=rf"same batch size.*q \(2, 3, 8\) and k \({k_batch}, 3, 8\)"):
        rope(q, k, **call)


def test_per_sequence_positions_with_gqa_heads():
    """Per-sequence positions: the batch must match, the heads may differ."""
    rope = RotaryEmbedding(dim=8)
    q, k = torch.randn(2, 4, 3, 8), torch.randn(2, 2, 3, 8)
    offsets = torch.tensor([0, 5])
    qo, ko = rope(q, k, offset=offsets)
    assert qo.shape == q.shape and ko.shape == k.shape
    for b in range(2):
        positions = torch.arange(offsets[b], offsets[b] + 3)
        torch.testing.assert_close(ko[b].double(), rope_oracle(k[b], positions, rope.inv_freq), **TOL[torch.float32])


def test_shared_positions_allow_different_leading_dims():
    """Documented: with an int offset (or (s,)/(1, s) position_ids) each tensor is rotated on its own."""
    rope = RotaryEmbedding(dim=8)
    q, k = torch.randn(2, 3, 8), torch.randn(3, 3, 8)
    for call in (dict(offset=4), dict(position_ids=torch.arange(4, 7)), dict(position_ids=torch.arange(4, 7)[None])):
        qo, ko = rope(q, k, **call)
        assert qo.shape == q.shape and ko.shape == k.shape
        torch.testing.assert_close(ko.double(), rope_oracle(k, torch.arange(4, 7), rope.inv_freq), **TOL[torch.float32])


def test_unbatched_inputs_and_per_sequence_positions():
    """(s, d) inputs have no batch dim: an offset tensor or (b, s) position_ids are rejected (they
    used to broadcast into an (s, s, d) or (1, s, d) output); (1, s) position_ids act as (s,)."""
    rope = RotaryEmbedding(dim=8)
    q = torch.randn(3, 8)
    with pytest.raises(ValueError, match=r"needs q and k with a batch dim.*got q \(3, 8\)"):
        rope(q, q, offset=torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match=r"need q and k with a batch dim.*got q \(3, 8\)"):
        rope(q, q, position_ids=torch.zeros(3, 3, dtype=torch.long))
    qo, _ = rope(q, q, position_ids=torch.tensor([[2, 3, 4]]))
    assert qo.shape == (3, 8)
    torch.testing.assert_close(qo.double(), rope_oracle(q, torch.arange(2, 5), rope.inv_freq), **TOL[torch.float32])


def test_devices_must_match():
    rope = RotaryEmbedding(dim=8)
    q = torch.randn(2, 3, 8)
    with pytest.raises(ValueError, match="q and k must be on one device, got q on cpu and k on meta"):
        rope(q, q.to("meta"))
    with pytest.raises(ValueError, match="q and k must be on one device, got q on cpu and k on meta"):
        rope(q, q.to("meta"), offset=torch.tensor([0, 1]))
    meta_rope = RotaryEmbedding(dim=8, device="meta")
    with pytest.raises(ValueError, match=r"q and k are on cpu but this RotaryEmbedding's buffers are on meta"):
        meta_rope(q, q)
    with pytest.raises(ValueError, match="position_ids is on the meta device"):
        rope(q, q, position_ids=torch.arange(3, device="meta"))
    with pytest.raises(ValueError, match="offset tensor is on the meta device"):
        rope(q, q, offset=torch.arange(2, device="meta"))


@pytest.mark.parametrize(
    "call, match",
    [
        (dict(offset=torch.tensor([3, -1])), "offset tensor must be non-negative, got a minimum of -1"),
        (dict(position_ids=torch.tensor([-2, 0, 1])), "position_ids must be non-negative, got a minimum of -2"),
        (dict(position_ids=torch.tensor([[0, 1, 2], [0, -5, 1]])), "position_ids must be non-negative, got a minimum of -5"),
    ],
)
def test_negative_tensor_positions_rejected_on_cpu(call, match):
    rope = RotaryEmbedding(dim=8)
    q = torch.randn(2, 3, 8)
    with pytest.raises(ValueError, match=match):
        rope(q, q, **call)


def test_tensor_positions_off_cpu_are_not_read():
    """Off the CPU positions are not checked (no host sync): on meta tensors (no values) it runs."""
    rope = RotaryEmbedding(dim=8, device="meta")
    q = torch.randn(2, 3, 8, device="meta")
    for call in (dict(offset=torch.tensor([0, 1], device="meta")), dict(position_ids=torch.arange(3, device="meta"))):
        qo, ko = rope(q, q, **call)
        assert qo.is_meta and qo.shape == q.shape


@pytest.mark.parametrize(
    "call, exc, match",
    [
        (dict(offset=True), ValueError, "non-negative int or a"),
        (dict(offset=torch.tensor([True, False])), ValueError, r"offset tensor must be integer \(b,\) with b=2, got torch.bool"),
        (dict(position_ids=torch.ones(3, dtype=torch.bool)), ValueError, r"position_ids must be integer.*torch.bool"),
        (dict(position_ids=[0, 1, 2]), TypeError, "position_ids must be an integer tensor.*got list"),
        (dict(seq_dim="1"), TypeError, "seq_dim must be an int, got str"),
    ],
)
def test_forward_argument_types(call, exc, match):
    rope = RotaryEmbedding(dim=8)
    q = torch.randn(2, 3, 8)
    with pytest.raises(exc, match=match):
        rope(q, q, **call)


