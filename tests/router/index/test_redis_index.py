"""The Redis-backed prefix index against a real Redis: same answers as the in-memory index,
shared between gateways, bounded, and fail-open when Redis is slow or gone."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import redis.asyncio
from prometheus_client import CollectorRegistry

import router.index.redis_index as redis_index
from router.index.circuit_breaker import CircuitBreaker
from router.index.prefix_index import InMemoryPrefixIndex, PrefixIndex
from router.index.redis_index import RedisPrefixIndex, pack_hashes
from router.index.redis_link import LuaScript, Unavailable, eval_script, key_tag
from tests.redis_server import FlakyProxy, declared_keys_only

pytestmark = pytest.mark.redis

Factory = Callable[..., RedisPrefixIndex]

TABLE = [
    ([], [1, 2, 3], {"a": 0, "b": 0}),
    ([("a", [1, 2, 3])], [1, 2, 3], {"a": 3, "b": 0}),
    ([("a", [1, 2, 3])], [1, 2, 3, 4, 5], {"a": 3, "b": 0}),
    ([("a", [1, 2]), ("b", [1, 2, 3, 4])], [1, 2, 3, 4], {"a": 2, "b": 4}),
    ([("a", [1, 2, 3])], [9, 2, 3], {"a": 0, "b": 0}),
    ([("a", [1, 2, 3]), ("b", [1])], [], {"a": 0, "b": 0}),
    ([("a", [1, 3])], [1, 2, 3], {"a": 1, "b": 0}),
    ([("a", [1, 2, 3]), ("b", [1, 2, 3])], [1, 2, 3], {"a": 3, "b": 3}),
    ([("a", [1, 2, 3]), ("b", [1, 2])], [1, 2, 3], {"a": 3, "b": 2}),
    ([("c", [1, 2, 3])], [1, 2, 3], {"a": 0, "b": 0}),
    ([("a", [2**64 - 1, 0, 7])], [2**64 - 1, 0, 7], {"a": 3, "b": 0}),
]


@pytest.fixture
async def make_index(redis_url: str, redis_namespace: str) -> AsyncIterator[Factory]:
    """Builds indexes on the test's namespace (or another URL) and closes them all afterwards."""
    made: list[RedisPrefixIndex] = []

    def make(url: str | None = None, **kwargs: Any) -> RedisPrefixIndex:
        kwargs.setdefault("namespace", redis_namespace)
        # Semantics tests must not depend on the machine's load: a generous budget unless the
        # test is about the budget itself (those pass their own timeout_ms).
        kwargs.setdefault("timeout_ms", 2000.0)
        kwargs.setdefault("write_timeout_ms", 2000.0)
        index = RedisPrefixIndex(url or redis_url, **kwargs)
        made.append(index)
        return index

    yield make
    for index in made:
        await index.aclose()


async def remote_view(make: Factory, writer: RedisPrefixIndex, **kwargs: Any) -> RedisPrefixIndex:
    """A second gateway with an empty local index: its answers can only come from Redis."""
    await writer.flush()
    return make(**kwargs)


@pytest.mark.parametrize(("records", "query", "expected"), TABLE)
@pytest.mark.parametrize("backend", ["memory", "redis", "redis-remote"])
async def test_match_table_same_as_memory(
    make_index: Factory,
    backend: str,
    records: list[tuple[str, list[int]]],
    query: list[int],
    expected: dict[str, int],
) -> None:
    if backend != "memory" and (records == [("a", [1, 3])] or query == [9, 2, 3]):
        # Real block hashes chain: block i's hash stands for blocks 0..i, so what an endpoint
        # holds of a chain is a prefix of it, and Redis may bisect. These rows are not chains.
        pytest.skip("not a chain: Redis bisects, exact for the prefix-closed sets chains make")
    writer: PrefixIndex = InMemoryPrefixIndex() if backend == "memory" else make_index()
    for endpoint, hashes in records:
        writer.record(endpoint, hashes)
    reader = writer
    if backend == "redis-remote":
        assert isinstance(writer, RedisPrefixIndex)
        reader = await remote_view(make_index, writer)
    assert await reader.match(query, ["a", "b"]) == expected


