import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers import TOL, max_err, rope_oracle
from torchembed.functional import apply_rotary, rope_cos_sin, rope_inv_freq, rope_positions

transformers = pytest.importorskip("transformers")

ROPE_CASES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32},
    "yarn_mscale": {
        "rope_type": "yarn", "rope_theta": 50000.0, "factor": 8.0, "original_max_position_embeddings": 32,
        "mscale": 0.707, "mscale_all_dim": 1.0, "beta_fast": 16, "beta_slow": 2,
    },
    "longrope": {
        "rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 32,
        "long_factor": [1.0 + i / 8 for i in range(8)], "short_factor": [1.0 + i / 32 for i in range(8)],
    },
    "llama3": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 16,
    },
}


def _hf_config(params, max_pos=128):
    return transformers.LlamaConfig(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_pos,
        rope_parameters=dict(params),
    )


@pytest.mark.parametrize("name", sorted(ROPE_CASES))
@pytest.mark.parametrize("seq_len", [None, 100, 400])
def test_inv_freq_matches_transformers(name, seq_len):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    params = ROPE_CASES[name]
    config = _hf_config(params)
    if params["rope_type"] == "default":
        hf_inv, hf_scale = LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    else:
        hf_inv, hf_scale = ROPE_INIT_FUNCTIONS[params["rope_type"]](config, None, seq_len=seq_len)
    ours, scale = rope_inv_freq(16, rope_parameters=params, max_position_embeddings=128, seq_len=seq_len)
    assert ours.dtype == torch.float32 and ours.shape == (8,)
    torch.testing.assert_close(ours, hf_inv, rtol=0, atol=0)  # bit-identical angles
    assert scale == pytest.approx(hf_scale, rel=1e-12)


def test_inv_freq_default_is_theta_progression():
    inv, scale = rope_inv_freq(8, base=10000.0)
    expected = torch.tensor([10000.0 ** (-i / 8) for i in range(0, 8, 2)])
    torch.testing.assert_close(inv, expected)
    assert scale == 1.0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(dim=7), "positive even"),
        (dict(dim=0), "positive even"),
        (dict(dim=8, rope_parameters={"rope_type": "nope"}), "unknown rope_type"),
        (dict(dim=8, rope_parameters={"rope_type": "llama3", "factor": 8.0}), "low_freq_factor"),
    ],
)
def test_inv_freq_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        rope_inv_freq(**kwargs)


def test_cos_sin_match_hf_rotary_module_fp32():
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = _hf_config(ROPE_CASES["yarn"])
    hf = LlamaRotaryEmbedding(config)
    position_ids = torch.randint(0, 128, (2, 9))
    x = torch.randn(2, 9, 64)
    hf_cos, hf_sin = hf(x, position_ids)
    inv, scale = rope_inv_freq(16, rope_parameters=ROPE_CASES["yarn"], max_position_embeddings=128)
    cos, sin = rope_cos_sin(inv, position_ids, scale)
    torch.testing.assert_close(torch.cat((cos, cos), -1), hf_cos, rtol=0, atol=0)
    torch.testing.assert_close(torch.cat((sin, sin), -1), hf_sin, rtol=0, atol=0)


def test_apply_rotary_is_bitwise_hf_in_fp32():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    q, k = torch.randn(2, 4, 7, 16), torch.randn(2, 2, 7, 16)
    inv, _ = rope_inv_freq(16)
    cos, sin = rope_cos_sin(inv, torch.arange(7)[None].expand(2, 7))
    hf_q, hf_k = apply_rotary_pos_emb(q, k, torch.cat((cos, cos), -1), torch.cat((sin, sin), -1))
    ours_q = apply_rotary(q, cos[:, None], sin[:, None])
    ours_k = apply_rotary(k, cos[:, None], sin[:, None])
    assert torch.equal(ours_q, hf_q) and torch.equal(ours_k, hf_k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rotary_dim", [32, 16])
def test_apply_rotary_vs_float64(dtype, interleaved, rotary_dim):
    x = torch.randn(2, 3, 11, 32).to(dtype)
    inv, _ = rope_inv_freq(rotary_dim, base=500000.0)
    positions = torch.arange(5, 16)
    cos, sin = rope_cos_sin(inv, positions)
    out = apply_rotary(x, cos, sin, interleaved=interleaved)
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out.double(), rope_oracle(x, positions, inv, interleaved=interleaved), **TOL[dtype])
    assert torch.equal(out[..., rotary_dim:], x[..., rotary_dim:])  # pass-through untouched


