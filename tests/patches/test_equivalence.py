"""Patched models compute upstream's function: logits, decoding, padding, rope variants, dtypes."""

import copy

import pytest
import torch

import torchembed
from torchembed.tools.checkpoints import TINY_MODELS
from torchembed.tools.compare import FP32_REL_TOL, compare

CAUSAL = [n for n in TINY_MODELS if n != "bert"]


@pytest.mark.parametrize("name", list(TINY_MODELS))
def test_compare_report_fp32_and_bf16(name, checkpoint):
    """float32: within 1e-5 relative of upstream; bf16: no further from float64 than upstream.

    Covers a left-padded batch with explicit position_ids, three KV-cache decode steps and every
    attention implementation the model supports (eager, sdpa).
    """
    report = compare(str(checkpoint(name)), dtypes=("float32", "bfloat16"), seq_len=12, decode_steps=3)
    assert report.rows, "compare produced no rows"
    for row in report.rows:
        if row.dtype == "float32":
            assert row.rel <= FP32_REL_TOL, row
        assert row.ok, row


@pytest.mark.parametrize("name", CAUSAL)
def test_generate_with_kv_cache_matches_upstream_each_step(name, load):
    upstream = load(name)
    patched = torchembed.patch(copy.deepcopy(upstream))
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, upstream.config.vocab_size, (2, 7), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # left padding
    kwargs = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, output_logits=True,
                  return_dict_in_generate=True, pad_token_id=0)
    with torch.no_grad():
        ref = upstream.generate(ids, **kwargs)
        out = patched.generate(ids, **kwargs)
    assert torch.equal(ref.sequences, out.sequences)
    assert len(ref.logits) == len(out.logits) == 5
    for step_ref, step_out in zip(ref.logits, out.logits):
        scale = step_ref.abs().max()
        assert (step_out - step_ref).abs().max() <= FP32_REL_TOL * scale


@pytest.mark.parametrize("name", ["llama-dynamic", "llama-longrope"])
def test_length_dependent_rope_past_original_length(name, load):
    """dynamic grows the base and longrope switches factors past the original length, as upstream."""
    upstream = load(name)
    patched = torchembed.patch(copy.deepcopy(upstream))
    ids = torch.randint(0, upstream.config.vocab_size, (1, 80))  # max_position_embeddings is 64
    with torch.no_grad():
        for length in (80, 10, 40):  # grow, reset, in between
            ref, out = upstream(ids[:, :length]).logits, patched(ids[:, :length]).logits
            torch.testing.assert_close(out, ref, rtol=FP32_REL_TOL, atol=FP32_REL_TOL * ref.abs().max().item())


@pytest.mark.parametrize("name", ["llama", "falcon", "bloom", "mpt", "gpt2", "bert", "falcon-alibi"])
def test_training_step_gradients_match(name, load):
    upstream = load(name).train()
    patched = torchembed.patch(copy.deepcopy(upstream)).train()
    for m in (upstream, patched):
        for module in m.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
            if isinstance(getattr(module, "dropout_prob", None), float):  # 4.x BERT's sdpa dropout
                module.dropout_prob = 0.0
    ids = torch.randint(0, upstream.config.vocab_size, (2, 10), generator=torch.Generator().manual_seed(2))

    def loss_of(model):
        out = model(input_ids=ids)
        value = out.logits if hasattr(out, "logits") else out.last_hidden_state
        # a fixed random projection: (LayerNorm output ** 2).mean() would be constant (zero gradients)
        weights = torch.randn(value.shape, generator=torch.Generator().manual_seed(3))
        return (value.float() * weights).mean()

    loss_ref, loss_out = loss_of(upstream), loss_of(patched)
    loss_ref.backward()
    loss_out.backward()
    torch.testing.assert_close(loss_out, loss_ref, rtol=1e-5, atol=0)
    grads_ref = dict(upstream.named_parameters())
    for pname, param in patched.named_parameters():
        ref_grad = grads_ref[pname].grad
        if ref_grad is None:
            assert param.grad is None, pname
            continue
        torch.testing.assert_close(param.grad, ref_grad, rtol=1e-4, atol=1e-5 * ref_grad.abs().max().item() + 1e-12, msg=pname)


def _cache_tensors(cache) -> list:
    return [t for layer in cache.layers for t in (layer.keys, layer.values)]


