"""The sweep report's ratio math: each target over the best target of each world."""

from __future__ import annotations

import math
import random

import pytest

from benchmarks.bench.metrics import Summary, TargetResult
from benchmarks.bench.sweep_report import (
    clear_p90_losses,
    p90_intervals,
    ratios,
    reuse_captured,
    reuse_gaps,
    summary_table,
    target_stats,
    ttft,
    world_table,
)


def result(name: str, p90: float, mean: float = 1.0, p99: float = 2.0,
           cached: float = 0.5, status: str = "ok") -> TargetResult:
    ttft = Summary(p50=0.5, p90=p90, p99=p99, mean=mean, n=10) if status == "ok" else None
    # 1000 reusable tokens of 1250 prompt tokens; ``cached`` of the prompt tokens hit.
    return TargetResult(name, "prefixgate", status=status, ttft=ttft, cached_ratio=cached,
                        reusable_fraction=0.8, reusable_tokens=1000, prompt_tokens=1250,
                        captured=cached * 1250 / 1000)


def test_ratios_are_over_the_lowest_value() -> None:
    assert ratios({"a": 2.0, "b": 1.0, "c": 3.0}) == {"a": 2.0, "b": 1.0, "c": 3.0}
    assert ratios({"a": 0.5, "b": 0.55}) == pytest.approx({"a": 1.0, "b": 1.1})
    assert ratios({"a": math.nan, "b": 4.0}) == {"b": 1.0}  # no requests: not ranked
    assert ratios({}) == {}


def test_target_stats_count_bands_worst_and_not_best() -> None:
    worlds = [
        (0, [result("x", 1.0), result("y", 1.05), result("z", 2.0)]),
        (1, [result("x", 1.2), result("y", 1.0), result("z", 1.25)]),
        (2, [result("x", 3.0), result("y", 1.0), result("z", 9.0, status="failed")]),
    ]
    stats = {s.target: s for s in target_stats(worlds, ["x", "y", "z"])["p90"]}
    x, y, z = stats["x"], stats["y"], stats["z"]
    assert x.ratios == [(0, 1.0), (1, 1.2), (2, 3.0)]
    assert (x.within(1.10), x.within(1.3), x.worst, x.not_best) == (1, 2, (2, 3.0), [1, 2])
    assert (y.within(1.10), y.within(1.3), y.worst, y.not_best) == (3, 3, (0, 1.05), [0])
    assert z.ratios == [(0, 2.0), (1, 1.25)]  # a failed run is not ranked
    assert x.median == 1.2 and y.median == 1.0 and z.median == pytest.approx(1.625)
    # Mean and p99 are ranked on their own figures.
    means = {s.target: s.ratios for s in target_stats(worlds, ["x"])["mean"]}
    assert means["x"] == [(0, 1.0), (1, 1.0), (2, 1.0)]


def test_reuse_is_hits_over_reusable_tokens_and_gaps_are_points_below_the_best() -> None:
    assert reuse_captured(result("a", 1.0, cached=0.4)) == pytest.approx(0.5)
    # Not the ratio of the two hit ratios: replicas that counted a preempted request's
    # re-admission (more queries, at a high hit ratio) read above 100% that way.
    readmitted = result("r", 1.0, cached=0.7)
    readmitted.captured = 0.9
    assert reuse_captured(readmitted) == pytest.approx(0.9)
    assert math.isnan(reuse_captured(TargetResult("none", "prefixgate")))
    worlds = [(0, [result("a", 1.0, cached=0.72), result("b", 1.0, cached=0.8)])]
    gaps = reuse_gaps(worlds, ["a", "b"])
    assert gaps["a"][0][1] == pytest.approx(10.0) and gaps["b"] == [(0, 0.0)]


def test_tables_name_targets_ratios_and_failures() -> None:
    results = [result("x", 1.0), result("y", 1.5), result("z", 1.0, status="failed")]
    rows = world_table(results)
    assert any(r.startswith("| y |") and "| 1.50 |" in r for r in rows)
    assert any(r.startswith("| z | failed") for r in rows)
    assert all(r.count("|") == rows[0].count("|") for r in rows)  # every row fills each column
    stats = target_stats([(4, results)], ["x", "y"])
    table = summary_table(stats, reuse_gaps([(4, results)], ["x", "y"]))
    assert any(r.startswith("| y | p90 | 1 | 0 | 0 |") and "1.50 (4)" in r for r in table)


