"""The figures of one run: client-side latency percentiles, throughput, and server-side cache
counters from the replicas' ``/metrics`` (deltas over the run).

Latencies are reported in simulated seconds (wall seconds x ``speed``), the time a real GPU
would show; throughput in tokens per simulated minute. With ``speed`` 1 both are plain wall
figures.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from benchmarks.bench.client import ClientRun
from benchmarks.bench.misses import ReuseMisses, reuse_misses

# Counters and gauges summed over label sets (models, LoRA adapters, finished reasons).
_SERIES = {
    "vllm:prefix_cache_hits_total": "hits",
    "vllm:prefix_cache_queries_total": "queries",
    "vllm:prompt_tokens_total": "prompt_tokens",
    "vllm:generation_tokens_total": "generation_tokens",
    "vllm:num_preemptions_total": "preemptions",
    "vllm:request_success_total": "requests",
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
}


@dataclass(frozen=True, slots=True)
class ReplicaCounters:
    hits: float = 0.0
    queries: float = 0.0
    prompt_tokens: float = 0.0
    generation_tokens: float = 0.0
    preemptions: float = 0.0
    requests: float = 0.0
    running: float = 0.0
    waiting: float = 0.0
    # The engine's own TTFT histogram (simulated seconds): cumulative count per upper bound.
    ttft_buckets: tuple[tuple[float, float], ...] = ()

    def minus(self, before: ReplicaCounters) -> ReplicaCounters:
        d: dict[str, Any] = {
            k: getattr(self, k) - getattr(before, k) for k in _SERIES.values()
        }
        d["running"], d["waiting"] = self.running, self.waiting
        earlier = dict(before.ttft_buckets)
        d["ttft_buckets"] = tuple((le, n - earlier.get(le, 0.0)) for le, n in self.ttft_buckets)
        return ReplicaCounters(**d)


_TTFT_BUCKET = "vllm:time_to_first_token_seconds_bucket"
_LE = re.compile(r'le="([^"]+)"')


def parse_counters(text: str) -> ReplicaCounters:
    """The counters of one replica's Prometheus text exposition."""
    values: dict[str, float] = {}
    buckets: dict[float, float] = {}
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        brace = line.find("{")
        name = line[: brace if brace != -1 else line.find(" ")]
        key = _SERIES.get(name)
        if key is None and name != _TTFT_BUCKET:
            continue
        tail = line[line.rfind("}") + 1 :] if brace != -1 else line[len(name) :]
        try:
            value = float(tail.split()[0])
        except (IndexError, ValueError):
            continue
        if key is not None:
            values[key] = values.get(key, 0.0) + value
            continue
        le = _LE.search(line)
        if le is not None:
            bound = float(le.group(1))  # "+Inf" parses as inf
            buckets[bound] = buckets.get(bound, 0.0) + value
    return ReplicaCounters(**values, ttft_buckets=tuple(sorted(buckets.items())))


def histogram_quantile(buckets: Sequence[tuple[float, float]], q: float) -> float:
    """Prometheus' histogram_quantile over cumulative (upper bound, count) pairs: linear
    within the bucket that holds the rank; the highest finite bound for the +Inf bucket."""
    if not buckets or buckets[-1][1] <= 0:
        return math.nan
    rank = q / 100.0 * buckets[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower_bound
            if count == lower_count:
                return bound
            share = (rank - lower_count) / (count - lower_count)
            return lower_bound + (bound - lower_bound) * share
        lower_bound, lower_count = bound, count
    return lower_bound


def merge_buckets(per_replica: Iterable[ReplicaCounters]) -> list[tuple[float, float]]:
    total: dict[float, float] = {}
    for counters in per_replica:
        for bound, count in counters.ttft_buckets:
            total[bound] = total.get(bound, 0.0) + count
    return sorted(total.items())


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default); NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


@dataclass(frozen=True, slots=True)
class Summary:
    p50: float
    p90: float
    p99: float
    mean: float
    n: int

    @classmethod
    def of(cls, values: Iterable[float], scale: float = 1.0) -> Summary:
        vals = [v * scale for v in values]
        mean = sum(vals) / len(vals) if vals else math.nan
        return cls(
            percentile(vals, 50), percentile(vals, 90), percentile(vals, 99), mean, len(vals)
        )


