import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from torchembed.functional import alibi_slopes
from torchembed.positional import ALiBiEmbedding


def test_no_parameters_and_empty_state_dict():
    alibi = ALiBiEmbedding(num_heads=8)
    assert list(alibi.parameters()) == [] and alibi.state_dict() == {}


def test_slopes_8_heads():
    torch.testing.assert_close(ALiBiEmbedding(8).slopes, torch.tensor([2.0 ** -(i + 1) for i in range(8)]))


def test_bias_is_nonpositive_with_zero_diagonal_and_linear():
    alibi = ALiBiEmbedding(num_heads=12, max_seq_len=16)
    scores = torch.zeros(2, 12, 10, 10)
    bias = alibi(scores)
    assert (bias <= 0).all()
    assert (torch.diagonal(bias, dim1=-2, dim2=-1) == 0).all()
    slopes = alibi_slopes(12)
    i, j = torch.meshgrid(torch.arange(10), torch.arange(10), indexing="ij")
    expected = -slopes[:, None, None] * (i - j).abs()
    torch.testing.assert_close(bias[1], expected)


def test_seq_q_shorter_than_seq_k_uses_last_positions():
    alibi = ALiBiEmbedding(num_heads=4)
    out = alibi(torch.zeros(1, 4, 1, 6))  # one decode step after 5 cached tokens
    torch.testing.assert_close(out[0, :, 0], -alibi.slopes[:, None] * torch.arange(5, -1, -1).float())


def test_extends_past_max_seq_len():
    alibi = ALiBiEmbedding(num_heads=2, max_seq_len=4)
    out = alibi(torch.zeros(1, 2, 9, 9))
    assert out[0, 0, 8, 0].item() == pytest.approx(-0.0625 * 8)


def test_adds_to_scores_and_keeps_dtype():
    alibi = ALiBiEmbedding(num_heads=4)
    scores = torch.randn(2, 4, 5, 5, dtype=torch.bfloat16)
    out = alibi(scores)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), scores.float() + alibi.bias(5, 5), atol=3e-2, rtol=1.6e-2)