def test_bf16_reference_at_least_as_accurate_as_hf():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    torch.manual_seed(0)
    q = torch.randn(4, 8, 256, 128).bfloat16()
    inv, _ = rope_inv_freq(128, base=500000.0)
    positions = torch.arange(1000, 1256)
    cos, sin = rope_cos_sin(inv, positions)
    truth = rope_oracle(q, positions, inv)
    hf_q, _ = apply_rotary_pos_emb(q, q, torch.cat((cos, cos), -1).bfloat16()[None], torch.cat((sin, sin), -1).bfloat16()[None])
    ours = apply_rotary(q, cos, sin)
    assert max_err(ours, truth) <= max_err(hf_q, truth)
    assert (ours.double() - truth).abs().mean() < (hf_q.double() - truth).abs().mean()


def test_conjugate_inverts():
    x = torch.randn(3, 5, 24, dtype=torch.float64)
    inv, _ = rope_inv_freq(24)
    cos, sin = rope_cos_sin(inv, torch.arange(5))
    back = apply_rotary(apply_rotary(x, cos.double(), sin.double()), cos.double(), sin.double(), conjugate=True)
    torch.testing.assert_close(back, x)


def test_relative_position_property():
    """<R_m q, R_n k> depends only on m - n."""
    q, k = torch.randn(64, dtype=torch.float64), torch.randn(64, dtype=torch.float64)
    inv, _ = rope_inv_freq(64)

    def rotate(x, m):
        cos, sin = rope_cos_sin(inv.double(), torch.tensor([m]))
        return apply_rotary(x[None], cos, sin)[0]

    base = rotate(q, 7) @ rotate(k, 3)
    for shift in (1, 50, 1000):
        assert rotate(q, 7 + shift) @ rotate(k, 3 + shift) == pytest.approx(base.item(), rel=1e-9, abs=1e-9)


def test_rope_positions():
    assert torch.equal(rope_positions(3, 4), torch.tensor([3, 4, 5, 6]))
    assert torch.equal(rope_positions(torch.tensor([0, 2]), 2), torch.tensor([[0, 1], [2, 3]]))
    with pytest.raises(ValueError, match="1-D integer"):
        rope_positions(torch.tensor([[1]]), 2)


def test_apply_rotary_errors():
    x = torch.randn(2, 8)
    cos = torch.randn(2, 8)
    with pytest.raises(ValueError, match="exceeds"):
        apply_rotary(x, cos, cos)
    with pytest.raises(ValueError, match="one shape"):
        apply_rotary(x, cos[:, :2], cos[:, :3])


@settings(max_examples=25, deadline=None)
@given(
    batch=st.integers(1, 3),
    seq=st.integers(1, 20),
    half=st.integers(1, 12),
    extra=st.integers(0, 6),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    interleaved=st.booleans(),
    offset=st.integers(0, 5000),
)
def test_apply_rotary_property(batch, seq, half, extra, dtype, interleaved, offset):
    x = torch.randn(batch, seq, 2 * (half + extra)).to(dtype)
    inv, _ = rope_inv_freq(2 * half)
    positions = torch.arange(offset, offset + seq)
    cos, sin = rope_cos_sin(inv, positions)
    out = apply_rotary(x, cos, sin, interleaved=interleaved)
    # float32 angles pos * theta carry a rounding error of up to pos * 2^-24 rad (HF's tables too),
    # which moves a rotated value by at most that times |x|.
    tol = dict(TOL[dtype])
    tol["atol"] += 2 * (offset + seq) * 2**-24 * x.abs().max().item()
    torch.testing.assert_close(out.double(), rope_oracle(x, positions, inv, interleaved=interleaved), **tol)
    # rotation preserves the norm of the rotated part
    rot = 2 * half
    n_in = x[..., :rot].double().norm(dim=-1)
    n_out = out[..., :rot].double().norm(dim=-1)
    torch.testing.assert_close(n_out, n_in, **TOL[dtype])


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(dim=8, base=0), ValueError, r"base must be a finite number > 0, got 0"),
        (dict(dim=8, base=-1.0), ValueError, r"base must be a finite number > 0, got -1.0"),
        (dict(dim=8, base=float("nan")), ValueError, r"base must be a finite number > 0, got nan"),
        (dict(dim=8, base=float("-inf")), ValueError, r"base must be a finite number > 0, got -inf"),
        (dict(dim=8, base=None), TypeError, r"base must be a real number.*got NoneType"),
        (dict(dim=8, rope_parameters={"rope_theta": 0}), ValueError, r"rope_parameters\['rope_theta'\] must be a finite number > 0"),
        (dict(dim=8, rope_parameters={"rope_type": "linear", "factor": -2.0}), ValueError, r"'factor'\] must be a finite number > 0, got -2.0"),
        (dict(dim=8, rope_parameters={"rope_type": "dynamic", "factor": float("nan")}), ValueError, r"'factor'\] must be"),
        (dict(dim=8, base=1, rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}),
         ValueError, r"'yarn' needs base \(rope_theta\) != 1, got 1.0"),
        (dict(dim=8, rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0, "high_freq_factor": 2.0,
                                      "original_max_position_embeddings": 16}), ValueError, "low_freq_factor != high_freq_factor"),
        (dict(dim=8, rope_parameters="llama3"), TypeError, "rope_parameters must be a mapping"),
    ],
)
def test_inv_freq_rejects_bad_base_and_parameters(kwargs, exc, match):
    """Each of these gave NaN/inf frequencies silently (or failed deep in math/torch)."""
    with pytest.raises(exc, match=match):
        rope_inv_freq(**kwargs)


