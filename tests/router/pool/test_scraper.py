"""Health checks and vLLM metric scraping, against real simulated replicas."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping

import httpx
import orjson
import pytest

from benchmarks.sim.cli import start_replicas
from benchmarks.sim.config import DEFAULT_MODEL, SimConfig
from router.core.endpoints import Endpoint, EndpointState
from router.core.lease import Lease
from router.core.pool import EndpointPool
from router.index.affinity import InMemoryAffinityStore
from router.index.prefix_index import InMemoryPrefixIndex
from router.index.redis_state import SharedInFlight
from router.index.stores import Stores
from router.pool import scraper
from router.pool.scraper import EndpointMonitor, MonitorSettings
from router.serve.server import running_gateway
from router.upstream.client import UpstreamClient
from tests.gateways import MODEL, gateway_config


@contextlib.asynccontextmanager
async def monitor_client() -> AsyncIterator[UpstreamClient]:
    """The monitor's client, as the composition root builds it (its own connections)."""
    client = UpstreamClient(8, 1.0)
    try:
        yield client
    finally:
        await client.aclose()


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port  # nothing listens once the socket is closed


async def test_monitor_scrapes_a_replica_and_marks_a_dead_one_unhealthy() -> None:
    settings = MonitorSettings(
        scrape_interval=0.02, scrape_timeout=0.5, health_interval=0.05, unhealthy_threshold=2
    )
    capacity: list[tuple[str, int, int]] = []
    config = SimConfig(speed=50.0, num_gpu_blocks=512)
    async with start_replicas(1, config) as (replica,), monitor_client() as http:
        live = Endpoint.from_url(replica.url)
        dead = Endpoint.from_url(f"http://127.0.0.1:{_closed_port()}")
        pool = EndpointPool([live, dead])
        monitor = EndpointMonitor(
            pool, http, settings, lambda eid, bs, n: capacity.append((eid, bs, n))
        )
        await monitor.check_all()
        states = {s.endpoint.id: s for s in pool}
        assert states[live.id].healthy and not states[dead.id].healthy
        assert states[live.id].models == {config.model}, "models found at the first health check"
        states[dead.id].healthy = True  # as if it had been up: failures must take it out
        monitor.start()
        try:
            async with asyncio.timeout(20):
                while not capacity or states[dead.id].healthy:  # noqa: ASYNC110 (monitor tasks)
                    await asyncio.sleep(0.02)
        finally:
            await monitor.stop()
        assert capacity == [(live.id, config.block_size, 512)]
        assert states[live.id].metrics.scraped_at > 0
        assert states[live.id].healthy


