"""The report of a scenario sweep: per world, every target's figures; per target, how far it
stays from the best target of each world (results.json, results.md, sweep_ratios.png).

A target's *ratio* in a world is its figure over the lowest figure any target reached there
(1.0: it was the best). Only targets that ran (status ok, at least one answered request) are
ranked; a failed or skipped target is listed in the world's table. *Unranked* targets (an
ablation, or a second copy of a scheduler that measures the runs' own spread) get their ratio to
the best of the others but never set the best themselves: a variant of the default that wins by
the luck of its run would otherwise count as the default's loss. Requests a run did not
answer before its deadline, or answered with an error, count as waiting the whole run.

*Reuse captured* is the replicas' prefix-cache hits over the tokens one infinitely large cache
would have served (the client's reuse ledger, which tokenizes and cuts blocks as the replicas
do): at most 1 (``benchmarks.bench.conversation``).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from benchmarks.bench.intervals import LEVEL, ratio_interval
from benchmarks.bench.metrics import Summary, TargetResult

METRICS = ("p90", "mean", "p99")
BANDS = (1.10, 1.3)

# (world, low end, high end) of a target's p90 over the world's best's (benchmarks.bench.intervals)
Interval = tuple[int, float, float]


def ratios(values: Mapping[str, float], unranked: Collection[str] = ()) -> dict[str, float]:
    """Each target's value over the lowest (finite, positive) value of the targets not in
    ``unranked``; none if there is none."""
    finite = {k: v for k, v in values.items() if math.isfinite(v)}
    best = min((v for k, v in finite.items() if v > 0 and k not in unranked), default=None)
    if best is None:
        return {k: 1.0 for k, v in finite.items() if v == 0}
    return {k: max(v, 0.0) / best for k, v in finite.items()}


@dataclass
class TargetStats:
    """One target's ratios to the best over the worlds, for one metric."""

    target: str
    metric: str
    ratios: list[tuple[int, float]] = field(default_factory=list)  # (world, ratio)

    def within(self, bound: float) -> int:
        return sum(1 for _, r in self.ratios if r <= bound + 1e-9)

    @property
    def worst(self) -> tuple[int, float] | None:
        return max(self.ratios, key=lambda wr: wr[1], default=None)

    @property
    def not_best(self) -> list[int]:
        return [w for w, r in self.ratios if r > 1.0 + 1e-9]

    @property
    def median(self) -> float:
        values = sorted(r for _, r in self.ratios)
        if not values:
            return math.nan
        mid = len(values) // 2
        return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2

    def to_json(self) -> dict[str, Any]:
        worst = self.worst
        return {
            "target": self.target, "metric": self.metric, "worlds": len(self.ratios),
            **{f"within_{b:g}x": self.within(b) for b in BANDS},
            "median_ratio": self.median, "worst_ratio": worst[1] if worst else None,
            "worst_world": worst[0] if worst else None, "not_best": self.not_best,
            "ratios": [[w, r] for w, r in self.ratios],
        }  # fmt: skip


def ranked(results: Sequence[TargetResult]) -> list[TargetResult]:
    return [r for r in results if r.status == "ok" and r.ttft is not None and r.ttft.n > 0]


def ttft(r: TargetResult) -> Summary:
    """The TTFT figures ranked: a run cut by its deadline counts each request it did not
    answer as waiting the whole run (simulated), so a target cannot gain by stalling; a
    request answered with an error counts the same, so it cannot gain by failing either."""
    assert r.ttft is not None
    if not r.incomplete + r.errors:
        return r.ttft
    return Summary.of(samples(r))


def samples(r: TargetResult) -> list[float]:
    """The TTFTs ranked, one per request: unanswered ones at the whole run (see ``ttft``)."""
    return [*r.ttft_samples, *[r.wall_s * r.speed] * (r.incomplete + r.errors)]


def p90_intervals(index: int, results: Sequence[TargetResult],
                  unranked: Collection[str] = ()) -> dict[str, tuple[float, float]]:
    """Each ranked target's interval of its TTFT p90 over the world's best target's (the
    best's own is none), from the requests' samples; seeded by the world's index."""
    runs = {r.name: r for r in ranked(results)}
    values = {name: float(ttft(r).p90) for name, r in runs.items()}
    rs = ratios(values, unranked)
    best = next((n for n, v in rs.items() if v == 1.0 and n not in unranked), None)
    if best is None:
        return {}
    out = {}
    for name, r in runs.items():
        if name != best:
            interval = ratio_interval(samples(r), samples(runs[best]), seed=index)
            if interval is not None:
                out[name] = interval
    return out


def clear_p90_losses(intervals: Sequence[tuple[int, Mapping[str, tuple[float, float]]]],
                     targets: Sequence[str], bound: float = BANDS[0]) -> dict[str, list[Interval]]:
    """Per target, the worlds where even the low end of its p90 interval (``intervals``: per
    world, ``p90_intervals``) is above ``bound``: losses its requests' sampling cannot
    explain."""
    out: dict[str, list[Interval]] = {t: [] for t in targets}
    for index, by_target in intervals:
        for name, (low, high) in by_target.items():
            if name in out and low > bound:
                out[name].append((index, low, high))
    return out