async def test_capacity_evicts_tail_first(make_index: Factory) -> None:
    memory = InMemoryPrefixIndex(default_capacity=4)
    writer = make_index(default_capacity=4)
    for index in (memory, writer):
        index.record("a", [1, 2, 3])
        index.record("a", [4, 5, 6])
    reader = await remote_view(make_index, writer)
    for index in (memory, writer, reader):
        assert await index.match([1, 2, 3], ["a"]) == {"a": 1}
        assert await index.match([4, 5, 6], ["a"]) == {"a": 3}


async def test_set_capacity_trims_in_redis(make_index: Factory) -> None:
    writer = make_index()
    writer.record("a", list(range(1, 11)))
    writer.set_capacity("a", 3)
    reader = await remote_view(make_index, writer)
    assert await reader.match(list(range(1, 11)), ["a"]) == {"a": 3}
    client = writer.link.client
    assert await client.zcard(key_tag(reader_ns(writer)) + ":l:a") == 3


async def test_a_large_shrink_trims_in_bounded_scripts(make_index: Factory) -> None:
    """A script runs alone on the server: a shrink from thousands of entries at once held
    every gateway's lookups past their budgets."""
    writer = make_index(max_blocks_per_write=8)
    for start in range(0, 100, 8):
        writer.record("a", list(range(1, start + 9)))
    await writer.flush()
    client = writer.link.client
    lru = key_tag(reader_ns(writer)) + ":l:a"
    assert await client.zcard(lru) == 104
    sizes: list[int] = []
    real_call = writer.link.call

    async def watched(op: str, fn: Any, budget: float | None = None) -> Any:
        result = await real_call(op, fn, budget)
        sizes.append(await client.zcard(lru))
        return result

    writer.link.call = watched  # type: ignore[method-assign]
    writer.set_capacity("a", 3)
    await writer.flush()
    assert sizes[-1] == 3
    assert all(a - b <= 8 for a, b in zip([104, *sizes], sizes, strict=False))
    reader = await remote_view(make_index, writer)
    assert await reader.match(list(range(1, 4)), ["a"]) == {"a": 3}


async def test_a_shrink_holds_for_a_long_record_shipped_in_pieces_beside_it(
    make_index: Factory,
) -> None:
    writer = make_index(max_blocks_per_write=4)
    writer.record("a", list(range(1, 41)))  # ten pieces, touched after the batch's trim
    writer.set_capacity("a", 5)
    await writer.flush()
    assert writer.local.entries("a") == 5
    assert await writer.link.client.zcard(key_tag(reader_ns(writer)) + ":l:a") == 5


def reader_ns(index: RedisPrefixIndex) -> str:
    return index._holders[len("{pg:") : index._holders.index("}")]


async def test_random_operations_match_memory(make_index: Factory) -> None:
    """Random records, capacity changes and purges: Redis answers like the in-memory index."""
    rng = random.Random(7)
    memory = InMemoryPrefixIndex(default_capacity=12)
    writer = make_index(default_capacity=12, forget_chunk=3)
    reader = make_index(default_capacity=12)
    endpoints = [f"10.0.0.{i}:8000" for i in range(10)]
    for step in range(150):
        roll = rng.random()
        endpoint = rng.choice(endpoints)
        if roll < 0.8:
            stem = rng.randrange(4)
            chain = [stem * 100 + i for i in range(rng.randrange(1, 9))]
            memory.record(endpoint, chain)
            writer.record(endpoint, chain)
        elif roll < 0.9:
            blocks = rng.randrange(2, 16)
            memory.set_capacity(endpoint, blocks)
            writer.set_capacity(endpoint, blocks)
        else:
            await memory.forget_endpoint(endpoint)
            await writer.forget_endpoint(endpoint)
        await writer.flush()
        query = [rng.randrange(4) * 100 + i for i in range(8)]
        query = [query[0] + i for i in range(8)]  # a chain: one stem, as real hashes are
        candidates = rng.sample(endpoints, 5)
        expected = await memory.match(query, candidates)
        assert await reader.match(query, candidates) == expected, step
        assert reader.local.entries(endpoint) == 0


