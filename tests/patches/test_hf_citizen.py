"""A patched model is a full HF model: what transformers, accelerate and PEFT do with a model works.

Each test compares a patched model with an upstream copy put through the same steps.
"""

import copy
import inspect
import io
import pickle

import pytest
import torch

import torchembed
from torchembed.patches.loading import load_upstream

transformers = pytest.importorskip("transformers")
FAMILIES = ["llama", "mistral", "falcon", "falcon-alibi", "bloom", "mpt", "bert", "gpt2"]
CAUSAL = [name for name in FAMILIES if name != "bert"]


def _ids(model, batch=2, length=9, seed=0):
    return torch.randint(0, model.config.vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed))


def _out(model, ids, **kwargs):
    with torch.no_grad():
        out = model(input_ids=ids, **kwargs)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def _close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item() + 1e-7)


def _pair(load, name, **kwargs):
    upstream = load(name, **kwargs)
    return upstream, torchembed.patch(copy.deepcopy(upstream))


@pytest.mark.parametrize("name", FAMILIES)
def test_init_weights_post_init_and_resize_token_embeddings(name, load):
    """HF re-initialises every module it knows (rotary buffers, position tables) on a patched model
    as on upstream's; resizing the vocabulary works; the results agree."""
    upstream, patched = _pair(load, name)
    for model in (upstream, patched):
        torch.manual_seed(7)
        model.init_weights()
        model.post_init()
        model.resize_token_embeddings(model.config.vocab_size + 8)
    assert torchembed.is_patched(patched)
    for (key, a), (_, b) in zip(upstream.state_dict().items(), patched.state_dict().items()):
        assert torch.equal(a, b), key
    ids = _ids(upstream)
    _close(_out(patched, ids), _out(upstream, ids))


def test_patched_base_model_inside_another_hf_model_and_missing_keys(checkpoint):
    """A patched base model wrapped in a task model (``post_init`` walks it), and a checkpoint
    loaded into a class with keys it lacks (HF initialises the missing ones), patched on load."""
    path = checkpoint("llama")
    base = torchembed.from_pretrained(path, model_class=transformers.LlamaModel)
    head = transformers.LlamaForSequenceClassification(base.config)
    head.model = base
    head.post_init()
    assert torchembed.is_patched(base)
    scores = torchembed.from_pretrained(path, model_class=transformers.LlamaForSequenceClassification)
    plain = load_upstream(transformers.LlamaForSequenceClassification, path)
    plain.score.load_state_dict(scores.score.state_dict())
    ids = _ids(plain, batch=1)
    _close(_out(scores.eval(), ids), _out(plain.eval(), ids))


def test_yarn_config_without_original_max_position_embeddings():
    """Any config HF's own rotary module accepts: the patched model keeps that module."""
    config = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                                      num_hidden_layers=2, vocab_size=128, max_position_embeddings=64,
                                      rope_scaling={"rope_type": "yarn", "factor": 4.0})
    torch.manual_seed(0)
    upstream = transformers.LlamaForCausalLM(config).eval()
    patched = torchembed.patch(copy.deepcopy(upstream))
    ids = _ids(upstream, length=40)
    _close(_out(patched, ids), _out(upstream, ids))


@pytest.mark.parametrize("name", [n for n in CAUSAL if n != "falcon-alibi"])  # its own test: test_falcon_alibi.py
def test_output_attentions_as_upstream(name, load):
    """Whatever upstream returns for ``output_attentions`` (per-layer weights, or nothing under
    sdpa), the patched model returns the same; eager attention gives the weights."""
    for impl in ("eager", None):
        kwargs = {} if impl is None else {"attn_implementation": impl}
        try:
            upstream, patched = _pair(load, name, **kwargs)
        except ValueError:  # not offered by this model
            continue
        ids = _ids(upstream)
        with torch.no_grad():
            ref = upstream(input_ids=ids, output_attentions=True).attentions
            out = patched(input_ids=ids, output_attentions=True).attentions
        assert (ref is None) == (out is None) and len(ref or ()) == len(out or ())
        for a, b in zip(out or (), ref or ()):
            assert (a is None) == (b is None)
            if a is not None:
                _close(a, b)
        if impl == "eager" and upstream.config.model_type != "falcon":  # falcon rotary/eager: sdpa-only weights
            assert ref and all(a is not None and a.dim() == 4 for a in ref)


