"""The PNG plots beside bench/RESULTS.md (matplotlib, the `bench` extra: `pip install -e ".[bench]"`)."""

from __future__ import annotations

from pathlib import Path

import matplotlib


matplotlib.use("Agg")  # files only, no display

import matplotlib.pyplot as plt  # noqa: E402
from harness.peers import PEERS  # noqa: E402
from harness.summary import Summary  # noqa: E402


DPI = 100


def memory_vs_world_size(series: dict[int, dict[str, list[float]]], path: Path, subtitle: str) -> None:
    """One panel per stage: model-state MB per rank against W, estimated (line) and measured (markers).

    `series` is report_sections.plot_series(...).
    """
    stages = sorted(series)
    fig, axes = plt.subplots(1, len(stages), figsize=(3.6 * len(stages), 3.8), sharey=True, squeeze=False)
    for ax, stage in zip(axes[0], stages, strict=True):
        data = series[stage]
        ws = data["world_size"]
        ax.plot(ws, data["formula"], "-", color="0.75", linewidth=6, label="ZeRO formula")
        ax.plot(ws, data["estimated"], "-", color="tab:blue", linewidth=2, label="estimate (model states)")
        ax.plot(
            ws, data["estimated_total"], ":", color="tab:blue", linewidth=2, label="estimate with transient buffers"
        )
        ax.plot(ws, data["measured"], "o", color="tab:orange", markersize=8, label="memory_breakdown() model states")
        ax.plot(ws, data["live_tensors"], "x", color="tab:green", markersize=9, mew=2, label="live tensors (gc)")
        ax.set_title(f"stage {stage}")
        ax.set_xlabel("world size W (processes)")
        ax.set_xticks(ws)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("MB per rank (max over ranks)")
    axes[0][0].set_ylim(bottom=0)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=5, frameon=False, fontsize=9)
    fig.suptitle(f"accelerate_zero memory per rank against world size, measured vs estimated\n{subtitle}", fontsize=10)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


def comparison(summaries: list[Summary], path: Path, subtitle: str) -> None:
    """Left: memory per rank of every system (live tensors, RSS, formula); right: median step time / DDP."""
    names = [PEERS[s.system].label for s in summaries]
    ddp = next((s for s in summaries if s.system == "ddp"), None)
    ys = range(len(summaries))
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 0.45 * len(summaries) + 2.2), sharey=True)
    height = 0.38
    left.barh([y - height / 2 for y in ys], [s.rss_mb for s in summaries], height, label="RSS", color="tab:gray")
    left.barh(
        [y + height / 2 for y in ys],
        [s.live_tensor_mb for s in summaries],
        height,
        label="live tensors",
        color="tab:blue",
    )
    left.plot([s.memory_formula_mb for s in summaries], list(ys), "k|", markersize=16, mew=2, label="ZeRO formula")
    # Untouched allocations (DeepSpeed stage 3's) make live tensors far larger than RSS: cut the axis, print the value.
    limit = 1.3 * max(max(s.rss_mb, s.memory_formula_mb) for s in summaries)
    left.set_xlim(0, limit)
    for y, s in zip(ys, summaries, strict=True):
        if s.live_tensor_mb > limit:
            left.text(
                limit, y + height / 2, f"{s.live_tensor_mb:,.0f} MB ▸", ha="right", va="center", fontsize=8, color="w"
            )
    left.set_xlabel("MB per rank (max over ranks)")
    left.set_yticks(list(ys), names, fontsize=8)
    left.invert_yaxis()
    left.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=3, frameon=False)
    left.grid(axis="x", alpha=0.3)
    ratios = [s.step_ms / ddp.step_ms if ddp else 0.0 for s in summaries]
    right.barh(list(ys), ratios, 0.6, color="tab:orange")
    right.axvline(1.0, color="k", linewidth=1)
    for y, ratio in zip(ys, ratios, strict=True):
        right.text(ratio, y, f" {ratio:.2f}", va="center", fontsize=8)
    right.set_xlabel("median step time / DDP's (same run)")
    right.grid(axis="x", alpha=0.3)
    fig.suptitle(subtitle, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