async def test_forget_endpoint_purges_in_chunks_and_frees_the_slot(make_index: Factory) -> None:
    writer = make_index(forget_chunk=2)
    writer.record("a", list(range(1, 8)))
    writer.record("b", [1, 2])
    await writer.flush()
    await writer.forget_endpoint("a")
    await writer.flush()
    client = writer.link.client
    assert await client.hgetall(writer._slots) == {b"b": b"1"}
    assert await client.hlen(writer._holders) == 2
    # The freed slot is reused; no stale bits may leak to its new owner.
    writer.record("c", [50])
    reader = await remote_view(make_index, writer)
    assert await reader.match(list(range(1, 8)), ["a", "b", "c"]) == {"a": 0, "b": 2, "c": 0}
    assert await client.hget(writer._slots, "c") == b"0"


async def test_a_purge_in_chunks_ends_before_what_was_recorded_after_it(
    make_index: Factory,
) -> None:
    writer = make_index(forget_chunk=10)
    writer.record("10.0.0.5:8000", list(range(1, 101)))  # a pod that leaves
    await writer.flush()
    await writer.forget_endpoint("10.0.0.5:8000")
    writer.record("10.0.0.5:8000", [1001, 1002, 1003])  # a new pod at the same address
    await writer.flush()
    client = writer.link.client
    assert await client.zcard(key_tag(reader_ns(writer)) + ":l:10.0.0.5:8000") == 3
    reader = await remote_view(make_index, writer)
    assert await reader.match([1001, 1002, 1003], ["10.0.0.5:8000"]) == {"10.0.0.5:8000": 3}


@pytest.mark.parametrize("chunk", [1000, 2], ids=["one script", "in chunks"])
async def test_a_purge_that_meets_a_redis_failure_is_finished_later(
    make_index: Factory, chunk: int
) -> None:
    """Nothing else removes a purged endpoint's entries (and a refresh keeps renewing them):
    a purge waits for Redis, it is never dropped like a record."""
    writer = make_index(forget_chunk=chunk)
    writer.record("a", list(range(1, 8)))
    writer.record("b", [1, 2])
    await writer.flush()
    real_call = writer.link.call
    failures = {"first": 1 if chunk > 2 else 0, "rest": 1 if chunk == 2 else 0}
    calls = 0

    async def flaky(op: str, fn: Any, budget: float | None = None) -> Any:
        nonlocal calls
        calls += 1
        which = "first" if calls == 1 else "rest"
        if failures[which]:
            failures[which] -= 1
            raise redis_index.Unavailable("timeout")  # a failover's blip
        return await real_call(op, fn, budget)

    writer.link.call = flaky  # type: ignore[method-assign]
    await writer.forget_endpoint("a")
    await writer.flush()
    client = writer.link.client
    assert await client.hgetall(writer._slots) == {b"b": b"1"}
    assert await client.hlen(writer._holders) == 2
    reader = await remote_view(make_index, writer)
    assert await reader.match(list(range(1, 8)), ["a", "b"]) == {"a": 0, "b": 2}


@pytest.mark.parametrize("first", ["a long record", "a purge"])
async def test_a_refresh_marked_done_has_run(make_index: Factory, first: str) -> None:
    """Every endpoint's keys are kept alive while any gateway writes: a refresh marked done
    that did not run (a long record's first piece returns early; a purge refreshes nothing)
    let an idle endpoint's LRU key expire while its holder bits stayed."""
    writer = make_index()
    writer.record("idle", list(range(1, 101)))
    writer.record("gone", [7])
    await writer.flush()
    client = writer.link.client
    lru = writer._lru_prefix + "idle"
    await client.pexpire(lru, 5_000)  # no traffic of its own for almost the key's TTL
    writer._refreshed_at = -float("inf")  # the refresh is due
    if first == "a purge":
        await writer.forget_endpoint("gone")
        writer.record("busy", [555])
    else:
        writer.record("busy", list(range(100_000, 100_600)))  # cold: shipped in pieces
    await writer.flush()
    assert writer._refreshed_at != -float("inf")
    assert await client.pttl(lru) > 5_000


