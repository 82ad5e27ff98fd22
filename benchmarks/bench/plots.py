"""PNG plots of a benchmark: TTFT CDF per target, cached-token ratio and throughput bars.

matplotlib is in the ``bench`` extra; without it the runner writes no plots and says so.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.bench.metrics import TargetResult


def _pyplot() -> Any | None:
    try:
        import matplotlib
    except ImportError:
        print("plots skipped: pip install 'prefixgate[bench]' for matplotlib", file=sys.stderr)
        return None
    matplotlib.use("Agg")  # files only: never open a window
    import matplotlib.pyplot as plt

    return plt


def _ttft_cdf(plt: Any, results: Sequence[TargetResult], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(8, 5))
    # Distinct colours past the default ten; peers dashed, so they stand apart.
    colours = plt.get_cmap("tab20" if len(results) > 10 else "tab10")
    for i, r in enumerate(results):
        xs = r.ttft_samples
        if xs:
            ys = [(k + 1) / len(xs) for k in range(len(xs))]
            style = "--" if r.kind == "peer" else "-"
            ax.step(xs, ys, where="post", label=r.name, linewidth=1.4, linestyle=style,
                    color=colours(i % colours.N))
    ax.set_xscale("log")
    ax.set_xlabel("time to first token (simulated s, log scale)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("TTFT CDF per target")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


Series = Sequence[tuple[str, list[float]]]


def _bar_panels(
    plt: Any,
    results: Sequence[TargetResult],
    panels: Sequence[tuple[str, str, Series]],
    path: Path,
) -> None:
    """One bar chart per panel (title, y label, series), targets along x."""
    width_in = max(6.0, 0.7 * len(results) + 2)
    fig, axes = plt.subplots(1, len(panels), figsize=(width_in * len(panels), 4.8), squeeze=False)
    xs = list(range(len(results)))
    for ax, (title, ylabel, series) in zip(axes[0], panels, strict=True):
        width = 0.8 / len(series)
        for i, (label, values) in enumerate(series):
            offset = (i - (len(series) - 1) / 2) * width
            ax.bar([x + offset for x in xs], values, width, label=label)
        ax.set_xticks(xs)
        ax.set_xticklabels([r.name for r in results], rotation=30, ha="right", fontsize=8)
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(True, axis="y", alpha=0.3)
        if len(series) > 1:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_plots(results: Sequence[TargetResult], out: Path) -> list[Path]:
    ran = [r for r in results if r.status == "ok"]
    plt = _pyplot()
    if plt is None or not ran:
        return []
    paths = [out / "ttft_cdf.png", out / "cached_ratio.png", out / "throughput.png"]
    _ttft_cdf(plt, ran, paths[0])
    cache = [
        ("cached-token ratio", [r.cached_ratio * 100 for r in ran]),
        ("share of reusable tokens captured", [r.captured * 100 for r in ran]),
    ]
    _bar_panels(plt, ran, [("Prefix cache on the replicas", "%", cache)], paths[1])
    per_min = "thousand tokens per simulated minute"
    _bar_panels(
        plt,
        ran,
        [
            ("Input throughput", per_min, [("input", [r.input_tpm / 1000 for r in ran])]),
            ("Output throughput", per_min, [("output", [r.output_tpm / 1000 for r in ran])]),
        ],
        paths[2],
    )
    return paths


def write_sweep_plot(
    ratios: Sequence[tuple[str, Sequence[tuple[str, Sequence[float]]]]], path: Path
) -> Path | None:
    """One panel per metric (title, [(target, ratios to the best)]): each world a dot, the
    box their spread; log scale, lines at 1.10x and 1.3x."""
    plt = _pyplot()
    if plt is None or not ratios:
        return None
    n_targets = max(len(series) for _, series in ratios)
    width = max(7.0, 0.9 * n_targets + 2)
    fig, axes = plt.subplots(len(ratios), 1, figsize=(width, 4.2 * len(ratios)), squeeze=False)
    for ax, (title, series) in zip(axes[:, 0], ratios, strict=True):
        data = [list(values) or [float("nan")] for _, values in series]
        ax.boxplot(data, showfliers=False, whis=(0, 100))
        for i, values in enumerate(data, 1):
            xs = [i + 0.15 * ((k % 5) - 2) / 2 for k in range(len(values))]
            ax.scatter(xs, values, s=12, alpha=0.6, zorder=3)
        for bound, style in ((1.10, "--"), (1.3, ":")):
            ax.axhline(bound, color="grey", linestyle=style, linewidth=1)
        ax.set_yscale("log")
        ax.set_xticks(range(1, len(series) + 1))
        ax.set_xticklabels([name for name, _ in series], rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("TTFT / best target's in the world (log)")
        ax.set_title(title)
        ax.grid(True, axis="y", which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
