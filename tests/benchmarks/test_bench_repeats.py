from __future__ import annotations

from typing import Any

import pytest

from benchmarks.bench.metrics import Summary, TargetResult
from benchmarks.bench.misses import ReuseMisses
from benchmarks.bench.repeats import pool, pooled
from benchmarks.bench.sweep_report import reuse_captured, ttft, world_table


def run(name: str, samples: list[float], captured: float, reusable: int,
        placed: int = 0, **kw: Any) -> TargetResult:
    r = TargetResult(name, "prefixgate", ttft=Summary.of(samples), ttft_samples=samples,
                     captured=captured, reusable_tokens=reusable, requests=len(samples),
                     misses=ReuseMisses(reusable, placed=placed), **kw)
    return r


def test_pooled_ttft_is_over_every_run_s_requests_and_keeps_each_run_s_p90() -> None:
    a = run("d", [0.1] * 9 + [1.0], 0.9, 1000, placed=100)
    b = run("d", [0.2] * 10, 0.6, 3000, placed=1200)
    p = pool([a, b])
    assert p.requests == 20 and p.ttft is not None and p.ttft.n == 20
    assert p.ttft.p50 == pytest.approx(0.2) and p.ttft.mean == pytest.approx(0.195)
    assert p.runs_p90 == [pytest.approx(0.19), pytest.approx(0.2)]
    # Reuse over all reusable tokens: (900 + 1800) / 4000.
    assert reuse_captured(p) == pytest.approx(0.675)
    assert p.misses == ReuseMisses(4000, placed=1300)


def test_a_failed_run_fails_the_pooled_result() -> None:
    failed = TargetResult("d", "prefixgate", status="failed", note="gateway did not start")
    assert pool([run("d", [0.1], 1.0, 10), failed]) is failed


def test_unanswered_requests_wait_the_longest_run() -> None:
    a = run("d", [0.1] * 8, 1.0, 10, incomplete=2, wall_s=20.0, speed=3.0)
    b = run("d", [0.1] * 10, 1.0, 10, wall_s=10.0, speed=3.0)
    assert ttft(pool([a, b])).p99 == pytest.approx(60.0)


def test_targets_keep_the_first_run_s_order_and_the_table_shows_the_runs() -> None:
    first = [run("x", [0.1, 0.3], 1.0, 10), run("y", [0.2, 0.4], 1.0, 10)]
    second = [run("y", [0.5, 0.6], 1.0, 10), run("x", [0.2, 0.2], 1.0, 10)]
    results = pooled([first, second])
    assert [r.name for r in results] == ["x", "y"]
    rows = world_table(results)
    assert any(r.startswith("| x |") and "(0.28, 0.20)" in r for r in rows)