def test_inv_freq_rope_theta_wins_over_base_and_is_checked():
    inv, _ = rope_inv_freq(8, 0.0, {"rope_theta": 10000.0})  # the argument is replaced, not used
    torch.testing.assert_close(inv, rope_inv_freq(8, 10000.0)[0])


def test_rope_positions_rejects_negative_and_non_integer_offsets():
    with pytest.raises(ValueError, match="offset tensor must be non-negative, got a minimum of -3"):
        rope_positions(torch.tensor([0, -3]), 2)
    with pytest.raises(ValueError, match="non-negative int or a 1-D integer tensor, got -1"):
        rope_positions(-1, 2)
    with pytest.raises(ValueError, match="non-negative int or a 1-D integer tensor, got 1.5"):
        rope_positions(1.5, 2)
    with pytest.raises(ValueError, match="1-D integer"):
        rope_positions(torch.tensor([True, False]), 2)
    # off the CPU the offsets are not read (no host sync): meta tensors have no values
    assert rope_positions(torch.tensor([0, -3], device="meta"), 2).shape == (2, 2)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_rotary_full_tables_each_feature_its_own_entry(interleaved, dtype):
    """Full-width rows (HF's cat / repeat_interleave tables) whose two entries of a pair differ:
    feature 2i (or i) by its own entries, against a float64 rotation written out pair by pair."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 5, 12, generator=gen).to(dtype)  # 8 rotated features, 4 passed through
    first, second = (torch.rand(5, 4, generator=gen, dtype=torch.float64) * 6 - 3 for _ in range(2))
    weave = (lambda a, b: torch.stack((a, b), -1).flatten(-2)) if interleaved else (lambda a, b: torch.cat((a, b), -1))
    cos, sin = weave(first.cos(), second.cos()), weave(first.sin(), second.sin())
    xd = x.double()
    x1, x2 = (xd[..., 0:8:2], xd[..., 1:8:2]) if interleaved else (xd[..., :4], xd[..., 4:8])
    y1 = x1 * first.cos() - x2 * first.sin()
    y2 = x2 * second.cos() + x1 * second.sin()
    want = torch.cat((weave(y1, y2), xd[..., 8:]), -1)
    out = apply_rotary(x, cos.float(), sin.float(), interleaved=interleaved, full=True)
    assert out.dtype == dtype
    # one rounding of float32 math: within half an ulp of the dtype (plus float32 table rounding)
    tol = 2 ** -8 if dtype == torch.bfloat16 else 1e-6
    torch.testing.assert_close(out.double(), want, rtol=tol, atol=tol * want.abs().max().item())
    # equal tables: the full form is the half form
    same = weave(first.cos(), first.cos()).float(), weave(first.sin(), first.sin()).float()
    torch.testing.assert_close(apply_rotary(x, *same, interleaved=interleaved, full=True),
                               apply_rotary(x, first.cos().float(), first.sin().float(), interleaved=interleaved), rtol=0, atol=0)


def test_apply_rotary_float32_is_hf_arithmetic_bit_for_bit():
    """float32 inputs and HF's cat tables: q * cos + rotate_half(q) * sin, the same bits."""
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(2, 4, 7, 16, generator=gen)
    theta = torch.rand(7, 8, generator=gen) * 6 - 3
    cos, sin = torch.cat((theta, theta), -1).cos(), torch.cat((theta, theta), -1).sin()
    rotate_half = torch.cat((-q[..., 8:], q[..., :8]), -1)
    assert torch.equal(apply_rotary(q, cos, sin, full=True), q * cos + rotate_half * sin)
