"""A patched model changes nothing outside itself (the stress suite).

Several threads run patched and unpatched models of a RoPE family (LLaMA, grouped kv heads) and an ALiBi
family (Falcon-ALiBi, BLOOM) at once, through a padded prefill, a plain decode loop and ``generate``: every
output equals the same call made alone, and process-wide flags read the same during and after. Many
forwards of varying shapes leave no tensor behind; a patched model, unpatched and deleted (or deleted
patched), is garbage-collected; the library's module-level state holds no tensor.

On the CPU the decode steps' CUDA route (the split-key kernel) is taken with the kernel's PyTorch
implementation standing in for the GPU (``_on_gpu`` below): the per-call decision, the per-forward state
and the threads are the same. The CUDA tests at the end run the kernels themselves.
"""

from __future__ import annotations

import copy
import random
import threading
import time
import weakref

import pytest
import torch
import transformers

import torchembed
from tests.isolation import (FlagWatcher, TensorCensus, compiler_state, live_tensors, run_threads,
                             tensors_in_library_state)

FAMILIES = ("llama", "falcon-alibi", "bloom")
NEW_TOKENS = 4


@pytest.fixture
def gpu_route(kernel_route_on_cpu):
    """Decode steps take the kernel route on CPU tensors too (the kernel's PyTorch implementation runs)."""


def _inputs(model, batch: int, length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, model.config.vocab_size, (batch, length), generator=gen)
    mask = torch.ones_like(ids)
    mask[0, : length // 3] = 0  # a left-padded row
    return ids.to(model.device), mask.to(model.device)


def _prefill(model, seed: int) -> torch.Tensor:
    ids, mask = _inputs(model, 2, 9, seed)
    with torch.no_grad():
        return model(ids, attention_mask=mask).logits


def _decode_loop(model, seed: int) -> torch.Tensor:
    ids, mask = _inputs(model, 2, 7, seed)
    steps = []
    with torch.no_grad():
        out = model(ids, attention_mask=mask, past_key_values=transformers.DynamicCache(), use_cache=True)
        for _ in range(NEW_TOKENS):
            nxt = out.logits[:, -1:].argmax(-1)
            mask = torch.cat((mask, torch.ones_like(nxt)), 1)
            out = model(nxt, attention_mask=mask, past_key_values=out.past_key_values, use_cache=True)
            steps.append(out.logits)
    return torch.cat(steps, 1)


def _generate(model, seed: int) -> torch.Tensor:
    ids, mask = _inputs(model, 2, 6, seed)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                             do_sample=False, pad_token_id=0, use_cache=True, output_scores=True,
                             return_dict_in_generate=True)
    return torch.cat([out.sequences.float().flatten(), *(s.flatten() for s in out.scores)])


PATHS = {"prefill": _prefill, "decode loop": _decode_loop, "generate": _generate}


def _models(load) -> dict[str, torch.nn.Module]:
    models = {}
    for name in FAMILIES:
        upstream = load(name, attn_implementation="sdpa" if name != "bloom" else "eager")
        models[f"{name} upstream"] = upstream
        models[f"{name} patched"] = torchembed.patch(copy.deepcopy(upstream))
    return models


def _jobs(models) -> list[tuple[str, str, int]]:
    return [(model, path, seed) for model in models for path in PATHS for seed in (0, 1)]


@pytest.mark.slow
def test_threads_see_what_calls_in_sequence_see(load, gpu_route):
    """3 families x upstream/patched x 3 paths x 2 inputs, each 3 times, on 6 threads in shuffled order:
    every output is bit-identical to the same call made alone; no thread ever sees a flag change."""
    models = _models(load)
    jobs = _jobs(models)
    alone = {job: PATHS[job[1]](models[job[0]], job[2]) for job in jobs}
    order = jobs * 3
    random.Random(0).shuffle(order)
    compiled_before = compiler_state()
    with FlagWatcher() as watcher:
        results = run_threads([lambda job=job: PATHS[job[1]](models[job[0]], job[2]) for job in order], threads=6)
    differ = [job for job, result in zip(order, results) if not torch.equal(result, alone[job])]
    assert not differ, f"{len(differ)} of {len(order)} concurrent calls differ from the same call alone: {differ[:4]}"
    assert watcher.changes == 0 and sum(watcher.states.values()) > 0, watcher.states
    assert compiler_state() == compiled_before
    assert not tensors_in_library_state()