def test_gradient_passes_through():
    alibi = ALiBiEmbedding(num_heads=3)
    scores = torch.randn(1, 3, 4, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(alibi, (scores,))


@pytest.mark.parametrize(
    "scores, exc, match",
    [
        (torch.zeros(1, 3, 4, 4), ValueError, "num_heads=4"),
        (torch.zeros(4, 4, 4), ValueError, "batch, heads, seq_q, seq_k"),
        (torch.zeros(1, 4, 5, 4), ValueError, "must not exceed"),
        (torch.zeros(1, 4, 4, 4, dtype=torch.long), TypeError, "floating-point"),
    ],
)
def test_forward_errors(scores, exc, match):
    with pytest.raises(exc, match=match):
        ALiBiEmbedding(num_heads=4)(scores)


@pytest.mark.parametrize("kwargs", [dict(num_heads=0), dict(num_heads=4, max_seq_len=0)])
def test_constructor_errors(kwargs):
    with pytest.raises(ValueError):
        ALiBiEmbedding(**kwargs)


@settings(max_examples=20, deadline=None)
@given(heads=st.integers(1, 20), sq=st.integers(1, 12), extra=st.integers(0, 12))
def test_property_matches_definition(heads, sq, extra):
    sk = sq + extra
    alibi = ALiBiEmbedding(num_heads=heads, max_seq_len=8)
    out = alibi(torch.zeros(1, heads, sq, sk))
    qpos = torch.arange(sk - sq, sk)[:, None]
    expected = -alibi_slopes(heads)[:, None, None] * (qpos - torch.arange(sk)[None]).abs()
    torch.testing.assert_close(out[0], expected)


def _naive_attention(q, k, v, bias, keep):
    scores = (q.double() @ k.double().transpose(-1, -2)) * q.shape[-1] ** -0.5 + bias.double()
    scores = scores.masked_fill(~keep, float("-inf"))
    return scores.softmax(-1) @ v.double()


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("seq_q, seq_k", [(7, 7), (1, 9), (3, 9)])
def test_attention_matches_scores_path(causal, seq_q, seq_k):
    alibi = ALiBiEmbedding(num_heads=6)
    q, k, v = torch.randn(2, 6, seq_q, 16), torch.randn(2, 6, seq_k, 16), torch.randn(2, 6, seq_k, 16)
    padding = torch.ones(2, seq_k, dtype=torch.bool)
    padding[1, :2] = False
    out = alibi.attention(q, k, v, causal=causal, key_padding_mask=padding)
    keep = padding[:, None, None, :].expand(2, 6, seq_q, seq_k)
    if causal:
        qpos = torch.arange(seq_k - seq_q, seq_k)[:, None]
        keep = keep & (torch.arange(seq_k)[None, :] <= qpos)
    expected = _naive_attention(q, k, v, alibi.bias(seq_q, seq_k)[None], keep)
    rows = keep.any(-1)  # padded queries with no key to attend to are undefined (NaN in the naive path)
    torch.testing.assert_close(out.double()[rows], expected[rows], atol=1e-5, rtol=1e-5)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("kv_heads", [1, 2])
@pytest.mark.parametrize("seq_q, seq_k", [(5, 5), (1, 9)])
def test_attention_gqa_equals_repeated_heads(causal, kv_heads, seq_q, seq_k):
    """GQA/MQA: query head i attends with key/value head i // (h / hk); outputs and gradients equal
    those of the same heads repeated (the multi-head path, itself checked against float64 above)."""
    torch.manual_seed(kv_heads)
    alibi = ALiBiEmbedding(num_heads=4)
    q = torch.randn(2, 4, seq_q, 16, requires_grad=True)
    k, v = (torch.randn(2, kv_heads, seq_k, 16, requires_grad=True) for _ in range(2))
    padding = torch.ones(2, seq_k, dtype=torch.bool)
    padding[1, :2] = False
    out = alibi.attention(q, k, v, causal=causal, key_padding_mask=padding)
    grad = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad)
    kr, vr = (x.detach().repeat_interleave(4 // kv_heads, 1).requires_grad_() for x in (k, v))
    ref = alibi.attention(q, kr, vr, causal=causal, key_padding_mask=padding)
    rq, rk, rv = torch.autograd.grad(ref, (q, kr, vr), grad)
    fold = lambda g: g.unflatten(1, (kv_heads, 4 // kv_heads)).sum(2)  # noqa: E731
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    for got, want in ((dq, rq), (dk, fold(rk)), (dv, fold(rv))):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_attention_bf16_is_closer_to_float64_than_bf16_scores_path():
    """The fused path keeps the bias exact near the diagonal; eager bf16 scores round it."""
    torch.manual_seed(0)
    alibi = ALiBiEmbedding(num_heads=4)
    q, k, v = (torch.randn(1, 4, 512, 32) for _ in range(3))
    qpos = torch.arange(512)[:, None]
    keep = (torch.arange(512)[None, :] <= qpos).expand(1, 4, 512, 512)
    truth = _naive_attention(q, k, v, alibi.bias(512, 512)[None], keep)
    ours = alibi.attention(q.bfloat16(), k.bfloat16(), v.bfloat16())
    scores = alibi((q.bfloat16() @ k.bfloat16().transpose(-1, -2)) * 32**-0.5)
    eager = scores.masked_fill(~keep, float("-inf")).float().softmax(-1).bfloat16() @ v.bfloat16()
    assert (ours.double() - truth).abs().mean() <= (eager.double() - truth).abs().mean()


def test_score_mod_equals_bias():
    alibi = ALiBiEmbedding(num_heads=3)
    mod = alibi.score_mod(offset=2)
    q_idx, kv_idx = torch.arange(4)[:, None], torch.arange(6)[None, :]
    for h in range(3):
        torch.testing.assert_close(mod(torch.zeros(4, 6), 0, h, q_idx, kv_idx), alibi.bias(4, 6)[h])


@pytest.mark.parametrize(
    "shapes, kwargs, match",
    [
        (((1, 3, 2, 8), (1, 3, 2, 8)), {}, "4 heads"),
        (((1, 4, 5, 8), (1, 4, 3, 8)), {}, "must not exceed"),
        (((1, 4, 2, 8), (1, 4, 3, 8)), {"key_padding_mask": torch.ones(1, 2, dtype=torch.bool)}, "key_padding_mask"),
    ],
)
def test_attention_errors(shapes, kwargs, match):
    q_shape, k_shape = shapes
    with pytest.raises(ValueError, match=match):
        ALiBiEmbedding(num_heads=4).attention(torch.randn(q_shape), torch.randn(k_shape), torch.randn(k_shape), **kwargs)


# ------------------------------------------------------------------------------------------
# bad inputs: a clear error naming what was expected and what was given, or defined behaviour
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("seq_k", [0, 3])
def test_attention_with_no_queries_is_empty(causal, seq_k):
    """seq_q = 0 (also with seq_k = 0, which raised IndexError): an empty (b, h, 0, d_v) result."""
    alibi = ALiBiEmbedding(num_heads=4)
    q = torch.randn(2, 4, 0, 8, requires_grad=True)
    k = torch.randn(2, 4, seq_k, 8, requires_grad=True)
    v = torch.randn(2, 4, seq_k, 6, requires_grad=True)
    out = alibi.attention(q, k, v, causal=causal)
    assert out.shape == (2, 4, 0, 6) and out.dtype == q.dtype
    out.sum().backward()
    assert q.grad.shape == q.shape and v.grad.shape == v.shape


@pytest.mark.parametrize("causal", [True, False])
def test_attention_integer_inputs_are_type_error(causal):
    alibi = ALiBiEmbedding(num_heads=4)
    x = torch.ones(1, 4, 3, 8, dtype=torch.long)
    with pytest.raises(TypeError, match="q must be a floating-point tensor, got torch.int64"):
        alibi.attention(x, x, x, causal=causal)
    with pytest.raises(TypeError, match="v must be a floating-point tensor, got torch.int64"):
        alibi.attention(x.float(), x.float(), x, causal=causal)
    with pytest.raises(TypeError, match="k must be a floating-point tensor, got list"):
        alibi.attention(x.float(), [1.0], x.float(), causal=causal)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(
    "shapes, match",
    [
        (((1, 4, 3, 8), (1, 4, 3, 4), (1, 4, 3, 4)), r"same head dim, got q \(1, 4, 3, 8\), k \(1, 4, 3, 4\)"),
        (((1, 4, 3, 8), (1, 4, 3, 8), (1, 4, 4, 8)), r"same sequence length seq_k, got .*v \(1, 4, 4, 8\)"),
        (((1, 4, 3, 8), (1, 3, 3, 8), (1, 3, 3, 8)), r"q's batch 1 and one head count dividing 4 \(GQA/MQA\), got .*k \(1, 3, 3, 8\)"),
        (((1, 4, 3, 8), (1, 2, 3, 8), (1, 4, 3, 8)), r"one head count dividing 4 \(GQA/MQA\), got .*v \(1, 4, 3, 8\)"),
        (((2, 4, 3, 8), (1, 4, 3, 8), (1, 4, 3, 8)), r"q's batch 2 .*, got .*k \(1, 4, 3, 8\)"),
        (((2, 4, 3, 8), (3, 4, 3, 8), (3, 4, 3, 8)), r"q's batch 2 .*, got .*k \(3, 4, 3, 8\)"),
        (((1, 4, 3, 8), (1, 4, 3, 8), (1, 4, 3)), r"\(batch, 4 heads, seq, dim\), got .*v \(1, 4, 3\)"),
    ],
)
def test_attention_shape_mismatches(shapes, match, causal):
    q, k, v = (torch.randn(s) for s in shapes)
    with pytest.raises(ValueError, match=match):
        ALiBiEmbedding(num_heads=4).attention(q, k, v, causal=causal)


def test_attention_dtype_device_and_argument_errors():
    alibi = ALiBiEmbedding(num_heads=4)
    q = torch.randn(1, 4, 3, 8)
    with pytest.raises(TypeError, match="one dtype, got torch.float32, torch.float64, torch.float32"):
        alibi.attention(q, q.double(), q)
    with pytest.raises(ValueError, match="one device, got cpu, meta, cpu"):
        alibi.attention(q, q.to("meta"), q)
    with pytest.raises(ValueError, match=r"dropout_p must be in \[0, 1\], got 1.5"):
        alibi.attention(q, q, q, dropout_p=1.5)
    with pytest.raises(ValueError, match="key_padding_mask must be on q's device cpu, got meta"):
        alibi.attention(q, q, q, key_padding_mask=torch.ones(1, 3, dtype=torch.bool, device="meta"))
    with pytest.raises(ValueError, match=r"key_padding_mask must be bool \(batch, seq_k\) = \(1, 3\), got list"):
        alibi.attention(q, q, q, key_padding_mask=[[True, True, True]])


def test_forward_device_and_bias_arguments():
    alibi = ALiBiEmbedding(num_heads=4)
    with pytest.raises(ValueError, match="attn_scores are on meta but this ALiBiEmbedding's buffers are on cpu"):
        alibi(torch.zeros(1, 4, 3, 3, device="meta"))
    with pytest.raises(ValueError, match="seq_q must be a non-negative int, got -1"):
        alibi.bias(-1, 3)
    with pytest.raises(ValueError, match="seq_k must be a non-negative int, got 2.0"):
        alibi.bias(1, 2.0)
    assert alibi(torch.zeros(2, 4, 0, 0)).shape == (2, 4, 0, 0)  # empty scores stay empty
    assert alibi.bias(0, 3).shape == (4, 0, 3)


@pytest.mark.parametrize(
    "scores, exc, match",
    [
        (torch.zeros(1, 4, 3), ValueError, r"\(batch, heads, seq_q, seq_k\), got shape \(1, 4, 3\)"),
        (torch.zeros(1, 1, 4, 3, 3), ValueError, r"\(batch, heads, seq_q, seq_k\), got shape \(1, 1, 4, 3, 3\)"),
        (torch.zeros(2, 8, 3, 3), ValueError, "attn_scores has 8 heads, this ALiBiEmbedding has num_heads=4"),
        ([[0.0]], TypeError, "attn_scores must be a floating-point tensor"),
    ],
)
def test_forward_wrong_rank_or_heads(scores, exc, match):
    with pytest.raises(exc, match=match):
        ALiBiEmbedding(num_heads=4)(scores)


def test_attention_with_no_queries_still_checks_the_padding_mask():
    alibi = ALiBiEmbedding(num_heads=4)
    q, k = torch.randn(1, 4, 0, 8), torch.randn(1, 4, 3, 8)
    with pytest.raises(ValueError, match=r"key_padding_mask must be bool \(batch, seq_k\) = \(1, 3\), got torch.bool \(1, 2\)"):
        alibi.attention(q, k, k, key_padding_mask=torch.ones(1, 2, dtype=torch.bool))
    out = alibi.attention(q, k, k, key_padding_mask=torch.ones(1, 3, dtype=torch.bool))
    assert out.shape == (1, 4, 0, 8)
