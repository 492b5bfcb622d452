"""Numerics: a patched model against its upstream self and against a float64 evaluation.

For every model, dtype and attention implementation, three copies of the same weights run the
same inputs (a left-padded batch with explicit ``position_ids`` where the model takes them, then
a few KV-cache decode steps): upstream in the dtype, torchembed-patched in the dtype, and upstream
in float64 (the truth). The report gives, over all real (non-padded) positions and decode steps:

* ``max_abs`` / ``rel``: how far patched is from upstream (``rel`` = max abs / max |truth|);
* ``upstream_err`` / ``patched_err``: max abs error of each against the float64 truth;
* ``upstream_spread``: for non-eager attention, how far upstream itself is from upstream eager
  (where upstream disagrees with itself, e.g. Falcon with ``alibi=True`` applies the bias twice in
  eager attention, the note says so).

Where upstream's implementations disagree, a family names the one its patched model computes
(``Family.reference_attn``; Falcon-ALiBi: sdpa). Rows of the other implementations then compare
the patched model with upstream (and float64) in that implementation, and the note says so.

A row passes when float32 agrees within ``rel <= 1e-5`` and, in half precision, patched is no
further from float64 than upstream (mean error over all outputs, allowing 25%). The rotation itself
rounds once from float32 and is the closer of the two; end to end the other bf16 ops dominate the
error, and a tiny random model amplifies a different rounding chaotically: on one draw of inputs
upstream's own eager and sdpa attention, equally valid roundings, differ in that error by up to 6%,
and over six draws the patched / upstream ratio of Gemma 4 (text) ranged 0.94-1.21 (mean 1.07).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import json
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["compare", "CompareReport", "CompareRow", "FP32_REL_TOL"]

FP32_REL_TOL = 1e-5
HALF_SLACK = 1.25  # bf16/fp16: patched mean error may exceed upstream's by this factor (rounding noise)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


@dataclass
class CompareRow:
    model: str
    family: str
    dtype: str
    attn: str
    max_abs: float
    rel: float
    upstream_err: float
    patched_err: float
    upstream_mean_err: float
    patched_mean_err: float
    upstream_spread: float | None
    ok: bool
    note: str = ""


@dataclass
class CompareReport:
    rows: list[CompareRow] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(row.ok for row in self.rows)

    def to_json(self) -> str:
        return json.dumps([asdict(r) for r in self.rows], indent=2)

    def table(self) -> Any:
        """A ``rich.table.Table`` of the rows."""
        from rich.table import Table

        table = Table(title="torchembed vs upstream (max abs error; errors vs float64 upstream)")
        for col in ("model", "dtype", "attn", "patched vs upstream", "rel", "upstream err", "torchembed err", "ok", "note"):
            table.add_column(col, justify="left" if col in ("model", "attn", "note") else "right")
        for r in self.rows:
            table.add_row(
                r.model, r.dtype, r.attn, f"{r.max_abs:.2e}", f"{r.rel:.1e}", f"{r.upstream_err:.2e}",
                f"{r.patched_err:.2e}", "[green]yes[/]" if r.ok else "[red]NO[/]", r.note,
            )
        return table

    def __str__(self) -> str:
        lines = [f"{'model':16} {'dtype':9} {'attn':6} {'vs upstream':>11} {'rel':>8} {'up err':>9} {'te err':>9} ok"]
        for r in self.rows:
            lines.append(
                f"{r.model:16} {r.dtype:9} {r.attn:6} {r.max_abs:11.2e} {r.rel:8.1e} {r.upstream_err:9.2e} "
                f"{r.patched_err:9.2e} {'yes' if r.ok else 'NO'} {r.note}"
            )
        return "\n".join(lines)


def _attn_implementations(model: nn.Module) -> list[str]:
    impls = ["eager"]
    if getattr(model, "_supports_sdpa", False):
        impls.append("sdpa")
    return impls


def _set_attn(model: nn.Module, impl: str) -> None:
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(impl)
    if model.config._attn_implementation != impl:
        # Models that pick their attention at run time from the config (Falcon, 4.x) refuse the
        # setter but honour the config field.
        model.config._attn_implementation = impl


def _inputs(model: nn.Module, batch: int, seq_len: int, steps: int, seed: int, device: torch.device) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(0, vocab, (batch, seq_len), generator=gen)
    mask = torch.ones(batch, seq_len, dtype=torch.long)
    for b in range(1, batch):  # rows after the first are left-padded by a growing amount
        mask[b, : min(b * 3, seq_len - 1)] = 0
    next_tokens = torch.randint(0, vocab, (steps, batch, 1), generator=gen)
    return {"ids": ids.to(device), "mask": mask.to(device), "next": next_tokens.to(device)}


def _is_causal_lm(model: nn.Module) -> bool:
    return hasattr(model, "lm_head") or type(model).__name__.endswith("ForCausalLM") or type(model).__name__.endswith("LMHeadModel")


def _forward_kwargs(model: nn.Module) -> tuple[bool, bool]:
    takes_positions = "position_ids" in inspect.signature(model.forward).parameters
    return takes_positions, _is_causal_lm(model)


def _returns_cache(out: Any) -> bool:
    """Whether the forward handed back a KV cache to decode on (recurrent models such as
    RecurrentGemma keep their state inside the model: compared on the prefill only)."""
    return getattr(out, "past_key_values", None) is not None


@torch.no_grad()
def _run(model: nn.Module, inputs: dict[str, Any]) -> Tensor:
    """Batched run: outputs at every real position, then every decode step; flat, float64."""
    ids, mask = inputs["ids"], inputs["mask"]
    takes_positions, causal = _forward_kwargs(model)
    kwargs: dict[str, Any] = {"attention_mask": mask}
    if takes_positions:
        kwargs["position_ids"] = (mask.cumsum(-1) - 1).clamp(min=0)
    if causal:
        kwargs["use_cache"] = True
    out = model(input_ids=ids, **kwargs)
    outputs = [(out.logits if causal else out.last_hidden_state)[mask.bool()].double()]
    if causal and _returns_cache(out):
        past = out.past_key_values
        for token in inputs["next"]:
            positions = mask.sum(-1, keepdim=True)
            mask = torch.cat((mask, torch.ones_like(token)), dim=-1)
            kwargs = {"attention_mask": mask, "past_key_values": past, "use_cache": True}
            if takes_positions:
                kwargs["position_ids"] = positions
            out = model(input_ids=token, **kwargs)
            past = out.past_key_values
            outputs.append(out.logits[:, -1].double())
    return torch.cat([o.reshape(-1) for o in outputs]).cpu()


@torch.no_grad()
@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _run_unpadded(model: nn.Module, inputs: dict[str, Any]) -> Tensor:
    """The same outputs, one sequence at a time without padding (what the truth model runs).

    Mathematically identical to the padded batch; it also keeps float64 eager attention away from
    fully masked padding rows, which upstream turns into NaN (its softmax runs in float32).
    """
    _, causal = _forward_kwargs(model)
    prefill, steps = [], []
    for b in range(inputs["ids"].shape[0]):
        ids = inputs["ids"][b][inputs["mask"][b].bool()][None]
        out = model(input_ids=ids, use_cache=True) if causal else model(input_ids=ids)
        prefill.append((out.logits if causal else out.last_hidden_state)[0].double())
        row = []
        if causal and _returns_cache(out):
            past = out.past_key_values
            for token in inputs["next"]:
                out = model(input_ids=token[b : b + 1], past_key_values=past, use_cache=True)
                past = out.past_key_values
                row.append(out.logits[0, -1].double())
        steps.append(row)
    flat = [p.reshape(-1) for p in prefill]
    flat += [steps[b][t] for t in range(len(steps[0])) for b in range(len(steps))]
    return torch.cat(flat).cpu()


@dataclass
class _Checkpoint:
    """A checked checkpoint: its folder or hub id and the hub keywords to load it with."""

    path: str
    hub_kwargs: dict[str, Any] = field(default_factory=dict)


def _load(source: str | _Checkpoint | nn.Module, dtype: torch.dtype, impl: str, device: torch.device) -> nn.Module:
    if isinstance(source, nn.Module):
        model = copy.deepcopy(source).to(device=device, dtype=dtype)
    else:
        from torchembed.patches.loading import load_upstream, model_class_for
        import transformers

        path, hub = (source.path, source.hub_kwargs) if isinstance(source, _Checkpoint) else (source, {})
        config = transformers.AutoConfig.from_pretrained(path, **hub)
        model = load_upstream(model_class_for(config), path, dtype=dtype, attn_implementation=impl, **hub).to(device)
    _set_attn(model, impl)
    if dtype == torch.float64:
        _plain_experts(model)
    return model.eval()


def _plain_experts(model: nn.Module) -> None:
    """Mixture-of-experts layers in plain PyTorch (5.x's grouped matmul has no float64 kernel)."""
    can_set = getattr(type(model), "_can_set_experts_implementation", None)
    if can_set is not None and can_set():
        model.set_experts_implementation("eager")


def _truth(source: str | _Checkpoint | nn.Module, impl: str, inputs: dict[str, Any], device: torch.device) -> tuple[Tensor, str]:
    """Upstream's outputs in float64, unpadded: the reference both errors are measured against.

    Some upstream models cannot run in float64 (4.57's DeepSeek-V3 routes in hard-coded float32
    and then mixes the two dtypes; BLT's float64 outputs are NaN); they get a float32 reference, said
    in the row's note. The
    float32 verdict does not use the reference, and float32 is far below bf16's rounding.
    """
    try:
        with _default_dtype(torch.float64):  # upstream code that makes tensors without a dtype (4.x MPT's masks)
            out = _run_unpadded(_load(source, torch.float64, impl, device), inputs)
    except RuntimeError as exc:
        if "type" not in str(exc):  # only dtype mix-ups ("scalar type", "dtype") fall back
            raise
        return _run_unpadded(_load(source, torch.float32, impl, device), inputs), "float32 reference: upstream fails in float64"
    if not torch.isfinite(out).all():  # (BLT's float64 patch entropies: NaN in upstream itself)
        return (_run_unpadded(_load(source, torch.float32, impl, device), inputs),
                "float32 reference: upstream's float64 outputs are not finite")
    return out, ""


def _compare_one(
    name: str, source: str | nn.Module, dtype_name: str, impl: str, inputs: dict[str, Any], device: torch.device,
    fused: bool | None, eager_reference: dict[str, Tensor],
) -> CompareRow:
    from torchembed.patches.core import find_positional_components, patch
    from torchembed.patches.registry import family_for

    dtype = _DTYPES[dtype_name]
    upstream = _load(source, dtype, impl, device)
    family = family_for(upstream.config)
    # Where upstream's attention implementations disagree, the patched model computes one of them
    # (family.reference_attn) under every setting: upstream and the truth run that one.
    ref_impl = (family.reference_attn if family else "") or impl
    reference = upstream if ref_impl == impl else _load(source, dtype, ref_impl, device)
    truth, truth_note = _truth(source, ref_impl, inputs, device)
    out_up = _run(reference, inputs)
    if impl == "eager":
        eager_reference[dtype_name] = out_up if reference is upstream else _run(upstream, inputs)
    patched = patch(upstream, fused=fused)  # same weights: patch the loaded upstream in place
    out_pt = _run(patched, inputs)
    scale = truth.abs().max().item() or 1.0
    max_abs = (out_pt - out_up).abs().max().item()
    err_up, err_pt = (out_up - truth).abs(), (out_pt - truth).abs()
    spread = None
    if impl != "eager" and dtype_name in eager_reference:
        spread = (out_up - eager_reference[dtype_name]).abs().max().item()
    if dtype == torch.float32 or dtype == torch.float64:
        ok = max_abs / scale <= FP32_REL_TOL
    else:
        ok = err_pt.mean().item() <= err_up.mean().item() * HALF_SLACK
    note = f"compared with upstream {ref_impl}" if ref_impl != impl else truth_note
    if spread is not None and spread / scale > (FP32_REL_TOL if dtype == torch.float32 else 5e-2):
        note = f"upstream {impl} differs from upstream eager by {spread:.2e}"
    if any(c.kind == "generation" for c in find_positional_components(patched)):  # (MPT: KeepGenerationCache)
        note = "; ".join(filter(None, (note, "generate keeps its KV cache (config: off)")))
    return CompareRow(
        model=name, family=family.name if family else "?", dtype=dtype_name, attn=impl, max_abs=max_abs,
        rel=max_abs / scale, upstream_err=err_up.max().item(), patched_err=err_pt.max().item(),
        upstream_mean_err=err_up.mean().item(), patched_mean_err=err_pt.mean().item(), upstream_spread=spread,
        ok=ok, note=note,
    )


def compare(
    models: str | nn.Module | Sequence[str | nn.Module] | None = None,
    *,
    dtypes: Iterable[str] = ("float32", "bfloat16"),
    attn_implementations: Iterable[str] | None = None,
    batch_size: int = 2,
    seq_len: int = 16,
    decode_steps: int = 3,
    seed: int = 0,
    fused: bool | None = None,
    device: str | torch.device = "cpu",
    cache_dir: str | os.PathLike[str] | None = None,
    progress: bool = False,
    every_model_type: bool = False,
    gguf_file: str | None = None,
) -> CompareReport:
    """Compare torchembed-patched models with upstream and with float64.

    Args:
        models: a model, a checkpoint directory or hub id, the name of one tiny model of the embedded
            default (``"llama"``, ``"falcon-alibi"``, a model type such as ``"qwen3"``; a local folder of
            that name comes first), or a list of them. ``None`` runs the embedded default: tiny
            random-weight checkpoints of every family and rope variant and a sample of the RoPE model
            types found by structure.
        every_model_type: with ``models=None``, tiny checkpoints of every causal-LM model type of
            the installed transformers that torchembed patches (``torchembed list --all``; the
            vision-language and encoder ones, with their images, are checked by the test suite).
        dtypes: any of float32, bfloat16, float16.
        attn_implementations: default: every one the model supports among eager and sdpa.
        fused: passed to :func:`torchembed.patch`.
        progress: progress on stderr while models load and run (a bar on a terminal, else a line every 10 s).
        gguf_file: the GGUF file inside each checkpoint folder (or hub repo) to load, as in
            ``from_pretrained(path, gguf_file=...)``; a model given as a path to a ``.gguf`` file
            needs none. transformers dequantises it to float (the ``gguf`` package is needed) once,
            into a temporary folder that every copy (each dtype, attention and the float64 truth)
            is loaded from.

    Raises:
        FileNotFoundError: (``CheckpointNotFoundError``) a model that is no local folder and
            cannot be had from the hub (a name that is no tiny model: the message names the closest),
            a folder without the checkpoint's files, or ``gguf_file`` with a tiny model's name.
        OSError: a ``.gguf`` file that is not GGUF.
        ValueError: a device this machine does not have, or an unknown dtype.

    Returns:
        A :class:`CompareReport`; ``report.ok`` is the verdict, ``print(report)`` a table.
    """
    from torchembed.tools.checkpoints import build_checkpoint

    problem = device_problem(device)
    if problem is not None:
        raise ValueError(f"device={str(device)!r}: {problem}; use device='cpu'")
    device = torch.device(device)
    dtypes = list(dtypes)
    for dtype_name in dtypes:
        if dtype_name not in _DTYPES:
            raise ValueError(f"unknown dtype {dtype_name!r}; choose from {sorted(_DTYPES)}")
    if gguf_file and models is None:
        raise ValueError("gguf_file names a file inside a checkpoint folder: pass that folder as models")
    with contextlib.ExitStack() as scratch:  # dequantised GGUF checkpoints live as long as the comparison
        if models is None:
            names = default_models(every_model_type, progress=progress)
            sources: list[tuple[str, str | _Checkpoint | nn.Module]] = []
            with _progress(progress, len(names), "compare: tiny checkpoints") as advance:
                for n in names:
                    sources.append((n, str(build_checkpoint(n, cache_dir))))
                    advance(n)
        else:
            items = [models] if isinstance(models, (str, os.PathLike, nn.Module)) else list(models)
            sources = [_source(m, gguf_file, scratch, cache_dir) for m in items]
        return _compare_sources(sources, dtypes, attn_implementations, batch_size, seq_len, decode_steps, seed, fused,
                                device, progress)


def device_problem(device: str | torch.device) -> str | None:
    """Why ``device`` cannot be used on this machine (``None`` when it can), in a few words."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as exc:
        return f"not a device ({str(exc).splitlines()[0]})"
    if dev.type == "cpu":
        return None
    if dev.type == "cuda":
        if torch.version.cuda is None and not getattr(torch.version, "hip", None):
            return f"this torch ({torch.__version__}) is a CPU-only build"
        if not torch.cuda.is_available():
            return "no CUDA device is visible"
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            return f"there are {torch.cuda.device_count()} CUDA devices (0-{torch.cuda.device_count() - 1})"
        return None
    backend = getattr(torch, dev.type, None)
    is_available = getattr(backend, "is_available", None)
    if callable(is_available) and not is_available():
        return f"no {dev.type} device is available"
    return None


def _source(model: str | os.PathLike[str] | nn.Module, gguf_file: str | None, scratch: contextlib.ExitStack,
            cache_dir: str | os.PathLike[str] | None = None) -> tuple[str, str | _Checkpoint | nn.Module]:
    """``(name, source)``: a model as given; the name of a tiny model of the embedded default that is
    no local path (``llama``, ``falcon-alibi``, ``qwen3``) built as in the default; a path or hub id
    checked (``resolve_checkpoint``), and a GGUF checkpoint dequantised once into a temporary folder."""
    if isinstance(model, nn.Module):
        return _name(model), model
    from torchembed.patches.loading import CheckpointNotFoundError, resolve_checkpoint
    from torchembed.tools.checkpoints import build_checkpoint, is_tiny_model

    if isinstance(model, str) and not Path(model).expanduser().exists() and is_tiny_model(model):
        if gguf_file:
            raise CheckpointNotFoundError(
                f"{model!r} is a tiny model of the embedded default (torchembed list), made from a config: it has no "
                f"GGUF file {gguf_file!r}; pass the checkpoint folder that holds it (FOLDER --gguf-file NAME)")
        return model, str(build_checkpoint(model, cache_dir))
    try:
        path, hub = resolve_checkpoint(model, **({"gguf_file": gguf_file} if gguf_file else {}))
    except CheckpointNotFoundError as err:
        if isinstance(model, str) and "/" not in model and Path(model).suffix != ".gguf":  # a name, maybe mistyped
            raise type(err)(f"no tiny model {model!r} (torchembed list names them{_did_you_mean(model)}), and as a "
                            f"checkpoint: {err}") from err
        raise
    gguf = hub.pop("gguf_file", None)
    if not gguf:
        return _name(model), _Checkpoint(path, hub)
    return Path(gguf).stem, _Checkpoint(_dequantized(path, gguf, hub, scratch))


def _did_you_mean(name: str) -> str:
    """``"; did you mean 'llama'?"`` for the closest tiny model name, or nothing."""
    import difflib

    from torchembed.tools.checkpoints import TINY_MODELS
    from torchembed.tools.zoo import text_model_types

    close = difflib.get_close_matches(name, [*TINY_MODELS, *text_model_types()], n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def _dequantized(path: str, gguf_file: str, hub: dict[str, Any], scratch: contextlib.ExitStack) -> str:
    """Load a GGUF checkpoint once in float32 (transformers dequantises it) and write it with
    ``save_pretrained`` to a temporary folder: loading that folder in a dtype gives the same
    tensors as loading the GGUF file in it, without parsing and dequantising it per copy."""
    import tempfile

    from torchembed.patches.loading import load_config, load_upstream, model_class_for

    config, kwargs = load_config(path, gguf_file=gguf_file, dtype=torch.float32, **hub)
    model = load_upstream(model_class_for(config), path, config=config, **kwargs)
    folder = scratch.enter_context(tempfile.TemporaryDirectory(prefix="torchembed-gguf-"))
    # The weights are plain float32 tensors now; transformers 5.x still marks the model as GGUF
    # "quantized", which save_pretrained refuses.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(folder)
    del model
    return folder


def _compare_sources(
    sources: list[tuple[str, str | _Checkpoint | nn.Module]], dtypes: list[str], attn_implementations: Iterable[str] | None,
    batch_size: int, seq_len: int, decode_steps: int, seed: int, fused: bool | None, device: torch.device, progress: bool,
) -> CompareReport:
    report = CompareReport()
    tasks = []
    with _progress(progress and len(sources) > 1, len(sources), "compare: loading") as advance:
        for name, source in sources:
            probe = _load(source, torch.float32, "eager", torch.device("cpu")) if not isinstance(source, nn.Module) else source
            impls = list(attn_implementations) if attn_implementations else _attn_implementations(probe)
            inputs = _inputs(probe, batch_size, seq_len, decode_steps, seed, device)
            tasks += [(name, source, d, impl, inputs) for d in dtypes for impl in impls]
            advance(name)
    eager_refs: dict[str, dict[str, Tensor]] = {}
    with _progress(progress, len(tasks), "compare") as advance:
        for name, source, dtype_name, impl, inputs in tasks:
            try:
                row = _compare_one(name, source, dtype_name, impl, inputs, device, fused, eager_refs.setdefault(name, {}))
            except Exception as exc:
                if hasattr(exc, "add_note"):  # Python 3.11+
                    exc.add_note(f"while comparing {name} ({dtype_name}, {impl} attention)")
                raise
            report.rows.append(row)
            advance(f"{name} {dtype_name} {impl} {'ok' if row.ok else 'MISMATCH'}")
    return report


def default_models(every_model_type: bool = False, *, progress: bool = False) -> list[str]:
    """The embedded default: the tiny models of the seven families and their variants, then a sample
    of the RoPE model types found by structure; with ``every_model_type``, every patched model type that
    has a causal-LM class instead of the sample (``progress``: of the survey, where it is not cached)."""
    from torchembed.tools.checkpoints import SAMPLED_MODEL_TYPES, TINY_MODELS
    from torchembed.tools.zoo import survey, text_model_types

    names = list(TINY_MODELS)
    available = set(text_model_types())
    if every_model_type:  # the causal LMs among them: compare's inputs are padded token ids
        extra = [s.model_type for s in survey(progress=progress) if s.supported and s.model_type in available]
    else:
        extra = [t for t in SAMPLED_MODEL_TYPES if t in available]
    return names + [t for t in extra if t not in names]


def _name(model: Any) -> str:
    if isinstance(model, nn.Module):
        return getattr(getattr(model, "config", None), "model_type", type(model).__name__)
    return Path(str(model)).name or str(model)


def _progress(enabled: bool, total: int, what: str) -> Any:
    from torchembed.tools.progress import progress

    return progress(total, what, enabled)
