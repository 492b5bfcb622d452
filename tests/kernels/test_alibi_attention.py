"""ALiBi attention's dispatch (the fused kernel, SDPA with the materialised bias, PyTorch) against
float64, and what ``fused`` means for it."""

import copy
import pickle

import pytest
import torch

import torchembed
from torchembed.functional.alibi import alibi_key_bias, alibi_slopes
from torchembed.kernels import alibi as module
from torchembed.kernels import attention_plan, route
from torchembed.kernels.alibi import alibi_attention, prefill_path
from torchembed.kernels.per_forward import PerForward
from torchembed.kernels.route import FusedUnavailableError

pytest.importorskip("triton")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _case(b, h, q_len, k_len, d, dtype, pad=2, kv_heads=None):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(b, h, q_len, d, generator=gen).to(DEV, dtype)
    k, v = (torch.randn(b, kv_heads or h, k_len, d, generator=gen).to(DEV, dtype) for _ in range(2))
    mask = torch.ones(b, k_len, dtype=torch.long, device=DEV)
    mask[0, :pad] = 0
    key_bias = alibi_key_bias(alibi_slopes(h, DEV), mask)
    positions = torch.arange(k_len, device=DEV)
    keep = (positions[None, :] <= positions[k_len - q_len :, None])[None, None] & mask.bool()[:, None, None, :]
    return q, k, v, key_bias, keep


def _truth(q, k, v, key_bias, keep, scale):
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = (q.double() @ k.double().transpose(-1, -2)) * scale + key_bias.double()[:, :, None, :]
    return s.masked_fill(~keep, float("-inf")).softmax(-1) @ v.double()


def _count(monkeypatch, target, name):
    """Record the calls of ``target.name`` (still calling it)."""
    calls, original = [], getattr(target, name)
    monkeypatch.setattr(target, name, lambda *a, **kw: calls.append(1) or original(*a, **kw))
    return calls


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("q_len, k_len", [(40, 40), (1, 50), (12, 50)])
def test_matches_float64(dtype, tol, q_len, k_len):
    q, k, v, key_bias, keep = _case(2, 4, q_len, k_len, 32, dtype)
    cache = PerForward()
    out = alibi_attention(q, k, v, key_bias, keep, scale=32**-0.5, cache=cache, layer=True)
    again = alibi_attention(q, k, v, key_bias, keep, scale=32**-0.5, cache=cache, layer=True)  # cached row summary / mask
    truth = _truth(q, k, v, key_bias, keep, 32**-0.5)
    rows = keep.expand(2, 4, q_len, k_len).any(-1)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.double()[rows], truth[rows], atol=tol, rtol=tol)
    assert torch.equal(out, again)


def test_causal_default_equals_explicit_mask():
    q, k, v, key_bias, _ = _case(1, 2, 20, 20, 16, torch.float32, pad=0)
    torch.testing.assert_close(
        alibi_attention(q, k, v, key_bias, scale=0.25),
        alibi_attention(q, k, v, key_bias, torch.ones(20, 20, dtype=torch.bool, device=DEV).tril()[None, None], scale=0.25),
    )


def test_grouped_kv_heads_on_every_path():
    """kv heads dividing the query heads: the kernel reads them in place, the SDPA paths repeat them."""
    q, k, v, key_bias, keep = _case(2, 4, 24, 24, 16, torch.float32, kv_heads=2)
    truth = _truth(q, k, v, key_bias, keep, 0.25)
    rows = keep.expand(2, 4, 24, 24).any(-1)
    for fused in (None, False):
        out = alibi_attention(q, k, v, key_bias, keep, scale=0.25, fused=fused)
        torch.testing.assert_close(out.double()[rows], truth[rows], atol=2e-5, rtol=2e-5)


