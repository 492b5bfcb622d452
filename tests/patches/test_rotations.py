"""Rotations beyond HF's usual helper: complex frequencies (Llama 4, DeepSeek-V2), vision towers and
M-RoPE (Qwen2.5-VL; transformers 4.x merges its sections inside the helper, 5.x in the rotary
module), multidimensional RoPE (Gemma 4's vision tower), keyword calls and left-out keys (Qwen4-Exp's
helper), and models torchembed refuses whole rather than half-patch.

Each patched model: float32 logits within 1e-5 of upstream, zero calls of upstream's rotation helper
during the patched forward (counted on the helper's code, whatever route calls it; upstream's own
forward makes them, so the count can fail), greedy generation with the cache identical, unpatch bit
for bit. The models are initialised with std 0.5 (HF's default 0.02 leaves tiny models' logits
nearly flat): a 1e-4 rotation error then moves the logits past the check, which
``test_a_small_rotation_error_fails_the_check`` shows by injecting one.
"""

from __future__ import annotations

import copy
import inspect
import os

import pytest
import torch
from torch import nn

import torchembed
from torchembed import kernels
from torchembed.tools.zoo import count_calls
from torchembed.patches.rope.recognition import TableSource, recognize
from torchembed.patches.rope.helper import RotaryHelper
from tests.helpers import counting_calls, upstream_rotation_helpers

transformers = pytest.importorskip("transformers")
V5 = int(transformers.__version__.split(".")[0]) >= 5
INIT = 0.5
DEVICE = os.environ.get("TORCHEMBED_TEST_DEVICE", "cpu")  # "cuda": every rotation on the fused kernel


def _llama4_text():
    config = transformers.Llama4TextConfig(
        hidden_size=64, intermediate_size=64, intermediate_size_mlp=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=128, num_local_experts=2, num_experts_per_tok=1,
        max_position_embeddings=128, initializer_range=INIT, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        use_qk_norm=False)  # an L2 norm of q and k after the rotation flattens the scores of a tiny model
    return transformers.Llama4ForCausalLM(config)


def _deepseek_v2():
    config = transformers.DeepseekV2Config(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=4, n_shared_experts=1, first_k_dense_replace=1,
        kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, head_dim=8,
        vocab_size=128, max_position_embeddings=128, n_group=1, topk_group=1, initializer_range=INIT)
    return transformers.DeepseekV2ForCausalLM(config)


QWEN_VL_IMAGE = dict(pixel_values=torch.randn(16, 3 * 2 * 4 * 4, generator=torch.Generator().manual_seed(3)),
                     image_grid_thw=torch.tensor([[1, 4, 4]]))  # 4 x 4 patches -> 4 merged image tokens


def _qwen2_5_vl():
    text = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                vocab_size=160, max_position_embeddings=256, initializer_range=INIT)
    rope = {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}
    text.update(rope_parameters=rope) if V5 else text.update(rope_scaling=rope)
    config = transformers.Qwen2_5_VLConfig(
        text_config=text,
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                           spatial_merge_size=2, temporal_patch_size=2, window_size=16, fullatt_block_indexes=[1],
                           in_channels=3, initializer_range=INIT),
        image_token_id=150, video_token_id=151, vision_start_token_id=152, vision_end_token_id=153, vocab_size=160,
        bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return transformers.Qwen2_5_VLForConditionalGeneration(config)


MODELS = {"llama4_text": _llama4_text, "deepseek_v2": _deepseek_v2, "qwen2_5_vl": _qwen2_5_vl}


def _build(name: str) -> nn.Module:
    if not hasattr(transformers, {"llama4_text": "Llama4TextConfig", "deepseek_v2": "DeepseekV2Config",
                                  "qwen2_5_vl": "Qwen2_5_VLConfig"}[name]):
        pytest.skip(f"transformers {transformers.__version__} has no {name}")
    torch.manual_seed(0)
    model = MODELS[name]().eval()
    for module in model.modules():  # std INIT everywhere (some classes keep their own small init)
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=INIT)
    return model.to(DEVICE)


