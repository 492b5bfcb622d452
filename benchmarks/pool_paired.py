"""Pool the paired upstream / patched ratios of several ``torchembed bench e2e`` runs.

Each repeat of a run measured upstream and patched back to back; their ratio is one paired sample.
Per (phase, model, batch, prompt length) this pools the samples of every file given and prints the
median with a bootstrap 95 % interval (resampling the pooled samples), as a markdown table.
Runs recorded before ``bench e2e`` kept the per-repeat ratio (no ``paired_speedup``) are skipped.

    python benchmarks/pool_paired.py benchmarks/results/e2e.json ... [--out pooled.md]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from pathlib import Path


def paired_samples(paths: list[Path]) -> dict[tuple, dict[str, list[float]]]:
    """(phase, model, batch, prompt) -> {file name: [upstream / patched per repeat]}, from the
    ``paired_speedup`` each run recorded on its patched rows."""
    pooled: dict[tuple, dict[str, list[float]]] = {}
    for path in paths:
        for r in json.loads(path.read_text())["results"]:
            if r["variant"] == "patched" and r.get("paired_speedup"):
                case = r["phase"], r["model"], r["batch"], r["prompt_len"]
                pooled.setdefault(case, {})[path.stem] = r["paired_speedup"]["values"]
    return pooled


def bootstrap_median(samples: list[float], rounds: int = 4000, seed: int = 0) -> tuple[float, float]:
    """2.5 and 97.5 percentiles of the median of resampled ``samples``."""
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(samples, k=len(samples))) for _ in range(rounds))
    return medians[int(0.025 * rounds)], medians[int(0.975 * rounds) - 1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, default=None, help="also write the table here")
    args = parser.parse_args()
    lines = ["| phase | model | batch x prompt | per file (median) | n | pooled median | 95 % interval | time ratio |",
             "|---|---|---:|---|---:|---:|---:|---:|"]
    for (phase, model, batch, prompt), per_file in sorted(paired_samples(args.files).items()):
        samples = [x for values in per_file.values() for x in values]
        median = statistics.median(samples)
        low, high = bootstrap_median(samples)
        files = ", ".join(f"{name} {statistics.median(v):.2f}" for name, v in per_file.items())
        lines.append(f"| {phase} | {model} | {batch} x {prompt} | {files} | {len(samples)} | {median:.3f}x | "
                     f"{low:.3f}-{high:.3f} | {1 / median:.3f} |")
    lines += ["", "upstream / patched per repeat (the two runs of a repeat back to back), pooled over the files; "
              "interval: bootstrap of the median; time ratio = patched / upstream time at the pooled median"]
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
