"""Plot ``torchembed bench long`` results: prefill and decode per (model, context), upstream against
patched, with each cell's floor; out-of-memory cells marked. Later files override earlier ones cell by
cell (model, variant, context). Needs matplotlib (not a dependency of the package).

    python benchmarks/plot_long_context.py OUT.png RESULT.json [RESULT.json ...]
"""

from __future__ import annotations

import json
import sys

LABELS = {"mpt": "MPT", "bloom": "BLOOM", "falcon": "Falcon", "llama": "LLaMA", "qwen3": "Qwen3"}


def cells(paths: list[str]) -> dict[tuple[str, int], dict]:
    table: dict[tuple[str, int], dict] = {}
    for path in paths:
        for rec in json.load(open(path))["results"]:
            if "skipped" in rec:
                continue
            cell = table.setdefault((rec["model"], rec["context"]), {"layers": rec["layers"]})
            cell["prefill_floor"], cell["decode_floor"] = rec["prefill_floor_ms"], rec["decode_floor_ms"]
            cell[rec["variant"]] = rec
    return table


def main(out: str, paths: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = cells(paths)
    keys = sorted(table, key=lambda k: (list(LABELS).index(k[0]), k[1]))
    names = [f"{LABELS[m]} {table[(m, c)]['layers']}L\n{c // 1024}k" for m, c in keys]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    for ax, what, floor in ((axes[0], "prefill_ms", "prefill_floor"), (axes[1], "decode_ms", "decode_floor")):
        width = 0.27
        for i, variant in enumerate(("upstream", "patched")):
            xs, ys, ooms = [], [], []
            for j, key in enumerate(keys):
                value = table[key].get(variant, {}).get(what)
                if isinstance(value, float):
                    xs.append(j + (i - 1) * width)
                    ys.append(value)
                elif value == "OOM":
                    ooms.append(j + (i - 1) * width)
            ax.bar(xs, ys, width, label=variant, color=("#999999", "#1f77b4")[i])
            for x in ooms:
                ax.text(x, 0.02, "OOM", rotation=90, ha="center", va="bottom", fontsize=8, color="#b00000",
                        transform=ax.get_xaxis_transform())
        ax.bar([j + width for j in range(len(keys))], [table[k][floor] for k in keys], width, label="floor",
               color="#2ca02c")
        ax.set_xticks(range(len(keys)), names, fontsize=8)
        ax.set_yscale("log")
        ax.set_ylabel("ms (log)")
        ax.set_title("prefill" if what == "prefill_ms" else "decode step (plain loop)")
        ax.legend(fontsize=8)
    fig.suptitle("Long context on one H200, bf16, batch 1 (torchembed bench long)", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
