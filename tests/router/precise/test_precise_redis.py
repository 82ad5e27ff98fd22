"""The precise index shared through Redis: gateway replicas that each follow the same event
streams apply every batch once, a late replica sees the full state, speculative entries are
shared and expire, and a Redis outage costs lookups nothing but their budget."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import pytest
import redis.asyncio
from prometheus_client import CollectorRegistry

from router.config.model import parse_config
from router.config.precise import PrecisePrefixConfig
from router.core.endpoints import EndpointSnapshot
from router.core.errors import ConfigError
from router.core.framework import RoutingRequest
from router.index.circuit_breaker import CircuitBreaker
from router.index.redis_link import RedisMetrics, key_tag
from router.precise import shared_index
from router.precise.event_codec import Cleared, Event, EventBatch, Removed, Stored, apply_batch
from router.precise.index import PreciseIndex, block_keys
from router.precise.routing import PreciseSettings, PreciseState, PreciseTracker
from router.precise.shared_index import RemoteMatch, SharedPreciseIndex
from router.precise.tokenizers import TokenizeInput
from tests.redis_server import FlakyProxy, declared_keys_only, delete_namespace

BS = 4
A, B = "127.0.0.1:9001", "127.0.0.1:9002"


def toks(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


class Replica:
    """One gateway replica's precise index: local, mirrored into the shared Redis view."""

    def __init__(self, url: str, namespace: str, **kwargs: Any) -> None:
        self.local = PreciseIndex(BS)
        # Semantics, not budgets (as in test_redis_index): tests about budgets pass their own.
        kwargs.setdefault("timeout_ms", 250.0)
        kwargs.setdefault("write_timeout_ms", 2000.0)
        self.shared = SharedPreciseIndex(
            self.local, url, namespace=namespace, metrics=RedisMetrics(CollectorRegistry()),
            resync_seconds=60.0, **kwargs,
        )

    def deliver(self, eid: str, seq: int, ts: float, *events: Event) -> None:
        """What EndpointSubscriber does with a batch: apply it locally, then mirror it."""
        ops: list[Any] = []
        apply_batch(self.local, eid, EventBatch(ts, list(events)), ops)
        self.shared.batch(eid, seq, ts, ops)

    async def lookup(self, keys: Sequence[int], *ids: str) -> dict[str, RemoteMatch]:
        found = await self.shared.lookup(keys, list(ids))
        assert found is not None
        return found


@asynccontextmanager
async def replicas(url: str, namespace: str, n: int, **kwargs: Any) -> AsyncIterator[list[Replica]]:
    reps = [Replica(url, namespace, **kwargs) for _ in range(n)]
    try:
        yield reps
    finally:
        for r in reps:
            await r.shared.aclose()


async def test_batches_apply_once_whichever_replica_delivers_first(
    redis_url: str, redis_namespace: str
) -> None:
    chain = toks(16)
    keys = block_keys(chain, BS)
    batches: list[list[Event]] = [
        [Stored([1, 2], None, chain[:8], BS)],
        [Stored([3, 4], 2, chain[8:], BS)],
        [Removed([4])],
    ]
    async with replicas(redis_url, redis_namespace, 3) as (first, lagging, late):
        for seq, events in enumerate(batches):
            first.deliver(A, seq, 100.0 + seq, *events)
        await first.shared.flush()
        for seq, events in enumerate(batches):  # the same stream, delivered later
            lagging.deliver(A, seq, 100.0 + seq, *events)
        await lagging.shared.flush()
        assert first.shared.statuses == {"fresh": 1, "applied": 2}
        assert lagging.shared.statuses == {"dup": 3}
        # The removal is not undone by the lagging replica's copy of the store.
        assert (await late.lookup(keys, A, B)) == {
            A: RemoteMatch(True, 3, 0), B: RemoteMatch(False, 0, 0)
        }
        # Both replicas stored block 3, yet one removal takes it away: no double counting.
        lagging.deliver(A, 3, 103.0, Removed([3]))
        await lagging.shared.flush()
        first.deliver(A, 3, 103.0, Removed([3]))
        await first.shared.flush()
        assert (await late.lookup(keys, A))[A] == RemoteMatch(True, 2, 0)
        client = redis.asyncio.Redis.from_url(redis_url)
        try:
            assert await client.hlen(key_tag(redis_namespace) + ":pm:" + A) == 2
        finally:
            await client.aclose()


