"""A patched model's decode steps replayed from a CUDA graph (torchembed.patches.decode_graphs).

On any device: a step over the cache's room (what a graph captures) computes upstream's step, leaves the cache as
upstream's update would, and the decision refuses every call a graph would get wrong. On CUDA: plain ``generate``
replays its steps and gives upstream's tokens (float32), across room growth, padding, beam search and hand-written loops.
"""

import copy
import gc
import inspect
import pickle
import sys
import threading
import weakref

import pytest
import torch

transformers = pytest.importorskip("transformers")

import torchembed  # noqa: E402
from torchembed.patches import decode_graphs as dg  # noqa: E402
from torchembed.patches.kv_cache import has_room, room_for  # noqa: E402

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
# float32 on both sides, the same operations but for the masked keys' zero terms in the softmax sums: a few ulp
ATOL = RTOL = 2e-5


def tiny(model_type, device="cpu", **extra):
    kwargs = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=1024, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if model_type == "gemma":
        kwargs["head_dim"] = 16
    if model_type == "mistral":
        kwargs["sliding_window"] = None
    kwargs.update(extra)
    config = transformers.AutoConfig.for_model(model_type, **kwargs)
    implementation = {} if model_type in dg.PADDING_MASK_TYPES else {"attn_implementation": "sdpa"}  # (BLOOM, MPT: eager)
    model = transformers.AutoModelForCausalLM.from_config(config, **implementation)
    return model.to(device).eval()


def prefill(model, batch=2, length=7, device="cpu"):
    """A prompt with the first row left-padded, its cache, the next ids and the mask for the next step."""
    ids = torch.randint(3, 128, (batch, length), device=device)
    mask = torch.ones(batch, length, dtype=torch.long, device=device)
    mask[0, :3] = 0
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, use_cache=True)
    step_mask = torch.cat([mask, mask.new_ones(batch, 1)], 1)
    return out.past_key_values, out.logits[:, -1:].argmax(-1), step_mask


def step_kwargs(cache, ids, mask):
    kwargs = dict(input_ids=ids, past_key_values=cache, attention_mask=mask, use_cache=True, return_dict=True)
    if dg._takes_cache_position(transformers.LlamaForCausalLM):  # transformers 4.x: generate passes it
        kwargs["cache_position"] = torch.tensor([cache.get_seq_length()], device=ids.device)
    return kwargs


def over_the_room(model, step):
    """One step as a graph captures it, run eagerly (the rooms as a replayed step takes them); the cache's layers made
    views of the rooms again, as a replayed step hands them back."""
    graphs = model.__dict__[dg._STATE]
    rooms = graphs.rooms_for(step)
    inputs = dg.FixedShapeStep.for_step(step, rooms)
    inputs.load(step)
    out = inputs.run(model)
    graphs.hand_back(step, rooms)
    return type(out)(logits=out.logits, past_key_values=step.cache)


@pytest.mark.parametrize("model_type", sorted(dg.GRAPHED_MODEL_TYPES))
def test_a_step_over_the_room_is_upstreams_step(model_type):
    torch.manual_seed(0)
    model = torchembed.patch(tiny(model_type))
    cache, ids, mask = prefill(model)
    ours = cache
    theirs = copy.deepcopy(cache)
    if model_type in dg.PADDING_MASK_TYPES and dg.padding_mask_refusal() is not None:  # (transformers < 5.21)
        with torch.no_grad():
            assert dg.inspect_step(model, (), step_kwargs(ours, ids, mask)) == dg.padding_mask_refusal()
        return
    for _ in range(3):  # the first step makes the rooms, the next ones write into them
        with torch.no_grad():
            expected = type(model).forward(model, **step_kwargs(theirs, ids, mask))
            step = dg.inspect_step(model, (), step_kwargs(ours, ids, mask))
            assert isinstance(step, dg.Step), step
            got = over_the_room(model, step)
        torch.testing.assert_close(got.logits, expected.logits, atol=ATOL, rtol=RTOL)
        assert got.past_key_values is ours
        assert (step.rooms is not None) == (_ > 0)  # (after the first step: the cache as that step left it)
        for mine, upstream in zip(ours.layers, theirs.layers):
            assert has_room(mine)
            torch.testing.assert_close(mine.keys, upstream.keys, atol=ATOL, rtol=RTOL)
            torch.testing.assert_close(mine.values, upstream.values, atol=ATOL, rtol=RTOL)
        ids = expected.logits[:, -1:].argmax(-1)
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], 1)


