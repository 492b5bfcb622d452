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


@pytest.mark.parametrize("name", ["bloom", "mpt", "falcon-alibi", "falcon-alibi-mha"])
def test_alibi_families_give_the_cache_contiguous_keys_and_values(name, load, monkeypatch):
    """The patched ALiBi families hand the cache contiguous keys and values (prefill and decode), not
    strided views of the fused query-key-value projection (whose concatenation onto a long cache takes
    a slow copy path on CUDA)."""
    import transformers

    model = torchembed.patch(load(name))
    seen = []
    update = transformers.DynamicCache.update

    def spy(self, key_states, value_states, *args, **kwargs):
        seen.append(key_states.is_contiguous() and value_states.is_contiguous())
        return update(self, key_states, value_states, *args, **kwargs)

    monkeypatch.setattr(transformers.DynamicCache, "update", spy)
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        out = model(ids, past_key_values=transformers.DynamicCache(), use_cache=True)
        model(ids[:, -1:], past_key_values=out.past_key_values, use_cache=True)
    assert len(seen) == 2 * model.config.num_hidden_layers and all(seen)