def reuse_captured(r: TargetResult) -> float:
    """Hits over reusable tokens, both in the replicas' tokens. (A ratio of the two hit
    ratios, as before, also moved with the replicas' counted queries.)"""
    return r.captured if r.reusable_tokens > 0 else math.nan


def target_stats(worlds: Sequence[tuple[int, Sequence[TargetResult]]],
                 targets: Sequence[str],
                 unranked: Collection[str] = ()) -> dict[str, list[TargetStats]]:
    """Per metric, each target's ratios to the best over ``worlds`` (index, results)."""
    out: dict[str, list[TargetStats]] = {}
    for metric in METRICS:
        stats = {t: TargetStats(t, metric) for t in targets}
        for index, results in worlds:
            values = {r.name: float(getattr(ttft(r), metric)) for r in ranked(results)}
            for name, ratio in ratios(values, unranked).items():
                if name in stats:
                    stats[name].ratios.append((index, ratio))
        out[metric] = list(stats.values())
    return out


def reuse_gaps(worlds: Sequence[tuple[int, Sequence[TargetResult]]],
               targets: Sequence[str],
               unranked: Collection[str] = ()) -> dict[str, list[tuple[int, float]]]:
    """Per target, (world, points of reuse captured below the world's best)."""
    gaps: dict[str, list[tuple[int, float]]] = {t: [] for t in targets}
    for index, results in worlds:
        values = {r.name: reuse_captured(r) for r in ranked(results)}
        finite = [v for k, v in values.items() if math.isfinite(v) and k not in unranked]
        if not finite:
            continue
        best = max(finite)
        for name, v in values.items():
            if name in gaps and math.isfinite(v):
                gaps[name].append((index, (best - v) * 100))
    return gaps


def _f(value: float | None, digits: int = 2) -> str:
    if value is None or not math.isfinite(value):
        return "-"
    return f"{value:.{digits}f}"


def summary_table(stats: dict[str, list[TargetStats]],
                  gaps: Mapping[str, Sequence[tuple[int, float]]],
                  clear: Mapping[str, Sequence[Interval]] | None = None) -> list[str]:
    """``clear``: per target, its p90 losses beyond 1.10x that sampling cannot explain."""
    lines = [
        "| target | TTFT | worlds | within 1.10x | within 1.3x | median ratio | worst ratio "
        "(world) | not best in worlds | reuse: worst gap to best, points (world) "
        f"| p90 over 1.10x at the low end of its {LEVEL:.0%} interval (worlds) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for metric in METRICS:
        for s in stats[metric]:
            worst = s.worst
            gap = max(gaps.get(s.target, ()), key=lambda wg: wg[1], default=None)
            lines.append(
                f"| {s.target} | {metric} | {len(s.ratios)} | {s.within(BANDS[0])} "
                f"| {s.within(BANDS[1])} | {_f(s.median)} "
                f"| {_f(worst[1]) + f' ({worst[0]})' if worst else '-'} "
                f"| {', '.join(map(str, s.not_best)) or '-'} "
                f"| {_f(gap[1], 1) + f' ({gap[0]})' if gap else '-'} "
                f"| {_clear_cell(clear, s.target) if metric == 'p90' else '-'} |"
            )
    return lines


def _clear_cell(clear: Mapping[str, Sequence[Interval]] | None, target: str) -> str:
    if clear is None or target not in clear:
        return "-"
    worlds = clear[target]
    return f"{len(worlds)}" + (f": {', '.join(str(w) for w, _, _ in worlds)}" if worlds else "")


def world_table(results: Sequence[TargetResult], unranked: Collection[str] = (),
                intervals: Mapping[str, tuple[float, float]] | None = None) -> list[str]:
    """The world's table; ``intervals``: its ``p90_intervals``, shown beside the ratios."""
    values = {m: {r.name: float(getattr(ttft(r), m)) for r in ranked(results)} for m in METRICS}
    rs = {m: ratios(v, unranked) for m, v in values.items()}
    intervals = intervals or {}
    lines = [
        f"| target | TTFT mean s | p50 s | p90 s | p99 s | p90 / best ({LEVEL:.0%} interval) "
        "| reuse captured "
        "| missed: placed / moved / at home | errors |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    ok = {r.name for r in ranked(results)}
    for r in results:
        if r.name not in ok:
            lines.append(f"| {r.name} | {r.status}: {r.note[:80]} | | | | | | | {r.errors} |")
            continue
        t = ttft(r)
        errors = str(r.errors) + (f" (+{r.incomplete} not run)" if r.incomplete else "")
        p90 = _f(t.p90)
        if len(r.runs_p90) > 1:
            p90 += " (" + ", ".join(_f(v) for v in r.runs_p90) + ")"
        lines.append(
            f"| {r.name} | {_f(t.mean)} | {_f(t.p50)} | {p90} | {_f(t.p99)} "
            f"| {_f(rs['p90'].get(r.name))}{_interval_text(intervals.get(r.name))} "
            f"| {_f(reuse_captured(r) * 100, 1)}% "
            f"| {r.misses.cell()} | {errors} |"
        )
    return lines


def _interval_text(interval: tuple[float, float] | None) -> str:
    return "" if interval is None else f" ({_f(interval[0])}-{_f(interval[1])})"