def _inputs(name: str) -> dict:
    return {key: value.to(DEVICE) for key, value in _cpu_inputs(name).items()}


def _cpu_inputs(name: str) -> dict:
    if name == "qwen2_5_vl":
        return dict(input_ids=torch.tensor([[1, 7, 152, 150, 150, 150, 150, 153, 5, 6, 7], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]]),
                    pixel_values=QWEN_VL_IMAGE["pixel_values"], image_grid_thw=QWEN_VL_IMAGE["image_grid_thw"])
    return dict(input_ids=torch.randint(3, 128, (2, 11), generator=torch.Generator().manual_seed(0)))


def _close(out: torch.Tensor, ref: torch.Tensor) -> bool:
    return torch.allclose(out, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


@pytest.mark.parametrize("name", list(MODELS))
def test_patched_matches_upstream_and_never_calls_its_helper(name):
    upstream = _build(name)
    helpers = upstream_rotation_helpers(upstream)
    patched = torchembed.patch(copy.deepcopy(upstream))
    paths = [c.path for c in torchembed.find_positional_components(patched)]
    if name == "qwen2_5_vl":  # the vision tower's rotation and the language model's
        assert any(".visual." in f".{p}." for p in paths) and any("language_model" in p for p in paths), paths
    inputs = _inputs(name)
    with torch.no_grad(), counting_calls(helpers) as upstream_calls:
        ref = upstream(**inputs).logits
    assert sum(upstream_calls.values()) > 0  # the counter sees upstream's calls
    launches, rope = [], kernels.rope
    run, kept_launch = rope._run, rope._kept_launch  # the kernel's first launch of a call form, its kept launches

    def kept(*args):
        out = kept_launch(*args)
        launches.extend([1] if out is not None else [])
        return out

    with torch.no_grad(), counting_calls(helpers) as calls, pytest.MonkeyPatch.context() as m:
        m.setattr(rope, "_run", lambda *a: launches.append(1) or run(*a))
        m.setattr(rope, "_kept_launch", kept)
        out = patched(**inputs).logits
    assert not calls, calls
    assert _close(out, ref), (out - ref).abs().max()
    if kernels.kernel_can_run(out):  # every rotation on the kernel: at least one launch per rotating layer
        assert len(launches) >= len(paths), (len(launches), len(paths))
    else:
        assert not launches

    kwargs = dict(max_new_tokens=4, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    prompt = {key: value[:1] if key == "input_ids" else value for key, value in inputs.items()}
    with torch.no_grad():
        gen_ref, gen_out = upstream.generate(**prompt, **kwargs), patched.generate(**prompt, **kwargs)
    assert torch.equal(gen_out.sequences, gen_ref.sequences)
    assert all(_close(a, b) for a, b in zip(gen_out.logits, gen_ref.logits))

    torchembed.unpatch(patched)
    with torch.no_grad():
        assert torch.equal(patched(**inputs).logits, ref)


@pytest.mark.parametrize("name", list(MODELS))
def test_a_small_rotation_error_fails_the_check(name, monkeypatch):
    """Patched helpers fed a sin table 1e-4 off (relative; for complex frequencies their imaginary part)
    move the logits past the 1e-5 check: the check can see a wrong rotation. (An error of the same
    angle in q and k would cancel: RoPE scores depend on angle differences only.)"""
    upstream = _build(name)
    patched = torchembed.patch(copy.deepcopy(upstream))
    inputs = _inputs(name)
    call = RotaryHelper.__call__

    def sin_off_by_1e4(self, *args, **kwargs):
        bound = inspect.signature(self.upstream).bind(*args, **kwargs)
        name = "sin" if "sin" in bound.arguments else self.rotation.call.tables[0]
        table = bound.arguments[name]
        bound.arguments[name] = (torch.complex(table.real, table.imag * (1 + 1e-4)) if table.is_complex()
                                 else table * (1 + 1e-4))
        return call(self, *bound.args, **bound.kwargs)

    monkeypatch.setattr(RotaryHelper, "__call__", sin_off_by_1e4)
    with torch.no_grad():
        ref, out = upstream(**inputs).logits, patched(**inputs).logits
    assert not _close(out, ref), f"{name}: a 1e-4 rotation error went unseen ({(out - ref).abs().max():.2e})"


# -- every way a helper is called -------------------------------------------------------------------


def _partial_helper_with_optional_k(q, k=None, cos=None, sin=None, unsqueeze_dim=1):
    """Qwen4-Exp's shape of helper: partial rotary, k may be left out (then q alone comes back)."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    rot = cos.shape[-1]

    def one(x):
        x_rot, x_pass = x[..., :rot], x[..., rot:]
        x1, x2 = x_rot[..., : rot // 2], x_rot[..., rot // 2:]
        return torch.cat((x_rot * cos + torch.cat((-x2, x1), dim=-1) * sin, x_pass), dim=-1)

    return one(q) if k is None else (one(q), one(k))


def test_keyword_calls_and_a_left_out_key_are_served_never_handed_back():
    upstream = _partial_helper_with_optional_k
    rotation = recognize(upstream)
    assert rotation is not None and rotation.call.single and rotation.math.partial
    helper = RotaryHelper.get(rotation, upstream, None)
    g = torch.Generator().manual_seed(0)
    theta = torch.rand(2, 5, 4, generator=g) * 6 - 3
    cos, sin = torch.cat((theta, theta), -1).cos(), torch.cat((theta, theta), -1).sin()
    q_bhsd, k_bhsd = torch.randn(2, 3, 5, 16, generator=g), torch.randn(2, 1, 5, 16, generator=g)
    q_bshd = torch.randn(2, 5, 3, 16, generator=g)
    calls = [
        ((q_bhsd, k_bhsd, cos, sin), {}),
        ((q_bhsd,), dict(k=k_bhsd, cos=cos, sin=sin)),
        ((), dict(q=q_bhsd, k=k_bhsd, sin=sin, cos=cos)),
        ((q_bshd,), dict(cos=cos, sin=sin, unsqueeze_dim=2)),  # k left out: q alone comes back
        ((q_bhsd, None, cos, sin, 1), {}),
    ]
    with counting_calls([upstream]) as upstream_calls:
        got = [helper(*args, **kwargs) for args, kwargs in calls]
    assert not upstream_calls
    for (args, kwargs), out in zip(calls, got):
        want = upstream(*args, **kwargs)
        assert type(out) is type(want)
        for o, w in zip(*((x,) if isinstance(x, torch.Tensor) else x for x in (out, want))):
            torch.testing.assert_close(o, w, rtol=1e-6, atol=1e-6)
    with pytest.raises(TypeError, match="unexpected keyword argument 'position'"):
        helper(q_bhsd, k_bhsd, cos, sin, position=3)
    with pytest.raises(TypeError, match="multiple values for argument 'k'"):
        helper(q_bhsd, k_bhsd, cos, sin, k=k_bhsd)
    with pytest.raises(TypeError, match="takes 5 positional arguments but 6"):
        helper(q_bhsd, k_bhsd, cos, sin, 1, 2)


def test_helpers_whose_inputs_cannot_be_modelled_are_not_recognised_and_say_why():
    from torchembed.patches.rope.recognition import explain

    def needs_grid(q, k, cos, sin, grid, unsqueeze_dim=1):
        return q, k

    def mrope_ignoring_its_sections(q, k, cos, sin, mrope_section, unsqueeze_dim=1):
        return apply_rotary_pos_emb(q, k, cos[0], sin[0], unsqueeze_dim)

    def depends_on_positions(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
        q, k = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)
        return (q, k) if position_ids is None else (q.roll(1, -2), k)

    for helper, why in ((needs_grid, "needs grid"),
                        (mrope_ignoring_its_sections, "does not select one position axis per feature section"),
                        (depends_on_positions, "depends on position_ids")):
        assert recognize(helper) is None
        assert why in explain(helper)


def _prefixed(q, k, cos, sin, **kwargs):
    """DINOv3's helper: the tokens before the tables' rows (cls, registers) pass through."""
    lead = q.shape[-2] - sin.shape[-2]
    (qp, qr), (kp, kr) = q.split((lead, sin.shape[-2]), dim=-2), k.split((lead, sin.shape[-2]), dim=-2)
    qr, kr = qr * cos + _rotate_half(qr) * sin, kr * cos + _rotate_half(kr) * sin  # (s, d) tables as they are
    return torch.cat((qp, qr), dim=-2), torch.cat((kp, kr), dim=-2)


def _drafter(q, k, cos, sin, unsqueeze_dim=1):
    """Muse Glimmer's assistant's helper: queries over the last rows of keys that carry a context."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    n = q.shape[-2]
    return q * cos[..., -n:, :] + _rotate_half(q) * sin[..., -n:, :], k * cos + _rotate_half(k) * sin


@pytest.mark.parametrize("helper, q_tokens, k_tokens, table_rows", [(_prefixed, 9, 9, 6), (_drafter, 4, 10, 10)])
def test_tokens_that_differ_from_the_tables_rows_are_served_as_upstream_does(helper, q_tokens, k_tokens, table_rows):
    """Leading tokens passed through (DINOv3) and queries at the tables' last rows (a drafter): found by
    probing, computed as upstream does, never by upstream's helper."""
    rotation = recognize(helper)
    assert rotation is not None and (rotation.shape.prefix, rotation.shape.tail) == (helper is _prefixed, helper is _drafter)
    mine = RotaryHelper.get(rotation, helper, None)
    gen = torch.Generator().manual_seed(3)
    q, k = torch.randn(2, 3, q_tokens, 16, generator=gen), torch.randn(2, 3, k_tokens, 16, generator=gen)
    theta = torch.randn(table_rows, 8, generator=gen) if helper is _prefixed else torch.randn(2, table_rows, 8, generator=gen)
    cos, sin = torch.cat((theta, theta), -1).cos(), torch.cat((theta, theta), -1).sin()
    with counting_calls([helper]) as calls:
        got = mine(q, k, cos, sin)
    assert not calls
    for a, b in zip(got, helper(q, k, cos, sin)):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_a_helper_with_kwargs_refuses_a_keyword_it_cannot_know():
    """``**kwargs`` do not stop recognition (no attention passes any); a call that does pass one is a
    clear TypeError, never a silent guess."""
    mine = RotaryHelper.get(recognize(_prefixed), _prefixed, None)
    q = torch.randn(1, 2, 5, 16)
    with pytest.raises(TypeError, match="takes \\*\\*kwargs"):
        mine(q, q, torch.ones(5, 16), torch.zeros(5, 16), num_prefix=1)


def _rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):  # HF's helper, as a module global of this file
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def apply_rotary_pos_emb_2d(q, k, cos, sin, grid):  # a rotation torchembed does not model
    return q, k


class _TextAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)

    def forward(self, x, cos, sin):
        q = k = self.proj(x).unflatten(-1, (2, 8)).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return (q + k).transpose(1, 2).flatten(-2)