async def test_a_block_stored_twice_stays_until_both_copies_are_removed(
    redis_url: str, redis_namespace: str
) -> None:
    # vLLM does not de-duplicate cached blocks: one hash may be cached in two blocks (a
    # BlockStored each), and evicting one emits a BlockRemoved while the other still hits.
    chain = toks(8)
    keys = block_keys(chain, BS)
    async with replicas(redis_url, redis_namespace, 2) as (r, reader):
        r.deliver(A, 0, 1.0, Stored([1, 2], None, chain, BS))
        r.deliver(A, 1, 2.0, Stored([2], 1, chain[4:], BS))  # a second copy of block 2
        r.deliver(A, 2, 3.0, Removed([2]))
        await r.shared.flush()
        assert (await reader.lookup(keys, A))[A] == RemoteMatch(True, 2, 0)
        r.deliver(A, 3, 4.0, Removed([2]))  # the last copy
        await r.shared.flush()
        assert (await reader.lookup(keys, A))[A] == RemoteMatch(True, 1, 0)
        # A clear forgets the copies too.
        r.deliver(A, 4, 5.0, Stored([2], 1, chain[4:], BS), Stored([2], 1, chain[4:], BS))
        r.deliver(A, 5, 6.0, Cleared(), Stored([1, 2], None, chain, BS), Removed([2]))
        await r.shared.flush()
        assert (await reader.lookup(keys, A))[A] == RemoteMatch(True, 1, 0)
        assert r.local.match(keys, [A]) == {A: 1}


class FixedTokenizer:
    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens

    async def tokenize(
        self, request: TokenizeInput, endpoints: Sequence[EndpointSnapshot]
    ) -> list[int] | None:
        return self.tokens

    async def aclose(self) -> None:
        pass


def snapshot(eid: str) -> EndpointSnapshot:
    return EndpointSnapshot(eid, f"http://{eid}", "both", 0, 0, 0.0, 0.0, 0.0, 0.0)


async def scored(tracker: PreciseTracker, serial: int) -> tuple[list[float], PreciseState]:
    state = PreciseState(TokenizeInput("completions", "m", {"prompt": "x"}))
    tracker._states[serial] = state
    request = RoutingRequest(f"r{serial}", "m", serial=serial)
    endpoints = [snapshot(A), snapshot(B)]
    await tracker.produce(request, endpoints)
    scores = tracker.scores(request, endpoints)
    assert scores is not None
    return scores, state


async def test_a_late_replica_routes_on_the_full_picture(
    redis_url: str, redis_namespace: str
) -> None:
    chain = toks(24)
    keys = block_keys(chain, BS)
    async with replicas(redis_url, redis_namespace, 2) as (warm, late):
        warm.deliver(A, 0, 1.0, Stored([1, 2, 3, 4], None, chain[:16], BS))
        await warm.shared.flush()
        # The late replica's stream starts at seq 1: block 5's parent is unknown to it, and it
        # delivers the batch first. Redis supplies the parent's key.
        late.local.set_trusted(A, False, "sequence gap 0..0; resyncing")
        late.deliver(A, 1, 2.0, Stored([5], 4, chain[16:20], BS))
        await late.shared.flush()
        warm.deliver(A, 1, 2.0, Stored([5], 4, chain[16:20], BS))
        await warm.shared.flush()
        assert late.shared.statuses == {"applied": 1} and warm.shared.statuses["dup"] == 1
        assert (await late.lookup(keys, A))[A] == RemoteMatch(True, 5, 0)
        # The late replica learnt the parents: its own index maps the next block.
        late.deliver(A, 2, 3.0, Stored([6], 5, chain[20:24], BS))
        assert late.local.stats.orphans == 1 and late.local.keys(A) == {keys[5]}
        await late.shared.flush()

        tracker = PreciseTracker(
            late.local,
            FixedTokenizer(chain),
            PreciseSettings(PrecisePrefixConfig(block_size=BS)),
            shared=late.shared,
        )
        scores, state = await scored(tracker, 1)
        assert scores == [1.0, 0.0] and state.shared_only == {A}
        # A stream that looks broken here is not vouched for by Redis either.
        late.local.set_trusted(A, False, "silent publisher", stale=True)
        scores, state = await scored(tracker, 2)
        assert scores == [0.0, 0.0] and not state.trusted


