"""The replicated index and affinity: two processes' worth of stores on one real Redis."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import msgpack
import pytest
import redis.asyncio
from prometheus_client import CollectorRegistry

from router.config.model import parse_config
from router.core.errors import ConfigError
from router.index.affinity import InMemoryAffinityStore
from router.index.prefix_index import InMemoryPrefixIndex
from router.index.redis_index import pack_hashes
from router.index.redis_link import RedisMetrics, key_tag
from router.index.replicated import (
    FORGOTTEN_FOR_S,
    MAX_SENT,
    RESEND_AFTER_S,
    ReplicatedAffinityStore,
    ReplicatedPrefixIndex,
    Replicator,
    coalesced,
)
from tests.manual_clock import ManualClock

pytestmark = pytest.mark.redis
T = TypeVar("T")


class Process:
    """What one worker builds: a replicator, an index and an affinity store on it."""

    def __init__(self, url: str, namespace: str) -> None:
        self.metrics = RedisMetrics(CollectorRegistry())
        self.replicator = Replicator(url, namespace, self.metrics)
        self.index = ReplicatedPrefixIndex(InMemoryPrefixIndex(1000), self.replicator)
        self.affinity = ReplicatedAffinityStore(InMemoryAffinityStore(60, 100), self.replicator)


async def _poll(
    probe: Callable[[], Awaitable[T]], until: Callable[[T], bool], rounds: int = 400
) -> T:
    result = await probe()
    for _ in range(rounds):  # 400: 20 s, generous on a loaded machine
        if until(result):
            return result
        await asyncio.sleep(0.05)
        result = await probe()
    return result


@pytest.fixture
async def pair(redis_url: str, redis_namespace: str) -> AsyncIterator[tuple[Process, Process]]:
    a, b = Process(redis_url, redis_namespace), Process(redis_url, redis_namespace)
    for p in (a, b):
        p.replicator.start()
    # Subscriptions are in place once a published probe comes back round; published until
    # then, since a message sent before a subscription reaches nobody.
    probe = Process(redis_url, redis_namespace)
    probe.replicator.start()

    async def heard() -> bool:
        probe.affinity.set("ready", "x")
        return [await p.affinity.get("ready") for p in (a, b)] == ["x", "x"]

    assert await _poll(heard, bool)
    await probe.replicator.aclose()
    try:
        yield a, b
    finally:
        for p in (a, b):
            await p.replicator.aclose()


async def test_a_record_in_one_process_is_matched_in_the_other(
    pair: tuple[Process, Process],
) -> None:
    a, b = pair
    a.index.record("e1:8000", [11, 12, 13])
    assert await a.index.match([11, 12, 13], ["e1:8000"]) == {"e1:8000": 3}, "at once locally"
    seen = await _poll(lambda: b.index.match([11, 12, 13, 14], ["e1:8000", "e2:8000"]),
                       lambda r: r["e1:8000"] == 3)
    assert seen == {"e1:8000": 3, "e2:8000": 0}


async def test_a_session_set_in_one_process_is_found_in_the_other(
    pair: tuple[Process, Process],
) -> None:
    a, b = pair
    b.affinity.set("s1", "e2:8000")
    assert await _poll(lambda: a.affinity.get("s1"), lambda e: e is not None) == "e2:8000"
    a.affinity.set("s1", "e1:8000")  # the session moved: the later set wins everywhere
    assert await _poll(lambda: b.affinity.get("s1"), lambda e: e == "e1:8000") == "e1:8000"


async def test_a_restored_session_is_restored_in_the_other_process(
    pair: tuple[Process, Process],
) -> None:
    """Failover: every attempt of the session's request failed, and its pick is undone in
    every process (back to the previous endpoint, or to none), not just in the one that
    picked; a session another process moved on since keeps where it went."""
    a, b = pair
    a.affinity.set("s1", "e1:8000")
    a.affinity.set("s1", "failed:8000")
    a.affinity.set("s2", "failed:8000")
    b.affinity.set("s3", "failed:8000")
    assert await _poll(lambda: b.affinity.get("s2"), lambda e: e is not None) == "failed:8000"
    assert await _poll(lambda: a.affinity.get("s3"), lambda e: e is not None) == "failed:8000"
    a.affinity.restore("s1", "failed:8000", "e1:8000")
    a.affinity.restore("s2", "failed:8000", None)
    b.affinity.set("s3", "e2:8000")  # moved on in b: a's restore, arriving later, leaves it
    a.affinity.restore("s3", "failed:8000", None)
    a.affinity.set("done", "x")  # published after the restores: once b has it, it has them
    assert await _poll(lambda: b.affinity.get("done"), lambda e: e is not None) == "x"
    assert [await b.affinity.get(s) for s in ("s1", "s2", "s3")] == ["e1:8000", None, "e2:8000"]


async def test_own_batches_are_not_applied_twice(pair: tuple[Process, Process]) -> None:
    a, _ = pair
    applied: list[tuple[str, bytes]] = []
    a.replicator.on("t", lambda key, value: applied.append((key, value)))
    other = msgpack.packb([b"someone", [["t", "k", b"v"]]])
    mine = msgpack.packb([a.replicator._sender, [["t", "k", b"mine"]]])
    a.replicator.apply(mine)
    a.replicator.apply(other)
    assert applied == [("k", b"v")]


async def test_picks_made_while_a_batch_lingers_leave_in_one_publish(
    redis_url: str, redis_namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    lingers: list[asyncio.Event] = []

    async def linger(seconds: float) -> None:
        assert seconds == 0.25
        lingers.append(asyncio.Event())
        await lingers[-1].wait()

    metrics = RedisMetrics(CollectorRegistry())
    replicator = Replicator(redis_url, redis_namespace, metrics, linger=0.25, sleep=linger)
    index = ReplicatedPrefixIndex(InMemoryPrefixIndex(1000), replicator)
    published: list[int] = []
    on_the_wire = asyncio.Event()
    publish = replicator._publish

    async def counted(batch: list[tuple[str, str, bytes]]) -> None:
        published.append(len(batch))
        await on_the_wire.wait()
        await publish(batch)

    async def turns(n: int = 3) -> None:
        for _ in range(n):
            await asyncio.sleep(0)

    monkeypatch.setattr(replicator, "_publish", counted)
    replicator.start()
    try:
        for block in range(5):  # one pick a loop turn, as requests finish under load
            index.record("e1:8000", [block])
            await turns()
        assert len(lingers) == 1 and published == [], "the first pick waits for the others"
        lingers[0].set()
        await turns()
        assert published == [5]
        for block in range(5, 8):  # picks made while that batch is on the wire
            index.record("e1:8000", [block])
            await turns()
        on_the_wire.set()
        for _ in range(500):  # the first batch's real publish, bounded
            if len(lingers) == 2:
                break
            await asyncio.sleep(0.01)
        assert published == [5] and len(lingers) == 2, "they wait a linger of their own"
        lingers[1].set()
        await turns()
        assert published == [5, 3]
    finally:
        on_the_wire.set()
        for event in lingers:
            event.set()
        await replicator.aclose()


def test_replicated_needs_a_url_and_one_server() -> None:
    with pytest.raises(ConfigError, match="url: the replicated backend needs url"):
        parse_config({"prefixIndex": {"backend": "replicated"}})
    with pytest.raises(ConfigError, match="cluster: the replicated backend publishes on one"):
        parse_config(
            {"prefixIndex": {"backend": "replicated", "url": "redis://r:6379", "cluster": True}}
        )


def test_a_batch_keeps_the_last_copy_of_each_repeated_op() -> None:
    a, b, c = ("r", "e1", b"chain-a"), ("s", "session", b"e1"), ("r", "e2", b"chain-a")
    assert coalesced([a, b, a, c, a]) == [b, c, a]
    assert coalesced([a, ("s", "session", b"e2"), b]) == [a, ("s", "session", b"e2"), b]
    assert coalesced([a]) == [a] and coalesced([]) == []


async def test_a_burst_on_one_prefix_is_published_once_a_linger(
    redis_url: str, redis_namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    lingered = asyncio.Event()

    async def linger(seconds: float) -> None:
        await lingered.wait()

    replicator = Replicator(
        redis_url, redis_namespace, RedisMetrics(CollectorRegistry()), sleep=linger
    )
    index = ReplicatedPrefixIndex(InMemoryPrefixIndex(1000), replicator)
    published: list[list[tuple[str, str, bytes]]] = []
    sent = asyncio.Event()

    async def counted(batch: list[tuple[str, str, bytes]]) -> None:
        published.append(batch)
        sent.set()

    monkeypatch.setattr(replicator, "_publish", counted)
    replicator.start()
    try:
        for _ in range(6):  # sub-agents of one parent: the same chain on the same endpoint
            index.record("e1:8000", [1, 2, 3])
        index.record("e2:8000", [1, 2, 3])
        lingered.set()
        await asyncio.wait_for(sent.wait(), 10)
        keys = [(kind, key) for kind, key, _ in published[0]]
        assert keys == [("r", "e1:8000"), ("r", "e2:8000")]
    finally:
        lingered.set()
        await replicator.aclose()


def _queued(replicator: Replicator) -> list[tuple[str, str]]:
    queued = [(kind, key) for kind, key, _ in replicator._pending]
    replicator._pending.clear()
    return queued


async def test_a_chain_published_a_moment_ago_is_not_published_again(
    redis_url: str, redis_namespace: str
) -> None:
    """A shared system prompt with short questions records one chain on every request: the
    other processes hold it after the first publish."""
    clock = ManualClock()
    replicator = Replicator(redis_url, redis_namespace, RedisMetrics(CollectorRegistry()))
    index = ReplicatedPrefixIndex(InMemoryPrefixIndex(1000), replicator, clock=clock)
    try:
        for _ in range(5):
            index.record("e1:8000", [1, 2, 3])
        index.record("e2:8000", [1, 2, 3])  # another endpoint: news
        index.record("e1:8000", [1, 2, 3, 4])  # the chain grew: news
        index.record("e1:8000", [1, 2])  # a shorter chain ends elsewhere: news
        e1, e2 = ("r", "e1:8000"), ("r", "e2:8000")
        assert _queued(replicator) == [e1, e2, e1, e1]
        assert index.local.entries("e1:8000") == 4  # every record counts here all the same
        clock.now += RESEND_AFTER_S - 0.01
        index.record("e1:8000", [1, 2, 3])
        assert _queued(replicator) == []
        clock.now += 0.01  # the others' recency of it is now a window old: sent again
        index.record("e1:8000", [1, 2, 3])
        assert _queued(replicator) == [("r", "e1:8000")]
        await index.clear_endpoint("e1:8000")  # restarted: the others clear it too
        index.record("e1:8000", [1, 2, 3])
        assert _queued(replicator) == [("r", "e1:8000")]
    finally:
        await replicator.aclose()


async def test_the_chains_remembered_as_published_are_bounded(
    redis_url: str, redis_namespace: str
) -> None:
    clock = ManualClock()
    replicator = Replicator(redis_url, redis_namespace, RedisMetrics(CollectorRegistry()))
    index = ReplicatedPrefixIndex(InMemoryPrefixIndex(1000), replicator, clock=clock)
    try:
        for n in range(MAX_SENT + 10):
            index.record("e1:8000", [n])
        assert len(index._sent) == MAX_SENT
        replicator._pending.clear()
        index.record("e1:8000", [0])  # the oldest went first: published again
        assert _queued(replicator) == [("r", "e1:8000")]
        clock.now += RESEND_AFTER_S
        index.record("e1:8000", [-1])  # the stale leave with the next publish
        assert len(index._sent) == 1
    finally:
        await replicator.aclose()


async def test_a_late_record_from_another_process_does_not_bring_back_a_forgotten_endpoint(
    redis_url: str, redis_namespace: str
) -> None:
    clock = ManualClock()
    replicator = Replicator(redis_url, redis_namespace, RedisMetrics(CollectorRegistry()))
    index = ReplicatedPrefixIndex(InMemoryPrefixIndex(1000), replicator, clock=clock)
    pod = "10.0.0.5:8000"

    def late_record(hashes: list[int]) -> None:
        # Another worker that has not seen the pod leave yet still picks it.
        replicator.apply(msgpack.packb([b"other", [("r", pod, pack_hashes(hashes))]]))

    try:
        index.record(pod, [1, 2, 3])
        await index.forget_endpoint(pod)
        late_record([1, 2, 3])
        assert index.local.entries(pod) == 0
        assert await index.match([1, 2, 3], [pod]) == {pod: 0}
        index.record(pod, [7])  # picked here again: a pod at that address is in the pool
        late_record([8, 9])
        assert index.local.entries(pod) == 3
        await index.forget_endpoint(pod)
        clock.now += FORGOTTEN_FOR_S
        late_record([4])  # long after: the other worker's view is this one's again
        assert index.local.entries(pod) == 1
    finally:
        await replicator.aclose()


async def test_a_restarted_endpoint_is_cleared_and_takes_the_other_processes_records_at_once(
    redis_url: str, redis_namespace: str
) -> None:
    """Unlike a departed endpoint, a restarted one stays in every process's pool: the other
    workers' records made after the restart are applied, not held back."""
    replicator = Replicator(redis_url, redis_namespace, RedisMetrics(CollectorRegistry()))
    index = ReplicatedPrefixIndex(InMemoryPrefixIndex(1000), replicator, clock=ManualClock())
    pod = "10.0.0.5:8000"
    try:
        index.record(pod, [1, 2, 3])
        await index.clear_endpoint(pod)
        assert await index.match([1, 2, 3], [pod]) == {pod: 0}
        replicator.apply(msgpack.packb([b"other", [("r", pod, pack_hashes([4, 5]))]]))
        assert await index.match([4, 5], [pod]) == {pod: 2}
    finally:
        await replicator.aclose()


async def test_a_message_that_cannot_be_applied_does_not_stop_the_subscription(
    pair: tuple[Process, Process], redis_url: str, redis_namespace: str
) -> None:
    """A message on the channel this release cannot read (another release's format, anything
    else published there) is skipped: the process goes on applying the others' writes."""
    a, b = pair
    client = redis.asyncio.Redis.from_url(redis_url)
    try:
        channel = key_tag(redis_namespace) + ":replicate"
        for garbage in (b"\xc1", msgpack.packb([b"other"]), msgpack.packb([b"other", [["r"]]])):
            await client.publish(channel, garbage)
    finally:
        await client.aclose()
    a.affinity.set("s9", "e1:8000")
    seen = await _poll(lambda: b.affinity.get("s9"), lambda e: e is not None, rounds=100)
    assert seen == "e1:8000"
    assert b.metrics.errors.labels("replicate", "unreadable")._value.get() == 3