@dataclass(slots=True)
class TargetResult:
    """Everything reported for one strategy or peer."""

    name: str
    kind: str
    status: str = "ok"  # ok | skipped | failed
    note: str = ""
    planned: int = 0
    requests: int = 0
    errors: int = 0
    incomplete: int = 0
    timed_out: bool = False
    wall_s: float = 0.0
    speed: float = 1.0  # the simulator's: simulated seconds per wall second
    ttft: Summary | None = None
    # The replicas' own TTFT histogram (arrival at the engine to first token, no router or
    # client overhead), as Prometheus would estimate its quantiles from the buckets.
    server_ttft_p50: float = math.nan
    server_ttft_p90: float = math.nan
    itl: Summary | None = None
    e2e: Summary | None = None
    input_tpm: float = 0.0
    output_tpm: float = 0.0
    prompt_tokens: int = 0
    reusable_tokens: int = 0
    reusable_fraction: float = 0.0
    cached_ratio: float = 0.0  # server side: prefix-cache hits / queries over the run
    client_cached_ratio: float = 0.0  # from usage.prompt_tokens_details.cached_tokens
    captured: float = 0.0  # cached tokens / reusable tokens
    imbalance: float = 0.0  # max / mean prefill work (uncached prompt tokens) per replica
    preemptions: float = 0.0
    per_replica_requests: list[float] = field(default_factory=list)
    misses: ReuseMisses = field(default_factory=ReuseMisses)
    # With --sweep-repeat: each pooled run's TTFT p90 (simulated s), to show their spread.
    runs_p90: list[float] = field(default_factory=list)
    ttft_samples: list[float] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def cache_delta(
    before: Mapping[str, ReplicaCounters], after: Mapping[str, ReplicaCounters]
) -> dict[str, ReplicaCounters]:
    return {url: after[url].minus(before[url]) for url in after if url in before}


def _imbalance(values: Sequence[float]) -> float:
    mean = sum(values) / len(values) if values else 0.0
    return max(values) / mean if mean > 0 else 0.0


def summarize(
    name: str,
    kind: str,
    run: ClientRun,
    deltas: Mapping[str, ReplicaCounters],
    speed: float,
) -> TargetResult:
    ok = [r for r in run.records if r.ok]
    sim_minutes = run.wall_s * speed / 60.0
    hits = sum(d.hits for d in deltas.values())
    queries = sum(d.queries for d in deltas.values())
    prompt = sum(r.prompt_tokens for r in ok)
    ledger = run.ledger
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    buckets = merge_buckets(deltas.values())
    return TargetResult(
        name=name,
        kind=kind,
        planned=run.planned,
        requests=len(run.records),
        errors=run.errors,
        incomplete=run.incomplete,
        timed_out=run.timed_out,
        wall_s=run.wall_s,
        speed=speed,
        ttft=Summary.of(ttfts, speed),
        server_ttft_p50=histogram_quantile(buckets, 50),
        server_ttft_p90=histogram_quantile(buckets, 90),
        itl=Summary.of((r.tpot for r in ok if r.tpot is not None), speed),
        e2e=Summary.of((r.e2e for r in ok if r.e2e is not None), speed),
        input_tpm=prompt / sim_minutes if sim_minutes else 0.0,
        output_tpm=sum(r.completion_tokens for r in ok) / sim_minutes if sim_minutes else 0.0,
        prompt_tokens=prompt,
        reusable_tokens=ledger.reusable_tokens,
        reusable_fraction=ledger.fraction,
        cached_ratio=hits / queries if queries else 0.0,
        client_cached_ratio=sum(r.cached_tokens for r in ok) / prompt if prompt else 0.0,
        captured=hits / ledger.reusable_tokens if ledger.reusable_tokens else 0.0,
        imbalance=_imbalance([d.queries - d.hits for d in deltas.values()]),
        preemptions=sum(d.preemptions for d in deltas.values()),
        per_replica_requests=[d.requests for d in deltas.values()],
        misses=reuse_misses(run.records),
        ttft_samples=sorted(t * speed for t in ttfts),
    )
