"""Training through patched models: optimizer steps with gradient checkpointing, offloaded dispatch."""

import copy

import pytest
import torch

import torchembed

transformers = pytest.importorskip("transformers")


def _train(model, batches, steps=3):
    """AdamW steps on fixed batches; returns the losses."""
    model.train()
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for ids in batches[:steps]:
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(out.loss.item())
    return losses


@pytest.mark.parametrize("name", ["llama", "falcon", "bloom", "gpt2"])
def test_optimizer_steps_with_gradient_checkpointing_match_upstream(name, load):
    upstream = load(name)
    patched = torchembed.patch(copy.deepcopy(upstream))
    for model in (upstream, patched):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    gen = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, upstream.config.vocab_size, (2, 12), generator=gen) for _ in range(3)]
    losses_ref, losses_out = _train(upstream, batches), _train(patched, batches)
    # float32: the runs differ only by float32 rounding in the positional path (none for the rope
    # families, which are bit-identical). Adam normalises every update to about lr = 1e-3, so a
    # rounding-level difference in a near-zero gradient can move a weight by a small fraction of
    # one step: allow 1% of a step (1e-5) on the weights after 3 steps.
    torch.testing.assert_close(torch.tensor(losses_out), torch.tensor(losses_ref), rtol=1e-5, atol=1e-6)
    ref = dict(upstream.named_parameters())
    for pname, param in patched.named_parameters():
        torch.testing.assert_close(param, ref[pname], rtol=0, atol=1e-5, msg=pname)
    assert torchembed.is_patched(patched)
    torchembed.unpatch(patched)  # still reversible after training


def test_device_map_with_disk_offload(checkpoint, load, tmp_path):
    pytest.importorskip("accelerate")
    upstream = load("llama")
    device_map = {
        "model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers.0": "cpu",
        "model.layers.1": "disk", "model.norm": "cpu", "lm_head": "cpu",
    }
    model = torchembed.from_pretrained(checkpoint("llama"), device_map=device_map, offload_folder=str(tmp_path))
    assert torchembed.is_patched(model)
    assert hasattr(model.model.layers[1].self_attn, "_hf_hook")  # accelerate's offload hooks stay in place
    ids = torch.randint(0, upstream.config.vocab_size, (2, 9))
    with torch.no_grad():
        ref, out = upstream(input_ids=ids).logits, model(input_ids=ids).logits
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    torchembed.unpatch(model)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, ref, rtol=0, atol=0)  # upstream again, exactly
