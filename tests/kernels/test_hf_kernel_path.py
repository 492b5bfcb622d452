"""The patched HF attention on the kernel path (in place for inference, autograd for training)."""

import copy

import pytest
import torch

import torchembed
from torchembed import kernels

pytest.importorskip("triton")
transformers = pytest.importorskip("transformers")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _tiny(name):
    from torchembed.tools.checkpoints import tiny_config

    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(tiny_config(name)).to(DEV).eval()


@pytest.mark.parametrize("name", ["llama", "falcon", "falcon-mha"])
def test_patched_model_on_the_kernel_matches_upstream(name):
    upstream = _tiny(name)
    patched = torchembed.patch(copy.deepcopy(upstream), fused=True)
    ids = torch.randint(0, upstream.config.vocab_size, (2, 11), device=DEV)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    assert kernels.kernel_can_run(ids.float())
    with torch.no_grad():  # inference: the in-place hot path
        ref = upstream(ids, attention_mask=mask).logits
        out = patched(ids, attention_mask=mask).logits
    keep = mask.bool()
    torch.testing.assert_close(out[keep], ref[keep], rtol=1e-5, atol=1e-5 * ref.abs().max().item())

    # training: the autograd path, gradients as upstream's
    loss_ref = upstream(ids).logits.pow(2).mean()
    loss_out = patched(ids).logits.pow(2).mean()
    loss_ref.backward()
    loss_out.backward()
    grads = dict(upstream.named_parameters())
    for pname, param in patched.named_parameters():
        ref_grad = grads[pname].grad
        torch.testing.assert_close(param.grad, ref_grad, rtol=1e-4, atol=1e-5 * ref_grad.abs().max().item() + 1e-12, msg=pname)


@pytest.mark.parametrize("padded", [True, False])
@pytest.mark.parametrize("name", ["bloom", "mpt", "falcon-alibi", "falcon-alibi-mha", "falcon-alibi-gqa"])
def test_patched_alibi_attention_matches_upstream(name, padded, monkeypatch):
    """On CUDA the prefill runs ALiBi inside FlexAttention (left-padded batch) or SDPA with the
    bias columns (no padding; forced on CPU too, and checked to be taken), the decode steps SDPA.

    Falcon's upstream is its sdpa attention (``from_config``'s default), the function the patched
    model computes; multi-query keys reach the fused kernels repeated over the heads.
    """
    import torchembed.kernels.alibi_attention as attention

    columns = []
    if not padded:
        monkeypatch.setattr(attention, "_FUSED_DEVICES", (torch.device(DEV).type,))
        original = attention._sdpa_with_columns
        monkeypatch.setattr(attention, "_sdpa_with_columns", lambda *a, **kw: columns.append(1) or original(*a, **kw))
    upstream = _tiny(name)
    assert upstream.config.model_type != "falcon" or upstream.config._attn_implementation == "sdpa"
    patched = torchembed.patch(copy.deepcopy(upstream))
    ids = torch.randint(0, upstream.config.vocab_size, (2, 24), device=DEV)
    mask = torch.ones_like(ids)
    if padded:
        mask[0, :5] = 0
    with torch.no_grad():
        ref = upstream.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, output_logits=True,
                                return_dict_in_generate=True, pad_token_id=0)
        out = patched.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, output_logits=True,
                               return_dict_in_generate=True, pad_token_id=0)
        prefill_ref = upstream(ids, attention_mask=mask).logits[mask.bool()]
        prefill_out = patched(ids, attention_mask=mask).logits[mask.bool()]
    scale = prefill_ref.abs().max().item()
    torch.testing.assert_close(prefill_out, prefill_ref, rtol=1e-5, atol=1e-5 * scale)
    for a, b in zip(out.logits, ref.logits):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * scale)
    if not padded:
        # every layer of generate's prefill and of the forward (MPT without a cache: of every step)
        assert len(columns) >= 2 * upstream.config.num_hidden_layers


@pytest.mark.skipif(DEV != "cuda", reason="bf16 training with the fused kernel needs CUDA (CPU parity: tests/patches/test_training.py)")
@pytest.mark.parametrize("name", ["llama", "falcon"])
def test_bf16_training_steps_with_the_fused_kernel_match_upstream(name):
    """3 AdamW steps in bf16: patched (fused kernel fwd+bwd) and upstream stay together.

    Tolerances: losses 2e-2 relative (bf16 logits round at ~4e-3 relative and the two rotations
    round differently); weights 3e-3 absolute = 3 steps of lr 1e-3, the most Adam can move a
    weight, against drift of one step when gradients disagree in sign (a broken backward).
    """
    upstream = _tiny(name).to(torch.bfloat16)
    patched = torchembed.patch(copy.deepcopy(upstream), fused=True)
    gen = torch.Generator().manual_seed(4)
    batches = [torch.randint(0, upstream.config.vocab_size, (4, 32), generator=gen).to(DEV) for _ in range(3)]
    losses = {}
    for key, model in (("upstream", upstream), ("patched", patched)):
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses[key] = []
        for ids in batches:
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses[key].append(loss.item())
    torch.testing.assert_close(torch.tensor(losses["patched"]), torch.tensor(losses["upstream"]), rtol=2e-2, atol=0)
    ref = dict(upstream.named_parameters())
    for pname, param in patched.named_parameters():
        torch.testing.assert_close(param.float(), ref[pname].float(), rtol=0, atol=3e-3, msg=pname)


def test_compiled_patched_model_calls_the_kernel_op_without_graph_breaks():
    """``torch.compile(fullgraph=True)`` of a patched model traces the rotation as the kernel's
    custom op (one per layer), with no graph break, and gives upstream's logits."""
    from torch._dynamo.utils import counters

    upstream = _tiny("llama")
    patched = torchembed.patch(copy.deepcopy(upstream))
    ids = torch.randint(0, upstream.config.vocab_size, (2, 7), device=DEV)
    ops = []

    def backend(gm, example_inputs):
        ops.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    torch._dynamo.reset()
    counters.clear()
    with torch.no_grad():
        out = torch.compile(patched, backend=backend, fullgraph=True)(input_ids=ids).logits
        ref = upstream(input_ids=ids).logits
    assert sum(counters["graph_break"].values()) == 0
    assert sum("torchembed.rotary" in op for op in ops) == upstream.config.num_hidden_layers, ops
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