@pytest.mark.parametrize("name", CAUSAL)
def test_generate_dict_outputs_beam_search_and_assisted_decoding(name, load):
    """Dict outputs with attentions, beam search and assisted decoding give upstream's tokens and
    scores; what upstream refuses patched refuses alike. MPT is compared with upstream asked for its cache
    (``use_cache=True``, what a patched MPT's generation config says; upstream's own config refuses assisted
    decoding for want of a cache). Falcon-ALiBi is compared with upstream's sdpa function without weights
    (upstream's eager path, taken for weights, adds the bias twice)."""
    upstream, patched = _pair(load, name)
    ids = _ids(upstream, batch=1, length=6)
    common = dict(max_new_tokens=4, do_sample=False, pad_token_id=0, return_dict_in_generate=True, output_scores=True)
    for kwargs in (dict(output_attentions=True), dict(num_beams=3), dict(assistant_model=copy.deepcopy(upstream))):
        reference = dict(kwargs, use_cache=True) if name == "mpt" else dict(kwargs)
        if name == "falcon-alibi":
            reference.pop("output_attentions", None)
        try:
            with torch.no_grad():
                ref = upstream.generate(ids, **common, **reference)
        except (ValueError, RuntimeError) as err:  # the error type differs across releases
            with pytest.raises(type(err)):
                patched.generate(ids, **common, **kwargs)
            continue
        with torch.no_grad():
            out = patched.generate(ids, **common, **kwargs)
        assert torch.equal(out.sequences, ref.sequences), kwargs.keys()
        for a, b in zip(out.scores, ref.scores):
            finite = torch.isfinite(b)
            assert torch.equal(torch.isfinite(a), finite)
            _close(a[finite], b[finite])


@pytest.mark.parametrize("name", FAMILIES)
def test_deepcopy_then_unpatch_the_copy(name, load):
    upstream = load(name)
    patched = torchembed.patch(copy.deepcopy(upstream))
    clone = copy.deepcopy(patched)
    ids = _ids(upstream)
    torchembed.unpatch(clone)
    assert not torchembed.is_patched(clone) and torchembed.is_patched(patched)
    assert all("forward" not in vars(m) for m in clone.modules())
    assert torch.equal(_out(clone, ids), _out(upstream, ids))
    _close(_out(patched, ids), _out(upstream, ids))


@pytest.mark.parametrize("name", FAMILIES)
def test_torch_save_and_pickle_of_a_patched_model(name, load):
    upstream = load(name)
    patched = torchembed.patch(copy.deepcopy(upstream))
    buffer = io.BytesIO()
    torch.save(patched, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    again = pickle.loads(pickle.dumps(patched))
    ids = _ids(upstream)
    for model in (loaded, again):
        assert torchembed.is_patched(model)
        assert torch.equal(_out(model, ids), _out(patched, ids))
        torchembed.unpatch(model)
        assert torch.equal(_out(model, ids), _out(upstream, ids))


def test_pickled_model_in_a_fresh_process(load, tmp_path):
    """What a multiprocessing hand-off does: pickle here, unpickle in a new interpreter (nothing of
    this process's clones or caches there), run; the logits are this process's."""
    import subprocess
    import sys

    patched = torchembed.patch(load("llama"))
    ids = _ids(patched)
    with open(tmp_path / "model.pkl", "wb") as f:
        pickle.dump((patched, ids), f)
    script = (
        "import pickle, sys, torch, torchembed\n"
        "model, ids = pickle.load(open(sys.argv[1], 'rb'))\n"
        "assert torchembed.is_patched(model)\n"
        "with torch.no_grad():\n"
        "    torch.save(model(input_ids=ids).logits, sys.argv[2])\n"
    )
    subprocess.run([sys.executable, "-c", script, tmp_path / "model.pkl", tmp_path / "out.pt"], check=True, timeout=300)
    assert torch.equal(torch.load(tmp_path / "out.pt"), _out(patched, ids))


@pytest.mark.parametrize("order", ["patch-then-peft", "peft-then-patch"])
@pytest.mark.parametrize("name", ["llama", "bloom", "gpt2"])
def test_peft_lora_training_step_and_merge(name, order, load):
    """LoRA on a patched model: forward, backward and an optimizer step match upstream's LoRA in
    float32 (1e-5); ``merge_and_unload`` gives a model that is still patched."""
    peft = pytest.importorskip("peft")
    targets = {"llama": ["q_proj", "v_proj"], "bloom": ["query_key_value"], "gpt2": ["c_attn"]}[name]

    def lora(model):
        config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0, init_lora_weights=False,
                                 fan_in_fan_out=name == "gpt2")
        torch.manual_seed(5)
        return peft.get_peft_model(model, config)

    upstream = lora(load(name))
    patched = lora(torchembed.patch(load(name))) if order == "patch-then-peft" else torchembed.patch(lora(load(name)))
    assert torchembed.is_patched(patched)
    ids = _ids(upstream)
    losses = []
    for model in (upstream, patched):
        model.train()
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
        torch.manual_seed(11)  # the same dropout masks
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)
    trained = {k: v for k, v in upstream.named_parameters() if "lora" in k}
    for key, value in patched.named_parameters():
        if "lora" in key:
            torch.testing.assert_close(value, trained[key], rtol=1e-5, atol=1e-7)
    merged_up, merged = upstream.merge_and_unload().eval(), patched.merge_and_unload().eval()
    assert torchembed.is_patched(merged) and not torchembed.is_patched(merged_up)
    _close(_out(merged, ids), _out(merged_up, ids))


