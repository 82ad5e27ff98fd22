"""Acceptance: prefix-aware routing pays off on a multi-session workload over 6 replicas.

Asserted on the replicas' own prefix-cache counters (cached tokens / prompt tokens), never on
wall-clock time. The KV caches are small enough that a careless router thrashes them: 10 live
sessions growing to ~4.6K tokens each need up to ~46K tokens on every replica under
round-robin, while each replica holds 768 blocks x 16 = ~12K tokens, enough for its share of
sessions when they stay put. Concurrency (10) is not a multiple of the replica count, so that
round-robin does not pin sessions by running them in lock step. With 4 replicas round-robin's
accidental returns (a session's next turn landing where the last one went) depended on timing
enough to move its ratio between 0.35 and 0.46; with 6 they are rarer (0.28-0.37 measured, also
with the CPU saturated), so the 2x comparison below measures routing, not the machine's load.
"""

from __future__ import annotations

import pytest

from benchmarks.driver import cache_stats, drive
from benchmarks.sim.cli import start_replicas
from benchmarks.sim.config import SimConfig
from benchmarks.workloads import multi_session_chat
from router.serve.server import running_gateway
from tests.gateways import MODEL, gateway_config

pytestmark = pytest.mark.slow


async def run_strategy(name: str) -> tuple[float, float]:
    """(cached-token ratio, share of the workload's reusable tokens captured)."""
    sim = SimConfig(num_gpu_blocks=768, speed=50.0)
    workload = multi_session_chat(
        sessions=20,
        turns=12,
        system_tokens=300,
        user_tokens=300,
        max_tokens=50,
        concurrency=10,
        seed=3,
    )
    async with start_replicas(6, sim) as replicas:
        urls = [r.url for r in replicas]
        config = gateway_config(urls, strategy=name)
        async with running_gateway(config) as gw:
            result = await drive(gw.url, workload, model=MODEL, deadline=120)
        stats = await cache_stats(urls)
    assert result.errors == 0
    hits = sum(s.hits for s in stats.values())
    queries = sum(s.queries for s in stats.values())
    return hits / queries, hits / result.reuse.reusable_tokens


async def test_default_profile_beats_round_robin_and_captures_reuse() -> None:
    default_ratio, default_captured = await run_strategy("default")
    rr_ratio, rr_captured = await run_strategy("round-robin")
    print(f"default: ratio {default_ratio:.3f} captured {default_captured:.3f}")
    print(f"round-robin: ratio {rr_ratio:.3f} captured {rr_captured:.3f}")
    assert default_ratio >= 2 * rr_ratio
    assert default_captured >= 0.80
