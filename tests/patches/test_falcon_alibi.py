"""Falcon with ``alibi=True``: torchembed's fused ALiBi attention computes upstream's sdpa path.

Variants: ``falcon-alibi`` (FalconConfig's defaults: multi-query, parallel attention),
``falcon-alibi-mha`` (falcon-rw-1b's layout) and ``falcon-alibi-gqa`` (new_decoder_architecture,
2 kv heads). Upstream's eager path adds the bias twice; its sdpa path is the reference.

Tolerance: float32 logits within 1e-5 of the largest |logit| (``FP32_REL_TOL``, as ``compare``);
measured 1.4e-7 to 3.1e-7 for prefill and decode steps (the bias is row-centred in float32,
upstream's is not, and the two attention paths sum in different orders). Gradients as the
training test of every family (rtol 1e-4, atol 1e-5 of the tensor's largest |grad|; measured
within 7e-7 of it).
"""

import copy

import pytest
import torch

import torchembed
from torchembed.patches.families.alibi import falcon_alibi_tensor
from torchembed.tools.compare import FP32_REL_TOL
from tests.helpers import assert_no_new_graph_breaks, graph_breaks

transformers = pytest.importorskip("transformers")
VARIANTS = ["falcon-alibi", "falcon-alibi-mha", "falcon-alibi-gqa"]


