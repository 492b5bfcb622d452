"""Every model type with a rotary component in the installed transformers, on tiny generic models.

For each patched model type: float32 outputs within 1e-5 relative of upstream, no call of
upstream's rotation helper while patched, greedy generation with the KV cache identical, unpatch
bit-exact; and a 1e-4 rotation error injected into torchembed's rotation fails that same check
(so the check can see a wrong rotation). (bf16 against float64: ``torchembed compare --all``.)
Run with ``-n N --dist loadgroup`` (``scripts/test.sh``): each model is then built in one worker only.
"""

import copy
import os

import pytest
import torch

import torchembed
from torchembed import functional, kernels

transformers = pytest.importorskip("transformers")
from torchembed.patches.rope.helper import RotaryHelper  # noqa: E402
from torchembed.tools.zoo import (  # noqa: E402
    count_calls, matches, outputs_of, rotary_model_types, rotation_code, status_of, zoo_case,
)

DEVICE = os.environ.get("TORCHEMBED_TEST_DEVICE", "cpu")  # "cuda": the fused kernel in every family
ROTARY = list(rotary_model_types())
# The model types people run most; each must be patched wherever the installed transformers has it.
REQUIRED = (
    "llama mistral falcon qwen2 qwen2_moe qwen3 qwen3_moe gemma gemma2 gemma3_text phi phi3 "
    "phimoe mixtral olmo olmo2 olmoe granite granitemoe stablelm gpt_neox gptj codegen cohere cohere2 starcoder2 "
    "glm glm4 helium smollm3 ministral nemotron persimmon deepseek_v3 exaone4 ernie4_5 seed_oss hunyuan_v1_dense "
    "arcee apertus"
).split()
# ... and one of each way of rotating: complex frequencies, M-RoPE (merged in the helper or in the rotary
# module, across both halves of the head), vision towers, queries at the tables' last rows, leading tokens
# passed through, keyword-only calls (an indexer), multidimensional and 2-D rotations
KINDS = ("llama4 llama4_text deepseek_v2 qwen2_vl qwen2_5_vl qwen3_vl glm4v hunyuan_vl gemma3 gemma4 pixtral "
         "muse_glimmer_assistant dinov3_vit qwen4_exp sam3_vision_model esm modernbert").split()
# TORCHEMBED_ZOO_TYPES=sample: the per-type tests for REQUIRED and KINDS only (the other releases' CI runs)
SAMPLE = os.environ.get("TORCHEMBED_ZOO_TYPES", "all") == "sample"
# the tests of one model type share a worker (``-n N --dist loadgroup``), which builds its model once
PER_TYPE = [pytest.param(t, marks=pytest.mark.xdist_group(t)) for t in ROTARY
            if not SAMPLE or t in REQUIRED or t in KINDS]
FAULT = 1e-4  # radians: the rotation error the equivalence check must see
REFERENCE = "torchembed.functional.apply_rotary"
# Model types whose tiny model's outputs move by about the check's resolution under FAULT whatever
# the init (measured over init seeds 0-3): the check there sees errors a few times FAULT.
AT_RESOLUTION = {"lfm3_vl_vision": "its 2-layer vision tower moves by 0.7-1.6e-5 relative at init seeds 0-3"}

# Where a 4.x release structures a family differently (checked, with the reason torchembed gives).
NOT_ON_4X = {"phimoe", "apertus"}


def _patched_case(model_type, request=None):
    status = status_of(model_type)
    if status.state == "partly patched" and request is not None:  # a known bug, reported by list --all
        request.applymarker(pytest.mark.xfail(reason=status.how, strict=True))
    elif not status.supported:
        pytest.skip(f"{status.state}: {status.how}")
    return zoo_case(model_type, DEVICE)


# -- the survey ------------------------------------------------------------------------------------


def test_rotary_model_types_are_found_by_structure():
    assert {"llama", "mistral", "qwen2", "qwen2_vl", "gemma3", "modernbert", "esm"} <= set(ROTARY)
    assert len(ROTARY) >= (300 if transformers.__version__ >= "5" else 120), len(ROTARY)
    assert "opt" not in ROTARY and "gpt2" not in ROTARY  # learned absolute positions


