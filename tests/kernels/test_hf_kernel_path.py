"""The patched HF attention on the kernel path (in place for inference, autograd for training)."""

import copy

import pytest
import torch

import torchembed
from torchembed import kernels

pytest.importorskip("triton")
transformers = pytest.importorskip("transformers")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _tiny(name):
    from torchembed.tools.checkpoints import tiny_config

    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(tiny_config(name)).to(DEV).eval()


def _spy(monkeypatch, name):
    """Record the calls of ``kernels.<name>`` (still calling it)."""
    calls, original = [], getattr(kernels, name)

    def spied(*a, **kw):
        out = original(*a, **kw)
        calls.append((a, kw, out))
        return out

    monkeypatch.setattr(kernels, name, spied)
    return calls


@pytest.mark.parametrize("name", ["llama", "falcon", "falcon-mha"])
def test_patched_model_on_the_kernel_matches_upstream(name, monkeypatch):
    upstream = _tiny(name)
    patched = torchembed.patch(copy.deepcopy(upstream), fused=True)
    ids = torch.randint(0, upstream.config.vocab_size, (2, 11), device=DEV)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    assert kernels.kernel_can_run(ids.float())
    calls = _spy(monkeypatch, "rotary_fused_usual")  # (q, k, cos, sin): rotary_fused(..., halves=True)
    with torch.no_grad():  # inference: in place on upstream's tables
        ref = upstream(ids, attention_mask=mask).logits
        out = patched(ids, attention_mask=mask).logits
    keep = mask.bool()
    torch.testing.assert_close(out[keep], ref[keep], rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    assert len(calls) == upstream.config.num_hidden_layers and all(out[0] is a[0] for a, _, out in calls)  # in place
    calls.clear()

    # training: the autograd path, gradients as upstream's
    loss_ref = upstream(ids).logits.pow(2).mean()
    loss_out = patched(ids).logits.pow(2).mean()
    assert len(calls) == upstream.config.num_hidden_layers
    assert all(a[2].shape[-1] == a[0].shape[-1] and out[0] is not a[0] for a, _, out in calls)
    loss_ref.backward()
    loss_out.backward()
    grads = dict(upstream.named_parameters())
    for pname, param in patched.named_parameters():
        ref_grad = grads[pname].grad
        torch.testing.assert_close(param.grad, ref_grad, rtol=1e-4, atol=1e-5 * ref_grad.abs().max().item() + 1e-12, msg=pname)


@pytest.mark.parametrize("padded", [True, False])
@pytest.mark.parametrize("name", ["bloom", "mpt", "falcon-alibi", "falcon-alibi-mha", "falcon-alibi-gqa"])
def test_patched_alibi_attention_matches_upstream(name, padded, monkeypatch, alibi_policy):
    """The prefill runs ALiBi inside the fused kernel (forced past the small-prefill bound, where SDPA
    with the materialised bias is taken), with HF's mask summarised per row (left-padded or not),
    multi-query and grouped kv heads read in place; the decode steps SDPA with the per-forward mask.

    Falcon's upstream is its sdpa attention (``from_config``'s default), the function the patched
    model computes.
    """
    from torchembed.kernels import attention_plan

    alibi_policy(dense_max_elements=0)
    launched = []
    original = attention_plan.ForwardPlan.__call__
    monkeypatch.setattr(attention_plan.ForwardPlan, "__call__", lambda *a: launched.append(1) or original(*a))
    upstream = _tiny(name)
    assert upstream.config.model_type != "falcon" or upstream.config._attn_implementation == "sdpa"
    patched = torchembed.patch(copy.deepcopy(upstream))
    ids = torch.randint(0, upstream.config.vocab_size, (2, 24), device=DEV)
    mask = torch.ones_like(ids)
    if padded:
        mask[0, :5] = 0
    with torch.no_grad():
        ref = upstream.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, output_logits=True,
                                return_dict_in_generate=True, pad_token_id=0)
        out = patched.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, output_logits=True,
                               return_dict_in_generate=True, pad_token_id=0)
        prefill_ref = upstream(ids, attention_mask=mask).logits[mask.bool()]
        prefill_out = patched(ids, attention_mask=mask).logits[mask.bool()]
    scale = prefill_ref.abs().max().item()
    torch.testing.assert_close(prefill_out, prefill_ref, rtol=1e-5, atol=1e-5 * scale)
    for a, b in zip(out.logits, ref.logits):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * scale)
    # every layer of generate's prefill and of the forward (MPT without a cache: of every step)
    assert len(launched) >= 2 * upstream.config.num_hidden_layers