def _replicate(model, scale):
    """What ``torch.nn.parallel.replicate`` does to each module (it needs CUDA devices to broadcast):
    ``_replicate_for_data_parallel`` (a ``__dict__`` copy), then the replica's own parameters (here
    the originals times ``scale``, so a replica computing with the original's weights is seen)."""
    replicas = {module: module._replicate_for_data_parallel() for module in model.modules()}
    for module, replica in replicas.items():
        for name, child in module._modules.items():
            replica._modules[name] = None if child is None else replicas[child]
        for name, param in module._parameters.items():
            replica._parameters[name] = None if param is None else param.detach() * scale
    return replicas[model]


@pytest.mark.parametrize("name", FAMILIES)
def test_data_parallel_replicas_compute_with_their_own_weights(name, load):
    """``nn.DataParallel`` (and HF Trainer on several GPUs without torchrun) runs replicas made by
    copying each module's ``__dict__``: torchembed's per-instance methods must follow the replica,
    not keep computing with the original module's weights (or device)."""
    upstream, patched = _pair(load, name)
    ids = _ids(upstream)
    _close(_out(_replicate(patched, 0.5), ids), _out(_replicate(upstream, 0.5), ids))
    assert torchembed.is_patched(patched)
    torchembed.unpatch(patched)
    assert not any("_replicate_for_data_parallel" in vars(m) for m in patched.modules())
    _close(_out(_replicate(patched, 0.5), ids), _out(_replicate(upstream, 0.5), ids))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@pytest.mark.parametrize("name", ["llama", "falcon", "bloom"])
def test_data_parallel_forward_on_two_gpus(name, load):
    upstream, patched = _pair(load, name)
    ids = _ids(upstream, batch=4).cuda()
    for model in (upstream, patched):
        model.cuda()
    expected = _out(upstream, ids)
    _close(_out(torch.nn.DataParallel(patched, device_ids=[0, 1]), ids), expected)


@pytest.mark.parametrize("name", ["bert", "gpt2", "llama"])
def test_hf_fx_symbolic_trace_where_upstream_traces(name, load):
    """transformers 4.x exports models with ``transformers.utils.fx.symbolic_trace`` (its model
    tests run it for BERT): a patched model traces wherever upstream does, to the same function."""
    fx = pytest.importorskip("transformers.utils.fx", reason="transformers 5 removed its fx tracer")
    upstream, patched = _pair(load, name)
    ids = _ids(upstream)
    inputs = dict(input_ids=ids, attention_mask=torch.ones_like(ids))
    for model in (upstream, patched):
        model.config.use_cache = False
    try:
        traced_upstream = fx.symbolic_trace(upstream, input_names=list(inputs))
    except Exception as err:  # noqa: BLE001  (e.g. GPT-2 and LLaMA in 4.57: upstream's own fx fails)
        pytest.skip(f"upstream does not trace here: {type(err).__name__}")
    traced = fx.symbolic_trace(patched, input_names=list(inputs))
    key = "logits" if hasattr(upstream, "lm_head") else "last_hidden_state"
    expected = traced_upstream(**inputs)[key]
    _close(traced(**inputs)[key], expected)
    _close(_out(patched, ids, attention_mask=inputs["attention_mask"]), expected)


