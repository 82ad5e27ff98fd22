"""Withdrawing a failed attempt's record (PrefixIndex.withdraw) in every backend: the blocks the
record added go, those the endpoint held before it stay, and so do the other endpoints'."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import msgpack
import pytest
from prometheus_client import CollectorRegistry

import router.index.redis_index as redis_index
from router.index.prefix_index import InMemoryPrefixIndex
from router.index.redis_index import RedisPrefixIndex
from router.index.redis_link import RedisMetrics, Unavailable
from router.index.replicated import ReplicatedPrefixIndex, Replicator
from tests.manual_clock import ManualClock
from tests.redis_server import declared_keys_only

CHAIN = list(range(1, 21))
HELD = 8  # the head the endpoint held before the failed attempt's record


def test_memory_withdraws_only_what_the_record_added() -> None:
    index = InMemoryPrefixIndex(1000)
    index.record("a", CHAIN[:HELD])
    index.record("b", CHAIN)
    index.record("a", CHAIN)
    index.withdraw("a", CHAIN, HELD)
    assert index.match_now(CHAIN, ["a", "b"]) == {"a": HELD, "b": len(CHAIN)}
    assert index.entries("a") == HELD
    index.record("a", CHAIN)  # the chain comes back with the next record
    assert index.match_now(CHAIN, ["a"]) == {"a": len(CHAIN)}


async def test_memory_withdraws_the_pieces_of_a_long_record_still_to_come() -> None:
    """A long cold chain is touched over turns of the loop: a withdrawal before its last piece
    must not see the rest of the chain come back."""
    index = InMemoryPrefixIndex(1000, max_blocks_per_step=4)
    index.record("a", CHAIN)
    assert index.pending_pieces == 1
    index.withdraw("a", CHAIN, 0)
    for _ in range(len(CHAIN)):  # bounded: each piece is one turn
        if not index.pending_pieces:
            break
        await asyncio.sleep(0)
    assert index.pending_pieces == 0
    assert index.match_now(CHAIN, ["a"]) == {"a": 0}
    assert index.entries("a") == 0
    index.record("a", CHAIN)  # a later record of the same chain is not withdrawn
    for _ in range(len(CHAIN)):
        if not index.pending_pieces:
            break
        await asyncio.sleep(0)
    assert index.match_now(CHAIN, ["a"]) == {"a": len(CHAIN)}


async def test_memory_a_record_after_the_withdrawal_keeps_its_pieces() -> None:
    """Another request's record of the same chain, made while the withdrawn record's pieces
    are still due, is served: its own pieces must not be dropped with the withdrawn ones."""
    index = InMemoryPrefixIndex(1000, max_blocks_per_step=4)
    index.record("a", CHAIN)
    index.withdraw("a", CHAIN, 0)
    index.record("a", CHAIN)  # before the withdrawn record's next piece ran
    for _ in range(2 * len(CHAIN)):  # bounded: each piece is one turn
        if not index.pending_pieces:
            break
        await asyncio.sleep(0)
    assert index.pending_pieces == 0
    assert index.match_now(CHAIN, ["a"]) == {"a": len(CHAIN)}


@pytest.fixture
async def redis_indexes(
    redis_url: str, redis_namespace: str, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[tuple[RedisPrefixIndex, RedisPrefixIndex]]:
    """A writer (records in pieces of 4) and a reader whose local view stays empty, with every
    script held to the keys it declares (a Redis Cluster routes a script by them)."""
    for name in ("_MATCH", "_RECORD", "_FORGET", "_WITHDRAW"):
        monkeypatch.setattr(redis_index, name, declared_keys_only(getattr(redis_index, name)))

    def make(pieces: int) -> RedisPrefixIndex:
        return RedisPrefixIndex(
            redis_url,
            namespace=redis_namespace,
            timeout_ms=2000.0,
            write_timeout_ms=2000.0,
            max_blocks_per_write=pieces,
        )

    writer, reader = make(4), make(256)
    try:
        yield writer, reader
    finally:
        await writer.aclose()
        await reader.aclose()


@pytest.mark.redis
@pytest.mark.parametrize("shipped_first", [True, False], ids=["shipped", "in-one-batch"])
async def test_redis_withdraws_in_redis_too(
    redis_indexes: tuple[RedisPrefixIndex, RedisPrefixIndex], shipped_first: bool
) -> None:
    """Whether the record reached Redis before the withdrawal or ships in the same batch (in
    pieces, after the batch's pipeline), Redis ends with only what was held before."""
    writer, reader = redis_indexes
    writer.record("a", CHAIN[:HELD])
    writer.record("b", CHAIN)
    await writer.flush()
    writer.record("a", CHAIN)
    if shipped_first:
        await writer.flush()
    writer.withdraw("a", CHAIN, HELD)
    await writer.flush()
    assert writer.local.match_now(CHAIN, ["a", "b"]) == {"a": HELD, "b": len(CHAIN)}
    assert reader.local.entries("a") == 0, "the reader's answer comes from Redis alone"
    assert await reader.match(CHAIN, ["a", "b"]) == {"a": HELD, "b": len(CHAIN)}
    lru = await writer.link.client.zcard(writer._lru_prefix + "a")
    assert lru == HELD


@pytest.mark.redis
async def test_redis_withdraw_stays_after_a_record_requeued_mid_pieces(
    redis_indexes: tuple[RedisPrefixIndex, RedisPrefixIndex], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Redis away between a long record's pieces: the record goes back to the queue, and its
    withdrawal (in the same batch) must go after it, or the withdrawn blocks come back."""
    writer, reader = redis_indexes
    writer.record("a", CHAIN[:HELD])
    await writer.flush()
    real, calls = writer.link.call, 0

    async def blip(op: str, fn: Any, budget: float | None = None) -> Any:
        nonlocal calls
        calls += 1
        if calls == 2:  # the batch's pipeline went through; its record's first piece fails
            raise Unavailable("timeout")
        return await real(op, fn, budget)

    monkeypatch.setattr(writer.link, "call", blip)
    writer.record("a", CHAIN)
    writer.withdraw("a", CHAIN, HELD)
    await writer.flush()
    assert calls > 2
    assert await reader.match(CHAIN, ["a"]) == {"a": HELD}


@pytest.mark.redis
async def test_replicated_withdraws_in_every_process(redis_url: str, redis_namespace: str) -> None:
    metrics = RedisMetrics(CollectorRegistry())
    one = Replicator(redis_url, redis_namespace, metrics)
    two = Replicator(redis_url, redis_namespace, metrics)
    mine = ReplicatedPrefixIndex(InMemoryPrefixIndex(1000), one, clock=ManualClock())
    other = ReplicatedPrefixIndex(InMemoryPrefixIndex(1000), two, clock=ManualClock())
    try:
        mine.record("a", CHAIN[:HELD])
        mine.record("a", CHAIN)
        mine.withdraw("a", CHAIN, HELD)
        assert mine.local.match_now(CHAIN, ["a"]) == {"a": HELD}
        published = list(one._pending)
        assert [kind for kind, _, _ in published] == ["r", "r", "w"]
        two.apply(msgpack.packb([b"one", published]))
        assert other.local.match_now(CHAIN, ["a"]) == {"a": HELD}
        one._pending.clear()
        mine.record("a", CHAIN)  # served there after all (another request): published at once
        assert [kind for kind, _, _ in one._pending] == ["r"]
    finally:
        await one.aclose()
        await two.aclose()