async def test_restarts_stale_deliveries_and_gaps(redis_url: str, redis_namespace: str) -> None:
    old, new = toks(8), toks(8, 1000)
    old_keys, new_keys = block_keys(old, BS), block_keys(new, BS)
    async with replicas(redis_url, redis_namespace, 3) as (one, lagging, reader):
        one.deliver(A, 0, 100.0, Stored([1], None, old[:4], BS))
        one.deliver(A, 1, 101.0, Stored([2], 1, old[4:], BS))
        # The replica restarted: its seq starts again at 0, published later.
        one.deliver(A, 0, 200.0, Stored([7], None, new[:4], BS))
        await one.shared.flush()
        assert one.shared.statuses == {"fresh": 1, "applied": 1, "restart": 1}
        found = await reader.lookup(old_keys + new_keys, A)
        assert found[A] == RemoteMatch(True, 0, 0)
        assert (await reader.lookup(new_keys, A))[A] == RemoteMatch(True, 1, 0)
        # A replica still delivering the old incarnation must not resurrect it.
        lagging.deliver(A, 1, 101.0, Stored([2], 1, old[4:], BS))
        lagging.deliver(A, 2, 102.0, Removed([1]))
        await lagging.shared.flush()
        assert lagging.shared.statuses == {"stale": 2}
        # A gap nobody filled: entries dropped, untrusted until the cache is known again.
        one.deliver(A, 5, 205.0, Stored([8], 7, new[4:], BS))
        await one.shared.flush()
        assert (await reader.lookup(new_keys, A))[A] == RemoteMatch(False, 0, 0)
        one.deliver(A, 6, 206.0, Cleared(), Stored([7, 8], None, new, BS))
        await one.shared.flush()
        assert (await reader.lookup(new_keys, A))[A] == RemoteMatch(True, 2, 0)


async def test_speculative_entries_are_shared_and_expire(
    redis_url: str, redis_namespace: str
) -> None:
    keys = block_keys(toks(20), BS)
    async with replicas(redis_url, redis_namespace, 2) as (picker, other):
        picker.shared.speculated(A, keys[:3], 0.3)
        picker.shared.speculated(A, keys, 0.3)
        await picker.shared.flush()
        found = await other.lookup(keys, A, B)
        assert found == {A: RemoteMatch(False, 0, 5), B: RemoteMatch(False, 0, 0)}
        assert found[A].held == 5
        deadline = time.monotonic() + 3.0
        while (await other.lookup(keys, A))[A].speculative and time.monotonic() < deadline:
            await other.shared.flush()
        assert (await other.lookup(keys, A))[A].speculative == 0


async def test_redis_outage_falls_back_within_budget_and_recovers(
    redis_url: str, redis_namespace: str
) -> None:
    chain = toks(8)
    keys = block_keys(chain, BS)
    proxy = FlakyProxy(redis_url)
    url = await proxy.start()
    breaker = CircuitBreaker(threshold=2, initial_seconds=0.05, max_seconds=0.2)
    try:
        async with replicas(
            url, redis_namespace, 1, timeout_ms=20.0, write_timeout_ms=100.0, breaker=breaker
        ) as (r,):
            r.deliver(A, 0, 1.0, Stored([1], None, chain[:4], BS))
            await r.shared.flush()
            assert (await r.lookup(keys, A))[A] == RemoteMatch(True, 1, 0)
            proxy.forwarding = False
            r.deliver(A, 1, 2.0, Stored([2], 1, chain[4:], BS))
            for _ in range(5):
                # The hung Redis never answers: only the 20 ms budget (then the open breaker)
                # ends a lookup. 1 s is 50x that budget, room for a loaded machine's loop lag.
                async with asyncio.timeout(1.0):
                    assert await r.shared.lookup(keys, [A]) is None
            await r.shared.flush()  # the write is given up on, not waited for
            assert r.local.keys(A) == set(keys)  # the local view stays warm meanwhile
            fallbacks = r.shared.metrics.fallbacks.labels("precise_match", "circuit_open")
            assert fallbacks._value.get() > 0
            proxy.forwarding = True
            deadline = time.monotonic() + 3.0
            while await r.shared.lookup(keys, [A]) is None:
                assert time.monotonic() < deadline
            r.deliver(A, 2, 3.0, Cleared(), Stored([1, 2], None, chain, BS))
            await r.shared.flush()
            assert (await r.lookup(keys, A))[A] == RemoteMatch(True, 2, 0)
    finally:
        await proxy.close()


