"""Built worlds: short whatever was drawn, the KV fits the longest request, seeded."""

from __future__ import annotations

import random

import pytest

from benchmarks.bench.conversation import estimate_reuse
from benchmarks.bench.world_build import (
    MAX_SPEED,
    MIN_SPEED,
    REQUESTS_PER_WALL_S,
    WALL_TARGET_S,
    build_world,
)
from benchmarks.bench.worlds import draw_worlds
from benchmarks.trace_replay import TraceRow


def synthetic_trace(n: int = 400) -> list[TraceRow]:
    rng = random.Random(5)
    rows, next_id = [], 100
    for i in range(n):
        blocks = rng.randint(1, 30)
        shared = list(range(rng.randint(0, min(blocks, 4))))  # a common head
        ids = shared + list(range(next_id, next_id + blocks - len(shared)))
        next_id += blocks
        rows.append(TraceRow(i * 300.0, blocks * 512 - rng.randint(0, 511),
                             rng.randint(1, 800), tuple(ids)))
    return rows


@pytest.mark.parametrize("scale", [0.2, 1.0])
def test_worlds_are_sized_to_the_budget(scale: float) -> None:
    rows = synthetic_trace()
    wall = WALL_TARGET_S * scale
    for world in draw_worlds(16, seed=21, trace_rows=len(rows)):
        built = build_world(world, scale, rows)
        wl = built.workload
        assert MIN_SPEED <= built.speed <= MAX_SPEED
        # Either it fits the budget, or it is already as small as the builder makes it; one
        # long session (its turns and sub-agents at their minimum) may run somewhat longer.
        small = len(wl.conversations) <= 4 or wl.num_requests <= 4
        assert wl.num_requests <= wall * REQUESTS_PER_WALL_S + 1 or small, world
        assert built.est_sim_s / built.speed <= wall * 1.5 or small, world
        ledger = estimate_reuse(wl, world.block_size)
        longest = ledger.max_prompt_tokens
        assert built.num_gpu_blocks * world.block_size >= longest
        if world.workload in ("shared-prefix", "trace"):
            assert wl.concurrency == len(wl.conversations)  # open loop
            assert wl.rate is not None or wl.arrivals is not None


def test_building_is_deterministic() -> None:
    rows = synthetic_trace()
    worlds = draw_worlds(6, seed=2, trace_rows=len(rows))
    a = [build_world(w, 0.5, rows) for w in worlds]
    b = [build_world(w, 0.5, rows) for w in worlds]
    assert [x.summary() for x in a] == [y.summary() for y in b]
    assert [x.workload for x in a] == [y.workload for y in b]


def test_a_trace_world_needs_the_trace() -> None:
    world = next(w for w in draw_worlds(40, seed=0, trace_rows=10) if w.workload == "trace")
    with pytest.raises(ValueError, match="--trace"):
        build_world(world, 1.0, [])


def test_a_shrunk_trace_window_still_offers_the_drawn_load() -> None:
    """Each pass sizes the window's time scale from its span in trace seconds: a span taken
    at the last pass's scale divided the new scale by the old."""
    from benchmarks.bench import world_build as wb
    from benchmarks.bench.worlds import World

    rows = [TraceRow(i * 100.0, 4096, 256, (0, 10_000 + i, *range(100 + 8 * i, 106 + 8 * i)))
            for i in range(400)]
    world = World(index=0, seed=1, replicas=2, prefill_mode="batched",
                  max_num_batched_tokens=2048, cost_per_token=4.0, cost_per_request=4.0,
                  itl_ms=10.0, slow=(1.0, 1.0), max_num_seqs=64, block_size=16,
                  bytes_per_token=4.0, kv_factor=1.0, workload="trace", load=0.2,
                  params={"start": 0, "block_tokens": 64, "max_output": 32, "keep": 1})
    c = wb._Costs.of(world, 1.0)
    wl = wb._trace(world, c, wb.WALL_TARGET_S, rows)
    assert wl.arrivals is not None and len(wl.conversations) < 75  # shrunk
    work = sum(wb._conv_work(conv, c)[0] for conv in wl.conversations) / 1000
    assert work / (world.replicas * wl.arrivals[-1]) == pytest.approx(world.load, rel=0.05)
