"""Several gateways sharing one Redis route as one; a Redis outage loses no request.

The gateways are separate ``prefixgate serve`` processes: nothing is shared between them but
Redis, as with gateway replicas behind a load balancer. Each
session's turns are spread across the gateways at random, as a load balancer would.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from redis.crc import key_slot

from benchmarks.driver import cache_stats
from benchmarks.reuse import ReuseTracker
from benchmarks.sim.cli import start_replicas
from benchmarks.sim.config import SimConfig
from benchmarks.sim.tokenizer import Tokenizer
from benchmarks.workloads import MultiSessionWorkload, multi_session_chat
from router.index.redis_link import key_tag
from tests.gateways import MODEL
from tests.processes import gateway_process
from tests.redis_server import FlakyProxy, unique_namespace

pytestmark = [pytest.mark.slow, pytest.mark.redis]


def workload() -> MultiSessionWorkload:
    return multi_session_chat(
        sessions=20,
        turns=10,
        system_tokens=300,
        user_tokens=300,
        max_tokens=50,
        concurrency=10,
        seed=5,
    )


@dataclass
class Outcome:
    requests: int = 0
    failed: int = 0
    reuse: ReuseTracker | None = None
    errors: list[str] = field(default_factory=list)  # status and body of each failure


async def spread(
    urls: list[str],
    wl: MultiSessionWorkload,
    seed: int,
    between: Callable[[int], Any] | None = None,
) -> Outcome:
    """Every turn of every session to a gateway picked at random."""
    rng = random.Random(seed)
    tokenizer, outcome = Tokenizer(), Outcome(reuse=ReuseTracker())
    gate = asyncio.Semaphore(wl.concurrency)
    async with httpx.AsyncClient(timeout=60) as http:

        async def session(s: Any) -> None:
            async with gate:
                messages: list[dict[str, Any]] = [{"role": "system", "content": s.system}]
                for text in s.user_turns:
                    messages.append({"role": "user", "content": text})
                    prompt = tokenizer.encode_chat(messages)
                    resp = await http.post(
                        f"{rng.choice(urls)}/v1/chat/completions",
                        json={"model": MODEL, "messages": messages, "max_tokens": s.max_tokens},
                        headers={"x-session-id": s.session_id},
                    )
                    outcome.requests += 1
                    if between is not None:
                        await between(outcome.requests)
                    if resp.status_code != 200:
                        outcome.failed += 1
                        outcome.errors.append(f"{resp.status_code} {resp.text[:300]}")
                        return
                    answer = resp.json()["choices"][0]["message"]["content"]
                    assert outcome.reuse is not None
                    outcome.reuse.observe(prompt, tokenizer.encode(answer))
                    messages.append({"role": "assistant", "content": answer})

        async with asyncio.timeout(120):
            await asyncio.gather(*(session(s) for s in wl.sessions))
    return outcome


@contextlib.asynccontextmanager
async def gateways(
    tmp_path: Path, urls: list[str], n: int, index: dict[str, Any]
) -> AsyncIterator[list[str]]:
    """``n`` gateway processes in front of ``urls``, sharing nothing but ``index``'s Redis."""
    config = {
        "pool": {
            "endpoints": [{"url": u} for u in urls],
            "healthCheck": {"intervalSeconds": 0.2, "unhealthyThreshold": 2},
            "metricsScrape": {"intervalSeconds": 0.05},
        },
        "prefixIndex": index,
    }
    async with contextlib.AsyncExitStack() as stack:
        running = await asyncio.gather(
            *(
                stack.enter_async_context(gateway_process(tmp_path, config, f"gateway{i}"))
                for i in range(n)
            )
        )
        yield [g.url for g in running]


@dataclass(frozen=True)
class Captured:
    reuse: float  # share of the workload's reusable tokens served from the replicas' caches
    fallbacks: float  # Redis calls the gateways gave up on (budget, breaker) during the run

    def __str__(self) -> str:
        return f"{self.reuse:.3f} ({self.fallbacks:.0f} Redis fallbacks)"


async def fallbacks(gateway: str) -> float:
    async with httpx.AsyncClient(base_url=gateway, timeout=30) as http:
        text = (await http.get("/metrics")).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("prefixgate_redis_fallbacks_total")
    )


async def captured(tmp_path: Path, n_gateways: int, index: dict[str, Any]) -> Captured:
    async with start_replicas(4, SimConfig(num_gpu_blocks=768, speed=50.0)) as replicas:
        urls = [r.url for r in replicas]
        async with gateways(tmp_path, urls, n_gateways, index) as gw_urls:
            outcome = await spread(gw_urls, workload(), seed=11)
            gave_up = sum([await fallbacks(url) for url in gw_urls])
        stats = await cache_stats(urls)
    assert outcome.failed == 0 and outcome.reuse is not None
    return Captured(sum(s.hits for s in stats.values()) / outcome.reuse.reusable_tokens, gave_up)