@pytest.mark.skipif(DEV != "cuda" and not kernels.interpret_mode(), reason="bf16 training with the fused kernel needs CUDA or TRITON_INTERPRET=1 (CPU parity: tests/patches/test_training.py)")
@pytest.mark.parametrize("name", ["llama", "falcon"])
def test_bf16_training_steps_with_the_fused_kernel_match_upstream(name):
    """3 AdamW steps in bf16: patched (fused kernel fwd+bwd) and upstream stay together.

    The first step's gradients point the same way (cosine > 0.99 per tensor; a broken backward
    gives ~0 or a sign flip). Then 3 steps: losses within 2e-2 relative (bf16 logits round at ~4e-3
    and the two rotations round differently); weights within 2 x 3 x lr absolute (Adam moves a
    weight by up to lr per step whatever its gradient's size, so a weight whose tiny gradient
    changes sign with rounding drifts by up to 2 lr per step) and within lr / 10 on average.
    """
    upstream = _tiny(name).to(torch.bfloat16)
    patched = torchembed.patch(copy.deepcopy(upstream), fused=True)
    gen = torch.Generator().manual_seed(4)
    batches = [torch.randint(0, upstream.config.vocab_size, (4, 32), generator=gen).to(DEV) for _ in range(3)]
    losses, first_grads, lr = {}, {}, 1e-3
    for key, model in (("upstream", upstream), ("patched", patched)):
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        losses[key] = []
        for step, ids in enumerate(batches):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            if step == 0:
                first_grads[key] = {n: p.grad.float().flatten().clone() for n, p in model.named_parameters()}
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses[key].append(loss.item())
    for pname, grad in first_grads["patched"].items():
        ref = first_grads["upstream"][pname]
        if ref.norm() > 0:
            assert torch.nn.functional.cosine_similarity(grad, ref, dim=0) > 0.99, pname
    torch.testing.assert_close(torch.tensor(losses["patched"]), torch.tensor(losses["upstream"]), rtol=2e-2, atol=0)
    ref = dict(upstream.named_parameters())
    for pname, param in patched.named_parameters():
        diff = (param.float() - ref[pname].float()).abs()
        assert diff.max() <= 2 * 3 * lr + 1e-4 and diff.mean() <= lr / 10, (pname, diff.max().item(), diff.mean().item())


@pytest.mark.parametrize("fused", [True, None])
def test_compiled_patched_model_calls_the_kernel_op_without_graph_breaks(fused):
    """``torch.compile(fullgraph=True)`` of a patched model, no graph break and upstream's logits:
    with ``fused=True`` the rotation is the kernel's custom op (one per layer); with ``fused=None``
    PyTorch operations that inductor can fuse (``use_rope_kernel``: no kernel under compile)."""
    from torch._dynamo.utils import counters

    upstream = _tiny("llama")
    patched = torchembed.patch(copy.deepcopy(upstream), fused=fused)
    ids = torch.randint(0, upstream.config.vocab_size, (2, 7), device=DEV)
    ops = []

    def backend(gm, example_inputs):
        ops.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    torch._dynamo.reset()
    try:
        with torch.no_grad():
            torch.compile(upstream, backend="eager", fullgraph=True)(input_ids=ids)
    except torch._dynamo.exc.Unsupported as err:  # e.g. transformers 5.24's LLaMA on torch 2.8
        pytest.skip(f"upstream itself does not compile with fullgraph=True here: {str(err).splitlines()[0]}")
    torch._dynamo.reset()
    counters.clear()
    with torch.no_grad():
        out = torch.compile(patched, backend=backend, fullgraph=True)(input_ids=ids).logits
        ref = upstream(input_ids=ids).logits
    assert sum(counters["graph_break"].values()) == 0
    layers = upstream.config.num_hidden_layers
    assert sum("torchembed.rotary" in op for op in ops) == (layers if fused else 0), ops
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


