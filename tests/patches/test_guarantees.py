"""What "patched" guarantees: instance scope, exact undo, idempotence, no data change, errors."""

import copy
import importlib

import pytest
import torch

import torchembed
from torchembed.patches import FusedUnavailableError, UnsupportedModelError
from torchembed.patches.actions import InstanceMethod
from torchembed.patches.loading import load_upstream
from torchembed.patches.rebind import chain, global_names
from tests.helpers import assert_no_new_graph_breaks, graph_breaks

transformers = pytest.importorskip("transformers")
FAMILY_MODELS = ["llama", "mistral", "falcon", "falcon-alibi", "bloom", "mpt", "bert", "gpt2"]


def _inputs(model, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=gen)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    return dict(input_ids=ids, attention_mask=mask)


def _out(model, inputs):
    with torch.no_grad():
        out = model(**inputs)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


@pytest.mark.parametrize("name", FAMILY_MODELS)
def test_instance_scope_unpatch_idempotence_and_state(name, load):
    model, other = load(name), load(name)
    inputs = _inputs(model)
    before = _out(model, inputs)
    state_before = {k: v.clone() for k, v in model.state_dict().items()}
    tensors_before = {k: v.data_ptr() for k, v in model.state_dict().items()}

    assert torchembed.patch(model) is model and torchembed.is_patched(model)
    components = torchembed.find_positional_components(model)
    assert components and all(c.replacement.startswith("torchembed") for c in components)
    assert torchembed.patch(model) is model  # twice: a no-op
    assert torchembed.find_positional_components(model) == components

    # no data change: same keys, values, storage
    state = model.state_dict()
    assert list(state) == list(state_before)
    for key, value in state.items():
        assert torch.equal(value, state_before[key]) and value.data_ptr() == tensors_before[key], key

    # instance scope: an unpatched model of the same family in the same process is untouched
    assert not torchembed.is_patched(other)
    assert torch.equal(_out(other, inputs), before)
    assert all("torchembed" not in type(m).__module__ for m in other.modules())

    patched_out = _out(model, inputs)
    assert torchembed.unpatch(model) is model and not torchembed.is_patched(model)
    assert torch.equal(_out(model, inputs), before)  # bit for bit
    assert all("torchembed" not in type(m).__module__ for m in model.modules())
    assert all("forward" not in vars(m) for m in model.modules())
    torch.testing.assert_close(patched_out, before, rtol=1e-5, atol=1e-5 * before.abs().max().item())
    assert torchembed.unpatch(model) is model  # unpatching an unpatched model is a no-op


@pytest.mark.parametrize("name", ["llama", "bloom", "gpt2"])
def test_save_pretrained_of_patched_model_loads_in_plain_transformers(name, load, tmp_path):
    model = torchembed.patch(load(name))
    inputs = _inputs(model)
    model.save_pretrained(tmp_path)
    plain = load_upstream(type(model), tmp_path).eval()
    assert not torchembed.is_patched(plain)
    torchembed.unpatch(model)
    assert torch.equal(_out(plain, inputs), _out(model, inputs))


@pytest.mark.parametrize("name", ["llama", "falcon-alibi", "bert"])
def test_deepcopy_of_patched_model_is_patched_independently(name, load):
    model = torchembed.patch(load(name))
    clone = copy.deepcopy(model)
    assert torchembed.is_patched(clone)
    inputs = _inputs(model)
    torch.testing.assert_close(_out(clone, inputs), _out(model, inputs), rtol=0, atol=0)
    torchembed.unpatch(clone)
    assert torchembed.is_patched(model) and not torchembed.is_patched(clone)
    assert all("torchembed" not in type(m).__module__ for m in clone.modules())
    assert any("torchembed" in type(m).__module__ or isinstance(vars(m).get("forward"), InstanceMethod) for m in model.modules())


def test_patched_context_manager(load):
    model = load("llama")
    inputs = _inputs(model)
    before = _out(model, inputs)
    with torchembed.patched(model) as m:
        assert m is model and torchembed.is_patched(model)
    assert not torchembed.is_patched(model)
    assert torch.equal(_out(model, inputs), before)
    torchembed.patch(model)
    with torchembed.patched(model):
        pass
    assert torchembed.is_patched(model)  # stays patched when it was on entry