async def test_two_gateways_share_what_they_learn(make_index: Factory) -> None:
    one, two = make_index(), make_index()
    one.record("a", [1, 2, 3])
    two.record("b", [1, 2])
    await one.flush()
    await two.flush()
    for index in (one, two):
        assert await index.match([1, 2, 3], ["a", "b"]) == {"a": 3, "b": 2}


async def test_many_endpoints_and_long_chains(make_index: Factory) -> None:
    writer = make_index()
    rng = random.Random(1)
    chain = [rng.getrandbits(64) for _ in range(3000)]
    for i in range(70):  # more endpoints than one bitmap byte or a 64-bit mask holds
        writer.record(f"e{i}", chain[: 40 * (i + 1)])
    reader = await remote_view(make_index, writer)
    ids = [f"e{i}" for i in range(70)]
    assert await reader.match(chain, ids) == {f"e{i}": 40 * (i + 1) for i in range(70)}


async def test_partitions_do_not_see_each_other(make_index: Factory) -> None:
    one, two = make_index(partition="model-a"), make_index(partition="model-b")
    one.record("a", [1, 2])
    await one.flush()
    assert await two.match([1, 2], ["a"]) == {"a": 0}
    assert await make_index(partition="model-a").match([1, 2], ["a"]) == {"a": 2}


def test_key_tag_rejects_braces() -> None:
    assert key_tag("pool") == "{pg:pool}"
    assert key_tag("pool", "m").startswith("{pg:pool:")
    with pytest.raises(ValueError):
        key_tag("a}b")


async def test_aclose_flushes_pending_updates(make_index: Factory) -> None:
    writer = make_index()
    writer.record("a", [1, 2])
    await writer.aclose()
    assert await make_index().match([1, 2], ["a"]) == {"a": 2}


async def test_metrics_count_lookups_and_hits(make_index: Factory) -> None:
    registry = CollectorRegistry()
    index = make_index(registry=registry)
    index.record("a", [1])
    await index.match([1], ["a"])
    await index.match([2], ["a"])
    assert registry.get_sample_value("prefixgate_index_lookups_total") == 2
    assert registry.get_sample_value("prefixgate_index_lookup_hits_total") == 1
    assert registry.get_sample_value("prefixgate_index_lookup_seconds_count") == 2


async def test_eval_falls_back_when_the_script_is_not_cached(redis_url: str) -> None:
    client = redis.asyncio.Redis.from_url(redis_url)
    try:
        script = LuaScript(f"-- {uuid.uuid4().hex}\nreturn ARGV[1]")
        assert await eval_script(client, script, [], ["x"]) == b"x"
        assert await client.evalsha(script.sha, 0, "y") == b"y"
    finally:
        await client.aclose()