async def test_a_monitoring_step_that_fails_does_not_end_the_endpoints_monitoring(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    settings = MonitorSettings(
        scrape_interval=0.02, scrape_timeout=0.5, health_interval=0.05, unhealthy_threshold=2
    )

    async def broken(self: EndpointMonitor, state: EndpointState) -> None:
        raise RuntimeError("a bug on an odd page")

    monkeypatch.setattr(EndpointMonitor, "_scrape", broken)
    async with monitor_client() as http:
        dead = Endpoint.from_url(f"http://127.0.0.1:{_closed_port()}")
        pool = EndpointPool([dead])
        monitor = EndpointMonitor(pool, http, settings)
        (state,) = pool
        state.healthy = True  # as if it had been up: its health checks must still run
        monitor.start()
        try:
            async with asyncio.timeout(20):
                while state.healthy:  # noqa: ASYNC110 (monitor tasks)
                    await asyncio.sleep(0.02)
        finally:
            await monitor.stop()


async def test_a_replica_slow_to_answer_its_metrics_stays_healthy() -> None:
    metrics_asked = 0
    release = asyncio.Event()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal metrics_asked
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            for _ in range(1000):
                head = await reader.readuntil(b"\r\n\r\n")
                if head.startswith(b"GET /metrics"):
                    metrics_asked += 1
                    await release.wait()  # busy: later than the scrape timeout
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
                await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    settings = MonitorSettings(
        scrape_interval=0.01, scrape_timeout=0.02, health_interval=60.0, unhealthy_threshold=2
    )
    try:
        async with monitor_client() as http:
            pool = EndpointPool([Endpoint.from_url(f"http://127.0.0.1:{port}")])
            (state,) = pool
            state.healthy = True
            monitor = EndpointMonitor(pool, http, settings)
            monitor.start()
            try:
                async with asyncio.timeout(20):
                    while metrics_asked < 4:  # noqa: ASYNC110 (monitor tasks)
                        await asyncio.sleep(0.01)
            finally:
                await monitor.stop()
            assert state.healthy, "slow metrics are stale metrics, not a dead replica"
    finally:
        release.set()
        server.close()


async def test_a_scrape_remembers_the_gateway_requests_it_may_have_counted() -> None:
    """A request that finished after the scrape still shows in its stale ``waiting``: it must
    not pass for another gateway's queue until the next scrape (it once moved a session)."""
    settings = MonitorSettings(scrape_interval=0.02, scrape_timeout=0.5, health_interval=5.0)
    async with (
        start_replicas(1, SimConfig(speed=50.0)) as (replica,),
        monitor_client() as http,
    ):
        pool = EndpointPool([Endpoint.from_url(replica.url)])
        (state,) = list(pool)
        monitor = EndpointMonitor(pool, http, settings, None)
        await monitor.check_all()
        lease = Lease(state, prefill_tokens=500, pool=pool, kv_tokens=700)
        await scrape_once(monitor, state)
        lease.release()
        state.metrics.waiting = 1.0  # the engine had our request queued when it was scraped
        snapshot = state.snapshot(pool.clock())
        assert (snapshot.in_flight, snapshot.scraped_in_flight) == (0, 1)
        assert snapshot.foreign_waiting == 0.0
        # Its KV too: what the scrape's cache use may count of ours, not a stranger's.
        assert (snapshot.in_flight_kv_tokens, snapshot.scraped_kv_tokens) == (0, 700)


async def scrape_once(monitor: EndpointMonitor, state: EndpointState) -> None:
    monitor.start()
    try:
        async with asyncio.timeout(20):
            while not state.metrics.scraped_at:  # noqa: ASYNC110 (monitor tasks)
                await asyncio.sleep(0.01)
    finally:
        await monitor.stop()


async def test_a_scrape_remembers_other_gateways_requests_too(
    redis_url: str, redis_namespace: str
) -> None:
    """Gateways sharing Redis: another replica's request that finished after the scrape is no
    stranger's queue either."""
    settings = MonitorSettings(scrape_interval=0.02, scrape_timeout=0.5, health_interval=5.0)
    others: dict[str, int] = {}
    other = SharedInFlight(
        redis_url, lambda: others, namespace=redis_namespace, gateway_id="other", timeout_ms=2000
    )
    this = SharedInFlight(
        redis_url, dict, namespace=redis_namespace, gateway_id="this", timeout_ms=2000
    )
    async with (
        start_replicas(1, SimConfig(speed=50.0)) as (replica,),
        monitor_client() as http,
    ):
        pool = EndpointPool([Endpoint.from_url(replica.url)])
        (state,) = list(pool)
        stores = Stores(InMemoryPrefixIndex(), InMemoryAffinityStore(), shared_in_flight=this)
        try:
            others[state.endpoint.id] = 2
            assert await other.sync_once() and await this.sync_once()
            monitor = EndpointMonitor(
                pool, http, settings, None, remote_load=this.remote_load
            )
            await monitor.check_all()
            await scrape_once(monitor, state)
            others.clear()  # the other gateway's two requests finish before the next scrape
            assert await other.sync_once() and await this.sync_once()
            state.metrics.waiting = 3.0  # the stale scrape: their two, and one stranger's
            (snapshot,) = stores.candidates(pool)(DEFAULT_MODEL)
        finally:
            await other.aclose()
            await this.aclose()
    assert (snapshot.in_flight, snapshot.scraped_in_flight) == (0, 2)
    assert snapshot.foreign_waiting == 1.0


async def _slot_limit_while_busy(
    config: SimConfig, prompt: str, max_tokens: int
) -> tuple[float, float]:
    """Four streamed requests at once through a gateway in front of one replica: the slot
    limit the gateway reports once it has learned one (or at the answers' end, 0), and the
    most requests it saw waiting in the replica meanwhile."""
    async with (
        start_replicas(1, config) as (replica,),
        running_gateway(gateway_config([replica.url])) as gw,
        httpx.AsyncClient(base_url=gw.url, timeout=30.0) as http,
    ):
        body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": True}

        async def ask() -> None:
            async with http.stream("POST", "/v1/completions", json=body) as reply:
                async for _ in reply.aiter_bytes():
                    pass

        async def gauges() -> dict[str, float]:
            text = (await http.get("/metrics")).text
            rows = (x.rsplit(" ", 1) for x in text.splitlines() if x.startswith(GAUGES))
            return {name.split("{")[0]: float(value) for name, value in rows}

        async with asyncio.timeout(30):
            asks = asyncio.gather(*(ask() for _ in range(4)))
            limit = waited = 0.0
            while not asks.done() and not limit:
                seen = await gauges()
                limit = seen[LIMIT]
                waited = max(waited, seen["prefixgate_endpoint_waiting"])
                await asyncio.sleep(0.05)
            await asks
        return limit, waited


LIMIT = "prefixgate_endpoint_slot_limit"
GAUGES = (LIMIT + "{", "prefixgate_endpoint_waiting{")


async def test_a_replica_with_its_slots_full_teaches_the_gateway_its_limit() -> None:
    # Two slots, four long answers: two decode while two wait for a slot.
    config = SimConfig(speed=20.0, max_num_seqs=2)
    limit, waited = await _slot_limit_while_busy(config, "hello", max_tokens=3000)
    assert limit == 2.0 and waited >= 1


async def test_requests_waiting_behind_a_prefill_teach_no_slot_limit() -> None:
    # Plenty of slots, one prefill at a time: requests wait, but for the prefill ahead.
    config = SimConfig(speed=20.0, prefill_mode="serial", prefill_ms_per_token=20.0)
    limit, waited = await _slot_limit_while_busy(config, "word " * 2000, max_tokens=2)
    assert waited >= 1, "requests waited, behind the prefill"
    assert limit == 0.0


Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@contextlib.asynccontextmanager
async def serving(handle: Handler) -> AsyncIterator[str]:
    """A loopback server answering with ``handle``; yields its URL."""
    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()


@contextlib.asynccontextmanager
async def counting_replica(
    queries: list[float], health: int = 200, started: list[float] | None = None
) -> AsyncIterator[str]:
    """A replica whose /metrics reads ``queries[0]`` as vLLM's prefix-cache query count (a
    test sets it back to play a restarted engine), and ``started[0]`` if given and not 0 as
    that counter's creation time (the engine's start), whose /v1/models lists model ``m`` and
    whose /health answers ``health``."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            for _ in range(10_000):
                head = await reader.readuntil(b"\r\n\r\n")
                if head.startswith(b"GET /v1/models"):
                    body = b'{"data": [{"id": "m"}]}'
                elif head.startswith(b"GET /metrics"):
                    page = f'vllm:prefix_cache_queries_total{{model_name="m"}} {queries[0]}\n'
                    if started and started[0]:
                        page += f"vllm:prefix_cache_queries_created {started[0]}\n"
                    body = page.encode()
                else:
                    body = b""
                status = health if head.startswith(b"GET /health") else 200
                writer.write(
                    b"HTTP/1.1 %d X\r\ncontent-length: %d\r\n\r\n" % (status, len(body)) + body
                )
                await writer.drain()
        writer.close()

    async with serving(handle) as url:
        yield url


async def test_a_replica_whose_counters_went_back_restarted_and_its_prefixes_are_forgotten(
) -> None:
    """A container restarted at the same address serves with an empty prefix cache: what the
    index held for it is dropped (its other endpoints' entries stay), once per restart."""
    queries = [400.0]
    index = InMemoryPrefixIndex()
    restarted: list[str] = []

    async def on_restart(endpoint_id: str, started: float) -> None:
        restarted.append(endpoint_id)
        await index.clear_endpoint(endpoint_id)

    async with counting_replica(queries) as url, monitor_client() as http:
        pool = EndpointPool([Endpoint.from_url(url)])
        (state,) = pool
        state.healthy = True
        monitor = EndpointMonitor(pool, http, MonitorSettings(), on_restart=on_restart)
        endpoint = state.endpoint.id
        index.record(endpoint, [1, 2, 3])
        index.record("other", [1, 2])
        await monitor._scrape(state)
        queries[0] = 450.0  # counting on: the same engine
        await monitor._scrape(state)
        assert restarted == [] and index.match_now([1, 2, 3], [endpoint]) == {endpoint: 3}
        queries[0] = 0.0  # a page without queries tells nothing (nor does the next, above)
        await monitor._scrape(state)
        queries[0] = 460.0
        await monitor._scrape(state)
        assert restarted == []
        queries[0] = 0.0  # a new engine, not queried yet: told by its next count
        await monitor._scrape(state)
        assert restarted == []
        queries[0] = 12.0  # back near zero: a new engine
        await monitor._scrape(state)
        assert restarted == [endpoint]
        assert index.match_now([1, 2, 3], [endpoint, "other"]) == {endpoint: 0, "other": 2}
        index.record(endpoint, [1, 2, 3])  # recorded again after the restart: kept
        queries[0] = 30.0
        await monitor._scrape(state)
        assert restarted == [endpoint]
        assert index.match_now([1, 2, 3], [endpoint]) == {endpoint: 3}


@contextlib.asynccontextmanager
async def restart_monitor(
    queries: list[float], started: list[float], restarted: list[str],
    lives: list[float] | None = None,
) -> AsyncIterator[tuple[EndpointMonitor, EndpointState]]:
    """A monitor of one counting replica (its engine's start time in ``started``), telling
    each restart it notices into ``restarted`` (and the start time it was told with into
    ``lives``); a test drives its scrapes one by one."""

    async def on_restart(endpoint_id: str, life: float) -> None:
        restarted.append(endpoint_id)
        if lives is not None:
            lives.append(life)

    async with counting_replica(queries, started=started) as url, monitor_client() as http:
        pool = EndpointPool([Endpoint.from_url(url)])
        (state,) = pool
        state.healthy = True
        yield EndpointMonitor(pool, http, MonitorSettings(), on_restart=on_restart), state


async def test_a_new_engine_start_time_tells_a_restart_its_higher_count_hides() -> None:
    """A gateway that last saw the old engine at a count the new one has passed by its next
    scrape (paused, its scrapes failing a while, or the new engine busy) sees no counter go
    back; the engine's start time changed, and tells the restart, once."""
    queries, started, restarted, lives = [400.0], [1.7e9], list[str](), list[float]()
    async with restart_monitor(queries, started, restarted, lives) as (monitor, state):
        await monitor._scrape(state)
        queries[0], started[0] = 900.0, 1.7e9 + 60  # a new engine, already past 400
        await monitor._scrape(state)
        assert restarted == [state.endpoint.id]
        queries[0] = 950.0  # the same new engine counting on
        await monitor._scrape(state)
        assert restarted == [state.endpoint.id]
        queries[0], started[0] = 5.0, 1.7e9 + 120  # both signals at once: still one restart
        await monitor._scrape(state)
        assert restarted == [state.endpoint.id] * 2
        queries[0] = 500.0
        await monitor._scrape(state)
        queries[0], started[0] = 0.0, 1.7e9 + 180  # not queried yet: told by its start time
        await monitor._scrape(state)
        assert restarted == [state.endpoint.id] * 3
        queries[0] = 12.0  # its first count, below the old engine's: the same restart
        await monitor._scrape(state)
        assert restarted == [state.endpoint.id] * 3
        # Each restart is told with the new engine's life, what the shared index clears once.
        assert lives == [1.7e9 + 60, 1.7e9 + 120, 1.7e9 + 180]


async def test_the_same_start_time_tells_no_restart_while_its_counter_grows() -> None:
    """An engine counting on is the same engine; its counter going back still tells one."""
    queries, started, restarted = [400.0], [1.7e9], list[str]()
    async with restart_monitor(queries, started, restarted) as (monitor, state):
        for count in (400.0, 900.0, 2000.0):
            queries[0] = count
            await monitor._scrape(state)
        assert restarted == []
        queries[0] = 10.0
        await monitor._scrape(state)
        assert restarted == [state.endpoint.id]


async def test_an_unknown_start_time_tells_nothing_and_the_counter_still_does() -> None:
    """A page without the engine's start time (0) is no new engine, nor is the next one with
    it again: only known times are compared; meanwhile the counter going back tells."""
    queries, started, restarted = [400.0], [1.7e9], list[str]()
    async with restart_monitor(queries, started, restarted) as (monitor, state):
        await monitor._scrape(state)
        queries[0], started[0] = 500.0, 0.0
        await monitor._scrape(state)
        queries[0], started[0] = 600.0, 1.7e9
        await monitor._scrape(state)
        assert restarted == []
        queries[0], started[0] = 10.0, 0.0
        await monitor._scrape(state)
        assert restarted == [state.endpoint.id]


async def test_the_gateway_forgets_a_restarted_replicas_prefixes() -> None:
    """Wired by the composition root: the gateway's own index, through its own scrapes."""
    queries = [400.0]

    async with counting_replica(queries) as url, running_gateway(gateway_config([url])) as gw:
        index = gw.gateway.stores.index
        assert isinstance(index, InMemoryPrefixIndex)
        (state,) = gw.gateway.pool
        async with asyncio.timeout(20):
            while state.metrics.prefix_queries != 400.0:  # noqa: ASYNC110 (monitor task)
                await asyncio.sleep(0.01)
        index.record(state.endpoint.id, [1, 2, 3])
        queries[0] = 3.0
        async with asyncio.timeout(20):
            while index.match_now([1, 2, 3], [state.endpoint.id])[state.endpoint.id]:  # noqa: ASYNC110
                await asyncio.sleep(0.01)


async def test_a_metrics_page_too_big_to_read_leaves_the_replica_healthy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The replica answered: its metrics go stale (like a slow page), they do not take it
    out as a refused connection does."""
    monkeypatch.setattr(scraper, "MAX_PAGE_BYTES", 16)  # the page is longer
    async with counting_replica([400.0]) as url, monitor_client() as http:
        pool = EndpointPool([Endpoint.from_url(url)])
        (state,) = pool
        state.healthy = True
        monitor = EndpointMonitor(pool, http, MonitorSettings(unhealthy_threshold=2))
        for _ in range(3):
            await monitor._scrape(state)
        assert state.healthy and state.consecutive_failures == 0
        assert state.metrics.scraped_at == 0.0, "nothing was read"


async def test_a_replica_failing_its_health_checks_goes_unhealthy_though_its_metrics_answer(
) -> None:
    """vLLM whose engine died: /health answers 503, /metrics (the API server's) still 200. A
    scrape that answers is no passed health check: it must not reset the failures."""
    steps: asyncio.Queue[None] = asyncio.Queue()
    ticks = iter(range(1_000_000))
    # Every monitoring step is due a health check: each reading of the clock is a second on.
    settings = MonitorSettings(scrape_interval=0.0, health_interval=1.0, unhealthy_threshold=2)
    async with counting_replica([400.0], health=503) as url, monitor_client() as http:
        pool = EndpointPool([Endpoint.from_url(url)])
        (state,) = pool
        state.healthy = True
        state.models.add("m")
        monitor = EndpointMonitor(
            pool, http, settings, clock=lambda: float(next(ticks)),
            on_scrape=lambda: steps.put_nowait(None),
        )
        monitor.start()
        try:
            async with asyncio.timeout(20):
                for _ in range(4):  # four health checks failed, each followed by a scrape
                    await steps.get()
        finally:
            await monitor.stop()
        assert state.metrics.scraped_at > 0, "its metrics were read"
        assert not state.healthy


def models_page(*models: Mapping[str, object]) -> bytes:
    return orjson.dumps({"object": "list", "data": list(models)})


BASE = {"id": "m", "object": "model", "root": "m", "parent": None}
ADAPTER = {"id": "sql-lora", "object": "model", "root": "/adapters/sql", "parent": "m"}


@contextlib.asynccontextmanager
async def listing_replica(listing: list[bytes | None]) -> AsyncIterator[str]:
    """A replica whose /health answers 200 and whose /v1/models answers ``listing[0]`` (None:
    the connection is dropped unanswered): a test changes it to load or unload adapters."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            for _ in range(10_000):
                head = await reader.readuntil(b"\r\n\r\n")
                body = listing[0] if head.startswith(b"GET /v1/models") else b""
                if body is None:
                    break
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(body) + body)
                await writer.drain()
        writer.close()

    async with serving(handle) as url:
        yield url


async def test_adapters_loaded_and_unloaded_at_runtime_are_followed() -> None:
    """vLLM loads and unloads LoRA adapters at runtime (/v1/load_lora_adapter): every health
    check reads /v1/models again, so an adapter loaded later is routed to the replica and
    one unloaded is not."""
    listing: list[bytes | None] = [models_page(BASE)]
    async with listing_replica(listing) as url, monitor_client() as http:
        pool = EndpointPool([Endpoint.from_url(url)])
        (state,) = pool
        monitor = EndpointMonitor(pool, http, MonitorSettings())
        await monitor.check_all()
        assert state.healthy and state.models == {"m"}
        assert not pool.knows_model("sql-lora")
        listing[0] = models_page(BASE, ADAPTER)  # loaded
        await monitor.check_all()
        assert [c.id for c in pool.candidates("sql-lora")] == [state.endpoint.id]
        listing[0] = models_page(BASE)  # unloaded
        await monitor.check_all()
        assert not pool.knows_model("sql-lora") and state.models == {"m"}
        listing[0] = models_page(BASE, ADAPTER)
        configured = EndpointPool([Endpoint.from_url(url, models=["m-configured"])])
        await EndpointMonitor(configured, http, MonitorSettings()).check_all()
        assert configured.models() == {"m-configured"}, "what the config says, not the list"


async def test_a_model_list_that_fails_fails_no_health_check() -> None:
    """/health alone tells whether a replica is up: a /v1/models that drops the connection,
    is no model list, or names nothing leaves the replica healthy and its models as known."""
    listing: list[bytes | None] = [None]
    async with listing_replica(listing) as url, monitor_client() as http:
        pool = EndpointPool([Endpoint.from_url(url)])
        (state,) = pool
        state.healthy = True
        monitor = EndpointMonitor(pool, http, MonitorSettings(unhealthy_threshold=1))
        await monitor.check_all()
        assert state.healthy and state.consecutive_failures == 0
        listing[0] = models_page(BASE)
        await monitor.check_all()
        assert state.models == {"m"}
        for page in (None, b"<html>busy</html>", b'{"data": 7}', models_page()):
            listing[0] = page
            await monitor.check_all()
            assert state.healthy and state.models == {"m"}, page


async def test_the_one_base_model_a_replica_lists_is_told() -> None:
    """Adapters name their base model (``parent``): the one base model listed is told when
    the list changes (the index sizer sizes the endpoint by it); several (one model served
    under aliases) tell None."""
    listing: list[bytes | None] = [models_page(BASE, ADAPTER)]
    told: list[tuple[str, str | None]] = []
    async with listing_replica(listing) as url, monitor_client() as http:
        pool = EndpointPool([Endpoint.from_url(url)])
        (state,) = pool
        monitor = EndpointMonitor(
            pool, http, MonitorSettings(), on_base_model=lambda e, m: told.append((e, m))
        )
        await monitor.check_all()
        await monitor.check_all()  # the same list: nothing new to tell
        listing[0] = models_page(BASE, {"id": "alias", "parent": None}, ADAPTER)
        await monitor.check_all()
    assert told == [(state.endpoint.id, "m"), (state.endpoint.id, None)]