def test_patch_is_atomic_on_failure(load, monkeypatch):
    from torchembed.patches.actions import OverrideAttribute

    model = load("llama")
    inputs = _inputs(model)
    before = _out(model, inputs)
    calls = {"n": 0}
    original = OverrideAttribute.apply

    def failing(self):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("boom")
        original(self)

    monkeypatch.setattr(OverrideAttribute, "apply", failing)
    with pytest.raises(RuntimeError, match="boom"):
        torchembed.patch(model)
    assert not torchembed.is_patched(model)
    assert all("torchembed" not in type(m).__module__ for m in model.modules())
    assert torch.equal(_out(model, inputs), before)


def test_find_positional_components_is_a_dry_run(load):
    model = load("llama")
    components = torchembed.find_positional_components(model)
    assert not torchembed.is_patched(model)
    kinds = [c.kind for c in components]
    assert kinds == ["rope-apply"] * model.config.num_hidden_layers
    assert [c.path for c in components] == [f"model.layers.{i}.self_attn" for i in range(model.config.num_hidden_layers)]
    assert "modeling_llama.apply_rotary_pos_emb" in components[0].upstream
    assert "cat tables, half pairing" in components[0].replacement
    assert "model.layers.0.self_attn" in str(components[0])


def test_unsupported_model_error_and_strict_false():
    config = transformers.OPTConfig(hidden_size=32, num_attention_heads=4, num_hidden_layers=1, ffn_dim=64, vocab_size=64)
    model = transformers.OPTForCausalLM(config)  # learned positions, no adapter
    with pytest.raises(UnsupportedModelError, match=r"'opt'.*no attention module calls a rotary-embedding helper"):
        torchembed.patch(model)
    with pytest.warns(UserWarning, match="left unpatched") as warned:
        assert torchembed.patch(model, strict=False) is model
    assert "Pass strict=False" not in str(warned[0].message)
    assert not torchembed.is_patched(model)
    with pytest.raises(UnsupportedModelError, match="config.model_type"):
        torchembed.patch(torch.nn.Linear(2, 2))
    with pytest.raises(UnsupportedModelError):
        torchembed.find_positional_components(model)


def test_fused_true_where_it_cannot_run_is_a_clear_error(load):
    model = load("llama")
    with pytest.raises(FusedUnavailableError, match="fused=True"):
        torchembed.patch(model, fused=True)
    assert not torchembed.is_patched(model)
    with pytest.raises(FusedUnavailableError, match="no fused kernel"):
        torchembed.patch(load("gpt2"), fused=True)
    with pytest.raises(TypeError, match="fused"):
        torchembed.patch(model, fused="yes")


def test_learned_table_overflow_is_a_clear_error(load):
    model = torchembed.patch(load("gpt2"))
    ids = torch.zeros(1, 65, dtype=torch.long)  # n_positions is 64
    with pytest.raises(ValueError, match="outside the learned table of 64 positions"):
        model(input_ids=ids)


def test_from_pretrained_loads_and_patches(checkpoint):
    model = torchembed.from_pretrained(checkpoint("mistral"), dtype=torch.float32)
    assert torchembed.is_patched(model) and type(model).__name__ == "MistralForCausalLM"
    bert = torchembed.from_pretrained(checkpoint("bert"))
    assert torchembed.is_patched(bert) and type(bert).__name__ == "BertModel"


def test_device_map_through_accelerate(checkpoint, load):
    pytest.importorskip("accelerate")
    upstream = load("llama")
    model = torchembed.from_pretrained(checkpoint("llama"), device_map={"": "cpu"})
    inputs = _inputs(upstream)
    torch.testing.assert_close(_out(model, inputs), _out(upstream, inputs), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["llama", "bloom", "gpt2"])
def test_torch_compile_fullgraph_no_new_graph_breaks(name, load):
    upstream = load(name)
    patched = torchembed.patch(copy.deepcopy(upstream))
    ids = torch.randint(0, upstream.config.vocab_size, (1, 8))
    ref_breaks, _ = graph_breaks(upstream, input_ids=ids)
    our_breaks, out = graph_breaks(patched, input_ids=ids)
    assert_no_new_graph_breaks(our_breaks, ref_breaks)
    torch.testing.assert_close(out, _out(upstream, dict(input_ids=ids)), rtol=1e-5, atol=1e-5)


_COMPILE_FIRST = """
import sys, torch, transformers, torchembed
configs = {
    "llama": transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=64),
    "bloom": transformers.BloomConfig(hidden_size=32, n_layer=2, n_head=4, vocab_size=64),
}
model = torchembed.patch(transformers.AutoModelForCausalLM.from_config(configs[sys.argv[1]]).eval())
ids = torch.randint(0, 64, (1, 6))
with torch.no_grad():
    torch.compile(model, backend="eager", fullgraph=True)(input_ids=ids)
"""