async def test_purge_and_clears_leave_no_garbage(redis_url: str, redis_namespace: str) -> None:
    a_chain, b_chain = toks(400), toks(400, 5000)
    p = key_tag(redis_namespace) + ":p"
    client = redis.asyncio.Redis.from_url(redis_url)
    async with replicas(redis_url, redis_namespace, 1) as (r,):
        try:
            r.deliver(A, 0, 1.0, Stored(list(range(1, 101)), None, a_chain, BS))
            r.deliver(B, 0, 1.0, Stored(list(range(1, 101)), None, b_chain, BS))
            r.deliver(B, 1, 2.0, Cleared(), Stored(list(range(1, 101)), None, b_chain, BS))
            await r.shared.flush()
            await r.shared.forget_endpoint(A)
            await r.shared.flush()
            assert A not in r.local.endpoints()
            assert await client.exists(p + "i:" + A, p + "m:" + A, p + "k:" + A) == 0
            assert await client.scard(p + "g") == 0
            assert await client.hkeys(p + "s") == [B.encode()]  # no slot left as garbage
            assert await client.hlen(p + "h") == 100  # B's blocks only
            b_keys = block_keys(b_chain, BS)
            assert (await r.lookup(b_keys, A, B))[B] == RemoteMatch(True, 100, 0)
        finally:
            await client.aclose()


