"""Shared state through a real Redis: session affinity and in-flight counts across replicas,
plus the update queue they rely on."""

from __future__ import annotations

import asyncio
import functools
import math
import socket
import time
from collections.abc import Callable
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from router.core.endpoints import QUEUE_AVERAGE_S, Endpoint
from router.core.pool import EndpointPool
from router.index import redis_state
from router.index.affinity import InMemoryAffinityStore
from router.index.prefix_index import InMemoryPrefixIndex
from router.index.redis_link import RedisLink, RedisMetrics, Unavailable
from router.index.redis_state import RedisAffinityStore, SharedInFlight, gateway_load
from router.index.stores import Stores
from tests.manual_clock import ManualClock
from tests.redis_server import declared_keys_only
from tests.router.index.shared_inflight import inflight

pytestmark = pytest.mark.redis


def dead_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"redis://127.0.0.1:{sock.getsockname()[1]}/0"


# --- session affinity -------------------------------------------------------------------------


def affinity(
    url: str, namespace: str, closing: list[Any], **kwargs: Any
) -> RedisAffinityStore:
    kwargs.setdefault("timeout_ms", 2000.0)  # semantics, not budgets: immune to machine load
    kwargs.setdefault("write_timeout_ms", 2000.0)
    store = RedisAffinityStore(url, namespace=namespace, **kwargs)
    closing.append(store)
    return store


async def test_affinity_is_shared_between_gateways(
    redis_url: str, redis_namespace: str, closing: list[Any]
) -> None:
    one = affinity(redis_url, redis_namespace, closing)
    two = affinity(redis_url, redis_namespace, closing)
    one.set("s1", "10.0.0.1:8000")
    assert await one.get("s1") == "10.0.0.1:8000"  # at once, before shipping
    await one.flush()
    assert await two.get("s1") == "10.0.0.1:8000"
    assert two.local.get_now("s1") == "10.0.0.1:8000"  # warmed for a later outage
    two.set("s1", "10.0.0.2:8000")
    await two.flush()
    assert await one.get("s1") == "10.0.0.2:8000"
    assert await one.get("unknown") is None


async def test_a_set_redis_did_not_take_is_not_undone_by_its_older_answer(
    redis_url: str, redis_namespace: str, closing: list[Any]
) -> None:
    """A session's newest turn went to B through this gateway and Redis missed that write:
    Redis's older answer (A) must not take the session back to the older prefix."""
    one = affinity(redis_url, redis_namespace, closing)
    two = affinity(redis_url, redis_namespace, closing)
    two.set("s1", "A")
    await two.flush()
    real_call = one._link.call
    failures = 1

    async def flaky(op: str, fn: Any, budget: float | None = None) -> Any:
        nonlocal failures
        if op == "affinity_set" and failures:
            failures -= 1
            raise Unavailable("timeout")
        return await real_call(op, fn, budget)

    one._link.call = flaky  # type: ignore[method-assign]
    one.set("s1", "B")
    await one.flush()
    assert await one.get("s1") == "B"
    await one.flush()  # and it goes again: the other gateway learns it too
    assert await two.get("s1") == "B"


async def test_affinity_expires_in_redis(
    redis_url: str, redis_namespace: str, closing: list[Any]
) -> None:
    one = affinity(redis_url, redis_namespace, closing, ttl_seconds=0.15)
    one.set("s1", "a:1")
    await one.flush()
    await asyncio.sleep(0.25)
    assert await affinity(redis_url, redis_namespace, closing).get("s1") is None
    assert await one.get("s1") is None


async def test_affinity_fails_open_to_local(redis_namespace: str, closing: list[Any]) -> None:
    registry = CollectorRegistry()
    store = affinity(dead_url(), redis_namespace, closing, metrics=RedisMetrics(registry))
    store.set("s1", "a:1")
    await store.flush()
    assert await store.get("s1") == "a:1"
    assert await store.get("s2") is None
    fallbacks = sum(
        registry.get_sample_value(
            "prefixgate_redis_fallbacks_total", {"op": "affinity_get", "reason": reason}
        )
        or 0
        for reason in ("error", "circuit_open")
    )
    # s2 was asked of Redis; s1 was not: its own set, which Redis did not take, goes again.
    assert fallbacks == 1
    await store.forget_endpoint("a:1")
    assert await store.get("s1") is None