def test_slopes_form_matches_the_key_bias_form():
    q, k, v, key_bias, _ = _case(2, 4, 30, 30, 16, torch.float32, pad=0)
    slopes = alibi_slopes(4, DEV)
    for fused in (None, False):
        torch.testing.assert_close(alibi_attention(q, k, v, None, scale=0.25, slopes=slopes, fused=fused),
                                   alibi_attention(q, k, v, key_bias, scale=0.25, fused=fused), atol=2e-5, rtol=2e-5)
    with pytest.raises(ValueError, match="key_bias .* or slopes"):
        alibi_attention(q, k, v, None, scale=0.25)


def test_per_forward_memo_is_per_source_identity_and_tag():
    cache = PerForward()
    a, b = torch.zeros(3), torch.zeros(3)
    calls = []

    def make(x):
        return lambda: calls.append(x) or x + 1

    first = cache.memo(a, "t", make(a))
    assert cache.memo(a, "t", make(a)) is first and len(calls) == 1  # same source: kept
    cache.memo(b, "t", make(b))  # equal values, another tensor: computed again
    cache.memo(a, "other", make(a))  # another tag: computed again
    cache.memo((a, b), "t", make(a))  # a pair of sources
    assert cache.memo((a, b), "t", make(a)) is not None and len(calls) == 4
    cache.memo((b, a), "t", make(a))  # another order: another entry
    assert len(calls) == 5 and len(cache) == 5


def test_the_mask_summary_is_derived_once_per_forward(monkeypatch, alibi_policy):
    """Every layer of a forward gets the same mask: the kernel's row summary is derived once."""
    alibi_policy(dense_max_elements=0)  # a prefill above the materialised-bias bound
    built = _count(monkeypatch, module, "mask_rows")
    q, k, v, key_bias, keep = _case(2, 4, 24, 24, 16, torch.float32)
    cache = PerForward()
    outs = [alibi_attention(q, k, v, key_bias, keep, scale=0.25, cache=cache, layer=True) for _ in range(3)]
    assert len(built) == 1
    for out in outs[1:]:
        assert torch.equal(out, outs[0])


def test_decode_mask_is_built_once_per_forward_and_matches_per_layer(monkeypatch):
    """At decode every layer gets the same key bias and mask: with a cache (a model's forward) the SDPA
    mask is derived once and gives the kernel's result (without a cache)."""
    q, k, v, key_bias, keep = _case(2, 4, 1, 80, 32, torch.float32)
    built = _count(monkeypatch, module, "alibi_decode_bias")
    cache = PerForward()
    outs = [alibi_attention(q, k, v, key_bias, keep, scale=32**-0.5, cache=cache, layer=True, sdpa_decode=True)
            for _ in range(3)]
    uncached = alibi_attention(q, k, v, key_bias, keep, scale=32**-0.5)
    assert len(built) == 1
    for out in outs:
        torch.testing.assert_close(out, uncached, atol=2e-6, rtol=2e-6)


def test_a_forward_decides_its_route_once(monkeypatch, alibi_policy):
    """The layers of one forward ask the route with the same inputs: it decides once (and prepares the mask
    once); a call of another shape in the same forward decides again; results equal the undecided call's."""
    alibi_policy(dense_devices=("cuda", "cpu"))  # the small prefill's SDPA path on either device
    decided = _count(monkeypatch, module, "alibi_path")
    q, k, v, key_bias, keep = _case(2, 4, 12, 12, 16, torch.float32)
    cache = PerForward()
    outs = [alibi_attention(q, k, v, key_bias, keep, scale=0.25, cache=cache, layer=True) for _ in range(4)]
    assert len(decided) == 1
    fresh = alibi_attention(q, k, v, key_bias, keep, scale=0.25, layer=True)
    for out in outs:
        assert torch.equal(out, fresh)
    alibi_attention(q[:, :2], k[:, :2], v[:, :2], key_bias[:, :2], keep, scale=0.25, cache=cache, layer=True)
    assert len(decided) == 3  # (the call without a forward decided too)