@pytest.mark.parametrize("model_type", REQUIRED)
def test_required_model_type_is_patched(model_type):
    if model_type not in ROTARY:
        pytest.skip(f"the installed transformers has no {model_type}")
    if model_type in NOT_ON_4X and transformers.__version__ < "5":
        assert status_of(model_type).how
        return
    status = status_of(model_type)
    assert status.supported, status.how


@pytest.mark.parametrize("model_type", ["llama4_text", "deepseek_v2", "qwen2_5_vl", "qwen3_vl", "hunyuan_vl", "dinov3_vit",
                                        "qwen4_exp", "muse_glimmer_assistant"])
def test_complex_mrope_vision_and_uneven_rotations_are_patched(model_type):
    """Complex frequencies (Llama 4, DeepSeek-V2), M-RoPE with vision towers (Qwen2.5-VL, Qwen3-VL,
    HunYuan-VL's sections across both halves), leading tokens passed through (DINOv3), keyword-only
    calls without a key (Qwen4-Exp's indexer), queries at the tables' last rows (a drafter)."""
    if model_type not in ROTARY or transformers.__version__ < "5":
        pytest.skip(f"checked on transformers 5.x where it exists (installed: {transformers.__version__})")
    status = status_of(model_type)
    assert status.supported, status.how


def test_refusals_name_what_is_missing():
    for model_type in ("llama4_text", "deepseek_v2", "roformer"):
        if model_type in ROTARY:
            status = status_of(model_type)
            assert status.state in ("patched", "refused") and status.how, (model_type, status)
            if status.state == "refused":
                with pytest.raises((torchembed.UnsupportedModelError, torchembed.StructureError)):
                    torchembed.patch(copy.deepcopy(zoo_case(model_type).model))
    if "llama4_text" in ROTARY and not status_of("llama4_text").supported:
        assert "complex-valued" in status_of("llama4_text").how


# -- equivalence, per model type ---------------------------------------------------------------------