# These tests are about sharing, not Redis's latency: a budget that a loaded machine's event
# loop lag cannot use up. With 50 ms, a busy 2-core box could make the gateways give up on
# Redis mid-run and route apart (reuse 0.919 against one gateway's 0.995); the outage test
# below is the one about budgets and fallbacks.
GENEROUS_MS = 1000


@pytest.mark.parametrize("backend", ["redis", "replicated"])
async def test_gateways_sharing_redis_route_as_one(
    tmp_path: Path, redis_url: str, redis_namespace: str, backend: str
) -> None:
    redis_index = {"backend": backend, "url": redis_url, "namespace": redis_namespace}
    single = await captured(tmp_path, 1, {})
    shared = await captured(tmp_path, 3, {**redis_index, "timeoutMs": GENEROUS_MS})
    separate = await captured(tmp_path, 3, {})
    seen = (
        f"captured reuse: 1 gateway {single}, 3 on Redis ({backend}) {shared}, "
        f"3 apart {separate}"
    )
    print(seen)
    # Three gateways sharing one index know what one gateway knows, less the routing noise of
    # concurrent turns that reach two gateways before either's index write lands. That noise
    # grows with the machine's load (quiet, 14 runs on 2026-12-02: 0.934-0.989 shared against
    # 0.967-0.997 alone; under a full test suite and benchmarks beside it: 0.907 against
    # 0.995), so the bound is relative: sharing must close at least half the gap between three
    # gateways apart (each knows about a third: 0.65-0.79, once 0.85 under load) and one. The
    # run must tell sharing apart at all (a gap of 10 points or more between one gateway and
    # three apart); then gateways that do not share fail the first check.
    assert single.reuse - separate.reuse >= 0.10, seen
    assert shared.reuse - separate.reuse >= 0.5 * (single.reuse - separate.reuse), seen


async def test_gateways_sharing_a_redis_cluster_route_as_one(
    tmp_path: Path, redis_cluster_url: str
) -> None:
    # A namespace whose slot the url's node does not serve: every index call is redirected.
    namespace = next(
        ns for ns in (unique_namespace() for _ in range(1000))
        if key_slot(key_tag(ns).encode()) >= 16384 // 3
    )
    cluster = {
        "backend": "redis", "url": redis_cluster_url, "cluster": True, "namespace": namespace,
        "timeoutMs": GENEROUS_MS,
    }
    shared = await captured(tmp_path, 3, cluster)
    separate = await captured(tmp_path, 3, {})
    seen = f"captured reuse: 3 on a Redis Cluster {shared}, 3 apart {separate}"
    print(seen)
    assert shared.reuse >= separate.reuse + 0.10, seen


CLOSED = 'prefixgate_redis_circuit_open{component="index"} 0.0'


async def until_recovered(gateway: str, seconds: float = 20.0) -> str:
    """Keep routing requests until the index's circuit breaker has closed again (bounded)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "probe " * 80}]}
    async with httpx.AsyncClient(base_url=gateway, timeout=30) as http:
        for _ in range(int(seconds / 0.2)):
            assert (await http.post("/v1/chat/completions", json=body)).status_code == 200
            text = (await http.get("/metrics")).text
            if CLOSED in text:
                break
            await asyncio.sleep(0.2)
    return text


async def test_redis_outage_fails_no_request(
    tmp_path: Path, redis_url: str, redis_namespace: str
) -> None:
    flaky = FlakyProxy(redis_url)
    url = await flaky.start()
    index = {"backend": "redis", "url": url, "namespace": redis_namespace, "timeoutMs": 20}

    async def outage(done: int) -> None:
        # Redis hangs for the middle third of the run, then comes back.
        if done == 60:
            flaky.forwarding = False
        elif done == 130:
            flaky.forwarding = True

    try:
        async with start_replicas(4, SimConfig(num_gpu_blocks=768, speed=50.0)) as replicas:
            urls = [r.url for r in replicas]
            async with gateways(tmp_path, urls, 2, index) as gw_urls:
                outcome = await spread(gw_urls, workload(), seed=3, between=outage)
                text = await until_recovered(gw_urls[0])
    finally:
        flaky.forwarding = True
        await flaky.close()
    assert outcome.failed == 0, outcome.errors
    assert outcome.requests == 200
    fallbacks = sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("prefixgate_redis_fallbacks_total")
    )
    assert fallbacks > 0, "the outage must have been noticed (and survived)"
    assert CLOSED in text, "the index must use Redis again once it is back"
