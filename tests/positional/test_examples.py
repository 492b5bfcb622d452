"""Every example of the API reference (positional.md), run as written."""

import math

import pytest
import torch



def test_rotary_basic_usage_llama_style():
    from torchembed.positional import RotaryEmbedding

    rope = RotaryEmbedding(dim=128, base=500000)
    q = torch.randn(2, 8, 64, 128)  # (batch, heads, seq, dim)
    k = torch.randn(2, 8, 64, 128)
    q, k = rope(q, k)
    assert q.shape == k.shape == (2, 8, 64, 128)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused example needs a CUDA device")
def test_rotary_fused_example_gpu():
    from torchembed.positional import RotaryEmbedding

    q = torch.randn(2, 8, 64, 128)
    k = torch.randn(2, 8, 64, 128)
    rope = RotaryEmbedding(dim=128, use_fused=True).to("cuda")
    q, k = rope(q.cuda(), k.cuda())
    assert q.is_cuda and k.is_cuda


def test_alibi_example():
    from torchembed.positional import ALiBiEmbedding

    head_dim = 16
    q, k = torch.randn(2, 8, 10, head_dim), torch.randn(2, 8, 10, head_dim)
    alibi = ALiBiEmbedding(num_heads=8)
    scores = q @ k.transpose(-2, -1) / math.sqrt(head_dim)
    scores = alibi(scores)
    weights = scores.softmax(-1)
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 8, 10))


def test_learned_kv_cache_example():
    from torchembed.positional import LearnedPositionalEmbedding

    emb = LearnedPositionalEmbedding(max_seq_len=4096, dim=768)
    x = torch.randn(2, 128, 768)
    out = emb(x)  # positions 0..127
    torch.testing.assert_close(out, x + emb.weight[:128])
    prompt_len, total_len = 5, 8
    for step in range(prompt_len, total_len):
        x = torch.randn(2, 1, 768)
        out = emb(x, offset=step)  # position = step
        torch.testing.assert_close(out, x + emb.weight[step])


def test_sinusoidal_usage():
    from torchembed.positional import SinusoidalEmbedding

    emb = SinusoidalEmbedding(dim=64)
    x = torch.randn(2, 10, 64)
    assert emb(x).shape == x.shape