@pytest.mark.parametrize("name", ["llama", "bloom"])
def test_a_fresh_process_compiles_a_patched_model_with_fullgraph_first(name):
    """``torch.compile(fullgraph=True)`` as the first thing a process does with a patched model: nothing
    the patch reads on its first call (its settings, what it recognised) is made inside the traced graph
    (in a test session earlier tests have made it already, so this runs in a process of its own)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _COMPILE_FIRST, name], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.parametrize("cudnn_decode", [False, True])
@pytest.mark.parametrize("padded", [True, False])
@pytest.mark.parametrize("name", ["bloom", "mpt", "falcon-alibi"])
def test_alibi_masks_derived_once_per_forward(name, padded, cudnn_decode, load, decode_masks_built, monkeypatch,
                                              alibi_policy, kernel_route_on_cpu):
    """A patched ALiBi model derives its per-forward tensors once for all layers (host time), not
    once per layer: the fused kernel's row summary of the mask (prefill and decode steps; the kernel
    stubbed on CPU), or with ``cudnn_decode`` the decode step's SDPA mask — with a padded batch (a mask
    tensor per forward) and without (Falcon's layers then get no mask at all: no summary)."""
    import torchembed.kernels.alibi as kernel

    alibi_policy(dense_max_elements=0)  # the kernel at any size
    monkeypatch.setattr(kernel, "fused_attention", lambda q, *a, **kw: torch.zeros_like(q))  # (the kernel: not under test)
    summaries = []
    monkeypatch.setattr(kernel, "mask_rows", lambda keep: summaries.append(1) or keep)
    model = load(name)
    if not padded and name == "falcon-alibi":  # no mask reaches the layers, as when transformers skips the sdpa mask
        falcon = type(model.transformer)
        modeling = importlib.import_module(falcon.__module__)
        if not hasattr(modeling, "create_causal_mask"):  # 4.x
            monkeypatch.setattr(falcon, "_update_causal_mask", lambda *a, **kw: None)
    model = torchembed.patch(model, cudnn_decode=cudnn_decode)
    if not padded and name == "falcon-alibi" and hasattr(modeling, "create_causal_mask"):  # 5.x: in the rebuilt forward
        for function in chain(model.transformer.forward.__func__):
            if "create_causal_mask" in global_names(function) and function.__globals__ is not vars(modeling):
                monkeypatch.setitem(function.__globals__, "create_causal_mask", lambda *a, **kw: None)
    ids = torch.randint(1, model.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    if padded:
        mask[0, :2] = 0
    with torch.no_grad():
        model.generate(ids, attention_mask=mask, max_new_tokens=3, min_new_tokens=3, do_sample=False, pad_token_id=0,
                       use_cache=True)  # (MPT configs default to no KV cache)
    layers = model.config.num_hidden_layers  # BLOOM and MPT map it to n_layer(s)
    no_mask = not padded and name == "falcon-alibi"
    forwards_on_kernel = 1 if cudnn_decode else 3  # the prefill, then two decode steps
    assert layers > 1 and len(decode_masks_built) == (2 if cudnn_decode else 0), len(decode_masks_built)
    assert len(summaries) == (0 if no_mask else forwards_on_kernel), len(summaries)  # once per forward


@pytest.mark.parametrize("padded", [True, False])
@pytest.mark.parametrize("name", ["bloom", "mpt", "falcon-alibi"])
def test_small_alibi_prefill_materialises_its_bias_once_per_forward(name, padded, load, monkeypatch, alibi_policy,
                                                                    kernel_route_on_cpu):
    """The materialised-bias path (small training steps; forced here, on CPU, at inference): SDPA with
    the bias made once per forward for all layers, padded or not, and upstream's logits."""
    import torchembed.kernels.alibi as kernel

    alibi_policy(dense_devices=("cpu",))
    monkeypatch.setattr(kernel, "fused_attention", lambda *a, **kw: pytest.fail("the fused kernel taken"))
    built = []
    original = kernel.prefill_bias
    monkeypatch.setattr(kernel, "prefill_bias", lambda *a: built.append(1) or original(*a))
    upstream = load(name)
    model = torchembed.patch(copy.deepcopy(upstream))
    ids = torch.randint(1, model.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    if padded:
        mask[0, :2] = 0
    with torch.no_grad():
        got = model(input_ids=ids, attention_mask=mask).logits
        want = upstream(input_ids=ids, attention_mask=mask).logits
    assert model.config.num_hidden_layers > 1 and len(built) == 1, len(built)
    rows = mask.bool()  # a padded position's own logits are not defined by either
    torch.testing.assert_close(got[rows], want[rows], rtol=1e-5, atol=1e-5)


def _decode_step_ops(model) -> int:
    """Operators a decode step dispatches from Python (top-level aten ops: what costs host time at
    decode shapes), counted with the profiler on one step after a 9-token prompt."""
    from torch.profiler import ProfilerActivity, profile

    inputs = _inputs(model)
    with torch.no_grad():
        cache = model(**inputs, use_cache=True).past_key_values
        token = inputs["input_ids"][:, -1:]
        mask = torch.cat([inputs["attention_mask"], torch.ones_like(token)], dim=1)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            model(input_ids=token, attention_mask=mask, past_key_values=cache, use_cache=True)
    return sum(1 for e in prof.events() if e.name.startswith("aten::")
               and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")))


@pytest.mark.parametrize("name", ["bloom", "mpt", "falcon-alibi", "falcon-alibi-mha", "falcon-alibi-gqa"])
def test_alibi_decode_step_dispatches_no_more_operators_than_upstream(name, load):
    """Decode is host-bound: a patched ALiBi model's decode step must not dispatch more operators
    than upstream's (a count, not a timing: the same on every machine; the ALiBi decode path is the
    same on CPU and CUDA, whereas the rope families run the fused kernel only on CUDA)."""
    upstream = load(name)
    patched = torchembed.patch(copy.deepcopy(upstream))
    ours, theirs = _decode_step_ops(patched), _decode_step_ops(upstream)
    assert 0 < ours <= theirs, (ours, theirs)


@pytest.mark.parametrize("name", [n for n in FAMILY_MODELS if n != "bert"])
def test_patching_a_model_around_a_patched_base_model_takes_it_over(name, load, monkeypatch):
    """A base model patched on its own, then a task model patched around it (as when every model
    is patched at construction): one patch covers both, and unpatching the outer one restores
    upstream exactly whatever the order of the two unpatch calls. If the outer patch fails, the
    inner one is as it was."""
    from torchembed.patches import core

    upstream = load(name)
    model = copy.deepcopy(upstream)
    base = model.base_model
    assert base is not model
    inputs = _inputs(model)
    expected = _out(upstream, inputs)
    torchembed.patch(base)
    torchembed.patch(model)
    assert torchembed.is_patched(model) and not torchembed.is_patched(base)
    assert [str(c) for c in torchembed.find_positional_components(model)] == [
        str(c) for c in torchembed.find_positional_components(upstream)]
    torch.testing.assert_close(_out(model, inputs), expected, rtol=1e-5, atol=1e-5)
    torchembed.unpatch(base)  # nothing of its own left: the outer patch covers it
    assert torchembed.is_patched(model)
    torchembed.unpatch(model)
    assert torch.equal(_out(model, inputs), expected)
    assert all("torchembed" not in type(m).__module__ for m in model.modules())
    assert not any(isinstance(v, InstanceMethod) for m in model.modules() for v in vars(m).values())

    torchembed.patch(base)
    patched_base = _out(model, inputs)
    monkeypatch.setattr(core, "_plan", lambda *a: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"):
        torchembed.patch(model)
    assert torchembed.is_patched(base) and not torchembed.is_patched(model)
    assert torch.equal(_out(model, inputs), patched_base)


@pytest.mark.parametrize("name", FAMILY_MODELS)
def test_patched_as_built_by_from_pretrained(name, checkpoint, load, monkeypatch):
    """Every model patched as it is constructed (``post_init``), which ``from_pretrained`` does under
    a meta default device and, with ``dtype``, a bfloat16 default dtype: the patch (its probing of
    upstream's helpers included) does not depend on either, and the loaded model computes as
    upstream's."""
    from torchembed.patches.rope import recognition

    monkeypatch.setattr(recognition, "_RECOGNIZED", {})  # probe upstream's helpers anew, here
    post_init = transformers.PreTrainedModel.post_init
    built = []

    def patching_post_init(self):
        post_init(self)
        built.append(torchembed.is_patched(torchembed.patch(self)))

    upstream = load(name, dtype=torch.bfloat16)
    monkeypatch.setattr(transformers.PreTrainedModel, "post_init", patching_post_init)
    model = load_upstream(type(upstream), checkpoint(name), dtype=torch.bfloat16).eval()
    monkeypatch.undo()
    assert built and all(built) and torchembed.is_patched(model)
    inputs = _inputs(model)
    expected = _out(upstream, inputs)
    torch.testing.assert_close(_out(model, inputs), expected, rtol=1.6e-2, atol=3e-2 * expected.abs().max().item())