@pytest.mark.parametrize("model_type", ["llama", "bloom", "mpt"])
def test_one_steps_inputs_serve_a_cache_cropped_within_its_room(model_type):
    """A captured step's inputs are loaded again for every step over the same rooms, also one over fewer tokens
    (a crop, as assisted decoding makes): the mask past the step's token is cleared, so the keys the earlier steps
    wrote there are not read."""
    if model_type in dg.PADDING_MASK_TYPES and dg.padding_mask_refusal() is not None:
        pytest.skip(dg.padding_mask_refusal())
    torch.manual_seed(0)
    with torch.no_grad():
        model = torchembed.patch(tiny(model_type))
        cache, ids, mask = prefill(model)
        theirs, graphs = copy.deepcopy(cache), None
        inputs = None
        for tokens in (8, 5):  # (a step after 7 cached tokens, then one after cropping to 4)
            if tokens < 8:
                cache.crop(-(8 - tokens) - 1)
                theirs.crop(-(8 - tokens) - 1)
            step_mask = mask[:, :tokens]
            expected = type(model).forward(model, **step_kwargs(theirs, ids, step_mask))
            step = dg.inspect_step(model, (), step_kwargs(cache, ids, step_mask))
            graphs = model.__dict__[dg._STATE]
            rooms = graphs.rooms_for(step)
            inputs = inputs or dg.FixedShapeStep.for_step(step, rooms)
            assert [k.data_ptr() for k, _ in inputs.rooms] == [k.data_ptr() for k, _ in rooms]  # (the same rooms)
            inputs.load(step)
            got = inputs.run(model)
            graphs.hand_back(step, rooms)
            torch.testing.assert_close(got.logits, expected.logits, atol=ATOL, rtol=RTOL)
            for mine, upstream in zip(cache.layers, theirs.layers):
                torch.testing.assert_close(mine.keys, upstream.keys, atol=ATOL, rtol=RTOL)


def test_mpts_rooms_are_cut_at_its_alibi_table_and_steps_past_it_run_upstreams_way():
    """MPT's ALiBi table covers ``config.max_seq_len`` keys (upstream's attention fails past it): a graphed step sees
    each room cut there, so its keys never outnumber the table while the cache's tokens fit; a step past the table
    is not replayed (the eager step raises as upstream's does)."""
    if dg.padding_mask_refusal() is not None:
        pytest.skip(dg.padding_mask_refusal())
    torch.manual_seed(0)
    model = torchembed.patch(tiny("mpt", max_seq_len=11))
    cache, ids, mask = prefill(model)  # 7 tokens cached
    theirs = copy.deepcopy(cache)
    with torch.no_grad():
        for _ in range(4):  # steps after 7, 8, 9 and 10 tokens: the last one fills the table
            expected = type(model).forward(model, **step_kwargs(theirs, ids, mask))
            step = dg.inspect_step(model, (), step_kwargs(cache, ids, mask))
            assert isinstance(step, dg.Step) and step.limit == 11, step
            got = over_the_room(model, step)
            assert all(keys.shape[-2] == 11 for keys, _ in model.__dict__[dg._STATE].rooms_for(step))
            torch.testing.assert_close(got.logits, expected.logits, atol=ATOL, rtol=RTOL)
            ids = expected.logits[:, -1:].argmax(-1)
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], 1)
        assert "ALiBi table" in dg.inspect_step(model, (), step_kwargs(cache, ids, mask))
        with pytest.raises(ValueError, match="exceed MPT's ALiBi table"):
            model(**step_kwargs(cache, ids, mask))


