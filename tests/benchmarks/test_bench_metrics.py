"""The benchmark's arithmetic: percentiles, histogram quantiles, counter deltas, the summary of
a run and the written report."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from benchmarks.bench.client import ClientRun, RequestRecord
from benchmarks.bench.conversation import ReuseLedger
from benchmarks.bench.metrics import (
    ReplicaCounters,
    Summary,
    TargetResult,
    cache_delta,
    histogram_quantile,
    parse_counters,
    percentile,
    summarize,
)
from benchmarks.bench.report import markdown, to_json, write
from benchmarks.bench.runner import BenchReport
from benchmarks.bench.settings import BenchSettings
from benchmarks.workloads import build_workload

EXPOSITION = """\
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{model_name="a"} 300.0
vllm:prefix_cache_hits_total{model_name="b"} 100.0
vllm:prefix_cache_queries_total{model_name="a"} 1000.0
vllm:prompt_tokens_total{model_name="a"} 1000.0
vllm:num_preemptions_total{model_name="a"} 2.0
vllm:request_success_total{finished_reason="length",model_name="a"} 7.0
vllm:request_success_total{finished_reason="stop",model_name="a"} 3.0
vllm:num_requests_running{model_name="a"} 4.0
vllm:num_requests_waiting{model_name="a"} 1.0
vllm:time_to_first_token_seconds_bucket{le="0.1",model_name="a"} 5.0
vllm:time_to_first_token_seconds_bucket{le="1.0",model_name="a"} 9.0
vllm:time_to_first_token_seconds_bucket{le="+Inf",model_name="a"} 10.0
vllm:time_to_first_token_seconds_count{model_name="a"} 10.0
vllm:cache_config_info{block_size="16",num_gpu_blocks="64"} 1.0
"""


def test_percentile_interpolates_like_numpy() -> None:
    values = [float(v) for v in range(1, 11)]
    assert percentile(values, 50) == pytest.approx(5.5)
    assert percentile(values, 90) == pytest.approx(9.1)
    assert percentile(values, 100) == 10.0
    assert percentile([3.0], 99) == 3.0
    assert math.isnan(percentile([], 50))


def test_summary_scales_wall_seconds_to_simulated() -> None:
    s = Summary.of([0.1, 0.2, 0.3], scale=10)
    assert (s.p50, s.mean, s.n) == (pytest.approx(2.0), pytest.approx(2.0), 3)
    assert math.isnan(Summary.of([]).p90)


def test_parse_counters_sums_label_sets_and_reads_the_ttft_histogram() -> None:
    c = parse_counters(EXPOSITION)
    assert (c.hits, c.queries, c.prompt_tokens) == (400.0, 1000.0, 1000.0)
    assert (c.preemptions, c.requests, c.running, c.waiting) == (2.0, 10.0, 4.0, 1.0)
    assert c.ttft_buckets == ((0.1, 5.0), (1.0, 9.0), (math.inf, 10.0))


def test_deltas_subtract_counters_but_keep_gauges() -> None:
    before = ReplicaCounters(hits=10, queries=100, running=3, ttft_buckets=((1.0, 2.0),))
    after = ReplicaCounters(hits=60, queries=300, running=1, ttft_buckets=((1.0, 5.0),))
    delta = cache_delta({"u": before}, {"u": after})["u"]
    assert (delta.hits, delta.queries, delta.running) == (50, 200, 1)
    assert delta.ttft_buckets == ((1.0, 3.0),)


def test_histogram_quantile_as_prometheus() -> None:
    buckets = [(0.1, 10.0), (1.0, 20.0), (math.inf, 20.0)]
    assert histogram_quantile(buckets, 50) == pytest.approx(0.1)
    assert histogram_quantile(buckets, 75) == pytest.approx(0.55)
    # A rank in the +Inf bucket answers the highest finite bound.
    assert histogram_quantile([(1.0, 5.0), (math.inf, 10.0)], 90) == 1.0
    assert math.isnan(histogram_quantile([(1.0, 0.0)], 50))


def _record(ttft: float, e2e: float, cached: int, ok: bool = True) -> RequestRecord:
    return RequestRecord(
        "main", 0.0, 200 if ok else 500, ok, ttft=ttft if ok else None, e2e=e2e,
        tpot=0.01 if ok else None, prompt_tokens=1000 if ok else 0,
        completion_tokens=50 if ok else 0, cached_tokens=cached,
    )  # fmt: skip


def _run() -> ClientRun:
    ledger = ReuseLedger()
    ledger.prompt_tokens, ledger.reusable_tokens = 3000, 2000
    run = ClientRun(planned=4, ledger=ledger, wall_s=6.0)
    run.records = [_record(0.1, 1.0, 800), _record(0.3, 2.0, 600), _record(0, 0.5, 0, ok=False),
                   _record(0.2, 1.5, 100)]  # fmt: skip
    return run


def test_summarize_a_run() -> None:
    deltas = {
        "r1": ReplicaCounters(hits=1200, queries=2000, prompt_tokens=2000, requests=2),
        "r2": ReplicaCounters(hits=300, queries=1000, prompt_tokens=1000, requests=1),
    }
    r = summarize("default", "prefixgate", _run(), deltas, speed=10.0)
    assert (r.requests, r.errors, r.incomplete) == (4, 1, 0)
    assert r.ttft is not None and r.ttft.p50 == pytest.approx(2.0)  # 0.2 wall s x speed 10
    assert r.ttft_samples == pytest.approx([1.0, 2.0, 3.0])
    assert r.cached_ratio == pytest.approx(1500 / 3000)
    assert r.client_cached_ratio == pytest.approx(1500 / 3000)
    assert r.captured == pytest.approx(1500 / 2000)
    assert r.imbalance == pytest.approx(800 / 750)  # uncached tokens: 800 and 700
    # 3000 prompt tokens in 6 wall s at speed 10 = one simulated minute.
    assert (r.input_tpm, r.output_tpm) == (pytest.approx(3000), pytest.approx(150))
    assert r.itl is not None and r.itl.p50 == pytest.approx(0.1)


def _report(tmp_path: Path) -> BenchReport:
    settings = BenchSettings(out=tmp_path, replicas=2, plots=False, command="prefixgate bench")
    workload = build_workload("agentic", "tiny")
    ledger = ReuseLedger()
    ledger.prompt_tokens, ledger.reusable_tokens = 100, 80
    ok = summarize("default", "prefixgate", _run(), {"r": ReplicaCounters(hits=5, queries=10)}, 1)
    skipped = TargetResult("smg-cache_aware", "peer", status="skipped", note="not installed")
    empty = summarize("random", "prefixgate", ClientRun(planned=3), {}, 1.0)
    return BenchReport(settings, workload, ledger, [ok, skipped, empty])


def test_markdown_has_a_row_per_run_and_notes_for_the_rest(tmp_path: Path) -> None:
    text = markdown(_report(tmp_path))
    rows = [line for line in text.splitlines() if line.startswith("| ")]
    assert [row.split(" | ")[0] for row in rows] == ["| target", "| default", "| random"]
    assert all(row.count("|") == rows[0].count("|") for row in rows)
    assert "- smg-cache_aware: skipped: not installed" in text
    assert "80.0% of 100" in text  # the workload's reusable share


def test_written_json_is_strict_and_complete(tmp_path: Path) -> None:
    report = _report(tmp_path)
    paths = write(report, tmp_path / "out")
    assert sorted(p.name for p in paths) == ["results.json", "results.md"]
    data = json.loads((tmp_path / "out" / "results.json").read_text())
    names = [r["name"] for r in data["results"]]
    assert names == ["default", "smg-cache_aware", "random"]
    assert data["results"][2]["ttft"]["p50"] is None  # NaN of no samples becomes null
    assert data["workload"]["estimate"]["reusable_fraction"] == pytest.approx(0.8)
    assert to_json(report)["settings"]["replicas"] == 2