def test_the_watcher_sees_a_global_switch(load):
    """The flag check can fail: a model whose forward flips SDPA's process-wide cuDNN switch (what
    ``sdpa_kernel`` does) is seen by the watcher in another thread."""
    model = load("llama", attn_implementation="sdpa")
    before = torch.backends.cuda.cudnn_sdp_enabled()

    def switch_off(*args):
        torch.backends.cuda.enable_cudnn_sdp(False)
        time.sleep(0.005)

    model.register_forward_pre_hook(switch_off)
    model.register_forward_hook(lambda *args: torch.backends.cuda.enable_cudnn_sdp(before))
    with FlagWatcher() as watcher:
        for seed in range(3):
            _prefill(model, seed)
    assert watcher.changes > 0


def test_library_state_finds_a_kept_tensor(monkeypatch):
    """The module-state check can fail: a tensor kept in a module-level table of the library is found."""
    from torchembed.kernels import per_forward

    monkeypatch.setattr(per_forward, "_PLANTED", {"mask": [torch.zeros(2)]}, raising=False)
    assert tensors_in_library_state() == ["torchembed.kernels.per_forward._PLANTED['mask'][0]"]


def test_the_census_finds_a_kept_tensor_beside_one_let_go():
    """What the next test counts: a tensor made after the census and kept is found, also while an unrelated
    one is let go meanwhile (a plain count of live tensors would see no change)."""
    unrelated = torch.zeros(3)
    census = TensorCensus()
    kept = torch.ones(2, 7)  # noqa: F841  (the planted leak)
    del unrelated
    assert census.born_since() == ["(2, 7) torch.float32"]


def test_no_tensor_outlives_its_forward(load, gpu_route):
    """Forwards of varying batches and lengths (prefill, decode loop, generate) leave as many live tensors
    as there were before them, and none in the library's module-level state (each forward's derived
    masks, biases and tables die with it)."""
    models = _models(load)
    for model in models.values():  # (a first round: HF's own lazily built state)
        for path in PATHS.values():
            path(model, 99)
    census = TensorCensus()
    for seed in range(3):
        for model in models.values():
            for path in PATHS.values():
                path(model, seed)
    assert not census.born_since()
    assert not tensors_in_library_state()


@pytest.mark.parametrize("unpatch", [True, False])
@pytest.mark.parametrize("name", FAMILIES)
def test_a_deleted_model_is_collected(name, unpatch, load, gpu_route):
    """Patch, run every path, (unpatch,) delete: the model is garbage-collected and nothing of it stays in
    the library's module-level state."""
    model = torchembed.patch(load(name))
    for path in PATHS.values():
        path(model, 0)
    if unpatch:
        torchembed.unpatch(model)
    gone = weakref.ref(model)
    weights = weakref.ref(next(model.parameters()))
    del model
    live_tensors()  # (collects)
    assert gone() is None and weights() is None
    assert not tensors_in_library_state()