@pytest.mark.parametrize("model_type", PER_TYPE)
def test_patched_model_type_matches_upstream(model_type, monkeypatch, request):
    case = _patched_case(model_type, request)
    upstream, inputs = case.model, case.inputs
    patched = torchembed.patch(copy.deepcopy(upstream))
    ref = outputs_of(upstream, inputs)
    codes = rotation_code(upstream)
    assert codes, "no upstream rotation helper found to count"
    with count_calls(codes) as upstream_calls:
        assert torch.equal(outputs_of(upstream, inputs), ref) or DEVICE != "cpu"
    assert sum(upstream_calls.values()) > 0  # the counter sees upstream's helper run

    calls, launches = [], []  # calls: (helper, per feature section, kernel launches it made)
    call, launch, usual = RotaryHelper.__call__, kernels.rotary_fused, kernels.rotary_fused_usual

    def usual_counted(*a):  # HF's usual call on the kernel (None: the kernel did not take it)
        out = usual(*a)
        launches.extend([1] if out is not None else [])
        return out

    def counted(self, *a, **k):
        before = len(launches)
        out = call(self, *a, **k)
        calls.append((self.__name__, self.rotation.source.kind == "sections", len(launches) - before))
        return out

    monkeypatch.setattr(RotaryHelper, "__call__", counted)
    monkeypatch.setattr(kernels, "rotary_fused", lambda *a, **k: launches.append(1) or launch(*a, **k))
    monkeypatch.setattr(kernels, "rotary_fused_usual", usual_counted)
    with count_calls({**codes, functional.apply_rotary.__code__: REFERENCE}) as fallbacks:
        out = outputs_of(patched, inputs)
    monkeypatch.undo()
    reference = fallbacks.pop(REFERENCE, 0)
    assert matches(out, ref), f"patched vs upstream: max abs {(out - ref).abs().max().item():.3g}"
    assert not fallbacks, f"upstream's rotation ran while patched: {dict(fallbacks)}"
    assert calls  # torchembed rotated
    if not kernels.kernel_can_run(next(patched.parameters())):  # the one PyTorch rotation, each time
        assert reference >= sum(upstream_calls.values()), (reference, dict(upstream_calls))
    else:
        # every call on the fused kernel, but per-feature-section rotations (Gemma 4's vision tower:
        # PyTorch by design, the kernel takes one table row per token)
        off = [(name, n) for name, sections, n in calls if not sections and n == 0]
        assert not off, f"calls not on the fused kernel: {off}"

    if case.prompt is not None:
        prompt = case.prompt
        kwargs = dict(max_new_tokens=3, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
        with torch.no_grad():
            gen_ref = upstream.generate(**prompt, **kwargs)
            gen_out = patched.generate(**prompt, **kwargs)
        assert torch.equal(gen_out.sequences, gen_ref.sequences)
        for step, (a, b) in enumerate(zip(gen_out.logits, gen_ref.logits)):
            if not matches(a, b):  # allowed only within upstream's own spread (on CUDA some are not reproducible)
                with torch.no_grad():
                    spread = (upstream.generate(**prompt, **kwargs).logits[step] - b).abs().max().item()
                off = (a - b).abs().max().item()
                assert 0 < spread and off <= 2 * spread, f"generate step {step}: max abs {off:.3g}, upstream's own {spread:.3g}"

    torchembed.unpatch(patched)
    restored = outputs_of(patched, inputs)
    if torch.equal(outputs_of(upstream, inputs), ref):
        assert torch.equal(restored, ref)
    else:  # upstream itself is not bit-reproducible here (atomic adds of a MoE layer on CUDA)
        assert matches(restored, ref)


def _misrotate(x):
    """``x`` with each feature pair ``(i, i + d/2)`` rotated by a further +-FAULT radians, the sign
    alternating over every index but the feature one (so q and k are not turned alike, which the
    attention scores would not see)."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.shape[-1] < 2:
        return x
    half = x.shape[-1] // 2
    parity = sum(torch.arange(n, device=x.device).view(*([1] * i), n, *([1] * (x.dim() - 2 - i)))
                 for i, n in enumerate(x.shape[:-1]))
    angle = FAULT * (1 - 2 * (parity % 2)).to(torch.float32)[..., None]
    a, b = x[..., :half].float(), x[..., half : 2 * half].float()
    out = x.clone()
    out[..., :half] = (a * angle.cos() - b * angle.sin()).to(x.dtype)
    out[..., half : 2 * half] = (a * angle.sin() + b * angle.cos()).to(x.dtype)
    return out


@pytest.mark.parametrize("model_type", PER_TYPE)
def test_a_wrong_rotation_fails_the_check(model_type, monkeypatch):
    if model_type in AT_RESOLUTION:
        pytest.skip(f"{model_type}: {AT_RESOLUTION[model_type]}")
    case = _patched_case(model_type)
    ref = outputs_of(case.model, case.inputs)
    patched = torchembed.patch(copy.deepcopy(case.model))
    call = RotaryHelper.__call__

    def misrotated(self, *args, **kwargs):
        out = call(self, *args, **kwargs)
        return tuple(_misrotate(t) for t in out) if isinstance(out, tuple) else _misrotate(out)

    monkeypatch.setattr(RotaryHelper, "__call__", misrotated)
    out = outputs_of(patched, case.inputs)
    monkeypatch.undo()
    rel = (out - ref).abs().max().item() / ref.abs().max().item()
    assert not matches(out, ref), f"{model_type}: a {FAULT:g} rad rotation error moves its outputs by only {rel:.2e} relative"


def test_the_counter_sees_a_call_that_falls_back_to_upstream(monkeypatch):
    case = zoo_case("llama")
    patched = torchembed.patch(copy.deepcopy(case.model))
    codes = rotation_code(case.model)
    call, fell_back = RotaryHelper.__call__, []

    def once_upstream(self, *args, **kwargs):
        if not fell_back:
            fell_back.append(1)
            return self.upstream(*args, **kwargs)
        return call(self, *args, **kwargs)

    monkeypatch.setattr(RotaryHelper, "__call__", once_upstream)
    with count_calls(codes) as fallbacks:
        out = outputs_of(patched, case.inputs)
    assert sum(fallbacks.values()) == 1  # the equivalence test's `assert not fallbacks` would fail
    assert matches(out, outputs_of(case.model, case.inputs))  # ... though the outputs agree