def _disk_map(model):
    """A ``device_map`` putting the children of the base model on disk, but for the token embedding
    (tied to the head, it stays on the CPU with the head) and the last child (transformers 5.0 does
    not dispatch a model with nothing on an execution device: its outputs came out on meta)."""
    base = getattr(model, model.base_model_prefix, model)
    prefix = "" if base is model else model.base_model_prefix + "."
    names = [name for name, _ in base.named_children()]
    device_map = {prefix + name: "cpu" if name in ("wte", "word_embeddings", "embed_tokens") or name == names[-1]
                  else "disk" for name in names}
    if base is not model:
        device_map.update({name: "cpu" for name, _ in model.named_children() if name != model.base_model_prefix})
    return device_map


@pytest.mark.parametrize("name", FAMILIES)
def test_disk_offload_dispatched_before_or_after_the_patch(name, checkpoint, load, tmp_path):
    """accelerate keeps offloaded weights on disk and loads them in a hook on each call: a model
    loaded with an offloading ``device_map`` and then patched (``torchembed.from_pretrained``
    included), and a patched model offloaded by ``accelerate.cpu_offload``, compute as upstream
    and again after ``unpatch`` (a swapped position table carries the hook both ways)."""
    accelerate = pytest.importorskip("accelerate")
    upstream = load(name)
    ids = _ids(upstream)
    expected = _out(upstream, ids)
    device_map = _disk_map(upstream)
    assert "disk" in device_map.values()
    loaded = torchembed.from_pretrained(checkpoint(name), device_map=device_map, offload_folder=str(tmp_path)).eval()
    assert torchembed.is_patched(loaded)
    _close(_out(loaded, ids), expected)
    torchembed.unpatch(loaded)
    _close(_out(loaded, ids), expected)

    patched = torchembed.patch(load(name))
    accelerate.cpu_offload(patched, execution_device="cpu")
    _close(_out(patched, ids), expected)
    torchembed.unpatch(patched)
    _close(_out(patched, ids), expected)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@pytest.mark.parametrize("name", ["llama", "bloom"])
def test_trainer_on_two_gpus_without_torchrun(name, load, tmp_path):
    """HF ``Trainer`` in one process with two GPUs wraps the model in ``nn.DataParallel``: a patched
    model trains there with the losses of upstream's."""
    pytest.importorskip("accelerate")
    batches = [{"input_ids": row, "labels": row} for row in _ids(load(name), batch=16, length=12, seed=3)]
    losses = {}
    for variant in ("upstream", "patched"):
        model = load(name).train()
        if variant == "patched":
            torchembed.patch(model)
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / variant), per_device_train_batch_size=4, max_steps=3, learning_rate=1e-3,
            logging_steps=1, report_to=[], save_strategy="no", seed=0, dataloader_num_workers=0,
        )
        trainer = transformers.Trainer(model=model, args=args, train_dataset=batches)
        assert trainer.args.n_gpu == 2
        trainer.train()
        assert isinstance(trainer.model_wrapped, torch.nn.DataParallel)
        losses[variant] = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses["patched"]) == 3
    torch.testing.assert_close(losses["patched"], losses["upstream"], rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("name", ["llama", "bloom", "gpt2"])
def test_trainer_checkpoint_and_resume(name, load, tmp_path):
    """HF ``Trainer`` trains a patched model, saves checkpoints and resumes from one into a freshly
    loaded patched model: the losses are upstream's, before and after the resume."""
    batches = [{"input_ids": row, "labels": row} for row in _ids(load(name), batch=8, length=12, seed=5)]

    def train(variant, resume=False):
        model = load(name).train()
        if variant == "patched":
            torchembed.patch(model)
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / variant), per_device_train_batch_size=2, max_steps=4, learning_rate=1e-3,
            logging_steps=1, report_to=[], save_strategy="steps", save_steps=2, seed=0, use_cpu=True,
            dataloader_num_workers=0,
        )
        trainer = transformers.Trainer(model=model, args=args, train_dataset=batches)
        trainer.train(resume_from_checkpoint=str(tmp_path / variant / "checkpoint-2") if resume else None)
        assert torchembed.is_patched(trainer.model) == (variant == "patched")
        return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]

    upstream, patched = train("upstream"), train("patched")
    assert len(patched) == 4
    torch.testing.assert_close(patched, upstream, rtol=1e-4, atol=1e-5)
    resumed = train("patched", resume=True)  # steps 3 and 4 again, from the saved optimizer state
    assert len(resumed) == 4  # the checkpoint's history, then the two steps run again
    torch.testing.assert_close(resumed, patched, rtol=1e-4, atol=1e-5)


