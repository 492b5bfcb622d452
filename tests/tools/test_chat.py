"""``torchembed chat``'s timing and report, on a tiny random-weight LLaMA (no checkpoint needed)."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import torchembed  # noqa: E402
from torchembed.tools import chat  # noqa: E402


class _Tokenizer:
    pad_token_id, eos_token_id = None, 0

    def decode(self, tokens, skip_special_tokens=True):
        return " ".join(map(str, tokens))


def _tiny() -> torch.nn.Module:
    config = transformers.LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      intermediate_size=64, vocab_size=97, initializer_range=0.5, eos_token_id=None)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def test_answers_alternate_and_report_medians(monkeypatch):
    upstream = _tiny()
    models = {"upstream": upstream, "torchembed": torchembed.patch(copy.deepcopy(upstream))}
    order: list[str] = []
    generate = chat._generate

    def spy(model, inputs, kwargs):
        order.append(next(label for label, m in models.items() if m is model))
        return generate(model, inputs, kwargs)

    monkeypatch.setattr(chat, "_generate", spy)
    ids = torch.randint(1, 97, (1, 6))
    answers = chat._answers(models, _Tokenizer(), {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, 5, 3)
    assert order == ["upstream", "torchembed", "torchembed", "upstream", "upstream", "torchembed"]
    assert [a.label for a in answers] == ["upstream", "torchembed"]
    assert answers[0].tokens == answers[1].tokens and len(answers[0].tokens) == 5
    assert all(a.runs == 3 and a.repeatable and a.ms_per_token > 0 for a in answers)
    result = chat.ChatResult("tiny", "p", answers)
    assert result.identical and "medians of 3 alternating runs each" in str(result)


def test_report_names_a_difference_and_unrepeatable_runs():
    a = chat.ChatAnswer("upstream", "x", [1, 2], 10.0, 5.0, 3)
    b = chat.ChatAnswer("torchembed", "y", [1, 3], 10.0, 5.0, 3, repeatable=False)
    text = str(chat.ChatResult("m", "p", [a, b]))
    assert "identical: NO" in text and "did not all give these tokens" in text


def test_repeats_must_be_positive():
    with pytest.raises(ValueError, match="repeats must be a positive int"):
        chat.chat("hi", "./no/such/model", repeats=0)


def test_a_run_without_the_kernel_says_what_the_speedup_means(monkeypatch):
    """On a CPU both sides run PyTorch operations: the report says so, and where the GPU numbers are."""
    from pathlib import Path
    from types import SimpleNamespace

    from torchembed import kernels

    cpu, cuda = torch.empty(0), SimpleNamespace(device=torch.device("cuda"))  # (no CUDA tensor on a CPU machine)
    monkeypatch.setattr(kernels, "kernel_can_run", lambda t: False)
    note = chat.rotation_note(cpu, None)
    assert "on the CPU torchembed rotates with PyTorch operations" in note and "CUDA GPUs" in note
    assert "docs/benchmarks.md" in note and (Path(__file__).resolve().parents[2] / "docs" / "benchmarks.md").is_file()
    assert "--fused off" in chat.rotation_note(cuda, False)
    assert "without Triton" in chat.rotation_note(cuda, None)
    monkeypatch.setattr(kernels, "kernel_can_run", lambda t: True)
    assert chat.rotation_note(cpu, None) == ""  # (TRITON_INTERPRET=1: the kernel runs, interpreted)
    assert chat.rotation_note(cpu, False) != ""
    a = chat.ChatAnswer("upstream", "x", [1, 2], 10.0, 5.0, 3)
    b = chat.ChatAnswer("torchembed", "x", [1, 2], 10.0, 5.0, 3)
    assert str(chat.ChatResult("m", "p", [a, b], note="here")).splitlines()[-2:] == [
        "identical: yes (2 tokens); speedup (time per token upstream / torchembed, above 1: torchembed faster): 1.00x "
        "(medians of 3 alternating runs each)", "note: here"]