async def test_a_large_endpoints_garbage_is_reclaimed_in_bounded_steps(
    redis_url: str, redis_namespace: str
) -> None:
    """A replica holds tens of thousands of blocks. Reclaimed by a scan restarted at cursor 0,
    its map stopped yielding once the scan's first buckets were empty (Redis keeps the table
    until it is 90% empty): every gateway looped on Redis, and when the map expired its slot
    was freed with its bits still in the holders, for the next endpoint to inherit."""
    blocks, step = 30_000, 1_000
    chain = toks(blocks * BS)
    p = key_tag(redis_namespace) + ":p"
    client = redis.asyncio.Redis.from_url(redis_url)
    async with replicas(redis_url, redis_namespace, 1) as (r,):
        try:
            for i in range(blocks // step):
                hashes = list(range(i * step + 1, (i + 1) * step + 1))
                part = chain[i * step * BS : (i + 1) * step * BS]
                r.deliver(A, i, float(i), Stored(hashes, i * step or None, part, BS))
            r.deliver(B, 0, 1.0, Stored([1], None, toks(BS, 10**6), BS))
            await r.shared.flush()
            await r.shared.forget_endpoint(A)
            await asyncio.wait_for(r.shared.flush(), 30)
            assert await client.scard(p + "g") == 0
            assert await client.hlen(p + "h") == 1  # B's block only
        finally:
            await client.aclose()


async def test_a_duplicate_batch_still_refreshes_every_endpoints_keys(
    redis_url: str, redis_namespace: str
) -> None:
    """Every gateway delivers each batch and all but one lose the race: a loser's refresh
    must run too, or an endpoint idle for the keys' TTL loses them while it holds blocks."""
    p = key_tag(redis_namespace) + ":p"
    client = redis.asyncio.Redis.from_url(redis_url)
    async with replicas(redis_url, redis_namespace, 2) as (winner, loser):
        try:
            winner.deliver(B, 0, 1.0, Stored([1], None, toks(BS, 10**6), BS))
            winner.deliver(A, 0, 1.0, Stored([2], None, toks(BS), BS))
            await winner.shared.flush()
            await client.pexpire(p + "m:" + B, 5_000)  # B idle for almost the keys' TTL
            loser.shared._refreshed_at = -float("inf")  # the loser's refresh is due
            loser.deliver(A, 0, 1.0, Stored([2], None, toks(BS), BS))  # a duplicate
            await loser.shared.flush()
            assert loser.shared.statuses == {"dup": 1}
            assert await client.pttl(p + "m:" + B) > 5_000
        finally:
            await client.aclose()


async def test_the_scripts_touch_only_the_keys_they_are_given(
    redis_url: str, redis_namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every key a script touches must be in its KEYS (Redis Cluster and proxies route a script
    by them, Dragonfly refuses any other): the refresh built every endpoint's keys inside the
    script, and a clear and the garbage reclaim named garbage maps from a slot number. A
    gateway that knows an endpoint's slot no longer (another one cleared it) is told and sends
    again."""
    for name in ("APPLY", "FORGET", "GC", "MATCH", "SPECULATE"):
        monkeypatch.setattr(shared_index, name, declared_keys_only(getattr(shared_index, name)))
    chain = toks(8)
    keys = block_keys(chain, BS)
    p = key_tag(redis_namespace) + ":p"
    client = redis.asyncio.Redis.from_url(redis_url)
    async with replicas(redis_url, redis_namespace, 2) as (one, two):
        try:
            one.deliver(A, 0, 1.0, Stored([1, 2], None, chain, BS))
            one.deliver(B, 0, 1.0, Stored([1, 2], None, chain, BS))
            one.shared.speculated(B, keys, 60.0)
            await one.shared.flush()
            two.shared._refreshed_at = time.monotonic()  # no refresh due: it knows no slot
            two.deliver(A, 0, 2.0, Stored([3], None, toks(BS, 100), BS))  # A restarted
            await two.shared.flush()
            one.shared._refreshed_at = -float("inf")  # every endpoint's keys to refresh
            one.deliver(A, 5, 3.0, Stored([4], None, toks(BS, 200), BS))  # a gap: cleared
            # A clear of what the call found, then one of what it stored itself.
            one.deliver(A, 6, 4.0, Cleared(), Stored([5], None, toks(BS, 300), BS), Cleared(),
                        Stored([1], None, chain[:BS], BS))
            await one.shared.flush()
            assert one.shared.statuses == {"fresh": 2, "gap": 1, "applied": 1}
            assert two.shared.statuses == {"restart": 1}
            assert await two.lookup(keys, A, B) == {
                A: RemoteMatch(True, 1, 0), B: RemoteMatch(True, 2, 2)
            }
            await two.shared.forget_endpoint(A)
            await two.shared.flush()
            for r in (one, two):
                assert r.shared.metrics.errors.labels("precise_update", "error")._value.get() == 0
            assert await client.scard(p + "g") == 0
            assert await client.hkeys(p + "s") == [B.encode()]
            assert await client.hlen(p + "h") == 2  # B's blocks only
        finally:
            await client.aclose()


async def test_a_redis_that_lost_everything_is_filled_again_by_the_next_batches(
    redis_url: str, redis_namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Redis restarted without persistence has no slots, garbage or meta left: the slots and
    garbage maps a gateway learned before name nothing now, and each endpoint's next batch
    starts it afresh, with no clear from the gateways."""
    for name in ("APPLY", "FORGET", "GC"):
        monkeypatch.setattr(shared_index, name, declared_keys_only(getattr(shared_index, name)))
    chain = toks(8)
    keys = block_keys(chain, BS)
    async with replicas(redis_url, redis_namespace, 2) as (r, reader):
        r.deliver(B, 0, 1.0, Stored([9], None, toks(BS, 500), BS))
        r.deliver(A, 0, 1.0, Stored([1, 2], None, chain, BS))
        r.deliver(A, 1, 2.0, Cleared(), Stored([1, 2], None, chain, BS))
        await r.shared.flush()
        await delete_namespace(redis_url, redis_namespace)  # Redis restarted empty
        r.deliver(A, 2, 3.0, Stored([3], None, toks(BS, 700), BS))
        r.deliver(A, 3, 4.0, Cleared(), Stored([1], None, chain[:BS], BS))
        await r.shared.flush()
        assert r.shared.statuses == {"fresh": 3, "applied": 2}
        assert r.shared.metrics.errors.labels("precise_update", "error")._value.get() == 0
        assert (await reader.lookup(keys, A, B)) == {
            A: RemoteMatch(True, 1, 0), B: RemoteMatch(False, 0, 0)
        }


async def test_an_endpoint_no_gateway_applied_for_the_ttl_is_purged_by_the_refresh(
    redis_url: str, redis_namespace: str
) -> None:
    """An endpoint that left while no gateway watched it was never purged: the refresh kept its
    map and meta alive for as long as any gateway wrote. One whose events come in now is kept,
    however long it was silent."""
    p = key_tag(redis_namespace) + ":p"
    client = redis.asyncio.Redis.from_url(redis_url)
    async with replicas(redis_url, redis_namespace, 2) as (r, later):
        try:
            r.deliver(A, 0, 1.0, Stored([1, 2], None, toks(8), BS))
            r.deliver(B, 0, 1.0, Stored([3], None, toks(BS, 500), BS))
            await r.shared.flush()
            for eid in (A, B):
                await client.hset(p + "i:" + eid, "at", 0)  # no batch applied for the TTL
            later.deliver(B, 1, 2.0, Stored([4], None, toks(BS, 900), BS))  # its first ship
            await later.shared.flush()
            assert await client.hkeys(p + "s") == [B.encode()]
            assert await client.exists(p + "i:" + A, p + "m:" + A) == 0
            assert await client.hlen(p + "h") == 2  # B's blocks only
        finally:
            await client.aclose()


async def test_bytes_per_entry(redis_url: str, redis_namespace: str) -> None:
    """The memory figures in docs/benchmarks/redis-index.md (run with -s to see them)."""
    n, step = 20_000, 500
    chain = toks(n * BS)
    p = key_tag(redis_namespace) + ":p"
    async with replicas(redis_url, redis_namespace, 1) as (r,):
        for i in range(n // step):
            parent = i * step if i else None
            hashes = list(range(i * step + 1, (i + 1) * step + 1))
            part = chain[i * step * BS : (i + 1) * step * BS]
            r.deliver(A, i, float(i), Stored(hashes, parent, part, BS))
        await r.shared.flush()
        assert r.shared.statuses["applied"] == n // step - 1
        client = redis.asyncio.Redis.from_url(redis_url)
        try:
            per_map = await client.memory_usage(p + "m:" + A) / n
            per_holder = await client.memory_usage(p + "h") / n
        finally:
            await client.aclose()
    print(f"\nprecise index in Redis: {per_map:.0f} B per (endpoint, block) in the map, "
          f"{per_holder:.0f} B per block in the holder hash")
    assert per_map < 150 and per_holder < 100


@pytest.mark.parametrize(
    ("index", "message"),
    [
        ({"backend": "redis"}, r"precisePrefix\.index\.url: the redis backend"),
        ({"backend": "disk"}, "precisePrefix.index.backend"),
        ({"bogus": 1}, "precisePrefix.index.bogus: unknown key"),
        ({"timeoutMs": 0}, "precisePrefix.index.timeoutMs"),
        ({"url": "http://x"}, r"precisePrefix\.index\.url: must be"),
        ({"namespace": "a{b}"}, r"precisePrefix\.index\.namespace: must"),
    ],
)
def test_config_rejects_bad_index_settings(index: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config({"precisePrefix": {"index": index}})


def test_config_index_defaults_to_memory() -> None:
    cfg = parse_config({"precisePrefix": {"index": {"backend": "redis", "url": "redis://h:1/0",
                                                    "timeoutMs": 3}}})
    assert cfg.precise_prefix.index.timeout_ms == 3.0
    assert parse_config({}).precise_prefix.index.backend == "memory"
