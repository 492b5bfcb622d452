"""The decode-step backend choice of a patched model: SDPA without cuDNN inside a trapped forward (a
CUDA decode step, with or without a mask), SDPA's own choice elsewhere and after it, also when it raises."""

import copy

import pytest
import torch
import transformers

import torchembed
from torchembed.patches import attention_backends


def _tiny_llama():
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                                      num_hidden_layers=2, vocab_size=64, attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(config).eval()


def _cudnn_seen(model):
    """Record, for each attention call, whether SDPA may pick cuDNN then."""
    seen = []
    for layer in model.model.layers:
        layer.self_attn.register_forward_pre_hook(lambda *a: seen.append(torch.backends.cuda.cudnn_sdp_enabled()))
    return seen


@pytest.mark.parametrize("cudnn_decode", [False, True])
def test_trapped_forwards_leave_cudnn_out_and_restore_it(cudnn_decode, monkeypatch):
    monkeypatch.setattr(attention_backends, "trapped", lambda args, kwargs: True)  # (a CUDA decode step, on any machine)
    model = torchembed.patch(_tiny_llama(), cudnn_decode=cudnn_decode)
    seen = _cudnn_seen(model)
    before = torch.backends.cuda.cudnn_sdp_enabled()
    with torch.no_grad():
        model(torch.randint(0, 64, (1, 3)))
        assert seen == [before if cudnn_decode else False] * 2
        model.model(torch.randint(0, 64, (1, 3)))  # a loop over the base model directly
    assert seen == [before if cudnn_decode else False] * 4
    assert torch.backends.cuda.cudnn_sdp_enabled() == before
    boom = model.model.layers[1].register_forward_pre_hook(lambda *a: 1 / 0)  # the forward raises midway
    with pytest.raises(ZeroDivisionError), torch.no_grad():
        model(torch.randint(0, 64, (1, 3)))
    boom.remove()
    assert torch.backends.cuda.cudnn_sdp_enabled() == before  # left also when the forward raised


def test_untrapped_forwards_keep_sdpas_choice():
    model = torchembed.patch(_tiny_llama())
    seen = _cudnn_seen(model)
    before = torch.backends.cuda.cudnn_sdp_enabled()
    with torch.no_grad():
        model(torch.randint(0, 64, (1, 3)))  # CPU: not trapped
    assert seen == [before] * 2


def test_trapped_names_cuda_decode_steps(monkeypatch):
    ids, long_ids = torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, attention_backends.DECODE_QUERIES + 1, dtype=torch.long)
    embeds = torch.zeros(1, 1, 8)
    assert not attention_backends.trapped((ids,), {})  # CPU
    monkeypatch.setattr(attention_backends, "_on_cuda", lambda t: True)
    assert attention_backends.trapped((ids,), {})
    assert attention_backends.trapped((), {"input_ids": ids})
    assert attention_backends.trapped((), {"inputs_embeds": embeds})
    assert attention_backends.trapped((ids,), {"attention_mask": torch.ones(1, 5)})  # generate passes one
    assert not attention_backends.trapped((long_ids,), {})  # a prefill
    assert not attention_backends.trapped((), {})


def test_patch_records_the_hooks_and_unpatch_removes_them():
    """The hooks sit on the base model (which the task model, generate and a hand-written loop all reach)."""
    model = _tiny_llama()

    def count(m):
        return len(m.model._forward_pre_hooks), len(m.model._forward_hooks)

    hooks = count(model)
    patched = torchembed.patch(copy.deepcopy(model))
    assert count(patched) == (hooks[0] + 1, hooks[1] + 1)
    assert all(c.kind == "rope-apply" for c in torchembed.find_positional_components(patched))
    copied = copy.deepcopy(patched)
    torchembed.unpatch(copied)
    assert count(copied) == hooks
    assert count(patched) == (hooks[0] + 1, hooks[1] + 1)
    off = torchembed.patch(copy.deepcopy(model), cudnn_decode=True)
    assert count(off) == hooks


@pytest.mark.skipif(not torch.cuda.is_available(), reason="SDPA's backends differ on CUDA only")
def test_a_decode_loop_without_cudnn_matches_upstream_within_bf16():
    """A decode loop (two steps without a mask, two with one) of the patched model (SDPA without cuDNN)
    against upstream (SDPA's own choice): each step's bf16 logits agree within bf16 rounding of the
    logits' scale."""
    config = transformers.LlamaConfig(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                                      num_hidden_layers=2, vocab_size=256, attn_implementation="sdpa")
    torch.manual_seed(0)
    upstream = transformers.LlamaForCausalLM(config).to("cuda", torch.bfloat16).eval()
    patched = torchembed.patch(copy.deepcopy(upstream))
    ids = torch.randint(0, 256, (1, 300), device="cuda")
    outs = []
    with torch.no_grad():
        for model in (upstream, patched):
            cache = transformers.DynamicCache()
            out = model(ids, past_key_values=cache)
            steps = []
            nxt = ids[:, -1:]
            for i in range(4):  # without a mask, then with the mask generate passes
                mask = None if i < 2 else torch.ones(1, ids.shape[1] + i + 1, dtype=torch.long, device="cuda")
                out = model(nxt, past_key_values=out.past_key_values, attention_mask=mask)
                steps.append(out.logits.float())
            outs.append(torch.cat(steps))
    scale = outs[0].abs().max()
    assert (outs[0] - outs[1]).abs().max() <= 2**-6 * scale