def test_rotary_module_stays_upstream_and_both_rotation_paths_agree(monkeypatch):
    """The patched model keeps its own rotary module (same object, same tables); the rebound
    rotation on the kernel and with the kernel switched off give the same q and k."""
    model = _tiny("llama")
    rotary = model.model.rotary_emb
    positions = torch.arange(9, device=DEV)[None] + torch.tensor([[0], [4]], device=DEV)
    x = torch.empty(0, device=DEV)
    before = rotary(x, positions)
    torchembed.patch(model)
    assert model.model.rotary_emb is rotary and "forward" not in vars(rotary)
    after = rotary(x, positions)
    assert all(torch.equal(a, b) for a, b in zip(before, after))

    apply = model.model.layers[0].self_attn.forward.replacements["apply_rotary_pos_emb"]
    q, k = torch.randn(2, 4, 9, 16, device=DEV), torch.randn(2, 2, 9, 16, device=DEV)
    monkeypatch.setenv("TORCHEMBED_DISABLE_TRITON", "1")
    got = apply(q.clone(), k.clone(), *after)
    monkeypatch.delenv("TORCHEMBED_DISABLE_TRITON")
    torch.testing.assert_close(apply(q.clone(), k.clone(), *after), got, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(DEV != "cuda", reason="generate compiles the forward of a static-cache model on CUDA")
@pytest.mark.parametrize("name", ["llama", "falcon"])
def test_static_cache_generate_compiled_on_cuda_matches_upstream(name):
    """``generate(cache_implementation="static")`` on CUDA compiles the model's forward (CUDA
    graphs included, transformers' default compile config): a patched model's rotation is then the
    kernel's custom op inside that compiled graph, and the tokens are upstream's."""
    upstream = _tiny(name)
    patched = torchembed.patch(copy.deepcopy(upstream), fused=True)
    ids = torch.randint(3, upstream.config.vocab_size, (2, 9), device=DEV, generator=torch.Generator(DEV).manual_seed(0))
    kwargs = dict(max_new_tokens=12, do_sample=False, pad_token_id=0, cache_implementation="static",
                  output_logits=True, return_dict_in_generate=True)
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    with torch.no_grad():
        expected = upstream.generate(ids, **kwargs)
        torch._dynamo.reset()
        counters.clear()
        got = patched.generate(ids, **kwargs)
        again = patched.generate(ids, **kwargs)  # replays what the first call compiled
    assert counters["frames"]["ok"] > 0, "generate did not compile the forward"
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert torch.equal(again.sequences, got.sequences)
    _assert_same_greedy(got, expected)


def _assert_same_greedy(got, expected, rel=1e-4):
    """``got`` chose upstream's tokens with upstream's logits (within ``rel`` of the largest) up to the
    first step where upstream's two best logits are themselves within that tolerance, if any: a
    rounding-level tie that either pick may take (a tiny random model's logits are nearly flat)."""
    for step, (a, b) in enumerate(zip(got.logits, expected.logits)):
        scale = b.abs().max().item()
        torch.testing.assert_close(a, b, rtol=rel, atol=rel * scale, msg=f"logits of step {step}")
        top2 = b.float().topk(2, dim=-1).values
        if not torch.equal(a.argmax(-1), b.argmax(-1)):
            gap = (top2[:, 0] - top2[:, 1]).abs()
            differ = a.argmax(-1) != b.argmax(-1)
            assert (gap[differ] <= 2 * rel * scale).all(), f"step {step}: a different token where upstream's is clear"
            return
    assert torch.equal(got.sequences, expected.sequences)


def test_tables_whose_halves_differ_on_the_kernel(monkeypatch):
    """HunYuan-VL composes its M-RoPE sections across both halves of the head: at an image token a
    pair's two features carry two axes' angles. On the kernel each feature reads its own entry
    (``halves``): outputs as upstream's, and gradients as close to float64 autograd as upstream's own
    float32 ones (gradients that are rounding noise, e.g. of a key bias under softmax, differ between
    any two float32 implementations: each is measured against the float64 truth, not against the other)."""
    from torchembed.tools.zoo import outputs_of, zoo_case

    case = zoo_case("hunyuan_vl") if "hunyuan_vl" in transformers.models.auto.configuration_auto.CONFIG_MAPPING_NAMES else None
    if case is None:
        pytest.skip("the installed transformers has no HunYuan-VL")
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)  # float32 convolutions (vision patches)
    upstream = copy.deepcopy(case.model).to(DEV)
    patched = torchembed.patch(copy.deepcopy(upstream), fused=True)
    calls = _spy(monkeypatch, "rotary_fused")
    usual = _spy(monkeypatch, "rotary_fused_usual")  # HF's usual call: rotary_fused(..., halves=True)
    ref, out = outputs_of(upstream, case.inputs), outputs_of(patched, case.inputs)
    assert (calls or usual) and all(kw.get("halves") for _, kw, _ in calls)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())

    def grads_of(model, dtype):
        inputs = {k: v.to(DEV, dtype) if v.is_floating_point() else v.to(DEV) for k, v in case.inputs.items()}
        model.zero_grad()
        model(**inputs).logits.pow(2).mean().backward()
        return {n: p.grad.double() for n, p in model.named_parameters() if p.grad is not None}

    truth = grads_of(copy.deepcopy(upstream).double(), torch.float64)
    got, theirs = grads_of(patched, torch.float32), grads_of(upstream, torch.float32)
    floor = 1e-6 * max(g.abs().max().item() for g in truth.values())
    for name, want in truth.items():
        ours, upstream_error = (got[name] - want).abs().max().item(), (theirs[name] - want).abs().max().item()
        assert ours <= 2 * upstream_error + floor, f"{name}: error {ours:.3g} vs upstream's {upstream_error:.3g}"