def test_a_cpu_prefill_takes_sdpa_with_the_bias_not_the_reference(monkeypatch):
    """On the CPU, where the kernel does not run, prefills take SDPA with the materialised bias (upstream's speed; the
    PyTorch reference measured 0.49-0.98x upstream there): a model layer's within the bound and beyond it, a lone
    call's; one-query decode steps SDPA with the decode mask; ``fused=False`` the reference. The dense results match
    float64 as the reference's do."""
    monkeypatch.setattr(route, "kernel_can_run", lambda t: False)  # (the CPU without Triton's interpreter)
    q, k, v, key_bias, keep = (t.cpu() for t in _case(2, 4, 12, 12, 16, torch.float32))
    path = lambda q, k, **kw: route.alibi_path(q, k, k, None, dropout_p=0.0, **{"fused": None, "layer": True, **kw})
    assert path(q, k) == "dense"
    long = torch.zeros(1, 1, 1, 8).expand(1, 1, 8193, 8)  # 8193^2 bias elements: above the bound (a view: no memory)
    assert 8193**2 > route.settings().policy.dense_max_elements and path(long, long) == "dense"
    assert path(q, k, layer=False) == "dense"
    assert path(q[:, :, -1:], k) == "decode"
    assert path(q, k, fused=False) == "reference"
    truth, rows = _truth(q, k, v, key_bias, keep, 0.25), keep.expand(2, 4, 12, 12).any(-1)
    taken = _count(monkeypatch, module, "masked_sdpa")
    for layer in (True, False):
        out = alibi_attention(q, k, v, key_bias, keep, scale=0.25, layer=layer)
        torch.testing.assert_close(out.double()[rows], truth[rows], atol=2e-5, rtol=2e-5)
    assert len(taken) == 2


