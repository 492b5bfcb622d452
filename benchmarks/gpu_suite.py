"""The whole test suite on a CUDA GPU, recorded; and whether that record is stale.

    python benchmarks/gpu_suite.py run --out DIR [--commit SHA] [--workers N] [--timeout S] [PYTEST ARGS]
    python benchmarks/gpu_suite.py status          # prints one line: current or stale (exit 0 either way)
    python benchmarks/gpu_suite.py status --strict # exit 1 when stale

``run`` runs every test file (``tests/``) with pytest-xdist on the GPU machine, each test bounded by pytest-timeout
where it is installed, and records every test's outcome as it ends (``DIR/gpu-suite.jsonl``: a run cut short still
leaves what finished). At the end it writes ``DIR/gpu-suite.json`` and ``DIR/gpu-suite.md``: the commit, the GPU, the
versions, counts per directory and per file, the slowest ten tests, the skips with their reasons, and the failures.
Given ``--cpu-record`` (a ``gpu-suite.json`` written by ``run`` on a machine without CUDA, e.g. CI's), the markdown
also counts the tests that ran on CUDA and skipped on the CPU. Copy both files to ``benchmarks/results/``.

``status`` compares the commit ``benchmarks/results/gpu-suite.md`` tested with the newest commit that touched the
library's core (``torchembed/kernels``, ``torchembed/functional``, ``torchembed/positional``, ``patches``): current when
the tested commit contains that change, stale otherwise. CI prints this line.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RECORD = ROOT / "benchmarks" / "results" / "gpu-suite.md"
CORE = ("torchembed/kernels", "torchembed/functional", "torchembed/positional", "patches")


# --- run ------------------------------------------------------------------------------------------


class Recorder:
    """A pytest plugin: one JSON line per test as its last report arrives (the controller's view under xdist)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.file = path.open("w")
        self.tests: dict[str, dict] = {}

    def pytest_runtest_logreport(self, report) -> None:
        entry = self.tests.setdefault(report.nodeid, {"test": report.nodeid, "outcome": "passed", "seconds": 0.0})
        entry["seconds"] += report.duration
        if report.skipped:
            entry["outcome"] = "skipped"
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
            entry["reason"] = reason.removeprefix("Skipped: ")
        elif report.failed:
            entry["outcome"] = "failed" if report.when == "call" else "error"
            entry["message"] = _last_line(str(report.longrepr))
        if report.when == "teardown":
            self.file.write(json.dumps(entry) + "\n")
            self.file.flush()

    def pytest_collectreport(self, report) -> None:
        if report.failed:
            entry = {"test": report.nodeid, "outcome": "error", "seconds": 0.0,
                     "message": _last_line(str(report.longrepr))}
            self.tests[report.nodeid] = entry
            self.file.write(json.dumps(entry) + "\n")
            self.file.flush()


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    errors = [line for line in lines if re.match(r"^E\s", line)]
    return (errors[-1] if errors else lines[-1] if lines else "")[:300]


def _environment() -> dict:
    env = {"python": platform.python_version()}
    for name in ("torch", "triton", "transformers"):
        try:
            env[name] = __import__(name).__version__
        except Exception:  # not installed
            env[name] = None
    import torch

    env["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return env


def run(args: argparse.Namespace, pytest_args: list[str]) -> int:
    import pytest

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    recorder = Recorder(out / "gpu-suite.jsonl")
    command = ["-q", "-p", "no:cacheprovider", "-n", str(args.workers), "--dist", "loadgroup", "-rN"]
    try:
        import pytest_timeout  # noqa: F401

        command += ["--timeout", str(args.timeout)]
    except ImportError:
        print("gpu_suite: pytest-timeout is not installed: tests run unbounded", file=sys.stderr)
    command += pytest_args or ["tests"]
    env = _environment()
    started = time.time()
    os.chdir(ROOT)
    # One intra-op thread per test process, as scripts/test.sh runs them: the suite's many small CPU models under
    # N workers with every core's worth of threads each oversubscribe the host (on a 16-core GPU machine with 14
    # workers the model-zoo tests took 60-180 s each instead of a few, and the suite outran its call).
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(name, "1")
    code = pytest.main(command, plugins=[recorder])
    recorder.file.close()
    record = {"commit": args.commit, "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              "wall_seconds": round(time.time() - started, 1), "exit_code": int(code),
              "command": "pytest " + " ".join(command), **env, "tests": list(recorder.tests.values())}
    cpu = json.loads(Path(args.cpu_record).read_text()) if args.cpu_record else None
    write(record, out, cpu)
    return int(code)


def write(record: dict, out: Path, cpu: dict | None = None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu-suite.json").write_text(json.dumps(record, indent=1) + "\n")
    text = markdown(record, cpu)
    (out / "gpu-suite.md").write_text(text)
    print(text)


def _counts(tests: list[dict], key) -> dict[str, collections.Counter]:
    groups: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for t in tests:
        group = groups[key(t["test"].split("::")[0])]
        group[t["outcome"]] += 1
        group["seconds"] += t["seconds"]
    return dict(sorted(groups.items()))


def _rows(groups: dict[str, collections.Counter], title: str) -> list[str]:
    lines = [f"| {title} | passed | failed | errors | skipped | seconds |", "|---|---:|---:|---:|---:|---:|"]
    for name, c in groups.items():
        lines.append(f"| `{name}` | {c['passed']} | {c['failed']} | {c['error']} | {c['skipped']} | {c['seconds']:.1f} |")
    return lines


def markdown(record: dict, cpu: dict | None = None) -> str:
    tests = record["tests"]
    total = collections.Counter(t["outcome"] for t in tests)
    commit = record.get("commit") or "unknown"
    lines = [
        "# The whole test suite on a GPU",
        "",
        f"- commit: {commit}",
        f"- date: {record['date']}; GPU: {record.get('gpu')}; Python {record.get('python')}, torch {record.get('torch')}, "
        f"Triton {record.get('triton')}, transformers {record.get('transformers')}",
        f"- command: `python benchmarks/gpu_suite.py run` (`{record['command']}`), {record['wall_seconds']:.0f} s wall, "
        f"pytest exit code {record['exit_code']}",
        f"- **{total['passed']} passed, {total['failed']} failed, {total['error']} errors, {total['skipped']} skipped**",
    ]
    if cpu is not None:
        cpu_skipped = {t["test"] for t in cpu["tests"] if t["outcome"] == "skipped"}
        cuda_only = sorted(t["test"] for t in tests if t["outcome"] == "passed" and t["test"] in cpu_skipped)
        lines.append(f"- {len(cuda_only)} tests ran here that skip on a machine without CUDA "
                     f"(the CPU record of {cpu.get('date')}, commit {cpu.get('commit')})")
    lines += ["", "## Per directory", ""]
    lines += _rows(_counts(tests, lambda path: str(Path(path).parent)), "directory")
    lines += ["", "## Per file", ""]
    lines += _rows(_counts(tests, lambda path: path), "file")
    lines += ["", "## The slowest ten tests", "", "| test | seconds |", "|---|---:|"]
    for t in sorted(tests, key=lambda t: -t["seconds"])[:10]:
        lines.append(f"| `{t['test']}` | {t['seconds']:.1f} |")
    bad = [t for t in tests if t["outcome"] in ("failed", "error")]
    if bad:
        lines += ["", "## Failures", "", "| test | outcome | message |", "|---|---|---|"]
        for t in bad:
            lines.append(f"| `{t['test']}` | {t['outcome']} | {t.get('message', '').replace('|', '/')} |")
    reasons = collections.Counter(t.get("reason", "") for t in tests if t["outcome"] == "skipped")
    lines += ["", "## Skips, by reason", "", "| tests | reason |", "|---:|---|"]
    for reason, n in reasons.most_common():
        lines.append(f"| {n} | {reason.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


# --- status ---------------------------------------------------------------------------------------


def _git(*args: str, root: Path = ROOT) -> str:
    return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True).stdout.strip()


def status(root: Path = ROOT) -> tuple[bool, str]:
    """(current?, the line to print) for the record ``benchmarks/results/gpu-suite.md`` under ``root``."""
    record = root / RECORD.relative_to(ROOT)
    core = _git("log", "-1", "--format=%H", "--", *CORE, root=root)
    if not core:
        return False, "GPU suite: unknown (no git history here)"
    if not record.exists():
        return False, f"GPU suite: stale: never recorded ({record.relative_to(root)} is missing); core last changed in {core[:9]}"
    text = record.read_text()
    match = re.search(r"^- commit: ([0-9a-f]{7,40})", text, re.M)
    tested = _git("rev-parse", "-q", "--verify", f"{match.group(1)}^{{commit}}", root=root) if match else ""
    if not tested:
        return False, f"GPU suite: stale: {record.name} names no commit of this history; core last changed in {core[:9]}"
    # current: the tested commit holds the newest core change, or the core here is the tested one (a change reverted)
    current = (subprocess.run(["git", "merge-base", "--is-ancestor", core, tested], cwd=root).returncode == 0
               or subprocess.run(["git", "diff", "--quiet", tested, "HEAD", "--", *CORE], cwd=root).returncode == 0)
    counts = re.search(r"^- \*\*(\d+) passed, (\d+) failed, (\d+) errors", text, re.M)
    failing = counts is not None and (int(counts.group(2)) or int(counts.group(3)))
    cut_short = "(cut short" in text  # the record of a run stopped at its time limit: some tests never ended
    state = ("stale" if not current
             else f"failing ({counts.group(2)} failed, {counts.group(3)} errors{'; cut short' if cut_short else ''})"
             if failing else "cut short (some tests never ended)" if cut_short else "current")
    return state == "current", (
        f"GPU suite: {state}: {record.name} tested {tested[:9]}; the core (kernels, functional, positional, patches) last "
        f"changed in {core[:9]}" + ("" if state == "current" else ": run `bash benchmarks/gpu_session.sh suite` on a GPU"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="run the whole suite and record it")
    r.add_argument("--out", default="torchembed-results")
    r.add_argument("--commit", default=None, help="the commit of the tree (default: git rev-parse HEAD where git works)")
    r.add_argument("--workers", type=int, default=8)
    r.add_argument("--timeout", type=int, default=300, help="seconds per test (pytest-timeout)")
    r.add_argument("--cpu-record", default=None, help="a gpu-suite.json recorded without CUDA, to count CUDA-only tests")
    s = sub.add_parser("status", help="whether benchmarks/results/gpu-suite.md tested the newest core commit")
    s.add_argument("--strict", action="store_true", help="exit 1 when stale")
    m = sub.add_parser("markdown", help="rewrite gpu-suite.md from a gpu-suite.json, or from the gpu-suite.jsonl of a "
                                        "run cut short")
    m.add_argument("record")
    m.add_argument("--commit", default=None, help="the tested commit (for a .jsonl)")
    m.add_argument("--cpu-record", default=None)
    m.add_argument("--out", default=None)
    args, rest = parser.parse_known_args(argv)
    if args.command == "run":
        args.commit = args.commit or _git("rev-parse", "HEAD") or None
        return run(args, rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "status":
        current, line = status()
        print(line)
        return 0 if current or not args.strict else 1
    path = Path(args.record)
    if path.suffix == ".jsonl":  # a run cut short: what finished
        tests = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        record = {"commit": args.commit, "date": datetime.datetime.fromtimestamp(path.stat().st_mtime, datetime.timezone.utc)
                  .strftime("%Y-%m-%d %H:%M UTC"), "wall_seconds": 0.0, "exit_code": -1,
                  "command": "(cut short: the tests that finished)", **_environment(), "tests": tests}
    else:
        record = json.loads(path.read_text())
    cpu = json.loads(Path(args.cpu_record).read_text()) if args.cpu_record else None
    write(record, Path(args.out or path.parent), cpu)
    return 0


if __name__ == "__main__":
    sys.exit(main())