class _VisionAttention(_TextAttention):
    def forward(self, x, cos, sin):
        q = k = self.proj(x).unflatten(-1, (2, 8)).transpose(1, 2)
        q, k = apply_rotary_pos_emb_2d(q, k, cos, sin, None)
        return (q + k).transpose(1, 2).flatten(-2)


class _TwoTowers(nn.Module):
    """A text attention with HF's helper and a vision attention with an unmodelled one."""

    def __init__(self) -> None:
        super().__init__()
        self.config = transformers.PretrainedConfig()
        self.config.model_type = "two_towers_test"
        self.text, self.vision = _TextAttention(), _VisionAttention()


def test_a_model_with_an_unrecognised_rotation_beside_recognised_ones_is_refused_whole():
    model = _TwoTowers()
    forwards = {name: m.forward for name, m in model.named_modules()}
    with pytest.raises(torchembed.UnsupportedModelError, match="apply_rotary_pos_emb_2d"):
        torchembed.patch(model)
    assert not torchembed.is_patched(model) and {name: m.forward for name, m in model.named_modules()} == forwards


def test_the_call_counter_sees_a_helper_that_hands_back_to_upstream(monkeypatch):
    upstream = _build("deepseek_v2")
    helpers = upstream_rotation_helpers(upstream)
    patched = torchembed.patch(copy.deepcopy(upstream))
    monkeypatch.setattr(RotaryHelper, "__call__", lambda self, *args, **kwargs: self.upstream(*args, **kwargs))
    with torch.no_grad(), counting_calls(helpers) as calls:
        patched(**_inputs("deepseek_v2"))
    assert sum(calls.values()) == upstream.config.num_hidden_layers


