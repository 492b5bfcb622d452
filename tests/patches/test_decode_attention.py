"""A patched RoPE model's decode steps: the split-key kernel, decided per call, for that model only.

On the CPU the kernel's route is exercised with its PyTorch implementation standing in for the GPU
(``gpu_route``); under ``TRITON_INTERPRET=1`` or on CUDA the Triton kernel runs."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import transformers

import torchembed
from torchembed.kernels import route
from torchembed.patches.rope import decode_attention as attention


def _llama(**overrides):
    config = transformers.LlamaConfig(**{"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
                                         "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 96,
                                         "attn_implementation": "sdpa", **overrides})
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


@pytest.fixture
def route_on_cpu(kernel_route_on_cpu):
    """The decode route on CPU tensors (the kernel's PyTorch implementation)."""


@pytest.fixture
def gpu_route(route_on_cpu, monkeypatch):
    """The decode route on CPU tensors, its calls counted."""
    calls, original = [], attention.fused_attention
    monkeypatch.setattr(attention, "fused_attention", lambda *a, **kw: calls.append(a[0].shape) or original(*a, **kw))
    return calls


def _generate(model, ids, mask, **kwargs):
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=5, min_new_tokens=5, do_sample=False,
                              pad_token_id=0, output_scores=True, return_dict_in_generate=True, **kwargs)