async def test_a_restore_takes_a_failed_pick_back_in_redis_too(
    redis_url: str, redis_namespace: str, closing: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Failover: every attempt of the session's request failed. Its pick is undone for every
    gateway: shipped already or still queued, back to the previous endpoint or to none."""
    # Cluster-safe: the script touches its session's key only, given as KEYS.
    monkeypatch.setattr(redis_state, "_RESTORE", declared_keys_only(redis_state._RESTORE))
    one = affinity(redis_url, redis_namespace, closing)
    two = affinity(redis_url, redis_namespace, closing)
    one.set("s1", "a:1")
    one.set("s2", "failed:1")
    await one.flush()
    one.set("s1", "failed:1")
    await one.flush()  # the pick reached Redis before the attempts failed
    one.restore("s1", "failed:1", "a:1")
    one.restore("s2", "failed:1", None)
    one.set("s3", "failed:1")
    one.restore("s3", "failed:1", None)  # still queued: never reaches Redis
    await one.flush()
    assert [await two.get(s) for s in ("s1", "s2", "s3")] == ["a:1", None, None]
    assert [await one.get(s) for s in ("s1", "s2", "s3")] == ["a:1", None, None]


async def test_a_restore_leaves_a_session_another_gateway_moved_on(
    redis_url: str, redis_namespace: str, closing: list[Any]
) -> None:
    one = affinity(redis_url, redis_namespace, closing)
    two = affinity(redis_url, redis_namespace, closing)
    one.set("s1", "failed:1")
    await one.flush()
    two.set("s1", "b:1")  # the session's next request, served through the other gateway
    await two.flush()
    one.restore("s1", "failed:1", None)
    await one.flush()
    assert await two.get("s1") == "b:1"
    assert await one.get("s1") == "b:1"


# --- in-flight counts -------------------------------------------------------------------------




async def test_in_flight_counts_are_summed_over_other_gateways(
    redis_url: str, redis_namespace: str, closing: list[Any]
) -> None:
    counts_a, counts_b, counts_c = {"e1": 3, "e2": 1}, {"e1": 2, "e3": 0}, {"e2": 5}
    a = inflight(redis_url, redis_namespace, closing, counts_a, gateway_id="a")
    b = inflight(redis_url, redis_namespace, closing, counts_b, gateway_id="b")
    c = inflight(redis_url, redis_namespace, closing, counts_c, gateway_id="c")
    for shared in (a, b, c, a, b):
        assert await shared.sync_once()
    assert a.remote_counts() == {"e1": 2, "e2": 5}  # its own counts are not included
    assert b.remote_in_flight("e1") == 3 and b.remote_in_flight("e2") == 6
    assert a.remote_in_flight("e3") == 0 and a.remote_in_flight("unknown") == 0


def gateway_pool(clock: Callable[[], float] = time.monotonic) -> EndpointPool:
    urls = [f"http://127.0.0.1:{p}" for p in (9001, 9002)]
    pool = EndpointPool([Endpoint.from_url(u) for u in urls], clock=clock)
    for state in pool:
        state.healthy = True
        state.models.add("m")
    return pool


async def test_the_prefill_queued_by_other_gateways_is_priced_here(
    redis_url: str, redis_namespace: str, closing: list[Any]
) -> None:
    """A replica's queue is what every gateway sent there: each sees the others' share too."""
    clock = ManualClock(100.0)
    here, there = gateway_pool(clock), gateway_pool(clock)
    busy, idle = (s.endpoint.id for s in there)
    leases = [there.lease(busy, prefill_tokens=700), there.lease(busy, prefill_tokens=300)]
    local = here.lease(busy, prefill_tokens=50)
    mine, theirs = (
        SharedInFlight(
            redis_url, functools.partial(gateway_load, pool), namespace=redis_namespace,
            gateway_id=name, timeout_ms=2000.0,
        )
        for name, pool in (("here", here), ("there", there))
    )
    closing += [mine, theirs]
    assert await theirs.sync_once() and await mine.sync_once()
    stores = Stores(InMemoryPrefixIndex(), InMemoryAffinityStore(), shared_in_flight=mine)
    snapshots = {s.id: s for s in stores.candidates(here)("m")}
    seen = {
        eid: (s.in_flight, s.pending_prefill_tokens, s.pending_prefill_requests)
        for eid, s in snapshots.items()
    }
    assert seen == {busy: (3, 1050, 3), idle: (0, 0, 0)}
    clock.now += 1.0
    for lease in leases:
        lease.first_byte()  # their prefills are done; their answers still stream
    assert await theirs.sync_once() and await mine.sync_once()
    (snapshot,) = [s for s in stores.candidates(here)("m") if s.id == busy]
    assert (snapshot.in_flight, snapshot.pending_prefill_tokens) == (3, 50)
    # The queue busy a moment ago is remembered, the others' part of it too (QUEUE_AVERAGE_S).
    decay = math.exp(-1.0 / QUEUE_AVERAGE_S)
    recent = 50 * (1 - decay) + round(1000 * (1 - decay))
    assert snapshot.recent_prefill_tokens == pytest.approx(recent)
    local.release()


async def test_crashed_gateway_counts_expire(
    redis_url: str, redis_namespace: str, closing: list[Any]
) -> None:
    # 1 s: the count must still be there between two calls however slow the machine, and gone
    # after a sleep past it (0.2 s expired between the two calls on a loaded machine).
    crashed = inflight(redis_url, redis_namespace, closing, {"e1": 4}, expiry=1.0)
    alive = inflight(redis_url, redis_namespace, closing, {}, expiry=1.0)
    assert await crashed.sync_once()
    assert await alive.sync_once()
    assert alive.remote_in_flight("e1") == 4
    await asyncio.sleep(1.2)  # the crashed one never publishes again
    assert await alive.sync_once()
    assert alive.remote_in_flight("e1") == 0


async def test_periodic_publishing_and_clean_leave(
    redis_url: str, redis_namespace: str, closing: list[Any]
) -> None:
    counts = {"e1": 1}
    publisher = SharedInFlight(
        redis_url, lambda: counts, namespace=redis_namespace, interval=0.01, timeout_ms=2000.0
    )
    reader = inflight(redis_url, redis_namespace, closing, {})
    publisher.start()
    counts["e1"] = 7

    async def until(predicate: Callable[[], bool]) -> None:
        async with asyncio.timeout(2):
            while not predicate():
                await asyncio.sleep(0.01)
                await reader.sync_once()

    await until(lambda: reader.remote_in_flight("e1") == 7)
    await publisher.aclose()
    await reader.sync_once()
    assert reader.remote_in_flight("e1") == 0


async def test_stale_remote_counts_read_as_zero(redis_namespace: str, closing: list[Any]) -> None:
    clock = ManualClock(100.0)
    shared = inflight(dead_url(), redis_namespace, closing, {"e1": 1}, clock=clock, expiry=1.0)
    shared._remote, shared._read_at = {"e1": 3}, clock.now
    assert shared.remote_in_flight("e1") == 3
    assert not await shared.sync_once()  # Redis is down: the old read stands until it is stale
    assert shared.remote_in_flight("e1") == 3
    clock.now += 1.5
    assert shared.remote_in_flight("e1") == 0 and shared.remote_counts() == {}


async def test_a_cancel_the_client_swallows_still_stops_the_caller(closing: list[Any]) -> None:
    """redis-py can swallow a cancellation that lands mid-command (the command then returns or
    fails as a connection error); a background loop cancelled then must still stop."""
    link = RedisLink(dead_url(), component="t", metrics=RedisMetrics(CollectorRegistry()),
                     timeout_ms=5_000.0)
    closing.append(link)
    started = asyncio.Event()

    async def swallowing(outcome: BaseException | None) -> int:
        started.set()
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            if outcome is not None:
                raise outcome from None
        return 1

    for outcome in (None, RedisConnectionError("lost"), RedisTimeoutError("late")):
        started.clear()
        task = asyncio.create_task(link.call("op", lambda _c, o=outcome: swallowing(o)))
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 2)


async def test_the_in_flight_script_touches_only_the_keys_it_is_given(
    redis_url: str, redis_namespace: str, closing: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every key a script touches must be in its KEYS (Redis Cluster routes a script by them):
    the others' counts, read from keys built inside the script, were never given."""
    monkeypatch.setattr(redis_state, "_INFLIGHT", declared_keys_only(redis_state._INFLIGHT))
    a = inflight(redis_url, redis_namespace, closing, {"e1": 3}, gateway_id="a")
    b = inflight(redis_url, redis_namespace, closing, {"e1": 2, "e2": 1}, gateway_id="b")
    for shared in (a, b, a):
        assert await shared.sync_once()
    assert a.remote_counts() == {"e1": 2, "e2": 1}
    assert b.remote_counts() == {"e1": 3}


async def test_a_sync_is_one_round_trip_while_no_gateway_joins(
    redis_url: str, redis_namespace: str, closing: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every worker of every gateway syncs some 13 times a second: each round trip is
    redis-py's CPU, whatever the load."""
    a = inflight(redis_url, redis_namespace, closing, {"e1": 3}, gateway_id="a")
    b = inflight(redis_url, redis_namespace, closing, {"e1": 2}, gateway_id="b")
    for shared in (a, b, a):
        assert await shared.sync_once()
    calls = 0
    real_call = a._link.call

    async def counted(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        return await real_call(*args, **kwargs)

    monkeypatch.setattr(a._link, "call", counted)
    assert await a.sync_once()
    assert (calls, a.remote_counts()) == (1, {"e1": 2})
    c = inflight(redis_url, redis_namespace, closing, {"e1": 4}, gateway_id="c")
    assert await c.sync_once()
    assert await a.sync_once()  # c joined: read again with c's key
    assert (calls, a.remote_counts()) == (3, {"e1": 6})
    await c.aclose()  # c leaves: its key read as nothing, no second call
    assert await a.sync_once()
    assert (calls, a.remote_counts()) == (4, {"e1": 2})
