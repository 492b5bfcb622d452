"""The ``torchembed`` command line: ``compare``, ``bench``, ``list``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _compare(args: argparse.Namespace) -> int:
    import transformers

    from torchembed.tools.compare import compare

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    report = compare(
        args.models or None,
        dtypes=args.dtype,
        attn_implementations=args.attn,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        decode_steps=args.steps,
        fused={"auto": None, "on": True, "off": False}[args.fused],
        device=args.device,
        cache_dir=args.cache_dir,
        progress=not args.json and sys.stderr.isatty(),
        every_model_type=args.all,
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


def _list(args: argparse.Namespace) -> int:
    from torchembed.patches import supported_families

    if not args.all:
        for family in supported_families():
            print(f"{family.name:14} {family.encoding:8} {family.description}")
        print(f"{'(any other)':14} {'rope':8} RoPE models found by structure: see `torchembed list --all`")
        return 0
    import transformers

    from torchembed.tools.zoo import survey

    transformers.logging.set_verbosity_error()
    statuses = survey()
    for status in statuses:
        print(f"{status.model_type:26} {'yes' if status.supported else 'no ':4} {status.how}")
    supported = sum(s.supported for s in statuses)
    print(f"{supported} of {len(statuses)} text model types of transformers {transformers.__version__} are patched "
          "(checked on tiny random-weight models built from each config class)")
    return 0


def _bench(args: argparse.Namespace) -> int:
    from torchembed.tools import bench

    return bench.main([args.what, *args.rest])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="torchembed", description="Positional encodings for PyTorch and HF models.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("compare", help="numerics of patched vs upstream models (default: tiny models of every family)")
    p.add_argument("models", nargs="*", metavar="MODEL", help="hub id or checkpoint directory; none = embedded default")
    p.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16", "float16"])
    p.add_argument("--attn", nargs="+", default=None, help="attention implementations (default: all supported of eager, sdpa)")
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--steps", type=int, default=3, help="KV-cache decode steps")
    p.add_argument("--device", default="cpu")
    p.add_argument("--fused", choices=["auto", "on", "off"], default="auto")
    p.add_argument("--cache-dir", default=None, help="where the tiny checkpoints are written (default ~/.cache/torchembed)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--all", action="store_true", help="every model type torchembed patches (see `list --all`)")
    p.set_defaults(func=_compare)

    p = sub.add_parser("bench", help="speed: rope kernel, alibi attention, end to end")
    p.add_argument("what", choices=["rope", "alibi", "e2e", "train"])
    p.add_argument("rest", nargs=argparse.REMAINDER, help="options of that benchmark (--help)")
    p.set_defaults(func=_bench)

    p = sub.add_parser("list", help="supported model families and what is swapped in each")
    p.add_argument("--all", action="store_true", help="every text model type of the installed transformers: supported or why not")
    p.set_defaults(func=_list)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
