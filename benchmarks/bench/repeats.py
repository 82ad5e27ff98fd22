"""One target's runs of the same world, pooled (``prefixgate bench --sweep-repeat K``).

A world of 20-70 requests gives a p90 that moves by tens of percent between two runs of the same
code: the simulator runs on wall time, and a burst placed one way or the other changes every
later turn of its sessions. Running each target K times and taking its TTFT percentiles over
the pooled requests estimates its p90 from K times the requests, and keeps each run's p90 so
that the spread shows next to the figure.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence

from benchmarks.bench.metrics import Summary, TargetResult
from benchmarks.bench.misses import ReuseMisses


def pooled(runs: Sequence[Sequence[TargetResult]]) -> list[TargetResult]:
    """Per target (in the first run's order), its results of every run pooled into one."""
    names = [r.name for r in runs[0]]
    return [pool([r for run in runs for r in run if r.name == name]) for name in names]


def pool(results: Sequence[TargetResult]) -> TargetResult:
    """Several runs of one target as one result: TTFT over all their requests, reuse over all
    their reusable tokens; ITL and E2E are not pooled (each run's report has them)."""
    first = results[0]
    failed = next((r for r in results if r.status != "ok"), None)
    if failed is not None:
        return failed
    samples = sorted(t for r in results for t in r.ttft_samples)
    reusable = sum(r.reusable_tokens for r in results)
    misses = [r.misses for r in results]
    return TargetResult(
        name=first.name, kind=first.kind,
        planned=sum(r.planned for r in results), requests=sum(r.requests for r in results),
        errors=sum(r.errors for r in results), incomplete=sum(r.incomplete for r in results),
        timed_out=any(r.timed_out for r in results),
        # Requests a run did not answer count as waiting the longest run (sweep_report.ttft).
        wall_s=max(r.wall_s for r in results), speed=first.speed,
        ttft=Summary.of(samples),
        server_ttft_p50=_mean(r.server_ttft_p50 for r in results),
        server_ttft_p90=_mean(r.server_ttft_p90 for r in results),
        prompt_tokens=sum(r.prompt_tokens for r in results),
        reusable_tokens=reusable,
        captured=sum(r.captured * r.reusable_tokens for r in results) / reusable
        if reusable else 0.0,
        misses=ReuseMisses(
            sum(m.reusable for m in misses), sum(m.placed for m in misses),
            sum(m.moved for m in misses), sum(m.at_home for m in misses),
            all(m.known for m in misses),
        ),
        preemptions=sum(r.preemptions for r in results),
        ttft_samples=samples,
        runs_p90=[r.ttft.p90 if r.ttft else math.nan for r in results],
    )  # fmt: skip


def _mean(values: Iterable[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return statistics.fmean(finite) if finite else math.nan