def _decode(model, ids, steps: int) -> tuple:
    """A prefill, then ``steps`` greedy decode steps on a ``DynamicCache``: the steps' logits, the cache's
    keys and values after the last, and the cache tensors' data pointers after each step."""
    import transformers

    cache = transformers.DynamicCache()
    logits, pointers = [], []
    with torch.no_grad():
        out = model(ids, past_key_values=cache, use_cache=True)
        for _ in range(steps):
            out = model(out.logits[:, -1:].argmax(-1), past_key_values=cache, use_cache=True)
            logits.append(out.logits)
            pointers.append({t.data_ptr() for t in _cache_tensors(cache)})
    # the caller's cache, as transformers made it (a patched attention's view of it lives for its call)
    assert out.past_key_values is cache and type(cache) is transformers.DynamicCache
    assert {type(layer) for layer in cache.layers} == {transformers.cache_utils.DynamicLayer}
    return torch.cat(logits), _cache_tensors(cache), pointers


@pytest.mark.parametrize("name", ["bloom", "mpt", "falcon-alibi", "falcon-alibi-mha"])
def test_alibi_families_fill_the_cache_as_upstream(name, load):
    """The patched ALiBi families' cache holds upstream's keys and values after a prefill and a decode step
    (a short cache: contiguous, as upstream's concatenation leaves it; never strided views of the fused
    query-key-value projection, whose concatenation onto a long cache takes a slow copy path on CUDA)."""
    upstream = load(name)
    patched = torchembed.patch(copy.deepcopy(upstream))
    ids = torch.randint(0, upstream.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(2))
    caches = [_decode(model, ids, 1)[1] for model in (upstream, patched)]
    assert len(caches[1]) == 2 * upstream.config.num_hidden_layers
    for want, got in zip(*caches):
        assert got.is_contiguous() and got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_strided_keys_reach_a_short_cache_contiguous_after_its_first_tokens(monkeypatch):
    """``kv_cache.update(..., strided_copy=True)`` (the ALiBi layers' views of their fused projection): a
    ``DynamicLayer``'s first tokens go in as given (its concatenation with nothing copies them once), later ones
    contiguous (a strided input sends the concatenation of the whole cache down CUDA's slow path); the cache holds
    the same values either way."""
    import transformers

    from torchembed.patches import kv_cache

    cache, given = transformers.DynamicCache(), []
    original = type(cache).update
    monkeypatch.setattr(type(cache), "update", lambda self, k, v, *a, **kw: given.append(
        (k.is_contiguous(), v.is_contiguous())) or original(self, k, v, *a, **kw))
    fused = torch.randn(2, 7, 3, 4, 8)  # (b, s, parts, h, d): k and v are strided views
    views = lambda t: (t[:, :, 1].transpose(1, 2), t[:, :, 2].transpose(1, 2))  # noqa: E731
    keys, values = kv_cache.update(cache, *views(fused), 0, strided_copy=True)
    step = torch.randn(2, 1, 3, 4, 8)
    keys, values = kv_cache.update(cache, *views(step), 0, strided_copy=True)
    assert given == [(False, False), (True, True)]
    torch.testing.assert_close(keys, torch.cat([views(fused)[0], views(step)[0]], dim=2), rtol=0, atol=0)
    torch.testing.assert_close(values, torch.cat([views(fused)[1], views(step)[1]], dim=2), rtol=0, atol=0)
    kv_cache.update(cache, *views(step), 0)  # (without strided_copy: as given)
    assert given[-1] == (False, False)


@pytest.mark.parametrize("name", ["bloom", "mpt", "falcon-alibi", "llama", "falcon", "mistral"])
def test_a_long_cache_grows_in_place(name, load, monkeypatch):
    """From ``IN_PLACE_BYTES`` of keys a patched layer (ALiBi, or a RoPE attention through its per-call view
    of the cache) appends each decode step's token into room kept beside its cache (no concatenation of the
    whole cache per step): the layer's keys stay views of one buffer across steps, and the cache, the
    logits, beam search (which reorders the cache) and greedy tokens are upstream's. (``generate`` gives
    Mistral a sliding-window cache, which is not grown in place: the same tokens.)"""
    from torchembed.patches import kv_cache

    monkeypatch.setattr(kv_cache, "IN_PLACE_BYTES", 0)
    upstream = load(name)
    patched = torchembed.patch(copy.deepcopy(upstream))
    ids = torch.randint(1, upstream.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(3))
    runs = [_decode(model, ids, 4) for model in (upstream, patched)]
    (want, want_cache, _), (got, got_cache, pointers) = runs
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for a, b in zip(want_cache, got_cache):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    assert all(p == pointers[0] for p in pointers[1:])  # the same buffers: no copy of the cache per step
    assert not got_cache[0].is_contiguous()  # (a view of a buffer with room)
    kwargs = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0, use_cache=True)
    with torch.no_grad():
        for extra in ({}, {"num_beams": 2}):
            assert torch.equal(upstream.generate(ids, **kwargs, **extra), patched.generate(ids, **kwargs, **extra))
