"""Sweep worlds: drawn deterministically per seed, within the documented ranges."""

from __future__ import annotations

import pytest

from benchmarks.bench.worlds import (
    BLOCK_SIZES,
    BPT_RANGE,
    COST_RANGE,
    FANOUT_RANGE,
    ITL_RANGE_MS,
    KV_RANGE,
    LOAD_RANGE,
    PREFILL_MODES,
    SEQS_RANGE,
    SLOW_RANGE,
    draw_worlds,
    replica_latency_args,
)


def test_same_seed_same_worlds_other_seed_other_worlds() -> None:
    assert draw_worlds(12, seed=3, trace_rows=100) == draw_worlds(12, seed=3, trace_rows=100)
    assert draw_worlds(12, seed=3, trace_rows=100) != draw_worlds(12, seed=4, trace_rows=100)
    # A longer sweep starts with the same worlds as a shorter one of the same seed.
    assert draw_worlds(5, seed=3)[:5] == draw_worlds(8, seed=3)[:5]


def _within(value: float, bounds: tuple[float, float]) -> bool:
    return bounds[0] * 0.999 <= value <= bounds[1] * 1.001


def test_worlds_stay_in_their_ranges_and_cover_them() -> None:
    worlds = draw_worlds(300, seed=11, max_replicas=8, trace_rows=1000)
    for w in worlds:
        assert 4 <= w.replicas <= 8 and len(w.slow) == w.replicas
        assert w.prefill_mode in PREFILL_MODES and w.block_size in BLOCK_SIZES
        assert _within(w.cost_per_token, COST_RANGE) and _within(w.cost_per_request, COST_RANGE)
        assert _within(w.itl_ms, ITL_RANGE_MS) and _within(w.kv_factor, KV_RANGE)
        assert SEQS_RANGE[0] <= w.max_num_seqs <= SEQS_RANGE[1]
        assert _within(w.bytes_per_token, BPT_RANGE)
        assert all(f == 1.0 or _within(f, SLOW_RANGE) for f in w.slow)
        assert 1.0 in w.slow  # never a fleet of slow replicas only
        if w.workload == "agentic":
            assert FANOUT_RANGE[0] <= w.params["burst_max"] <= FANOUT_RANGE[1]
        if w.workload in ("shared-prefix", "trace"):
            assert _within(w.load, LOAD_RANGE)
        if w.workload == "trace":
            assert 0 <= w.params["start"] < 1000
    # Wide ranges are drawn, not just their middles.
    assert {w.workload for w in worlds} == {"agentic", "chat", "shared-prefix", "trace"}
    assert {w.prefill_mode for w in worlds} == set(PREFILL_MODES)
    assert {w.block_size for w in worlds} == set(BLOCK_SIZES)
    assert min(w.cost_per_token for w in worlds) < 0.4 < 3.0 < max(w.cost_per_token for w in worlds)
    assert min(w.kv_factor for w in worlds) < 0.5 and max(w.kv_factor for w in worlds) > 2.5
    assert min(w.bytes_per_token for w in worlds) < 3 and max(w.bytes_per_token for w in worlds) > 8
    fanouts = [w.params["burst_max"] for w in worlds if w.workload == "agentic"]
    assert min(fanouts) <= 2 and max(fanouts) >= 30
    assert any(any(f > 1.0 for f in w.slow) for w in worlds)
    assert any(all(f == 1.0 for f in w.slow) for w in worlds)


def test_no_trace_worlds_without_a_trace() -> None:
    assert all(w.workload != "trace" for w in draw_worlds(100, seed=1, trace_rows=0))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_slow_replicas_get_their_factor_on_every_latency(seed: int) -> None:
    for w in draw_worlds(20, seed):
        args = replica_latency_args(w)
        assert len(args) == w.replicas
        fast = args[w.slow.index(1.0)]
        for flags, factor in zip(args, w.slow, strict=True):
            values = [float(v) for v in flags[1::2]]
            base = [float(v) for v in fast[1::2]]
            assert values == pytest.approx([b * factor for b in base], rel=1e-3)