def test_alibi_steps_are_refused_where_transformers_builds_the_eager_mask_on_the_host(monkeypatch):
    """Before 5.21 transformers' eager causal mask (BLOOM's, MPT's) is made with ``torch.tensor(0.0, device=...)``,
    a host-to-device copy that fails a CUDA graph's capture: such steps are refused up front, not captured to fail."""
    torch.manual_seed(0)
    model = torchembed.patch(tiny("bloom"))
    cache, ids, mask = prefill(model)
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "5.20.0")  # (the module imported now)
    dg.padding_mask_refusal.cache_clear()
    try:
        with torch.no_grad():
            why = dg.inspect_step(model, (), step_kwargs(cache, ids, mask))
        assert isinstance(why, str) and ("5.21" in why or "cache's length" in why), why
        llama = torchembed.patch(tiny("llama"))  # (its step takes a keep mask: not concerned)
        cache, ids, mask = prefill(llama)
        with torch.no_grad():
            assert isinstance(dg.inspect_step(llama, (), step_kwargs(cache, ids, mask)), dg.Step)
    finally:
        monkeypatch.undo()
        dg.padding_mask_refusal.cache_clear()


def test_a_cache_as_the_last_step_left_it_skips_the_layer_checks_and_anything_else_is_checked_again(monkeypatch):
    """The decision checks each cache layer (its tokens, its room, whether beam search replaced its tensors) unless
    the cache is the one the last step handed back and every layer holds the views it was given, found by identity;
    a crop, a reorder or an eager step's update replaces them and the layers are checked again. What is remembered
    is held weakly: the cache goes when its owner drops it."""
    torch.manual_seed(0)
    with torch.no_grad():
        model = torchembed.patch(tiny("llama"))
        cache, ids, mask = prefill(model)
        checked, replaced = [], dg.room_replaced
        monkeypatch.setattr(dg, "room_replaced", lambda layer: checked.append(layer) or replaced(layer))
        step = dg.inspect_step(model, (), step_kwargs(cache, ids, mask))
        assert step.rooms is None and len(checked) == 2  # (a cache never handed back: each layer checked)
        over_the_room(model, step)
        mask = torch.cat([mask, mask.new_ones(2, 1)], 1)
        checked.clear()
        step = dg.inspect_step(model, (), step_kwargs(cache, ids, mask))
        assert step.rooms is not None and not checked and step.filled == 8
        assert [room[0].data_ptr() for room in step.rooms] == [room_for(layer, 0)[0].data_ptr() for layer in cache.layers]
        over_the_room(model, step)
        cache.crop(-1)  # (the layers now hold other views of their rooms: checked again, and taken)
        step = dg.inspect_step(model, (), step_kwargs(cache, ids, mask))
        assert step.rooms is None and len(checked) == 2 and step.filled == 8
        over_the_room(model, step)
        cache.layers[1].keys = cache.layers[1].keys[[1, 0]]  # (what beam search's reorder does to a layer)
        mask = torch.cat([mask, mask.new_ones(2, 1)], 1)
        assert "replaced" in dg.inspect_step(model, (), step_kwargs(cache, ids, mask))
        other, _, _ = prefill(model)
        assert dg.inspect_step(model, (), step_kwargs(other, ids, mask[:, :-2])).rooms is None  # (another cache)
    gone = weakref.ref(cache)
    del cache, step, other
    gc.collect()
    assert gone() is None and model.__dict__[dg._STATE].handed.cache() is None


def test_new_room_space_is_zero_not_new_memory():
    layer = transformers.cache_utils.DynamicLayer()
    layer.update(torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8))
    keys, values = room_for(layer, 1)
    assert keys.shape[-2] >= 6
    assert not keys[..., 5:, :].any() and not values[..., 5:, :].any()  # a masked slot holding NaN poisons SDPA


