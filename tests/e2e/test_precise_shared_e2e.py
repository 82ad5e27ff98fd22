"""Shared precise index end to end: gateway replicas each subscribed to one real ZMQ publisher,
and a gateway that subscribes to endpoints Kubernetes discovery adds (and forgets them)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry

from benchmarks.sim.cli import start_replicas
from benchmarks.sim.config import SimConfig
from benchmarks.sim.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventPublisher
from router.index.redis_link import RedisMetrics
from router.precise.events import EventSource, SubscriberSettings
from router.precise.events_manager import KVEventsManager
from router.precise.index import PreciseIndex, block_keys
from router.precise.shared_index import RemoteMatch, SharedPreciseIndex
from router.serve.server import running_gateway
from tests.gateways import gateway_config
from tests.router.pool.test_discovery import FakeKube, pod
from tests.router.precise.test_kv_events import wait_for

BS = 4
EID = "127.0.0.1:9"


async def test_two_gateways_on_one_publisher_apply_each_batch_once(
    redis_url: str, redis_namespace: str
) -> None:
    pub = KVEventPublisher("127.0.0.1", 0, "kv@t@m")
    source = EventSource(EID, pub.address)
    settings = SubscriberSettings(tick_seconds=0.02)
    gateways: list[tuple[PreciseIndex, SharedPreciseIndex, KVEventsManager]] = []
    try:
        for _ in range(2):
            local = PreciseIndex(BS)
            shared = SharedPreciseIndex(
                local, redis_url, namespace=redis_namespace, timeout_ms=250.0,
                metrics=RedisMetrics(CollectorRegistry()),
            )
            manager = KVEventsManager(local, [source], settings, CollectorRegistry(), shared)
            manager.start()
            gateways.append((local, shared, manager))
        async with asyncio.timeout(5):  # clears are harmless probes until both listen
            while not all(g[0].trusted(EID) for g in gateways):
                pub.publish([AllBlocksCleared()])
                await asyncio.sleep(0.02)
        chain = list(range(24))
        keys = block_keys(chain, BS)
        pub.publish([BlockStored([1, 2, 3], None, chain[:12], BS)])
        pub.publish([BlockStored([4, 5, 6], 3, chain[12:], BS)])
        pub.publish([BlockRemoved([6])])
        for local, shared, _ in gateways:
            await wait_for(lambda i=local: i.entries(EID) == 5)  # type: ignore[misc]
            await shared.flush()
        statuses: dict[str, int] = {}
        for _, shared, _ in gateways:
            for status, count in shared.statuses.items():
                statuses[status] = statuses.get(status, 0) + count
        # Every batch either applied once or skipped as a duplicate; never a gap.
        assert statuses.get("dup", 0) >= 3 and "gap" not in statuses
        assert sum(statuses.values()) - statuses["dup"] <= pub.published
        late = SharedPreciseIndex(
            PreciseIndex(BS), redis_url, namespace=redis_namespace, timeout_ms=250.0,
            metrics=RedisMetrics(CollectorRegistry()),
        )
        try:
            assert await late.lookup(keys, [EID]) == {EID: RemoteMatch(True, 5, 0)}
        finally:
            await late.aclose()
    finally:
        for _, shared, manager in gateways:
            await manager.stop()
            await shared.aclose()
        await pub.aclose()


@pytest.fixture
async def kube_api() -> AsyncIterator[tuple[FakeKube, str]]:
    fake = FakeKube()
    runner = web.AppRunner(fake.app(), shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield fake, f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        for w in fake.watchers:
            w.queue.put_nowait(None)
        await runner.cleanup()


async def test_a_discovered_endpoint_gets_events_and_is_forgotten_when_gone(
    kube_api: tuple[FakeKube, str], redis_url: str, redis_namespace: str
) -> None:
    fake, api = kube_api
    sim = SimConfig(speed=100.0, num_gpu_blocks=64, kv_events_port=0, kv_events_replay_port=0)
    async with start_replicas(1, sim) as (replica,):
        assert replica.kv_events_address and replica.kv_events_replay_address
        kv_port = int(replica.kv_events_address.rsplit(":", 1)[1])
        replay_port = int(replica.kv_events_replay_address.rsplit(":", 1)[1])
        fake.put("pods", pod("a", "127.0.0.1"))
        redis_section = {"backend": "redis", "url": redis_url, "namespace": redis_namespace,
                         "timeoutMs": 250}
        precise: dict[str, Any] = {
            "tokenizer": {"type": "sim"},
            "kvEvents": {"portOffset": kv_port - replica.port,
                         "replayPortOffset": replay_port - replica.port},
            "index": redis_section,
        }
        discovery = {"labelSelector": {"app": "vllm"}, "targetPorts": [replica.port],
                     "apiServer": api, "tokenFile": None}
        config = gateway_config(
            [], discovery=discovery, strategy="precise", precisePrefix=precise,
            prefixIndex=redis_section,  # both Redis users share one set of metrics
        )
        eid = f"127.0.0.1:{replica.port}"
        async with running_gateway(config) as gw, httpx.AsyncClient(base_url=gw.url) as client:
            runtime = gw.gateway.precise
            assert runtime is not None and runtime.events is not None
            events = runtime.events
            await wait_for(lambda: eid in events.subscribers and events.subscribers[eid].connected)
            body = {"model": "sim-model", "prompt": "tell me a story " * 20, "max_tokens": 4}
            resp = await client.post("/v1/completions", json=body, timeout=10)
            assert resp.status_code == 200
            cached = set(replica.engine.kv.cached_hashes())
            assert cached
            await wait_for(lambda: runtime.index.engine_hashes(eid) == cached)
            await wait_for(lambda: runtime.index.trusted(eid))
            assert runtime.shared is not None
            await runtime.shared.flush()
            assert runtime.shared.statuses.get("fresh") == 1
            fake.delete("pods", "a")
            await wait_for(lambda: eid not in events.subscribers)
            await wait_for(lambda: eid not in runtime.index.endpoints())
