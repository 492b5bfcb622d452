"""How the patch mechanism meets each way upstream code can change (fake modeling modules).

Every case ends in the correct result (patched outputs equal upstream's, torchembed's rotation
called) or in a clear error raised before anything changed (the model still computes upstream's
function and is not marked patched).
"""

from __future__ import annotations

import functools
import sys
import textwrap
import types

import pytest
import torch
from torch import nn

import torchembed
from torchembed.patches import StructureError, UnsupportedModelError
from torchembed.patches.rope.helper import RotaryHelper

HELPERS = '''
import functools
import torch
from torch import nn


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


apply_rope = apply_rotary_pos_emb


def with_wraps(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)
    return wrapper


def without_wrapped(fn):
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)
    return wrapper


def rename_kwarg(old, new):
    """Like transformers' deprecate_kwarg: a call with ``old=`` reaches ``fn`` as ``new=``."""
    def decorator(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if old in kwargs:
                kwargs[new] = kwargs.pop(old)
            return fn(*args, **kwargs)
        return wrapper
    return decorator


class Rotary(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, dim, 2).float() / dim), persistent=False)

    def forward(self, x, position_ids):
        freqs = position_ids[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


class AttentionBase(nn.Module):
    def __init__(self, hidden, heads):
        super().__init__()
        self.heads, self.dim = heads, hidden // heads
        self.q, self.k, self.v, self.o = (nn.Linear(hidden, hidden) for _ in range(4))

    def project(self, x):
        b, s, _ = x.shape
        return (p(x).view(b, s, self.heads, self.dim).transpose(1, 2) for p in (self.q, self.k, self.v))

    def finish(self, q, k, v, cache):
        if cache is not None:
            cache.append(k)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        b, h, s, d = out.shape
        return self.o(out.transpose(1, 2).reshape(b, s, h * d))
'''

ATTENTIONS = {
    "plain": '''
class Attention(AttentionBase):
    def forward(self, x, position_embeddings, cache=None):
        q, k, v = self.project(x)
        cos, sin = position_embeddings
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return self.finish(q, k, v, cache)
''',
    "wraps": '''
class Attention(AttentionBase):
    @with_wraps
    def forward(self, x, position_embeddings, cache=None):
        q, k, v = self.project(x)
        q, k = apply_rotary_pos_emb(q, k, *position_embeddings)
        return self.finish(q, k, v, cache)
''',
    "no_wrapped": '''
class Attention(AttentionBase):
    @without_wrapped
    def forward(self, x, position_embeddings, cache=None):
        q, k, v = self.project(x)
        q, k = apply_rotary_pos_emb(q, k, *position_embeddings)
        return self.finish(q, k, v, cache)
''',
    "stacked": '''
class Attention(AttentionBase):
    @with_wraps
    @rename_kwarg("past", "cache")
    def forward(self, x, position_embeddings, cache=None):
        q, k, v = self.project(x)
        q, k = apply_rotary_pos_emb(q, k, *position_embeddings)
        return self.finish(q, k, v, cache)
''',
    "renamed_helper": '''
class Attention(AttentionBase):
    def forward(self, x, position_embeddings, cache=None):
        q, k, v = self.project(x)
        q, k = apply_rope(q, k, *position_embeddings)
        return self.finish(q, k, v, cache)
''',
    "attribute": '''
import sys as _sys


class Attention(AttentionBase):
    def forward(self, x, position_embeddings, cache=None):
        q, k, v = self.project(x)
        helpers = _sys.modules[__name__]
        q, k = helpers.apply_rotary_pos_emb(q, k, *position_embeddings)
        return self.finish(q, k, v, cache)
''',
    "renamed_class": '''
class SelfAttentionV2(AttentionBase):
    def forward(self, x, position_embeddings, cache=None):
        q, k, v = self.project(x)
        q, k = apply_rotary_pos_emb(q, k, *position_embeddings)
        return self.finish(q, k, v, cache)


Attention = SelfAttentionV2
''',
    "subclass_super": '''
class Parent(AttentionBase):
    def forward(self, x, position_embeddings, cache=None):
        q, k, v = self.project(x)
        q, k = apply_rotary_pos_emb(q, k, *position_embeddings)
        return self.finish(q, k, v, cache)


class Attention(Parent):
    def forward(self, x, position_embeddings, cache=None):
        return super().forward(x, position_embeddings, cache)
''',
    "subclass_own": '''
class Parent(AttentionBase):
    def forward(self, x, position_embeddings, cache=None):
        raise AssertionError("never called")


class Attention(Parent):
    def forward(self, x, position_embeddings, cache=None):
        q, k, v = self.project(x)
        q, k = apply_rotary_pos_emb(q, k, *position_embeddings)
        return self.finish(q, k, v, cache)
''',
    "unknown_rotation": '''
def apply_rotary_emb_scaled(q, k, cos, sin):
    return q * cos * 2, k * sin


class Attention(AttentionBase):
    def forward(self, x, position_embeddings, cache=None):
        q, k, v = self.project(x)
        q, k = apply_rotary_pos_emb(q, k, *position_embeddings)
        q, k = apply_rotary_emb_scaled(q, k, *position_embeddings)
        return self.finish(q, k, v, cache)
''',
}