@pytest.mark.parametrize("layout", ["16-byte elements", "head dim of 6 bytes", "strided cache"])
def test_a_move_into_a_room_keeps_every_byte_and_zeroes_the_space(layout):
    """A move copies the cache read as 16-byte elements where the layout allows, else as it is: either way the room's
    first tokens are the cache's, byte for byte (random bits: NaN and denormal patterns included), and its space is
    zero, not the new memory's contents (NaN here)."""
    from torchembed.patches import kv_cache

    dim = 3 if layout == "head dim of 6 bytes" else 8
    bits = torch.randint(-2**15, 2**15, (2, 7, 3, dim), dtype=torch.int16, generator=torch.Generator().manual_seed(0))
    cache = bits.view(torch.bfloat16).transpose(1, 2)  # (2, 3, 7, dim)
    if layout != "strided cache":
        cache = cache.contiguous()
    room = torch.full((2, 3, 11, dim), float("nan"), dtype=torch.bfloat16)
    assert kv_cache._widens(room[..., :7, :], cache) == (layout != "head dim of 6 bytes")  # (strided rows of 16 bytes too)
    kv_cache.move_into(room, cache)
    assert torch.equal(room[..., :7, :].view(torch.int16), cache.view(torch.int16))
    assert torch.equal(room[..., 7:, :].view(torch.int16), torch.zeros(2, 3, 4, dim, dtype=torch.int16))


def test_a_layer_moved_into_its_room_lets_go_of_its_old_tensors():
    """A graphed step makes every layer's room before it runs: each layer must drop its old keys and values as its
    room is made, or the whole cache is held twice at that step (a 65k full-depth MPT ran out of memory on 80 GB)."""
    layer = transformers.cache_utils.DynamicLayer()
    layer.update(torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8))
    before = layer.keys.clone()
    old = weakref.ref(layer.keys), weakref.ref(layer.values)
    keys, _ = room_for(layer, 1)
    gc.collect()
    assert old[0]() is None and old[1]() is None
    assert has_room(layer) and layer.keys.shape[-2] == 5 and torch.equal(layer.keys, before)
    assert layer.keys.data_ptr() == keys.data_ptr()