@pytest.mark.parametrize("padded", [False, True])
def test_decode_steps_take_the_kernel_and_match_upstream(padded, gpu_route):
    """generate(): every decode step of every layer runs the kernel route (none of upstream's SDPA), with
    upstream's tokens and scores (float32, within rounding)."""
    upstream = _llama()
    patched = torchembed.patch(copy.deepcopy(upstream))
    ids = torch.randint(1, 96, (2, 20), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    if padded:
        mask[0, :5] = 0
    want, got = _generate(upstream, ids, mask), _generate(patched, ids, mask)
    assert torch.equal(want.sequences, got.sequences)
    for a, b in zip(want.scores, got.scores):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    decode_calls = [shape for shape in gpu_route if shape[2] == 1]
    assert len(decode_calls) == 4 * 2  # 4 decode steps x 2 layers
    assert len(gpu_route) == len(decode_calls)  # the 20-token prefill: upstream's SDPA


@pytest.mark.parametrize("q_len, padded", [(1, False), (1, True), (3, True)])
def test_decode_attention_matches_float64(q_len, padded, gpu_route):
    """The route's output for one call (grouped heads, HF's (b, s, h, d) memory viewed as (b, h, s, d), a
    padding mask or none) against float64, within float32 rounding; upstream's layout (b, q, h, d)."""
    gen = torch.Generator().manual_seed(2)
    b, h, hk, n, d = 2, 8, 2, 37, 16
    q = torch.randn(b, q_len, h, d, generator=gen).transpose(1, 2)
    k, v = (torch.randn(b, n, hk, d, generator=gen).transpose(1, 2) for _ in range(2))
    keep = None
    if padded:
        positions = torch.arange(n)
        keep = (positions <= positions[n - q_len:, None])[None, None].expand(b, 1, q_len, n).clone()
        keep[0, :, :, :6] = False
    upstream = attention._upstream_sdpa()
    out, weights = attention.DecodeAttention(upstream, None)(None, q, k, v, keep, scaling=0.3)
    assert weights is None and out.shape == (b, q_len, h, d) and len(gpu_route) == 1
    scores = (q.double() @ k.double().repeat_interleave(h // hk, 1).transpose(-1, -2)) * 0.3
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    truth = scores.softmax(-1) @ v.double().repeat_interleave(h // hk, 1)
    torch.testing.assert_close(out.double(), truth.transpose(1, 2), atol=2e-6, rtol=2e-6)


def test_upstream_keeps_its_functions_and_cudnn_decode_leaves_them(gpu_route):
    """The route is the patched instance's only: an unpatched model beside it, a model patched with
    ``cudnn_decode=True`` and transformers' own table never reach it; unpatch restores upstream's."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.models.llama import modeling_llama

    upstream = _llama()
    patched = torchembed.patch(copy.deepcopy(upstream))
    kept = torchembed.patch(copy.deepcopy(upstream), cudnn_decode=True)
    assert modeling_llama.ALL_ATTENTION_FUNCTIONS is ALL_ATTENTION_FUNCTIONS
    assert not isinstance(ALL_ATTENTION_FUNCTIONS["sdpa"], attention.DecodeAttention)
    ids = torch.randint(1, 96, (1, 8))
    for model in (upstream, kept):
        _generate(model, ids, torch.ones_like(ids))
    assert not gpu_route
    _generate(patched, ids, torch.ones_like(ids))
    assert gpu_route
    torchembed.unpatch(patched)
    gpu_route.clear()
    _generate(patched, ids, torch.ones_like(ids))
    assert not gpu_route


def test_fused_false_never_takes_the_kernel(gpu_route):
    patched = torchembed.patch(_llama(), fused=False)
    ids = torch.randint(1, 96, (1, 8))
    _generate(patched, ids, torch.ones_like(ids))
    assert not gpu_route


def test_the_route_gives_the_kernel_the_decode_steps_it_computes_as_upstream(route_on_cpu):
    """``decode_attention_on_kernel`` (fused=None): decode steps (``decode_step``) that the kernel computes as
    upstream's SDPA does; everything else stays upstream's."""
    q, k = torch.randn(2, 4, 1, 16), torch.randn(2, 2, 30, 16)
    keep = torch.ones(2, 1, 1, 30, dtype=torch.bool)

    def on(*args):
        return route.decode_attention_on_kernel(None, *args)

    assert on(q, k, k, None, 0.0, {})
    assert on(q, k, k, keep, 0.0, {"position_ids": None, "cache_position": torch.zeros(1)})
    assert on(q.expand(2, 4, 3, 16), k, k, keep.expand(2, 1, 3, 30), 0.0, {})  # a few queries
    assert not on(q.expand(2, 4, 3, 16), k, k, None, 0.0, {})  # (upstream: causal from the start)
    assert not on(q.expand(2, 4, 17, 16), k, k, keep.expand(2, 1, 17, 30), 0.0, {})  # a prefill
    assert not on(q, k, k, keep, 0.1, {})  # dropout
    assert not on(q, k, k, keep.float(), 0.0, {})  # an additive mask
    assert not on(q, k, k, keep[..., :29], 0.0, {})
    assert not on(q, k, k, keep, 0.0, {"softcap": 50.0})  # changes upstream's function
    assert not on(q, k, k, keep, 0.0, {"position_bias": torch.zeros(1)})
    assert on(q, k, k, keep, 0.0, {"softcap": None})
    assert not on(q, k[..., :8], k, keep, 0.0, {})  # head dims differ
    assert not on(q.double(), k.double(), k.double(), keep, 0.0, {})
    assert not on(q, torch.randn(2, 3, 30, 16), torch.randn(2, 3, 30, 16), keep, 0.0, {})
    assert not route.decode_attention_on_kernel(False, q, k, k, keep, 0.0, {})
    # a static cache's prompt (several queries, no mask: the first keys) is a prefill, upstream's under fused=True too
    assert not route.decode_attention_on_kernel(True, q.expand(2, 4, 3, 16), k, k, None, 0.0, {})


def test_the_table_reads_as_upstreams_and_pickles():
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    table = attention.AttentionFunctions.get_for(ALL_ATTENTION_FUNCTIONS, None)
    assert attention.AttentionFunctions.get_for(ALL_ATTENTION_FUNCTIONS, None) is table
    assert isinstance(table["sdpa"], attention.DecodeAttention)
    assert isinstance(table.get_interface("sdpa", None), attention.DecodeAttention)
    assert table.get_interface("eager", "fallback") == "fallback"
    assert set(table) == set(ALL_ATTENTION_FUNCTIONS) and "sdpa" in table and len(table) == len(ALL_ATTENTION_FUNCTIONS)
    assert pickle.loads(pickle.dumps(table)) is table
    assert pickle.loads(pickle.dumps(attention.AttentionFunctions.get_for(ALL_ATTENTION_FUNCTIONS, False))).fused is False


def test_a_patched_model_pickles_and_copies_with_its_route(gpu_route):
    patched = torchembed.patch(_llama())
    ids = torch.randint(1, 96, (1, 8))
    for twin in (copy.deepcopy(patched), pickle.loads(pickle.dumps(patched))):
        gpu_route.clear()
        _generate(twin, ids, torch.ones_like(ids))
        assert len(gpu_route) == 4 * 2


def test_compiled_static_cache_decode_is_one_graph_with_the_kernel(route_on_cpu):
    """HF's fast path (a static cache, ``torch.compile(fullgraph=True)``): six decode steps compile into one
    graph (no recompilation as the cache fills: its mask and positions are tensors), which holds the
    split-key kernel's custom op once per layer (the mask summary beside it: no Python-side state in a
    graph), and give upstream's logits."""
    from transformers import StaticCache

    upstream = _llama()
    patched = torchembed.patch(copy.deepcopy(upstream))
    ids = torch.randint(1, 96, (1, 10), generator=torch.Generator().manual_seed(3))
    graphs = []

    def backend(gm, inputs):
        graphs.append(gm)
        return gm.forward

    def decode(model, compiled):
        cache = StaticCache(config=model.config, max_cache_len=32)
        with torch.no_grad():
            out = model(ids, past_key_values=cache, cache_position=torch.arange(10), use_cache=True)
            step = torch.compile(model, backend=backend, fullgraph=True) if compiled else model
            logits = []
            for i in range(10, 16):
                out = step(out.logits[:, -1:].argmax(-1), past_key_values=cache, cache_position=torch.tensor([i]),
                           use_cache=True)
                logits.append(out.logits)
        return torch.cat(logits)

    want, got = decode(upstream, False), decode(patched, True)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    ops = [str(node.target) for gm in graphs for node in gm.graph.nodes if node.op == "call_function"]
    assert len(graphs) == 1
    assert sum("torchembed.alibi_flash" in op for op in ops) == patched.config.num_hidden_layers


@pytest.mark.slow
def test_compiled_decode_step_summarises_the_mask_without_launches_of_its_own(route_on_cpu):
    """Inside ``torch.compile`` the mask summary is tensor ops, which inductor fuses into the kernels around it: the
    step's only library calls are the attention's, one per layer (the summary as a custom op of its own was one
    more launch per layer: 32 of 15 us in a 64k-key step of LLaMA-3.1-8B on an H100)."""
    import re

    from torch._inductor.utils import run_and_get_code
    from transformers import StaticCache

    patched = torchembed.patch(_llama(num_hidden_layers=3))
    ids = torch.randint(1, 96, (1, 10), generator=torch.Generator().manual_seed(3))
    cache = StaticCache(config=patched.config, max_cache_len=32)
    with torch.no_grad():
        patched(ids, past_key_values=cache, cache_position=torch.arange(10), use_cache=True)
        step = torch.compile(lambda t, i: patched(t, past_key_values=cache, cache_position=i, use_cache=True).logits,
                             fullgraph=True)
        _, code = run_and_get_code(step, ids[:, -1:], torch.tensor([10]))
    library_calls = re.findall(r"torch\.ops\.torchembed\.(\w+)\.default\(", "\n".join(code))
    assert library_calls == ["alibi_flash"] * 3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_decode_attention_never_synchronises_with_the_host():
    """The route's call (mask summary, plan, launches) makes no host synchronisation (what CUDA graphs and a
    host running ahead need): CUDA's sync debug mode raises on one."""
    q = torch.randn(2, 8, 1, 64, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, 2, 300, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    keep = torch.ones(2, 1, 1, 300, dtype=torch.bool, device="cuda")
    keep[0, ..., :40] = False
    route = attention.DecodeAttention(attention._upstream_sdpa(), None)
    route(None, q, k, v, keep)  # (first call: compiles)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            out, _ = route(None, q, k, v, keep)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(out).all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_compiled_static_cache_decode_matches_eager():
    """HF's fast path (static cache, torch.compile with CUDA graphs): the patched model compiles with the
    kernel inside, decodes the tokens its eager self decodes, and compiles once as the cache fills."""
    config = transformers.LlamaConfig(hidden_size=512, intermediate_size=1024, num_attention_heads=4,
                                      num_key_value_heads=2, num_hidden_layers=2, vocab_size=256,
                                      attn_implementation="sdpa")
    torch.manual_seed(0)
    model = torchembed.patch(transformers.LlamaForCausalLM(config).to("cuda", torch.bfloat16).eval())
    ids = torch.randint(0, 256, (1, 64), device="cuda")
    eager = _generate(model, ids, torch.ones_like(ids))
    compiled = _generate(model, ids, torch.ones_like(ids), cache_implementation="static",
                         compile_config=transformers.CompileConfig(fullgraph=True, mode="reduce-overhead"))
    assert torch.equal(eager.sequences, compiled.sequences)
