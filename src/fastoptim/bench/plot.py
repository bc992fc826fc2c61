"""The bench as a picture: one horizontal bar chart per (workload, optimizer), log time axis."""

from __future__ import annotations

import math

COLORS = {"fastoptim": "#1f77b4", "torch": "#ff7f0e"}
OTHER = "#8c8c8c"
FLOOR = "#2ca02c"


def plot(results: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    heights = [max(2.5, 0.38 * len(r["rows"]) + 1.2) for r in results]
    fig, axes = plt.subplots(len(results), 1, figsize=(10, sum(heights)), squeeze=False,
                             gridspec_kw={"height_ratios": heights})
    for ax, result in zip(axes[:, 0], results):
        rows = [r for r in result["rows"] if not r["error"] and r["median_ms"] == r["median_ms"]][::-1]
        labels = [r["label"] for r in rows]
        values = [r["median_ms"] for r in rows]
        colors = [FLOOR if r["label"] == "flat floor" else COLORS.get(r["library"], OTHER) for r in rows]
        bars = ax.barh(labels, values, color=colors)
        ax.set_xscale("log")
        floor = next((r["median_ms"] for r in rows if r["label"] == "flat floor"), math.nan)
        if floor == floor:
            ax.axvline(floor, color=FLOOR, linestyle="--", linewidth=1)
        for bar, r in zip(bars, rows):
            note = f" {r['median_ms']:.2f} ms"
            if r["vs_flat_floor"] is not None:
                note += f"  ({r['vs_flat_floor']:.1f}x floor)"
            ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, note, va="center", fontsize=8)
        ax.set_xlim(min(values) / 1.5, max(values) * 8)
        ax.set_xlabel("ms per optimizer step (log scale; dashed: the flat floor)")
        ax.set_title(f"{result['optimizer']} on {result['workload']}: {result['params'] / 1e6:.1f}M params in "
                     f"{result['tensors']} tensors", fontsize=10)
        ax.tick_params(axis="y", labelsize=8)
    from matplotlib.patches import Patch
    handles = [Patch(color=COLORS["fastoptim"], label="fastoptim"), Patch(color=COLORS["torch"], label="torch.optim"),
               Patch(color=OTHER, label="other libraries"), Patch(color=FLOOR, label="flat floor")]
    axes[0, 0].legend(handles=handles, loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