class Config:
    def __init__(self, model_type: str, layers: int = 2) -> None:
        self.model_type, self.num_hidden_layers = model_type, layers


def make_model(case: str, model_type: str = "fakerope", seed: int = 0) -> nn.Module:
    """A two-layer model whose attention is written as ``ATTENTIONS[case]``, in a module of its own."""
    name = f"fake_modeling_{case}_{model_type}"
    module = sys.modules.get(name)
    if module is None:
        module = types.ModuleType(name)
        sys.modules[name] = module
        exec(compile(textwrap.dedent(HELPERS + ATTENTIONS[case]), name, "exec"), module.__dict__)

    torch.manual_seed(seed)
    return Model(module, model_type)


class Model(nn.Module):
    def __init__(self, modeling: types.ModuleType, model_type: str) -> None:
        super().__init__()
        self.config = Config(model_type)
        self.rotary = modeling.Rotary(8)
        self.layers = nn.ModuleList(modeling.Attention(16, 2) for _ in range(2))

    def forward(self, x, cache=None, cache_kwarg="cache"):
        pe = self.rotary(x, torch.arange(x.shape[1])[None])
        for layer in self.layers:
            x = x + layer(x, pe, **{cache_kwarg: cache})
        return x


def _spy_rotations(monkeypatch) -> list:
    calls, original = [], RotaryHelper.__call__
    monkeypatch.setattr(RotaryHelper, "__call__", lambda self, *a, **k: calls.append(1) or original(self, *a, **k))
    return calls


def _check_patched_matches(model: nn.Module, monkeypatch, **call) -> None:
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = model(x, **call)
        calls = _spy_rotations(monkeypatch)
        torchembed.patch(model)
        after = model(x, **call)
    assert torchembed.is_patched(model)
    assert len(calls) == 2  # torchembed rotated in both layers
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-6)
    torchembed.unpatch(model)
    with torch.no_grad():
        assert torch.equal(model(x, **call), before)


def _check_untouched(model: nn.Module) -> None:
    assert not torchembed.is_patched(model)
    assert all("forward" not in vars(m) for m in model.modules())


@pytest.mark.parametrize("case", ["plain", "wraps", "no_wrapped", "renamed_helper", "renamed_class", "subclass_own"])
def test_decorated_renamed_or_subclassed_attention_is_patched_correctly(case, monkeypatch):
    _check_patched_matches(make_model(case), monkeypatch)