def test_unanswered_requests_count_as_waiting_the_whole_run() -> None:
    cut = result("cut", 1.0)
    cut.ttft_samples, cut.incomplete, cut.wall_s, cut.speed = [0.1] * 8, 2, 20.0, 3.0
    # 8 answered at 0.1 s, 2 never answered: counted at 60 simulated seconds.
    assert ttft(cut).n == 10 and ttft(cut).mean == pytest.approx((0.8 + 120) / 10)
    whole = result("whole", 1.0)
    assert ttft(whole) is whole.ttft
    stats = {s.target: s for s in target_stats([(0, [cut, whole])], ["cut", "whole"])["p90"]}
    assert stats["whole"].ratios == [(0, 1.0)] and stats["cut"].ratios[0][1] > 50


def test_unranked_targets_are_rated_against_the_others_but_never_the_best() -> None:
    assert ratios({"a": 1.0, "b": 0.8}, unranked={"b"}) == pytest.approx({"a": 1.0, "b": 0.8})
    worlds = [(0, [result("x", 1.0, cached=0.6), result("copy", 0.5, cached=0.8),
                   result("y", 2.0, cached=0.7)])]
    stats = {s.target: s for s in target_stats(worlds, ["x", "copy", "y"], {"copy"})["p90"]}
    assert stats["x"].ratios == [(0, 1.0)] and stats["x"].not_best == []
    assert stats["copy"].ratios == [(0, 0.5)] and stats["y"].ratios == [(0, 2.0)]
    gaps = reuse_gaps(worlds, ["x", "copy", "y"], {"copy"})
    assert gaps["x"][0][1] == pytest.approx(12.5) and gaps["y"] == [(0, 0.0)]
    assert gaps["copy"][0][1] == pytest.approx(-12.5)  # above the best of the others
    rows = world_table(worlds[0][1], {"copy"})
    assert any(r.startswith("| x |") and "| 1.00 |" in r for r in rows)


def test_errored_requests_count_as_waiting_the_whole_run_too() -> None:
    # 8 answered at 0.1 s and 2 answered with an error (shed, or a cut stream): leaving those
    # two out of the percentiles would rank a failing target as the fast one.
    failing = result("failing", 1.0)
    failing.ttft_samples, failing.errors, failing.wall_s, failing.speed = [0.1] * 8, 2, 20.0, 3.0
    assert ttft(failing).n == 10 and ttft(failing).mean == pytest.approx((0.8 + 120) / 10)
    steady = result("steady", 1.0)
    steady.ttft = Summary(p50=0.2, p90=0.2, p99=0.2, mean=0.2, n=10)
    stats = {s.target: s for s in target_stats([(0, [failing, steady])],
                                                ["failing", "steady"])["p90"]}
    assert stats["steady"].ratios == [(0, 1.0)] and stats["failing"].ratios[0][1] > 50


def sampled(name: str, values: list[float]) -> TargetResult:
    r = result(name, 1.0)
    r.ttft, r.ttft_samples = Summary.of(values), sorted(values)
    return r


def test_p90_intervals_tell_clear_losses_from_what_the_sample_size_explains() -> None:
    rng = random.Random(7)
    best = [rng.expovariate(1.0) for _ in range(400)]
    twice = [2 * rng.expovariate(1.0) for _ in range(400)]  # twice as slow: a clear loss
    near = [1.05 * rng.expovariate(1.0) for _ in range(400)]
    few = [1.3 * rng.expovariate(1.0) for _ in range(12)]  # 1.3x, but on 12 requests
    results = [sampled("best", best), sampled("twice", twice), sampled("near", near),
               sampled("few", few)]
    intervals = p90_intervals(3, results)
    assert "best" not in intervals and set(intervals) == {"twice", "near", "few"}
    assert intervals["twice"][0] > 1.10 and intervals["near"][0] < 1.10 < intervals["twice"][1]
    assert intervals["few"][0] < 1.10
    assert p90_intervals(3, results) == intervals  # seeded by the world
    names = ["best", "twice", "near", "few"]
    clear = clear_p90_losses([(3, intervals), (4, p90_intervals(4, results[:2]))], names)
    assert [w for w, _, _ in clear["twice"]] == [3, 4]
    assert clear["near"] == [] and clear["few"] == [] and clear["best"] == []
    rows = world_table(results, intervals=intervals)
    low, high = intervals["twice"]
    assert any(r.startswith("| twice |") and f"({low:.2f}-{high:.2f})" in r for r in rows)
    assert all(r.count("|") == rows[0].count("|") for r in rows)
    table = summary_table(target_stats([(3, results)], names), reuse_gaps([(3, results)], names),
                          clear)
    assert any(r.startswith("| twice | p90 |") and r.endswith("| 2: 3, 4 |") for r in table)
    assert any(r.startswith("| near | p90 |") and r.endswith("| 0 |") for r in table)
    assert any(r.startswith("| twice | mean |") and r.endswith("| - |") for r in table)
    assert all(r.count("|") == table[0].count("|") for r in table)