async def test_update_pipeline_loads_a_missing_script(
    make_index: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    fresh = LuaScript(redis_index._RECORD.source + f"\n-- {uuid.uuid4().hex}")
    monkeypatch.setattr(redis_index, "_RECORD", fresh)
    writer = make_index()
    writer.record("a", [1, 2])
    reader = await remote_view(make_index, writer)
    assert await reader.match([1, 2], ["a"]) == {"a": 2}


def test_record_without_a_running_loop_stays_local() -> None:
    index = RedisPrefixIndex("redis://127.0.0.1:1/0")
    index.record("a", [1, 2])
    assert index.local.match_now([1, 2], ["a"]) == {"a": 2}
    assert pack_hashes([1]) == b"\x01" + b"\x00" * 7


# --- fail-open -------------------------------------------------------------------------------


@pytest.fixture
async def proxy(redis_url: str) -> AsyncIterator[FlakyProxy]:
    flaky = FlakyProxy(redis_url)
    yield flaky
    flaky.forwarding = True
    await flaky.close()


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


async def test_dead_redis_falls_back_to_local(make_index: Factory) -> None:
    registry = CollectorRegistry()
    index = make_index(url=f"redis://127.0.0.1:{free_port()}/0", registry=registry)
    index.record("a", [1, 2, 3])
    for _ in range(5):
        assert await index.match([1, 2, 3], ["a", "b"]) == {"a": 3, "b": 0}
    errors = registry.get_sample_value(
        "prefixgate_redis_errors_total", {"op": "index_match", "kind": "error"}
    )
    assert errors is not None and errors >= 1
    skipped = registry.get_sample_value(
        "prefixgate_redis_fallbacks_total", {"op": "index_match", "reason": "circuit_open"}
    )
    assert skipped is not None and skipped >= 1
    await index.flush()  # the update is given up on, not stuck
    dropped = registry.get_sample_value(
        "prefixgate_redis_dropped_updates_total", {"op": "index_update", "reason": "error"}
    )
    assert dropped == 1


async def test_hung_redis_costs_one_budget_then_nothing(
    make_index: Factory, proxy: FlakyProxy
) -> None:
    registry = CollectorRegistry()
    url = await proxy.start()
    # The breaker's clock stands still: a loaded machine's stall must not half-open it midway.
    breaker = CircuitBreaker(2, 0.05, clock=lambda: 0.0)
    index = make_index(url=url, registry=registry, timeout_ms=20, breaker=breaker)
    index.record("a", [1, 2])
    await index.flush()
    proxy.forwarding = False
    worst = 0.0
    for _ in range(20):
        start = time.perf_counter()
        assert await index.match([1, 2], ["a"]) == {"a": 2}
        worst = max(worst, time.perf_counter() - start)
    # The hung Redis never answers: only the 20 ms budget (then the open breaker) ends a
    # match. 1 s is 50x that budget, room for a loaded machine's loop lag.
    assert worst < 1.0
    timeouts = registry.get_sample_value(
        "prefixgate_redis_errors_total", {"op": "index_match", "kind": "timeout"}
    )
    assert timeouts == 2  # the open breaker stops the rest
    assert registry.get_sample_value("prefixgate_redis_circuit_open", {"component": "index"}) == 1


async def test_recovers_when_redis_returns(make_index: Factory, proxy: FlakyProxy) -> None:
    registry = CollectorRegistry()
    url = await proxy.start()
    index = make_index(url=url, registry=registry, timeout_ms=20, breaker=CircuitBreaker(1, 0.05))
    proxy.forwarding = False
    assert await index.match([1, 2], ["a"]) == {"a": 0}
    other = make_index()
    other.record("a", [1, 2])
    await other.flush()
    proxy.forwarding = True
    deadline = time.monotonic() + 3
    while await index.match([1, 2], ["a"]) != {"a": 2}:
        assert time.monotonic() < deadline, "did not recover"
        await asyncio.sleep(0.02)
    assert registry.get_sample_value("prefixgate_redis_circuit_open", {"component": "index"}) == 0
    index.record("b", [7])  # and updates flow again
    await index.flush()
    assert await other.match([7], ["b"]) == {"b": 1}


async def test_burst_while_redis_hangs_is_bounded(make_index: Factory, proxy: FlakyProxy) -> None:
    registry = CollectorRegistry()
    url = await proxy.start()
    proxy.forwarding = False
    index = make_index(url=url, registry=registry, max_pending=4, write_timeout_ms=20)
    for i in range(20):
        index.record("a", [i, i + 1000])
    assert len(index._queue) == 4
    dropped = registry.get_sample_value(
        "prefixgate_redis_dropped_updates_total", {"op": "index_update", "reason": "overflow"}
    )
    assert dropped == 16
    assert await index.match([19, 1019], ["a"]) == {"a": 2}
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(1):
            await index.flush()
    assert len(index._queue) == 0


async def test_branching_chains_under_pressure_match_memory(make_index: Factory) -> None:
    """Sessions that grow turn by turn and fork sub-agents off a shared head, over capacity:
    Redis scores, touches and evicts exactly as the in-memory index does."""
    rng = random.Random(11)
    memory = InMemoryPrefixIndex(default_capacity=60)
    writer = make_index(default_capacity=60)
    chains: list[list[int]] = [[1, 2, 3, 4]]
    fresh = 1000
    for step in range(120):
        endpoint = f"e{rng.randrange(3)}"
        base = rng.choice(chains)
        cut = rng.randrange(1, len(base) + 1)
        grown = [*base[:cut], *range(fresh, fresh + rng.randrange(1, 6))]
        fresh += 10
        chains.append(grown)
        memory.record(endpoint, grown)
        writer.record(endpoint, grown)
        if step % 10 == 9:
            await writer.flush()
            reader = make_index(default_capacity=60)
            for query in rng.sample(chains, 8):
                ids = ["e0", "e1", "e2"]
                assert await reader.match(query, ids) == memory.match_now(query, ids), step
    await writer.flush()
    client = writer.link.client
    for e in ("e0", "e1", "e2"):
        remote = dict(await client.zrange(writer._lru_prefix + e, 0, -1, withscores=True))
        local = memory._lru[e].scores
        assert {int.from_bytes(k, "little"): v for k, v in remote.items()} == local


async def test_pieces_of_a_chain_longer_than_the_fresh_window_score_as_in_memory(
    make_index: Factory,
) -> None:
    """Each piece is judged against the fresh bound its record began with, in Redis as in
    memory: every block is touched once, and both indexes end with the same scores."""
    memory = InMemoryPrefixIndex(default_capacity=64, max_blocks_per_step=4)  # window: 16
    writer = make_index(default_capacity=64, max_blocks_per_write=4)
    head = list(range(1, 9))
    for chain in (head, list(range(100, 140)), [*head, *range(200, 230)], list(range(1, 90))):
        memory.record("a", chain)
        writer.record("a", chain)
        for _ in range(30):
            await asyncio.sleep(0)
        assert memory.pending_pieces == 0
        await writer.flush()
    client = writer.link.client
    remote = dict(await client.zrange(writer._lru_prefix + "a", 0, -1, withscores=True))
    assert {int.from_bytes(k, "little"): v for k, v in remote.items()} == memory._lru["a"].scores
    clock = float(await client.hget(writer._clocks, "a"))
    assert clock == memory._lru["a"].clock == 8 + 40 + 38 + 64, "each record's blocks once"


async def test_a_long_cold_chain_is_touched_in_pieces(make_index: Factory) -> None:
    """No script touches more than max_blocks_per_write blocks; the pieces add up to the whole
    chain, which still evicts from its tail."""
    writer = make_index(default_capacity=100, max_blocks_per_write=4)
    chain = list(range(1, 11))
    writer.record("a", chain)
    writer.record("a", [*chain, 11, 12])  # the next turn: within the limit, one call
    reader = await remote_view(make_index, writer)
    assert await reader.match([*chain, 11, 12], ["a"]) == {"a": 12}
    scores = await writer.link.client.zrange(writer._lru_prefix + "a", 0, -1, withscores=True)
    order = [int.from_bytes(member, "little") for member, _ in scores]
    assert order == list(range(12, 0, -1)), "lowest score first: the chain's tail"
    assert dict(scores)[(5).to_bytes(8, "little")] % 1, "block 5 came in the second piece"
    writer.set_capacity("a", 12)
    writer.record("a", [100, 101, 102])  # over capacity: the old chain's tail goes
    reader = await remote_view(make_index, writer)
    assert await reader.match([*chain, 11, 12], ["a"]) == {"a": 9}


def fail_call(index: RedisPrefixIndex, nth: int) -> Callable[[], int]:
    """Make the index's ``nth`` Redis call from now on fail as a blip would (Unavailable);
    returns how many calls it has made since."""
    real_call = index.link.call
    calls = 0

    async def flaky(op: str, fn: Any, budget: float | None = None) -> Any:
        nonlocal calls
        calls += 1
        if calls == nth:
            raise Unavailable("timeout")
        return await real_call(op, fn, budget)

    index.link.call = flaky  # type: ignore[method-assign]
    return lambda: calls


async def test_a_long_record_that_meets_a_redis_failure_keeps_its_capacity(
    make_index: Factory,
) -> None:
    """A long record whose pieces meet a blip goes back to the queue, finished when Redis is
    back: with the capacity it was queued with, not 0, which trimmed the endpoint's whole LRU
    in Redis (every entry past a capacity of 0 evicted)."""
    writer = make_index(default_capacity=100, max_blocks_per_write=4)
    writer.record("a", [1, 2, 3])
    await writer.flush()
    fail_call(writer, 2)  # the first piece, after the pipeline that found the record long
    chain = list(range(100, 120))
    writer.record("a", chain)
    await writer.flush()
    assert await writer.link.client.zcard(writer._lru_prefix + "a") == 23
    reader = await remote_view(make_index, writer)
    assert await reader.match([1, 2, 3], ["a"]) == {"a": 3}
    assert await reader.match(chain, ["a"]) == {"a": 20}


@pytest.mark.parametrize("interruption", ["a blip", "its rounds used up"])
async def test_a_purge_interrupted_midway_still_ends_before_what_was_recorded_after_it(
    make_index: Factory, monkeypatch: pytest.MonkeyPatch, interruption: str
) -> None:
    """A purge that cannot finish in one go (Redis away between its chunks, or its rounds for
    this batch used up) goes on before the records queued after it: the new pod at the same
    address keeps what it recorded."""
    writer = make_index(forget_chunk=2)
    writer.record("10.0.0.5:8000", list(range(1, 21)))  # a pod that leaves
    await writer.flush()
    if interruption == "its rounds used up":
        monkeypatch.setattr(redis_index, "_FORGET_ROUNDS", 2)
    else:
        fail_call(writer, 3)  # the purge's second chunk after its first run
    await writer.forget_endpoint("10.0.0.5:8000")
    writer.record("10.0.0.5:8000", [1001, 1002, 1003])  # a new pod at the same address
    await writer.flush()
    client = writer.link.client
    assert await client.zcard(writer._lru_prefix + "10.0.0.5:8000") == 3
    reader = await remote_view(make_index, writer)
    assert await reader.match([1001, 1002, 1003], ["10.0.0.5:8000"]) == {"10.0.0.5:8000": 3}
    assert await reader.match(list(range(1, 21)), ["10.0.0.5:8000"]) == {"10.0.0.5:8000": 0}


async def test_the_index_scripts_touch_only_the_keys_they_are_given(
    make_index: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every key a script touches must be in its KEYS (Redis Cluster routes a script by them):
    a refresh that built every endpoint's LRU key inside the script touched keys it was never
    given."""
    for name in ("_MATCH", "_RECORD", "_FORGET"):
        monkeypatch.setattr(redis_index, name, declared_keys_only(getattr(redis_index, name)))
    registry = CollectorRegistry()
    writer = make_index(registry=registry, forget_chunk=2, max_blocks_per_write=4)
    writer.record("a", [1, 2, 3])
    writer.record("b", [1, 2])
    writer.record("gone", [5, 6, 7])
    await writer.flush()
    writer._refreshed_at = -float("inf")  # the refresh of every endpoint's keys is due
    writer.record("a", list(range(1, 12)))  # past max_blocks_per_write: in pieces
    writer.set_capacity("b", 1)
    await writer.forget_endpoint("gone")
    await writer.flush()
    assert registry.get_sample_value(
        "prefixgate_redis_errors_total", {"op": "index_update", "kind": "error"}
    ) is None
    reader = await remote_view(make_index, writer, registry=CollectorRegistry())
    ids = ["a", "b", "gone"]
    assert await reader.match(list(range(1, 12)), ids) == {"a": 11, "b": 1, "gone": 0}
    assert reader.metrics.fallbacks.labels("index_match", "error")._value.get() == 0


async def test_an_endpoint_no_gateway_recorded_for_the_ttl_is_purged_by_the_refresh(
    make_index: Factory,
) -> None:
    """An endpoint that left while no gateway watched it was never purged: the refresh kept
    its keys alive for as long as any gateway wrote, and a replica given its address later
    was credited with its blocks. One recorded now is kept, however long it was away."""
    writer = make_index()
    writer.record("10.0.0.5:8000", list(range(1, 11)))  # leaves while no gateway watches
    writer.record("10.0.0.6:8000", list(range(1, 6)))
    await writer.flush()
    client = writer.link.client
    last_records = writer._slots[: -len(":s")] + ":t"
    for endpoint_id in ("10.0.0.5:8000", "10.0.0.6:8000"):
        await client.hset(last_records, endpoint_id, 0)  # none recorded them for the TTL
    later = make_index()  # a gateway started since: its first record refreshes every key
    later.record("10.0.0.6:8000", [100])
    await later.flush()
    assert await client.hkeys(writer._slots) == [b"10.0.0.6:8000"]
    assert await client.exists(writer._lru_prefix + "10.0.0.5:8000") == 0
    reader = await remote_view(make_index, later)
    assert await reader.match(list(range(1, 11)), ["10.0.0.5:8000", "10.0.0.6:8000"]) == {
        "10.0.0.5:8000": 0, "10.0.0.6:8000": 5
    }


async def test_a_purge_already_done_is_not_run_again_after_the_records_that_followed_it(
    make_index: Factory,
) -> None:
    """A batch whose later round trip fails puts its purges back, the ones done in its earlier
    round trips too: run again, such a purge took what a new pod at the same address had
    recorded after it."""
    writer = make_index()
    writer.record("10.0.0.5:8000", list(range(1, 11)))  # a pod that leaves
    writer.record("10.0.0.6:8000", list(range(11, 21)))  # another one
    await writer.flush()
    calls = fail_call(writer, 3)  # the batch's third round trip: its last records
    await writer.forget_endpoint("10.0.0.5:8000")
    writer.record("10.0.0.5:8000", [1001, 1002, 1003])  # a new pod at the same address
    await writer.forget_endpoint("10.0.0.6:8000")
    writer.record("10.0.0.7:8000", [2001])
    await writer.flush()
    assert calls() >= 3
    client = writer.link.client
    assert await client.zcard(writer._lru_prefix + "10.0.0.5:8000") == 3
    assert await client.zcard(writer._lru_prefix + "10.0.0.6:8000") == 0
    reader = await remote_view(make_index, writer)
    assert await reader.match([1001, 1002, 1003], ["10.0.0.5:8000"]) == {"10.0.0.5:8000": 3}


async def test_a_departed_endpoint_leaves_no_capacity_behind_a_restarted_one_keeps_it(
    make_index: Factory,
) -> None:
    """As the in-memory index: an endpoint that left the pool is forgotten with its size (a pod
    back under its id is sized by its next scrape); a restarted engine keeps its size."""
    index = make_index(default_capacity=100)
    index.set_capacity("left", 7)
    index.set_capacity("restarted", 9)
    await index.forget_endpoint("left")
    await index.clear_endpoint("restarted")
    await index.flush()
    assert (index.local.capacity("left"), index.local.capacity("restarted")) == (100, 9)


async def test_an_engine_restart_is_cleared_once_across_gateways(
    make_index: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each gateway notices a restart in its own scrapes, some a while later than others: the
    shared clear is done once per engine life (the first gateway to notice it), or a late one
    would wipe what the others recorded for the new engine meanwhile. The late one still
    clears its own view; a later restart (another life) clears again."""
    forget = declared_keys_only(getattr(redis_index, "_FORGET"))  # noqa: B009 (private name)
    monkeypatch.setattr(redis_index, "_FORGET", forget)
    registry = CollectorRegistry()
    # Purged one entry a script: the later chunks belong to the same clear, not skipped.
    first = make_index(forget_chunk=1, registry=registry)
    second = make_index(registry=CollectorRegistry())
    first.record("e", [1, 2, 3])
    second.record("e", [1, 2, 3])
    await first.flush()
    await second.flush()
    await first.clear_endpoint("e", life="1700000000.25")
    await first.flush()
    first.record("e", [7, 8])  # the new engine's blocks, as both gateways route to it
    second.record("e", [7, 8, 9])
    await first.flush()
    await second.flush()
    await second.clear_endpoint("e", life="1700000000.25")  # the same restart, noticed late
    await second.flush()
    assert second.local.match_now([1, 2, 3], ["e"]) == {"e": 0}  # its own view is cleared
    reader = make_index(registry=CollectorRegistry())
    assert await reader.match([7, 8, 9], ["e"]) == {"e": 3}
    assert await reader.match([1, 2, 3], ["e"]) == {"e": 0}
    errors = {"op": "index_update", "kind": "error"}
    assert registry.get_sample_value("prefixgate_redis_errors_total", errors) is None
    await second.clear_endpoint("e", life="1700000900.5")  # restarted again: a new life
    await second.flush()
    assert await reader.match([7, 8, 9], ["e"]) == {"e": 0}