@pytest.mark.parametrize("padded", [False, True])
def test_decode_steps_on_the_kernel_match_upstream_within_bf16(padded, monkeypatch):
    """A patched model's generate() (every decode step on the split-key kernel: CUDA, or the CPU through Triton's
    interpreter) against upstream (SDPA), bf16, grouped kv heads, head dim 128, a left-padded row: scores within bf16
    rounding of their scale."""
    config = transformers.LlamaConfig(hidden_size=512, intermediate_size=1024, num_attention_heads=4,
                                      num_key_value_heads=2, num_hidden_layers=2, vocab_size=256,
                                      attn_implementation="sdpa")
    torch.manual_seed(0)
    upstream = transformers.LlamaForCausalLM(config).to(DEV, torch.bfloat16).eval()
    patched = torchembed.patch(copy.deepcopy(upstream))
    ids = torch.randint(0, 256, (2, 300 if DEV == "cuda" else 80), device=DEV)
    mask = torch.ones_like(ids)
    if padded:
        mask[0, :40] = 0
    launches = []
    from torchembed.patches.rope import decode_attention as attention

    original = attention.fused_attention
    monkeypatch.setattr(attention, "fused_attention", lambda *a, **kw: launches.append(1) or original(*a, **kw))
    kwargs = dict(attention_mask=mask, max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0,
                  output_scores=True, return_dict_in_generate=True)
    with torch.no_grad():
        want, got = upstream.generate(ids, **kwargs), patched.generate(ids, **kwargs)
    graphs = vars(patched).get("_torchembed_decode_graphs")  # CUDA: replayed steps launch the captured kernel
    replayed, captured = (graphs.replays, graphs.captures) if graphs is not None else (0, 0)
    assert len(launches) == (3 - replayed + captured) * config.num_hidden_layers  # every decode step of every layer
    wanted, gotten = torch.stack(want.scores).float(), torch.stack(got.scores).float()
    finite = torch.isfinite(wanted)  # min_new_tokens sets the end-of-sequence score to -inf, in both
    assert torch.equal(finite, torch.isfinite(gotten))
    scale = wanted[finite].abs().max()
    assert (wanted[finite] - gotten[finite]).abs().max() <= 2**-6 * scale