def test_a_patched_model_forward_decides_its_route_once(monkeypatch):
    decided = _count(monkeypatch, module, "alibi_path")
    upstream = _tiny("bloom")
    patched = torchembed.patch(copy.deepcopy(upstream))
    ids = torch.randint(0, upstream.config.vocab_size, (2, 10), device=DEV)
    with torch.no_grad():
        torch.testing.assert_close(patched(ids).logits, upstream(ids).logits, rtol=1e-5, atol=1e-5)
    assert upstream.config.num_hidden_layers > 1 and len(decided) == 1


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("q_len", [1, 3])
def test_decode_steps_take_the_split_key_kernel(monkeypatch, dtype, tol, q_len):
    """A model layer's decode step (a padded batch, grouped kv heads, one or a few queries) runs the fused
    kernel where it runs, no SDPA mask, and matches float64; with ``sdpa_decode`` (the patch's
    ``cudnn_decode``) a one-query step takes SDPA with the decode mask, built once per forward."""
    q, k, v, key_bias, keep = _case(2, 4, q_len, 80, 32, dtype, pad=5, kv_heads=2)
    kernel, masks = _count(monkeypatch, module, "fused_attention"), _count(monkeypatch, module, "alibi_decode_bias")
    out = alibi_attention(q, k, v, key_bias, keep, scale=32**-0.5, cache=PerForward(), layer=True)
    assert (len(kernel), len(masks)) == (1, 0)
    torch.testing.assert_close(out.double(), _truth(q, k, v, key_bias, keep, 32**-0.5), atol=tol, rtol=tol)
    if q_len == 1:
        cache = PerForward()
        for _ in range(2):
            sdpa = alibi_attention(q, k, v, key_bias, keep, scale=32**-0.5, cache=cache, layer=True, sdpa_decode=True)
        assert (len(kernel), len(masks)) == (1, 1)
        torch.testing.assert_close(sdpa.double(), _truth(q, k, v, key_bias, keep, 32**-0.5), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("pad", [0, 3])
def test_small_prefill_materialises_the_bias_once_per_forward(monkeypatch, dtype, tol, pad, alibi_policy):
    """CUDA prefills of at most ``dense_max_elements`` bias elements (``b * h * q * k``) take SDPA with
    the bias materialised, once per forward for all layers (where the H200 measured it faster than
    the kernel); larger ones the kernel. Plain causal and left-padded batches match float64."""
    alibi_policy(dense_devices=(torch.device(DEV).type,))
    built, kernel = _count(monkeypatch, module, "prefill_bias"), _count(monkeypatch, module, "fused_attention")
    b, h, n, d = 2, 3, 40, 16
    q, k, v, key_bias, keep = _case(b, h, n, n, d, dtype, pad=pad)
    truth = _truth(q, k, v, key_bias, keep, d**-0.5)
    rows = keep.expand(b, h, n, n).any(-1)  # a left-padded query attends to nothing: no truth
    alibi_policy(dense_max_elements=b * h * n * n)
    cache = PerForward()
    for _ in range(3):  # three layers of one forward
        out = alibi_attention(q, k, v, key_bias, keep, scale=d**-0.5, cache=cache, layer=True)
        assert out.dtype == dtype and out.shape == q.shape
        torch.testing.assert_close(out.double()[rows], truth[rows], atol=tol, rtol=tol)
    assert len(built) == 1 and not kernel
    alibi_policy(dense_max_elements=b * h * n * n - 1)  # one element more: the kernel
    out = alibi_attention(q, k, v, key_bias, keep, scale=d**-0.5, cache=PerForward(), layer=True)
    torch.testing.assert_close(out.double()[rows], truth[rows], atol=tol, rtol=tol)
    assert len(kernel) == 1


def test_a_call_without_a_forward_cache_takes_the_kernel_at_any_size(monkeypatch, alibi_policy):
    """The materialised bias pays off when the layers of one forward share it (``cache``); a call of
    its own (``ALiBiEmbedding.attention``) would build it for itself alone: the kernel, at every size."""
    alibi_policy(dense_devices=(torch.device(DEV).type,))
    built, kernel = _count(monkeypatch, module, "prefill_bias"), _count(monkeypatch, module, "fused_attention")
    q, k, v, key_bias, keep = _case(1, 2, 24, 24, 16, torch.float32, pad=0)
    alibi_policy(dense_max_elements=2**40)
    out = alibi_attention(q, k, v, key_bias, keep, scale=0.25)
    torch.testing.assert_close(out.double(), _truth(q, k, v, key_bias, keep, 0.25), atol=2e-5, rtol=2e-5)
    assert (len(built), len(kernel)) == (0, 1)


def test_gradients_keep_the_materialised_bias_longer(monkeypatch, alibi_policy):
    """With gradients recorded the bound is ``dense_grad_max_elements`` (the kernel's backward measured
    slower there), and the gradients match float64."""
    alibi_policy(dense_devices=(torch.device(DEV).type,))
    q, k, v, key_bias, keep = _case(1, 2, 16, 16, 16, torch.float32, pad=0)
    alibi_policy(dense_max_elements=0)
    alibi_policy(dense_grad_max_elements=2 * 16 * 16)
    assert route.alibi_path(q, k, v, keep, fused=None, dropout_p=0.0, layer=True) != "dense"
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    assert route.alibi_path(*leaves, keep, fused=None, dropout_p=0.0, layer=True) == "dense"
    kernel = _count(monkeypatch, module, "fused_attention")
    grad = torch.randn_like(q)
    alibi_attention(*leaves, key_bias, keep, scale=0.25, cache=PerForward(), layer=True).backward(grad)
    assert not kernel
    ref = [x.double().requires_grad_() for x in (q, k, v)]
    _truth(*ref, key_bias, keep, 0.25).backward(grad.double())
    for got, want in zip(leaves, ref):
        torch.testing.assert_close(got.grad.double(), want.grad, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("path", ["dense", "kernel"])
def test_prefill_path_forces_one_path(monkeypatch, path, alibi_policy):
    """``prefill_path("dense")`` takes the materialised bias, ``"kernel"`` the kernel, whatever the size."""
    alibi_policy(dense_devices=(torch.device(DEV).type,))
    alibi_policy(dense_max_elements=0 if path == "dense" else 2**40)
    built, kernel = _count(monkeypatch, module, "prefill_bias"), _count(monkeypatch, module, "fused_attention")
    q, k, v, key_bias, keep = _case(1, 2, 32, 32, 16, torch.float32, pad=0)
    with prefill_path(path):
        out = alibi_attention(q, k, v, key_bias, keep, scale=0.25)
    torch.testing.assert_close(out.double(), _truth(q, k, v, key_bias, keep, 0.25), atol=2e-5, rtol=2e-5)
    assert (len(built), len(kernel)) == ((1, 0) if path == "dense" else (0, 1))
    with pytest.raises(ValueError, match="prefill path must be one of"):
        with prefill_path("flex"):
            pass


# ---------------------------------------------------------------------------------------------
# fused: False = PyTorch operations only, None = the kernel where it runs, True = the kernel or an error
# ---------------------------------------------------------------------------------------------


def _kernel_launches(monkeypatch):
    """Count the fused kernel's forward launches."""
    calls = []
    original = attention_plan.ForwardPlan.__call__
    monkeypatch.setattr(attention_plan.ForwardPlan, "__call__", lambda *a: calls.append(1) or original(*a))
    return calls


def test_fused_false_never_calls_a_kernel(monkeypatch, alibi_policy):
    launches = _kernel_launches(monkeypatch)
    alibi_policy(dense_devices=(torch.device(DEV).type,))  # (the dense path is a Triton write too)
    bias_kernel = _count(monkeypatch, module, "prefill_bias")
    q, k, v, key_bias, keep = _case(2, 4, 24, 24, 16, torch.float32)
    out = alibi_attention(q, k, v, key_bias, keep, scale=0.25, fused=False)
    decode = alibi_attention(q[:, :, -1:], k, v, key_bias, keep[:, :, -1:], scale=0.25, fused=False,
                             cache=PerForward(), layer=True)
    assert not launches and not bias_kernel
    rows = keep.expand(2, 4, 24, 24).any(-1)
    torch.testing.assert_close(out.double()[rows], _truth(q, k, v, key_bias, keep, 0.25)[rows], atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(decode, out[:, :, -1:], atol=2e-6, rtol=2e-6)


def test_fused_none_takes_the_kernel_where_it_runs(monkeypatch, alibi_policy):
    alibi_policy(dense_max_elements=0)  # a prefill above the materialised-bias bound
    launches = _kernel_launches(monkeypatch)
    q, k, v, key_bias, keep = _case(2, 4, 24, 24, 16, torch.float32)
    alibi_attention(q, k, v, key_bias, keep, scale=0.25)
    assert len(launches) == 1


def test_fused_true_without_a_kernel_is_a_clear_error(monkeypatch):
    q, k, v, key_bias, keep = _case(1, 2, 8, 8, 16, torch.float32)
    with pytest.raises(FusedUnavailableError, match="dropout"):
        alibi_attention(q, k, v, key_bias, keep, scale=0.25, dropout_p=0.1, fused=True)
    with pytest.raises(FusedUnavailableError, match="float16/bfloat16/float32"):
        alibi_attention(q.double(), k.double(), v.double(), key_bias, keep, scale=0.25, fused=True)
    monkeypatch.setenv("TORCHEMBED_DISABLE_TRITON", "1")
    with pytest.raises(FusedUnavailableError, match="TORCHEMBED_DISABLE_TRITON"):
        alibi_attention(q, k, v, key_bias, keep, scale=0.25, fused=True)
    out = alibi_attention(q, k, v, key_bias, keep, scale=0.25)  # None: PyTorch there, quietly
    assert out.shape == q.shape


@pytest.mark.skipif(DEV == "cuda", reason="CPU tensors: the kernel runs on CPU only under TRITON_INTERPRET=1")
def test_fused_true_on_cpu_without_the_interpreter_names_the_fix(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q, k, v, key_bias, keep = _case(1, 2, 8, 8, 16, torch.float32)
    with pytest.raises(FusedUnavailableError, match=r"CUDA tensors .*\.to\('cuda'\)"):
        alibi_attention(q, k, v, key_bias, keep, scale=0.25, fused=True)
    launches = _kernel_launches(monkeypatch)
    alibi_attention(q, k, v, key_bias, keep, scale=0.25)
    assert not launches


def test_alibi_embedding_attention_fused_argument(monkeypatch, alibi_policy):
    from torchembed.positional import ALiBiEmbedding

    alibi_policy(dense_max_elements=0)  # a prefill above the materialised-bias bound

    alibi = ALiBiEmbedding(4).to(DEV)
    q, k, v, _, _ = _case(1, 4, 20, 20, 16, torch.float32)
    launches = _kernel_launches(monkeypatch)
    ours = alibi.attention(q, k, v)
    assert len(launches) == 1
    torch.testing.assert_close(alibi.attention(q, k, v, fused=False), ours, atol=2e-5, rtol=2e-5)
    assert len(launches) == 1
    with pytest.raises(FusedUnavailableError, match="causal"):
        alibi.attention(q, k, v, causal=False, fused=True)
    with pytest.raises(TypeError, match="fused must be None"):
        alibi.attention(q, k, v, fused="yes")


def _tiny(name):
    from torchembed.tools.checkpoints import tiny_config

    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(tiny_config(name)).to(DEV).eval()


@pytest.mark.parametrize("fused", [None, False])
@pytest.mark.parametrize("name", ["bloom", "falcon-alibi-gqa"])
def test_patched_models_honour_fused(name, fused, monkeypatch, alibi_policy):
    """``patch(model, fused=False)`` keeps the attention on PyTorch operations (no kernel launch, no
    Triton bias write); ``fused=None`` takes the kernel for the prefill (forced past the small-prefill
    bound); both match upstream."""
    alibi_policy(dense_max_elements=0)
    launches, bias_writes = _kernel_launches(monkeypatch), _count(monkeypatch, module, "_write_bias")
    upstream = _tiny(name)
    patched = torchembed.patch(copy.deepcopy(upstream), fused=fused)
    forwards = [m.forward for m in patched.modules() if "Attention" in type(m).__name__]
    assert forwards and all(f.function.options.fused is fused for f in forwards)
    ids = torch.randint(0, upstream.config.vocab_size, (2, 20), device=DEV)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    with torch.no_grad():
        ref = upstream(ids, attention_mask=mask).logits[mask.bool()]
        out = patched(ids, attention_mask=mask).logits[mask.bool()]
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    if fused is False:
        assert not launches and not bias_writes
    else:
        assert len(launches) == upstream.config.num_hidden_layers


def test_the_bound_forward_pickles_and_copies():
    from torchembed.patches.alibi.families import AlibiForward, AlibiOptions, bloom_attention_forward

    bound = AlibiForward(bloom_attention_forward, AlibiOptions(False, sdpa_decode=True))
    bound.options.constants.get(("slopes",), lambda: torch.ones(2))
    for twin in (pickle.loads(pickle.dumps(bound)), copy.deepcopy(bound)):
        assert twin.forward is bloom_attention_forward and twin.options.fused is False and twin.options.sdpa_decode
        assert len(twin.options.constants) == 0  # a copy keeps no tensors of the original
    assert bound.__qualname__ == bloom_attention_forward.__qualname__


def test_instance_constants_are_bounded_and_per_model():
    """What a patched model derives from its config is kept on that model, at most ``LIMIT`` tensors (the
    oldest dropped), and a copy of the model starts with none."""
    from torchembed.patches.alibi.families import InstanceConstants

    constants, made = InstanceConstants(), []
    for i in range(InstanceConstants.LIMIT + 3):
        constants.get(("slopes", i), lambda i=i: made.append(i) or torch.full((2,), float(i)))
    assert len(constants) == InstanceConstants.LIMIT and len(made) == InstanceConstants.LIMIT + 3
    kept = constants.get(("slopes", InstanceConstants.LIMIT + 2), lambda: pytest.fail("made again"))
    assert kept[0].item() == InstanceConstants.LIMIT + 2
    assert len(copy.deepcopy(constants)) == 0 and len(pickle.loads(pickle.dumps(constants))) == 0
    a, b = (torchembed.patch(_tiny("falcon-alibi")) for _ in range(2))
    options = {id(m.forward.function.options) for model in (a, b) for m in model.modules() if "Attention" in type(m).__name__}
    assert len(options) == 2  # one per model, shared by its layers