def test_stacked_decorators_keep_the_keyword_rename(monkeypatch):
    """The rebuilt forward keeps every wrapper: ``past=`` still reaches the forward as ``cache=``
    (a copy of the inner function alone would drop the cache into ``**kwargs``, silently unused)."""
    model = make_model("stacked")
    cache_up: list = []
    with torch.no_grad():
        model(torch.randn(1, 3, 16), cache=cache_up, cache_kwarg="past")
    assert len(cache_up) == 2
    torchembed.patch(model)
    cache: list = []
    with torch.no_grad():
        model(torch.randn(1, 3, 16), cache=cache, cache_kwarg="past")
    assert len(cache) == 2
    torchembed.unpatch(model)
    _check_patched_matches(model, monkeypatch, cache=[], cache_kwarg="past")


def test_declared_family_names_a_renamed_helper():
    """A declared family (llama) expects ``apply_rotary_pos_emb``: a release that renamed it is a
    StructureError naming the family, what was expected and what was found."""
    model = make_model("renamed_helper", model_type="llama")
    with pytest.raises(StructureError, match=r"llama: .*expected calls to apply_rotary_pos_emb; found calls to apply_rope"):
        torchembed.patch(model)
    _check_untouched(model)
    with pytest.warns(UserWarning, match="left unpatched"):
        torchembed.patch(model, strict=False)
    _check_untouched(model)


def test_helper_reached_through_an_attribute_is_a_clear_error():
    model = make_model("attribute")
    with pytest.raises(UnsupportedModelError, match="through an attribute"):
        torchembed.patch(model)
    _check_untouched(model)
    declared = make_model("attribute", model_type="llama")
    with pytest.raises(StructureError, match=r"llama: .*through an attribute.*transformers"):
        torchembed.patch(declared)
    _check_untouched(declared)


def test_subclass_calling_super_forward_is_a_clear_error():
    model = make_model("subclass_super")
    with pytest.raises(StructureError, match=r"super\(\).forward"):
        torchembed.patch(model)
    _check_untouched(model)


def test_unknown_rotation_next_to_a_known_one_is_never_half_patched():
    model = make_model("unknown_rotation")
    with pytest.raises(StructureError, match="apply_rotary_emb_scaled.*computes none of the rotations"):
        torchembed.patch(model)
    _check_untouched(model)


def test_declared_family_expects_one_rotating_attention_per_layer():
    model = make_model("plain", model_type="llama")
    model.config.num_hidden_layers = 3
    with pytest.raises(StructureError, match=r"one rotating attention per layer \(3 layers\).*found 2 modules"):
        torchembed.patch(model)
    _check_untouched(model)


def test_patched_forward_keeps_the_upstream_signature_and_pickles():
    import inspect
    import pickle

    model = torchembed.patch(make_model("stacked"))
    layer = model.layers[0]
    assert list(inspect.signature(layer.forward).parameters) == ["x", "position_embeddings", "cache"]
    clone = pickle.loads(pickle.dumps(model))
    assert torchembed.is_patched(clone)
    x = torch.randn(1, 4, 16)
    with torch.no_grad():
        torch.testing.assert_close(clone(x), model(x), rtol=0, atol=0)
    torchembed.unpatch(clone)
    assert all("forward" not in vars(m) for m in clone.modules())


def test_rebuilt_wrappers_point_at_rebuilt_functions():
    from torchembed.patches.rebind import chain, replace_globals

    module = make_model("stacked").layers[0]
    forward = type(module).forward
    replacement = lambda q, k, cos, sin, unsqueeze_dim=1: (q, k)  # noqa: E731
    rebuilt = replace_globals(forward, {"apply_rotary_pos_emb": replacement})
    assert rebuilt is not forward and rebuilt is replace_globals(forward, {"apply_rotary_pos_emb": replacement})
    functions = list(chain(rebuilt))
    assert len(functions) == 3  # with_wraps wrapper, rename wrapper, the forward
    assert functions[-1].__globals__["apply_rotary_pos_emb"] is replacement
    assert forward.__globals__["apply_rotary_pos_emb"] is not replacement  # the module is untouched
    assert rebuilt.__wrapped__ is functions[1] and functions[1].__wrapped__ is functions[2]
    assert functools.reduce(lambda f, _: f.__wrapped__, range(2), rebuilt) is functions[-1]
