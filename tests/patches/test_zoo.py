"""Every RoPE model type of the installed transformers, found by structure, on tiny generic configs.

For each supported model type: float32 logits within 1e-5 relative of upstream, greedy generation
with the KV cache identical, unpatch bit-exact. (bf16 against float64: ``torchembed compare --all``.)
"""

import copy
import os

import pytest
import torch

import torchembed
from torchembed import kernels

transformers = pytest.importorskip("transformers")
from torchembed.patches.rotation import RotaryHelper  # noqa: E402
from torchembed.tools.zoo import build_tiny, status_of, survey, text_model_types  # noqa: E402

DEVICE = os.environ.get("TORCHEMBED_TEST_DEVICE", "cpu")  # "cuda": the fused kernel in every family

# The model types people run most; each must be supported wherever the installed transformers has it.
REQUIRED = (
    "llama mistral falcon bloom mpt bert gpt2 qwen2 qwen2_moe qwen3 qwen3_moe gemma gemma2 gemma3_text phi phi3 "
    "phimoe mixtral olmo olmo2 olmoe granite granitemoe stablelm gpt_neox gptj codegen cohere cohere2 starcoder2 "
    "glm glm4 helium smollm3 ministral nemotron persimmon deepseek_v3 exaone4 ernie4_5 seed_oss hunyuan_v1_dense "
    "arcee apertus"
).split()
# Where a 4.x release structures a family differently (checked, with the reason torchembed gives).
NOT_ON_4X = {"phimoe", "apertus"}


def test_at_least_sixty_model_types_and_every_required_one():
    status = {s.model_type: s for s in survey()}
    supported = [t for t, s in status.items() if s.supported]
    assert len(supported) >= (60 if transformers.__version__ >= "5" else 50), len(supported)
    exempt = NOT_ON_4X if transformers.__version__ < "5" else set()
    missing = {t: status[t].how for t in REQUIRED if t in status and not status[t].supported and t not in exempt}
    assert not missing


def test_unsupported_model_types_say_why():
    available = set(text_model_types())
    for model_type in ("opt", "roformer"):
        if model_type in available:
            status = status_of(model_type)
            assert not status.supported and status.how, model_type
    for model_type in ("llama4_text",):  # complex-valued rotations (DeepSeek-V2: tests/patches/test_rotations.py)
        if model_type in available:
            assert status_of(model_type).supported, status_of(model_type).how


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("model_type", text_model_types())
def test_patched_model_type_matches_upstream(model_type, monkeypatch):
    status = status_of(model_type)
    if not status.supported:
        pytest.skip(f"not patched: {status.how}")
    upstream = build_tiny(model_type, device=DEVICE)
    patched = torchembed.patch(copy.deepcopy(upstream))
    vocab = upstream.config.get_text_config().vocab_size
    ids = torch.randint(3, vocab, (2, 11), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    ref = _logits(upstream, ids)
    calls, fallbacks, launches = [], [], []
    for helper in list(RotaryHelper._INSTANCES.values()):
        monkeypatch.setattr(helper, "upstream", lambda *a, _f=helper.upstream, **k: fallbacks.append(1) or _f(*a, **k))
    call = RotaryHelper.__call__
    monkeypatch.setattr(RotaryHelper, "__call__", lambda self, *a, **k: calls.append(1) or call(self, *a, **k))
    for name in ("rotary_fused",):
        launch = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, lambda *a, _f=launch, **k: launches.append(1) or _f(*a, **k))
    out = _logits(patched, ids)
    monkeypatch.undo()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    assert not fallbacks  # torchembed rotated every call, none went back to upstream's helper
    if kernels.kernel_can_run(ids.float()):
        assert len(launches) == len(calls)  # each on the fused kernel

    prompt = ids[:1, :6]
    kwargs = dict(max_new_tokens=5, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        gen_ref = upstream.generate(prompt, **kwargs)
        gen_out = patched.generate(prompt, **kwargs)
    assert torch.equal(gen_out.sequences, gen_ref.sequences)
    for a, b in zip(gen_out.logits, gen_ref.logits):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item())

    torchembed.unpatch(patched)
    restored = _logits(patched, ids)
    if torch.equal(_logits(upstream, ids), ref):
        assert torch.equal(restored, ref)
    else:  # upstream itself is not bit-reproducible here (atomic adds of a MoE layer on CUDA)
        torch.testing.assert_close(restored, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
