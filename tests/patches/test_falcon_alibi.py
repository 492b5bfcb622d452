"""Falcon with ``alibi=True``: torchembed's fused ALiBi attention computes upstream's sdpa path.

Variants: ``falcon-alibi`` (FalconConfig's defaults: multi-query, parallel attention),
``falcon-alibi-mha`` (falcon-rw-1b's layout) and ``falcon-alibi-gqa`` (new_decoder_architecture,
2 kv heads). Upstream's eager path before 5.25 adds the bias twice; its sdpa path is the reference.

Tolerance: float32 logits within 1e-5 of the largest |logit| (``FP32_REL_TOL``, as ``compare``);
measured 1.4e-7 to 3.1e-7 for prefill and decode steps (the bias is row-centred in float32,
upstream's is not, and the two attention paths sum in different orders). Gradients as the
training test of every family (rtol 1e-4, atol 1e-5 of the tensor's largest |grad|; measured
within 7e-7 of it).
"""

import copy
import inspect

import pytest
import torch

import torchembed
from torchembed.patches.alibi.families import falcon_key_bias
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
        seen.append((kwargs.get("alibi"), kwargs["attention_mask"]))

    hooks = [layer.self_attention.register_forward_pre_hook(record, with_kwargs=True) for layer in patched.transformer.h]
    ids, mask = _padded_batch(upstream.config.vocab_size, seed=11)
    with torch.no_grad():
        ref = upstream(ids, attention_mask=mask).logits
        out = patched(ids, attention_mask=mask).logits
    for hook in hooks:
        hook.remove()
    _assert_logits_close(out, ref, mask.bool())
    # no layer got a model-level bias or the (b, h, q, k) fold: the plain causal mask, (b, 1, q, k)
    # bool from 5.x's create_causal_mask or additive float from 4.x's, the bias derived from it
    assert len(seen) == patched.config.num_hidden_layers
    for alibi, layer_mask in seen:
        assert alibi is None
        assert layer_mask.shape == (3, 1, 13, 13) and layer_mask.dtype in (torch.bool, torch.float32)


@pytest.mark.parametrize("name", VARIANTS)
def test_patched_eager_computes_upstream_sdpa_not_eager(name, load):
    """Patched computes upstream's sdpa function under any setting; upstream eager adds the bias twice
    before 5.25 (and agrees with sdpa from 5.25 on, which folds it into the mask only)."""
    upstream, patched = _pair(load, name, impl="eager")
    upstream_eager = load(name, attn_implementation="eager")
    ids, mask = _padded_batch(upstream.config.vocab_size, seed=12)
    with torch.no_grad():
        ref, out = upstream(ids, attention_mask=mask).logits, patched(ids, attention_mask=mask).logits
        eager = upstream_eager(ids, attention_mask=mask).logits
    keep = mask.bool()
    _assert_logits_close(out, ref, keep)
    double_bias = "alibi" in inspect.signature(type(upstream_eager.transformer.h[0].self_attention).forward).parameters
    gap = (eager - ref)[keep].abs().max()
    if double_bias:  # 4.57-5.24: the eager layer adds `alibi` on top of the folded mask
        assert gap > 100 * FP32_REL_TOL * ref.abs().max()
    else:
        assert gap <= FP32_REL_TOL * ref.abs().max()


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
    """Upstream's eager attention runs (5.25's sdpa returns no weights, patched or not), with the
    bias applied once: the same function as the fused path."""
    _, patched = _pair(load, name, impl="eager")
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
    replaced = [c.replacement for c in components if c.kind == "alibi"]
    assert replaced == ["torchembed.patches.alibi.families.falcon_no_model_bias"]  # nothing folded into the mask
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

    ours = falcon_key_bias(None, 12, 2, torch.device("cpu"))
    assert ours.dtype == torch.float32 and ours.shape == (1, 12, 2)
    slopes = alibi_slopes(12)
    assert torch.equal(ours[0, :, 1] - ours[0, :, 0], slopes)  # slope * (position 1 - position 0)
    upstream = build_alibi_tensor(torch.ones(1, 2, dtype=torch.long), 12, torch.float32)[:, 0, 1]
    assert torch.equal(upstream, slopes.bfloat16().float()) and not torch.equal(upstream, slopes)


@pytest.mark.parametrize("dtype", [torch.bool, torch.float32])
def test_key_bias_from_the_mask_counts_positions_over_real_keys(dtype):
    """The bias derived from a left-padded causal mask equals upstream's bias from the 2-D mask,
    up to one constant per row (bool keep masks and additive float masks alike)."""
    from transformers.models.falcon.modeling_falcon import build_alibi_tensor

    ids_mask = torch.tensor([[1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1], [0, 0, 0, 0, 0, 1]])
    keep = torch.ones(6, 6, dtype=torch.bool).tril()[None, None] & ids_mask.bool()[:, None, None, :]
    mask = keep if dtype == torch.bool else torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(dtype).min)
    ours = falcon_key_bias(mask, 8, 6, torch.device("cpu"))  # (3, 8, 6); 8 heads: power-of-2 slopes, exact in bf16
    upstream = build_alibi_tensor(ids_mask, 8, torch.float32).view(3, 8, 6)
    real = ids_mask.bool()[:, None, :].expand_as(ours)
    for row in range(3):
        diff = (upstream - ours)[row][real[row]].view(8, -1)
        assert torch.equal(diff, diff[:, :1].expand_as(diff))  # one constant per (row, head)
    assert (ours[~real] == 0).all() and (ours[real] <= 0).all()  # padding 0; non-positive, 0 at the newest key


def test_folded_mask_given_to_the_attention_is_a_clear_error(load):
    model = torchembed.patch(load("falcon-alibi-mha"))
    attn = model.transformer.h[0].self_attention
    hidden = torch.randn(1, 4, model.config.hidden_size)
    folded = torch.zeros(1, model.config.num_attention_heads, 4, 4)
    with pytest.raises(ValueError, match="folds the ALiBi bias"):
        attn(hidden, attention_mask=folded)