def test_a_patched_mpt_generates_with_its_kv_cache_and_unpatch_restores_the_config(load):
    """``MptConfig`` (MPT-7B's config.json too) turns the cache off, so upstream's plain ``generate`` re-runs the whole
    prefix for every token. A patched MPT's plain ``generate`` keeps a KV cache (that instance's generation config,
    listed among the patch's components), with upstream's tokens under ``use_cache=True`` (float32); another
    instance keeps its own config, and ``unpatch`` restores the original object."""
    upstream = load("mpt")
    assert upstream.generation_config.use_cache is False
    original = upstream.generation_config
    patched = torchembed.patch(copy.deepcopy(upstream))
    assert any(c.kind == "generation" for c in torchembed.find_positional_components(patched))
    fed = []  # the tokens each forward is fed: the new token alone once a cache holds the rest
    forward = patched.transformer.forward
    patched.transformer.forward = lambda *a, **kw: fed.append((a[0] if a else kw["input_ids"]).shape[-1]) or forward(*a, **kw)
    ids = torch.randint(1, upstream.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = upstream.generate(ids, max_new_tokens=5, do_sample=False, use_cache=True, pad_token_id=0)
        got = patched.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
    del patched.transformer.forward
    assert torch.equal(want, got)
    assert fed == [12, 1, 1, 1, 1], fed  # every step after the prefill reads the cache (else 12, 13, 14, ...)
    assert upstream.generation_config is original and original.use_cache is False
    kept = patched.generation_config
    torchembed.unpatch(patched)
    assert patched.generation_config is not kept and patched.generation_config.use_cache is False


def test_continuous_batching_generate_batch_gives_upstreams_tokens():
    """transformers' continuous batching (``generate_batch``: paged cache, requests of different lengths scheduled
    together) on a patched LLaMA: upstream's greedy tokens (float32), the rotation torchembed's (upstream's helper
    never called)."""
    from transformers import GenerationConfig

    from tests.helpers import counting_calls, upstream_rotation_helpers

    if not hasattr(transformers.LlamaForCausalLM, "generate_batch"):
        pytest.skip(f"transformers {transformers.__version__} has no generate_batch")
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                      num_key_value_heads=2, num_hidden_layers=2, vocab_size=96,
                                      attn_implementation="sdpa")
    torch.manual_seed(0)
    upstream = transformers.LlamaForCausalLM(config).eval()
    patched = torchembed.patch(copy.deepcopy(upstream))
    gen = torch.Generator().manual_seed(1)
    requests = [torch.randint(1, 96, (n,), generator=gen).tolist() for n in (7, 12, 5)]
    # a bounded paged cache: sized by default from the GPU's free memory, which other test processes share
    limits, extra = dict(num_blocks=16, max_batch_tokens=64), {}
    if "continuous_batching_config" in inspect.signature(transformers.LlamaForCausalLM.generate_batch).parameters:
        extra["continuous_batching_config"] = transformers.ContinuousBatchingConfig(**limits)
        limits = {}
    settings = GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=-1, pad_token_id=0, **limits)

    def tokens(model):
        out = model.generate_batch(inputs=requests, generation_config=settings, **extra)
        return [out[key].generated_tokens for key in sorted(out)]

    want = tokens(upstream)
    if not want:  # (4.57's continuous batching generates nothing on a CPU: no request comes back)
        pytest.skip(f"transformers {transformers.__version__}'s generate_batch returns no request here")
    with counting_calls(upstream_rotation_helpers(upstream)) as calls:
        got = tokens(patched)
    assert got == want and len(got) == 3 and all(len(t) == 6 for t in got)
    assert not calls, calls


def test_compare_says_when_the_patch_keeps_generates_cache(checkpoint):
    """``torchembed compare`` notes MPT's kept KV cache (and no other family's)."""
    from torchembed.tools.compare import compare

    report = compare([str(checkpoint("mpt")), str(checkpoint("llama"))], dtypes=("float32",),
                     attn_implementations=("eager",), seq_len=8)
    notes = {row.family: row.note for row in report.rows}
    assert "KV cache" in notes["mpt"] and "KV cache" not in notes["llama"], notes