def test_the_decision_refuses_what_a_graph_would_get_wrong():
    torch.manual_seed(0)
    model = torchembed.patch(tiny("llama"))
    cache, ids, mask = prefill(model)
    good = step_kwargs(cache, ids, mask)
    assert dg.decode_graph_step(model, (), good) == "the input ids are not a CUDA tensor"
    with torch.no_grad():
        assert isinstance(dg.inspect_step(model, (), good), dg.Step)
        refused = {
            "prefill": dg.inspect_step(model, (), {**good, "input_ids": torch.cat([ids, ids], 1)}),
            "attentions": dg.inspect_step(model, (), {**good, "output_attentions": True}),
            "labels": dg.inspect_step(model, (), {**good, "labels": ids}),
            "unknown": dg.inspect_step(model, (), {**good, "token_type_ids": ids}),
            "no cache": dg.inspect_step(model, (), {**good, "use_cache": False}),
            "bad mask": dg.inspect_step(model, (), {**good, "attention_mask": mask[:, 1:]}),
            "tuple": dg.inspect_step(model, (), {**good, "return_dict": False}),
        }
    refused["autograd"] = dg.inspect_step(model, (), good)
    assert all(isinstance(why, str) for why in refused.values()), refused
    with torch.no_grad():
        model.train()
        assert isinstance(dg.inspect_step(model, (), good), str)
        model.eval()
        handle = model.model.layers[0].mlp.register_forward_hook(lambda *a: None)
        assert "hooks" in dg.inspect_step(model, (), good)  # (a hook registered since the last scan: scanned again)
        handle.remove()
        assert isinstance(dg.inspect_step(model, (), good), str)  # (no new hook: the same cache's verdict kept)
        assert isinstance(dg.inspect_step(model, (), step_kwargs(copy.deepcopy(cache), ids, mask)), dg.Step)
        mlp = model.model.layers[0].mlp
        original = mlp.down_proj
        mlp.down_proj = Adapted(original.in_features, original.out_features, bias=False)  # e.g. PEFT's LoRA layer
        assert "Adapted" in dg.inspect_step(model, (), step_kwargs(copy.deepcopy(cache), ids, mask))
        mlp.down_proj = original
        beams = copy.deepcopy(cache)
        over_the_room(model, dg.inspect_step(model, (), step_kwargs(beams, ids, mask)))
        beams.reorder_cache(torch.tensor([1, 0]))  # beam search: new tensors, not views of the rooms
        assert "replaced" in dg.inspect_step(model, (), step_kwargs(beams, ids, torch.cat([mask, mask[:, :1]], 1)))
        windowed = torchembed.patch(tiny("qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=0))
        cache, ids, mask = prefill(windowed)
        assert isinstance(dg.inspect_step(windowed, (), step_kwargs(cache, ids, mask)), str)


class Adapted(torch.nn.Linear):
    """A module from outside torch and transformers, whose Python may change what it computes between calls."""


def test_the_module_scan_runs_once_per_cache_unless_a_hook_is_registered(monkeypatch):
    torch.manual_seed(0)
    model = torchembed.patch(tiny("llama"))
    cache, ids, mask = prefill(model)
    scans = []
    original = dg._modules_differ
    monkeypatch.setattr(dg, "_modules_differ", lambda m: scans.append(1) or original(m))
    with torch.no_grad():
        for _ in range(3):
            assert isinstance(dg.inspect_step(model, (), step_kwargs(cache, ids, mask)), dg.Step)
        assert len(scans) == 1
        other = copy.deepcopy(cache)
        assert isinstance(dg.inspect_step(model, (), step_kwargs(other, ids, mask)), dg.Step)
        assert len(scans) == 2  # another cache: another generate call
        model.lm_head.register_forward_pre_hook(lambda *a: None).remove()
        assert isinstance(dg.inspect_step(model, (), step_kwargs(other, ids, mask)), dg.Step)
        assert len(scans) == 3  # a hook registered (and removed) since: scanned again


def test_patch_installs_the_forward_for_this_instance_and_unpatch_restores_it():
    model = tiny("llama")
    other = tiny("llama")
    torchembed.patch(model)
    assert isinstance(vars(model)["forward"], dg.GraphedForward)
    assert inspect.signature(model.forward) == inspect.signature(other.forward)  # what Trainer and generate read
    assert pickle.loads(pickle.dumps(model)).forward.__self__ is not model
    assert "forward" not in vars(other)
    record = vars(model)["_torchembed_patch"]
    assert [a.component.kind for a in record.actions].count("decode-graphs") == 2  # the forward, the graphs' drop
    assert all(c.kind != "decode-graphs" for c in torchembed.find_positional_components(model))  # not positional
    vars(model)[dg._STATE] = dg.DecodeGraphs()
    clone = copy.deepcopy(model)
    assert vars(clone)[dg._STATE] is not vars(model)[dg._STATE]
    torchembed.unpatch(model)
    assert "forward" not in vars(model) and dg._STATE not in vars(model)
    assert "forward" not in vars(torchembed.patch(tiny("llama"), cuda_graphs=False))
    assert "forward" not in vars(torchembed.patch(tiny("gpt_neox")))  # not a model type checked over a room


# ----------------------------------------------------------------------------------------------- on a CUDA device


def _pair(model_type="llama", **extra):
    torch.manual_seed(0)
    upstream = tiny(model_type, "cuda", **extra)
    patched = torchembed.patch(copy.deepcopy(upstream))
    return upstream, patched


def _graphs(model):
    return vars(model).get(dg._STATE)


@cuda
@pytest.mark.parametrize("model_type", ["llama", "qwen3", "bloom", "mpt"])
def test_cuda_plain_generate_replays_its_steps_and_gives_upstreams_tokens(model_type):
    if model_type in dg.PADDING_MASK_TYPES and dg.padding_mask_refusal() is not None:
        pytest.skip(dg.padding_mask_refusal())
    upstream, patched = _pair(model_type)
    ids = torch.randint(3, 128, (2, 9), device="cuda")
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    kwargs = dict(attention_mask=mask, max_new_tokens=300, do_sample=False, min_new_tokens=300)  # past one room
    with torch.no_grad():
        expected = upstream.generate(ids, **kwargs)
        got = patched.generate(ids, **kwargs)
    assert torch.equal(got, expected)
    graphs = _graphs(patched)
    assert graphs.captures >= 2 and graphs.replays >= 290  # a new room after 256 tokens: captured again
    with torch.no_grad():
        again = patched.generate(ids, **kwargs)  # a second call: new cache, its own rooms
    assert torch.equal(again, expected)


@cuda
def test_cuda_beam_search_sampling_and_a_hand_written_loop_keep_upstreams_results():
    upstream, patched = _pair()
    ids = torch.randint(3, 128, (1, 12), device="cuda")
    with torch.no_grad():
        beams = dict(num_beams=3, max_new_tokens=20, do_sample=False)
        assert torch.equal(patched.generate(ids, **beams), upstream.generate(ids, **beams))
        torch.manual_seed(1)
        expected = upstream.generate(ids, do_sample=True, max_new_tokens=30)
        torch.manual_seed(1)
        assert torch.equal(patched.generate(ids, do_sample=True, max_new_tokens=30), expected)
        ours, theirs = transformers.DynamicCache(), transformers.DynamicCache()
        a, b = patched(ids, past_key_values=ours), upstream(ids, past_key_values=theirs)
        nxt = b.logits[:, -1:].argmax(-1)
        for _ in range(5):
            a, b = patched(nxt, past_key_values=ours), upstream(nxt, past_key_values=theirs)
            torch.testing.assert_close(a.logits, b.logits, atol=ATOL, rtol=RTOL)
            nxt = b.logits[:, -1:].argmax(-1)
    assert _graphs(patched).replays >= 3


@cuda
def test_cuda_graphs_stay_per_instance_and_threads_get_upstreams_tokens():
    upstream, patched = _pair()
    second = torchembed.patch(copy.deepcopy(upstream))
    prompts = [torch.randint(3, 128, (1, 10), device="cuda") for _ in range(4)]
    with torch.no_grad():
        expected = [upstream.generate(p, max_new_tokens=40, do_sample=False) for p in prompts]
    results = {}

    def run(i, model):
        with torch.no_grad():
            results[i] = model.generate(prompts[i], max_new_tokens=40, do_sample=False)

    threads = [threading.Thread(target=run, args=(i, patched if i % 2 else second)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, want in enumerate(expected):
        assert torch.equal(results[i], want), i
    assert _graphs(patched) is not _graphs(second)
    torchembed.unpatch(patched)
    assert _graphs(patched) is None
    with torch.no_grad():
        assert torch.equal(patched.generate(prompts[0], max_new_tokens=40, do_sample=False), expected[0])


@cuda
def test_cuda_the_captured_step_does_not_keep_the_cache_alive():
    upstream, patched = _pair()
    ids = torch.randint(3, 128, (1, 50), device="cuda")
    with torch.no_grad():
        out = patched.generate(ids, max_new_tokens=20, do_sample=False, return_dict_in_generate=True)
    assert _graphs(patched).replays > 0
    room = weakref.ref(vars(out.past_key_values.layers[0])["_torchembed_room"][0])
    del out
    gc.collect()
    assert room() is None  # the graph holds the rooms' addresses, not the rooms
    assert _graphs(patched).captured is not None


def test_a_peft_lora_model_is_never_replayed():
    """Its LoRA layers compute with whichever adapter is active (``disable_adapter()`` for a reference model): a
    graph would replay the one it captured."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    model = torchembed.patch(tiny("llama"))
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    cache, ids, mask = prefill(lora.base_model.model)
    with torch.no_grad():
        why = dg.inspect_step(lora.base_model.model, (), step_kwargs(cache, ids, mask))
    assert isinstance(why, str) and "peft" in why


@cuda
def test_cuda_inference_mode_and_autocast_are_captured_apart():
    """A step captured under ``torch.inference_mode()`` holds inference tensors, which take no copies outside it; one
    captured under autocast bakes its casts in: neither is replayed for a call without them."""
    upstream, patched = _pair()
    ids = torch.randint(3, 128, (1, 30), device="cuda")
    kwargs = dict(max_new_tokens=12, do_sample=False)
    with torch.no_grad():
        expected = upstream.generate(ids, **kwargs)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            cast = upstream.generate(ids, **kwargs)
    with torch.inference_mode():
        assert torch.equal(patched.generate(ids, **kwargs), expected)
    with torch.no_grad():
        assert torch.equal(patched.generate(ids, **kwargs), expected)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            got = patched.generate(ids, **kwargs)
        assert got.shape == cast.shape
        assert torch.equal(patched.generate(ids, **kwargs), expected)
    assert _graphs(patched).captures >= 3
