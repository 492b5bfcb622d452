"""Plot benchmark JSON files (from ``torchembed bench ...``) as PNGs next to them.

    python benchmarks/plot_results.py benchmarks/results
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot_e2e(path: Path) -> Path:
    """Grouped bars: ms per phase/model/batch/prompt length for each variant (median, min-max whiskers)."""
    data = json.loads(path.read_text())
    rows = [r for r in data["results"] if isinstance(r.get("ms"), dict)]  # measured (not skipped)
    variants = list(dict.fromkeys(r["variant"] for r in rows))

    def case_of(r: dict) -> tuple:
        return r["phase"], r["model"], r["batch"], r.get("prompt_len")

    cases = list(dict.fromkeys(case_of(r) for r in rows))
    several_prompts = len({c[3] for c in cases}) > 1
    fig, axes = plt.subplots(1, len({c[0] for c in cases}), figsize=(16 if several_prompts else 13, 4.4), squeeze=False)
    for ax, phase in zip(axes[0], dict.fromkeys(c[0] for c in cases)):
        phase_cases = [c for c in cases if c[0] == phase]
        width = 0.8 / len(variants)
        for i, variant in enumerate(variants):
            xs, ys, lo, hi = [], [], [], []
            for j, case in enumerate(phase_cases):
                match = [r for r in rows if case_of(r) == case and r["variant"] == variant]
                if match:
                    ms = match[0]["ms"]
                    xs.append(j + i * width)
                    ys.append(ms["median"])
                    lo.append(ms["median"] - ms["min"])
                    hi.append(ms["max"] - ms["median"])
            ax.bar(xs, ys, width, yerr=[lo, hi], capsize=2, label=variant)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(phase_cases))])
        ax.set_xticklabels([f"{m}\nb{b} p{p}" if several_prompts else f"{m}\nbatch {b}" for _, m, b, p in phase_cases],
                           fontsize=7 if several_prompts else 8)
        prompt = "" if several_prompts else f" {phase_cases[0][3]} tokens"
        legend = "; b = batch, p = prompt tokens" if several_prompts else ""
        ax.set_title(f"prefill{prompt} (ms{legend})" if phase == "prefill"
                     else f"{phase} (ms/token{legend or ', prompt' + prompt})")
        ax.legend(fontsize=8)
    env = data["env"]
    fig.suptitle(f"torchembed e2e, {env.get('gpu', env.get('device', ''))}, bf16, {env.get('date', '')}", fontsize=10)
    fig.tight_layout()
    out = path.with_suffix(".png")
    fig.savefig(out, dpi=110)
    return out


def plot_rope(path: Path) -> Path | None:
    """Forward time as % of the copy floor per shape and provider (higher is better); None when
    the file has no prefill-sized shapes (a host-overhead or tuning run)."""
    data = json.loads(path.read_text())
    if "results" not in data:
        return None
    rows = [r for r in data["results"] if r.get("section") == "forward" and r.get("provider") != "floor"]
    shapes = list(dict.fromkeys(r["shape_label"] for r in rows if r["shape"]["seq"] > 1))
    if not shapes:
        return None
    providers = list(dict.fromkeys(r["provider"] for r in rows))
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.8 / len(providers)
    for i, provider in enumerate(providers):
        ys = [next((r.get("pct_of_floor") or 0.0 for r in rows if r["shape_label"] == s and r["provider"] == provider), 0.0)
              for s in shapes]
        ax.bar([j + i * width for j in range(len(shapes))], ys, width, label=provider)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(shapes))])
    ax.set_xticklabels(shapes, fontsize=8)
    ax.set_ylabel("% of copy floor (forward)")
    ax.axhline(100, color="gray", lw=0.5)
    ax.legend(fontsize=8)
    env = data["env"]
    ax.set_title(f"RoPE forward, bf16, HF layout, {env.get('gpu', env.get('device', ''))}, {env.get('date', '')}", fontsize=10)
    fig.tight_layout()
    out = path.with_suffix(".png")
    fig.savefig(out, dpi=110)
    return out


def main(folder: str) -> None:
    for path in sorted(Path(folder).glob("*.json")):
        name = path.stem
        if name.startswith("e2e"):
            print(plot_e2e(path))
        elif name.startswith("rope"):
            out = plot_rope(path)
            if out is not None:
                print(out)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results")
