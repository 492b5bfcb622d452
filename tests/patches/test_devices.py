"""Models split over devices (accelerate ``device_map``): the layers of each device share one
copy of the attention mask and ALiBi bias per forward (``torchembed.patches.devices``).

There is no second device on CPU: the split is simulated with accelerate-style ``_hf_hook``
objects naming cuda:0 for the first half of the decoder layers and cuda:1 for the second, and
"moving" a tensor to cuda:1 makes a clone (a new tensor, as a device copy is). The GPU run of
``scripts/multi_gpu.sh`` is the real thing.
"""

from __future__ import annotations

import types

import pytest
import torch

import torchembed
from torchembed.patches.devices import DeviceCopies
from torchembed.tools.checkpoints import tiny_config

transformers = pytest.importorskip("transformers")
ALIBI = ["bloom", "mpt", "falcon-alibi"]
META = torch.device("meta")


def test_only_the_attention_inputs_are_shared():
    """Hidden states and anything else keep accelerate's per-layer copies: only the mask and
    bias, which torchembed's attention reads and nothing writes, are shared."""
    copies = DeviceCopies()
    layer = types.SimpleNamespace(_hf_hook=types.SimpleNamespace(execution_device="meta"))
    hidden, mask, alibi = torch.randn(2, 3), torch.ones(2, 1, 3, 3), torch.randn(4, 1, 3)
    args, kwargs = copies(layer, (hidden,), {"attention_mask": mask, "alibi": alibi, "use_cache": True})
    assert args[0] is hidden and kwargs["use_cache"] is True
    assert kwargs["attention_mask"].device == META and kwargs["alibi"].device == META
    assert copies(layer, (hidden,), {"hidden_states": hidden}) is None  # nothing to share: unchanged


def test_inference_tensors_are_shared_too():
    copies = DeviceCopies()
    with torch.inference_mode():
        mask = torch.ones(2, 3)
    assert copies.to(mask, META) is copies.to(mask, META)


def test_one_copy_per_tensor_version_and_device():
    copies = DeviceCopies()
    a, b = torch.randn(3), torch.randn(3)
    first = copies.to(a, META)
    assert first.device == META and copies.to(a, META) is first
    assert copies.to(a, torch.device("cpu")) is a  # already there: no copy
    assert copies.to(b, META) is not first  # another tensor, another copy
    a.add_(1)  # an in-place change makes a new version: the old copy is stale
    assert copies.to(a, META) is not first
    assert copies.to(3, META) == 3  # non-tensors pass through
    del a, b
    assert not copies._copies, "copies must die with their sources"


def _model(name: str, layers: int = 4) -> torch.nn.Module:
    config = tiny_config(name)
    config.num_hidden_layers = layers  # BLOOM's n_layer and MPT's n_layers through attribute_map
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.generation_config.pad_token_id = 0
    return model


def _split(model: torch.nn.Module, devices: tuple[int, int] = (0, 1)) -> list[torch.nn.Module]:
    """accelerate-style dispatch hooks: the first half of the decoder layers on ``devices[0]``."""
    layers = [m for m in model.modules() if type(m).__name__ in model._no_split_modules]
    for i, layer in enumerate(layers):
        layer._hf_hook = types.SimpleNamespace(execution_device=devices[0] if i < len(layers) // 2 else devices[1])
    return layers


@pytest.fixture
def simulated_second_device(monkeypatch):
    monkeypatch.setattr(DeviceCopies, "_elsewhere", staticmethod(lambda value, device: device.index == 1))
    monkeypatch.setattr(DeviceCopies, "_move", staticmethod(lambda value, device: value.clone()))


@pytest.mark.parametrize("name", ALIBI)
def test_split_model_gets_one_prehook_per_layer_and_unpatch_removes_them(name):
    model = _model(name)
    layers = _split(model)
    torchembed.patch(model)
    kinds = [c.kind for c in torchembed.find_positional_components(model)]
    assert kinds.count("device-copies") == len(layers) == 4
    hooks = {id(next(iter(layer._forward_pre_hooks.values()))) for layer in layers}
    assert len(hooks) == 1, "one DeviceCopies per model, shared by its layers"
    torchembed.unpatch(model)
    assert all(not layer._forward_pre_hooks and not layer._forward_pre_hooks_with_kwargs for layer in layers)


def test_model_on_one_device_gets_no_prehooks():
    model = _model("bloom")
    layers = _split(model, devices=(0, 0))
    torchembed.patch(model)
    assert "device-copies" not in {c.kind for c in torchembed.find_positional_components(model)}
    assert all(not layer._forward_pre_hooks for layer in layers)


@pytest.mark.parametrize("name", ALIBI)
def test_layers_of_a_device_share_one_copy_and_masks_are_derived_once(name, simulated_second_device,
                                                                      decode_masks_built):
    """Generation on the simulated split equals the unsplit patched model bit for bit; every
    layer on cuda:1 receives the same mask object, and each decode step derives its mask once
    per device (2), not once per layer (4)."""
    reference = torchembed.patch(_model(name))
    model = _model(name)
    layers = _split(model)
    torchembed.patch(model)
    received: list[tuple[int, int]] = []  # (device, id of the mask) per layer call, in order
    for layer in layers:  # after torchembed's pre-hook: what the layer's forward gets
        def record(module, args, kwargs):
            received.append((module._hf_hook.execution_device, id(kwargs["attention_mask"])))
        layer.register_forward_pre_hook(record, with_kwargs=True)
    ids = torch.randint(1, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    kwargs = dict(attention_mask=mask, max_new_tokens=3, min_new_tokens=3, do_sample=False, use_cache=True,
                  output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        ref = reference.generate(ids, **kwargs)
        decode_masks_built.clear()
        out = model.generate(ids, **kwargs)
    assert torch.equal(out.sequences, ref.sequences)
    for step_out, step_ref in zip(out.logits, ref.logits, strict=True):
        assert torch.equal(step_out, step_ref)
    assert len(decode_masks_built) == 2 * 2, "two decode steps, one mask per device each"
    forwards = [received[i:i + len(layers)] for i in range(0, len(received), len(layers))]
    assert len(forwards) == 3  # the prompt and two decode steps
    for calls in forwards:  # within a forward all are alive at once, so ids tell tensors apart
        per_device = {device: {mask for d, mask in calls if d == device} for device in (0, 1)}
        assert len(per_device[0]) == len(per_device[1]) == 1, "one mask object per device"
        assert per_device[0] != per_device[1], "cuda:1 layers get a copy, not the cuda:0 tensor"