def _multidimensional(x, cos, sin, position_ids, unsqueeze_dim=2):
    """Gemma 4's vision rotation: ``position_ids.shape[-1]`` feature sections, each rotated half-split."""
    sections = position_ids.shape[-1]
    width = 2 * (x.shape[-1] // (2 * sections))
    parts = zip(x.split(width, -1), cos.split(width, -1), sin.split(width, -1))
    return torch.cat([p * c.unsqueeze(unsqueeze_dim) + _rotate_half(p) * s.unsqueeze(unsqueeze_dim) for p, c, s in parts], -1)


@pytest.mark.parametrize("sections", [1, 2, 3])
def test_multidimensional_rope_rotates_each_feature_section(sections):
    rotation = recognize(_multidimensional)
    assert rotation is not None and rotation.source == TableSource("sections", "position_ids")
    helper = RotaryHelper.get(rotation, _multidimensional, None)
    g = torch.Generator().manual_seed(sections)
    theta = torch.rand(2, 7, sections, 4, generator=g) * 6 - 3
    full = torch.cat((theta, theta), -1).flatten(-2)
    x = torch.randn(2, 7, 3, 8 * sections, generator=g)
    positions = torch.randint(0, 9, (2, 7, sections), generator=g)
    with counting_calls([_multidimensional]) as calls:
        got = helper(x, full.cos(), full.sin(), positions)
    assert not calls
    torch.testing.assert_close(got, _multidimensional(x, full.cos(), full.sin(), positions), rtol=1e-6, atol=1e-6)
    if sections > 1:  # features that do not split into equal sections: upstream's split fails too
        with pytest.raises(ValueError, match="do not split"):
            helper(x[..., :-2], full.cos()[..., :-2], full.sin()[..., :-2], positions)


def _indexed(q, k, cos, sin, position_ids, unsqueeze_dim=1):
    """The older helpers' form: tables of every position, gathered by ``position_ids``."""
    return apply_rotary_pos_emb(q, k, cos[position_ids], sin[position_ids], unsqueeze_dim)


def test_tables_indexed_by_position_ids():
    rotation = recognize(_indexed)
    assert rotation is not None and rotation.source == TableSource("indexed", "position_ids")
    helper = RotaryHelper.get(rotation, _indexed, None)
    g = torch.Generator().manual_seed(0)
    theta = torch.rand(40, 8, generator=g) * 6 - 3
    cos, sin = torch.cat((theta, theta), -1).cos(), torch.cat((theta, theta), -1).sin()
    q, k = torch.randn(2, 4, 5, 16, generator=g), torch.randn(2, 2, 5, 16, generator=g)
    ids = torch.randint(0, 40, (2, 5), generator=g)
    with counting_calls([_indexed]) as calls:
        got = helper(q, k, cos, sin, ids)
    assert not calls
    for g_, w in zip(got, _indexed(q, k, cos, sin, ids)):
        torch.testing.assert_close(g_, w, rtol=1e-6, atol=1e-6)


class _OpLog(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 16])
def test_the_cpu_path_dispatches_fewer_operations_than_upstream(dtype, tokens, monkeypatch):
    """The CPU cost of a patched rotation, counted instead of timed: HF's usual call (LLaMA's helper,
    q (1, 9, s, 64) and k (1, 3, s, 64) in HF's transposed memory), the tables prepared once per
    forward (the second call with the same tables prepares none): torchembed.functional.apply_rotary
    once per tensor, no more operations than upstream's 16 (float32: fewer), no copy of q or k (bf16
    inputs promote inside the products; the one cast is each result's rounding). Upstream's results."""
    monkeypatch.setenv("TORCHEMBED_DISABLE_TRITON", "1")  # the PyTorch path, also under TRITON_INTERPRET
    from transformers.models.llama import modeling_llama

    from torchembed.functional import rope
    from torchembed.kernels import per_forward

    upstream = modeling_llama.apply_rotary_pos_emb
    helper = RotaryHelper(recognize(upstream), upstream, None)
    q = torch.randn(1, tokens, 9, 64, dtype=dtype).transpose(1, 2)
    k = torch.randn(1, tokens, 3, 64, dtype=dtype).transpose(1, 2)
    theta = torch.randn(1, tokens, 32)
    cos, sin = (torch.cat((t, t), -1).to(dtype) for t in (theta.cos(), theta.sin()))
    owner = object()  # a patched model's forward: open while its layers run
    per_forward.open_forward(owner)
    with torch.no_grad():
        helper(q, k, cos, sin)  # the forward's first layer: the tables prepared and kept
        with _OpLog() as ours, count_calls({rope.apply_rotary.__code__: "apply_rotary"}) as calls:
            got = helper(q, k, cos, sin)
        per_forward.close_forward(owner)
        with _OpLog() as theirs:
            want = upstream(q, k, cos, sin)
    assert len(theirs.ops) == 16, theirs.ops  # (so the count can fail: upstream's own, as measured)
    assert calls == {"apply_rotary": 2}, calls
    assert len(ours.ops) <= (14 if dtype == torch.float32 else 16), ours.ops
    assert not {"copy_", "clone", "contiguous"} & set(ours.ops), ours.ops
    assert ours.ops.count("_to_copy") == (0 if dtype == torch.float32 else 2), ours.ops  # the two results only
    tol = {} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **tol)