def _padded_batch(vocab, seed, length=13):
    """Three rows, left-padded by 0, 3 and 7 tokens."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (3, length), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    mask[2, :7] = 0
    return ids, mask


def _assert_logits_close(out, ref, keep=None):
    if keep is not None:
        out, ref = out[keep], ref[keep]
    scale = ref.abs().max().item()
    assert (out - ref).abs().max().item() <= FP32_REL_TOL * scale


def _pair(load, name, impl="sdpa"):
    upstream = load(name, attn_implementation="sdpa")
    patched = torchembed.patch(load(name, attn_implementation=impl))
    assert upstream.config._attn_implementation == "sdpa" and patched.config._attn_implementation == impl
    return upstream, patched


@pytest.mark.parametrize("name", VARIANTS)
def test_padded_logits_match_upstream_sdpa_without_the_folded_mask(name, load):
    upstream, patched = _pair(load, name)
    seen = []

    def record(module, args, kwargs):
        seen.append((kwargs["alibi"], kwargs["attention_mask"]))

    hooks = [layer.self_attention.register_forward_pre_hook(record, with_kwargs=True) for layer in patched.transformer.h]
    ids, mask = _padded_batch(upstream.config.vocab_size, seed=11)
    with torch.no_grad():
        ref = upstream(ids, attention_mask=mask).logits
        out = patched(ids, attention_mask=mask).logits
    for hook in hooks:
        hook.remove()
    _assert_logits_close(out, ref, mask.bool())
    # every layer got the float32 key bias (b*h, 1, k) and the mask without it, not the (b, h, q, k)
    # fold: (b, q, k) bool from 5.x's create_causal_mask, (b, 1, q, k) additive from 4.x's
    heads = patched.config.num_attention_heads
    assert len(seen) == patched.config.num_hidden_layers
    for alibi, layer_mask in seen:
        assert alibi.shape == (3 * heads, 1, 13) and alibi.dtype == torch.float32
        assert layer_mask.shape in ((3, 13, 13), (3, 1, 13, 13)) and layer_mask.dtype in (torch.bool, torch.float32)


@pytest.mark.parametrize("name", VARIANTS)
def test_patched_eager_computes_upstream_sdpa_not_eager(name, load):
    """Upstream eager adds the bias twice; patched computes the sdpa function under any setting."""
    upstream, patched = _pair(load, name, impl="eager")
    upstream_eager = load(name, attn_implementation="eager")
    ids, mask = _padded_batch(upstream.config.vocab_size, seed=12)
    with torch.no_grad():
        ref, out = upstream(ids, attention_mask=mask).logits, patched(ids, attention_mask=mask).logits
        eager = upstream_eager(ids, attention_mask=mask).logits
    keep = mask.bool()
    _assert_logits_close(out, ref, keep)
    assert (eager - ref)[keep].abs().max() > 100 * FP32_REL_TOL * ref.abs().max()  # the double bias is visible


@pytest.mark.parametrize("name", VARIANTS)
def test_greedy_generate_with_kv_cache_matches_upstream_sdpa(name, load):
    upstream, patched = _pair(load, name)
    ids, mask = _padded_batch(upstream.config.vocab_size, seed=13, length=9)
    kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, output_logits=True,
                  return_dict_in_generate=True, pad_token_id=0)
    with torch.no_grad():
        ref, out = upstream.generate(ids, **kwargs), patched.generate(ids, **kwargs)
    assert torch.equal(out.sequences, ref.sequences)
    assert len(out.logits) == len(ref.logits) == 6
    for step_out, step_ref in zip(out.logits, ref.logits):
        _assert_logits_close(step_out, step_ref)


@pytest.mark.parametrize("name", VARIANTS)
def test_backward_with_padding_matches_upstream_sdpa(name, load):
    upstream, patched = _pair(load, name)
    ids, mask = _padded_batch(upstream.config.vocab_size, seed=14)
    keep = mask.bool()
    losses = []
    for model in (upstream, patched):
        model.train()
        for module in model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
        loss = model(ids, attention_mask=mask).logits[keep].pow(2).mean()
        loss.backward()
        losses.append(loss)
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=0)
    grads = dict(upstream.named_parameters())
    for pname, param in patched.named_parameters():
        ref_grad = grads[pname].grad
        assert ref_grad is not None and param.grad is not None, pname
        torch.testing.assert_close(param.grad, ref_grad, rtol=1e-4, atol=1e-5 * ref_grad.abs().max().item() + 1e-12, msg=pname)


@pytest.mark.parametrize("name", VARIANTS)
def test_output_attentions_falls_back_to_upstream_on_the_unfolded_mask(name, load):
    _, patched = _pair(load, name)
    ids, mask = _padded_batch(patched.config.vocab_size, seed=15)
    with torch.no_grad():
        fused = patched(ids, attention_mask=mask).logits
        out = patched(ids, attention_mask=mask, output_attentions=True)
    keep = mask.bool()
    _assert_logits_close(out.logits, fused, keep)  # same function: single bias, as sdpa
    rows = keep[:, None, :, None]  # real queries; padding queries attend uniformly, as upstream
    padding_keys = ~keep[:, None, None, :]
    assert len(out.attentions) == patched.config.num_hidden_layers
    for probs in out.attentions:
        assert probs.shape == (3, patched.config.num_attention_heads, 13, 13)
        sums = probs.sum(-1)[rows[..., 0].expand_as(probs[..., 0])]
        torch.testing.assert_close(sums, torch.ones_like(sums), rtol=0, atol=1e-6)
        real = probs * rows
        assert real.triu(1).abs().max() == 0  # causal
        assert real.masked_select(padding_keys).max() == 0  # padding keys get no weight


@pytest.mark.parametrize("name", VARIANTS)
def test_components_and_bit_exact_unpatch(name, load):
    model = load(name, attn_implementation="sdpa")
    ids, mask = _padded_batch(model.config.vocab_size, seed=16)
    with torch.no_grad():
        before = model(ids, attention_mask=mask).logits
    components = torchembed.find_positional_components(model)
    kinds = [c.kind for c in components]
    assert kinds.count("alibi-attention") == model.config.num_hidden_layers
    replaced = " ".join(c.replacement for c in components if c.kind == "alibi")
    assert "falcon_alibi_tensor" in replaced
    # the bias kept out of the mask: 5.x rebinds create_causal_mask, 4.x overrides _update_causal_mask
    assert "falcon_causal_mask" in replaced or "_falcon_unfolded_mask" in replaced
    assert not torchembed.is_patched(model)
    torchembed.patch(model)
    assert torchembed.is_patched(model) and torchembed.find_positional_components(model) == components
    with torch.no_grad():
        patched = model(ids, attention_mask=mask).logits
    _assert_logits_close(patched, before, mask.bool())
    torchembed.unpatch(model)
    assert not torchembed.is_patched(model)
    assert all("forward" not in vars(m) for m in model.modules())
    with torch.no_grad():
        assert torch.equal(model(ids, attention_mask=mask).logits, before)  # bit for bit


def test_rotary_falcon_keeps_upstream_attention(load):
    model = torchembed.patch(load("falcon", attn_implementation="sdpa"))
    kinds = {c.kind for c in torchembed.find_positional_components(model)}
    assert kinds == {"rope-apply"}
    assert all(c.path != "transformer" for c in torchembed.find_positional_components(model))


@pytest.mark.parametrize("name", ["falcon-alibi", "falcon-alibi-mha"])
def test_torch_compile_no_new_graph_breaks(name, load):
    upstream = load(name, attn_implementation="sdpa")
    patched = torchembed.patch(copy.deepcopy(upstream))
    ids, mask = _padded_batch(upstream.config.vocab_size, seed=17, length=8)
    ref_breaks, _ = graph_breaks(upstream, input_ids=ids, attention_mask=mask)
    our_breaks, out = graph_breaks(patched, input_ids=ids, attention_mask=mask)
    assert_no_new_graph_breaks(our_breaks, ref_breaks)
    with torch.no_grad():
        ref = upstream(input_ids=ids, attention_mask=mask).logits
    _assert_logits_close(out, ref, mask.bool())


def test_float32_slopes_not_rounded_to_bfloat16():
    """12 heads: slopes that are not powers of two; upstream rounds them to bf16, torchembed does not."""
    from transformers.models.falcon.modeling_falcon import build_alibi_tensor

    from torchembed.functional.alibi import alibi_slopes

    mask = torch.ones(1, 2, dtype=torch.long)
    ours = falcon_alibi_tensor(mask, 12, torch.bfloat16)  # dtype ignored: float32
    assert ours.dtype == torch.float32 and ours.shape == (12, 1, 2)
    slopes = alibi_slopes(12)
    assert torch.equal(ours[:, 0, 1] - ours[:, 0, 0], slopes)  # slope * (position 1 - position 0)
    upstream = build_alibi_tensor(mask, 12, torch.float32)[:, 0, 1]
    assert torch.equal(upstream, slopes.bfloat16().float()) and not torch.equal(upstream, slopes)


def test_folded_mask_given_to_the_attention_is_a_clear_error(load):
    model = torchembed.patch(load("falcon-alibi-mha"))
    attn = model.transformer.h[0].self_attention
    hidden = torch.randn(1, 4, model.config.hidden_size)
    alibi = falcon_alibi_tensor(torch.ones(1, 4), model.config.num_attention_heads, torch.float32)
    folded = torch.zeros(1, model.config.num_attention_heads, 4, 4)
    with pytest.raises(ValueError, match="folds the ALiBi bias"):
        attn(hidden, alibi=alibi, attention_mask=folded)