def test_the_forward_state_is_per_thread_and_closes(load, gpu_route, monkeypatch):
    """Each thread's forward gets its own per-forward state, opened and closed by the patched model: a
    forward that raises closes it too."""
    from torchembed.kernels import per_forward

    model = torchembed.patch(load("falcon-alibi"))
    seen: dict[int, list] = {}  # per thread, the state every layer found (the objects: no id reuse)
    original = per_forward.current

    def spy():
        scope = original()
        seen.setdefault(threading.get_ident(), []).append(scope)
        return scope

    monkeypatch.setattr("torchembed.patches.alibi.families.current", spy)
    start = threading.Barrier(4)

    def one_forward():
        start.wait()
        _prefill(model, 0)

    threads = [threading.Thread(target=one_forward) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    layers = model.config.num_hidden_layers
    assert len(seen) == 4 and all(len(found) == layers and None not in found for found in seen.values())
    per_thread = [{id(scope) for scope in found} for found in seen.values()]
    assert all(len(ids) == 1 for ids in per_thread)  # one per forward, shared by its layers
    assert len(set().union(*per_thread)) == 4  # none shared between threads
    boom = model.transformer.h[1].register_forward_pre_hook(lambda *a: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        _prefill(model, 0)
    boom.remove()
    assert per_forward.current() is None


# ---------------------------------------------------------------------------------------------------
# On the GPU: the kernels themselves, memory
# ---------------------------------------------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _cuda_models(names=("llama", "falcon-alibi")) -> dict[str, torch.nn.Module]:
    from torchembed.tools.checkpoints import TINY_MODELS

    models = {}
    for name in names:
        config = TINY_MODELS[name]()
        config._attn_implementation = "sdpa"
        torch.manual_seed(0)
        upstream = transformers.AutoModelForCausalLM.from_config(config).to("cuda", torch.bfloat16).eval()
        models[f"{name} upstream"] = upstream
        models[f"{name} patched"] = torchembed.patch(copy.deepcopy(upstream))
    return models


@pytest.mark.slow
@cuda
def test_cuda_threads_see_what_calls_in_sequence_see():
    """As on the CPU, with the kernels (bf16; each output bit-identical to the same call alone)."""
    models = _cuda_models()
    jobs = _jobs(models)
    alone = {job: PATHS[job[1]](models[job[0]], job[2]) for job in jobs}
    order = jobs * 3
    random.Random(0).shuffle(order)
    with FlagWatcher() as watcher:
        results = run_threads([lambda job=job: PATHS[job[1]](models[job[0]], job[2]) for job in order], threads=6)
    differ = [job for job, result in zip(order, results) if not torch.equal(result, alone[job])]
    assert not differ, f"{len(differ)} of {len(order)} differ: {differ[:4]}"
    assert watcher.changes == 0


@cuda
def test_cuda_memory_returns_to_baseline_and_repeats_cost_one_call():
    """A patched Falcon-ALiBi (d 1024, 8 layers, sdpa, bf16): 60 forwards of random lengths 16-4096 at
    batch 1 or 4 leave allocated memory where it was; the peak of 33 repeated calls at 1 x 2048 is within
    5 % of one call's."""
    from torchembed.tools.checkpoints import TINY_MODELS

    config = TINY_MODELS["falcon-alibi"]()
    config.hidden_size, config.num_attention_heads, config.num_hidden_layers = 1024, 16, 8
    config._attn_implementation = "sdpa"
    model = torchembed.patch(transformers.AutoModelForCausalLM.from_config(config).to("cuda", torch.bfloat16).eval())
    gen = torch.Generator().manual_seed(0)

    def call(batch, length):
        ids = torch.randint(1, config.vocab_size, (batch, length), generator=gen).cuda()
        with torch.no_grad():
            model(ids).logits.sum().item()

    call(1, 64)
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    for _ in range(60):
        call(random.choice((1, 4)), random.randint(16, 4096))
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == baseline
    torch.cuda.reset_peak_memory_stats()
    call(1, 2048)
    one = torch.cuda.max_memory_allocated() - baseline
    torch.cuda.reset_peak_memory_stats()
    for _ in range(33):
        call(1, 2048)
    repeated = torch.cuda.max_memory_allocated() - baseline
    assert repeated <= 1.05 * one, (repeated, one)
    assert torch.cuda.memory_allocated() == baseline