def test_a_call_derives_its_tables_once_per_forward():
    """Beyond HF's usual call too (here tables gathered by position ids): what a call's tensors are rotated with is
    derived once per forward for the calls alike (every layer gets the same tables), so a later layer's call gathers
    no rows; without an open forward each call derives its own (so the count can fail). Upstream's results."""
    from torchembed.kernels import per_forward

    helper = RotaryHelper.get(recognize(_indexed), _indexed, None)
    g = torch.Generator().manual_seed(1)
    theta = torch.rand(40, 8, generator=g) * 6 - 3
    cos, sin = torch.cat((theta, theta), -1).cos(), torch.cat((theta, theta), -1).sin()
    q, k = torch.randn(2, 4, 5, 16, generator=g), torch.randn(2, 2, 5, 16, generator=g)
    ids = torch.randint(0, 40, (2, 5), generator=g)
    owner = object()  # a patched model's forward: open while its layers run
    per_forward.open_forward(owner)
    try:
        with torch.no_grad():
            helper(q, k, cos, sin, ids)  # the forward's first layer: the rows gathered and kept
            with _OpLog() as later:
                got = helper(q, k, cos, sin, ids)
    finally:
        per_forward.close_forward(owner)
    with torch.no_grad(), _OpLog() as alone:
        helper(q, k, cos, sin, ids)
    assert alone.ops.count("index") == 2, alone.ops
    assert "index" not in later.ops, later.ops
    for g_, w in zip(got, _indexed(q, k, cos, sin, ids)):
        torch.testing.assert_close(g_, w, rtol=1e-6, atol=1e-6)
