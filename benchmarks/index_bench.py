"""Prefix index latency: in-memory vs Redis on loopback, side by side, as a markdown table.

    python -m benchmarks.index_bench [--redis-url redis://127.0.0.1:6379/0] [--quick]

Prompts of 1K, 32K and 200K tokens (4 bytes a token, hashed at the default block size) against
8 and 64 endpoints. Endpoint 0 holds the whole chain and the others its first half, so a lookup
walks every block. "lookup" is ``match`` (for Redis: the local walk plus one script round trip).
"record" (in-memory ``record``) and "update" (Redis ``record`` plus the shipped round trip) are
an agent's next turn: the chain the endpoint holds plus 1,000 new tokens, in turn on each
endpoint. "new chain" is a chain no endpoint has seen (a cold start: every block is new, so its
work is linear in the prompt): in memory, the longest the event loop is held (the record leaves
all but its first 256 blocks to later turns of the loop); in Redis, all its round trips.
Also prints Redis bytes per entry measured with MEMORY USAGE. Runs in well under a minute.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable

import redis.asyncio

from router.core.hashing import DEFAULT_BLOCK_BYTES, block_hashes
from router.index.prefix_index import DEFAULT_CAPACITY_BLOCKS, InMemoryPrefixIndex
from router.index.redis_index import RedisPrefixIndex

MODEL = "bench-model"
TURN_BLOCKS = -(-1_000 * 4 // DEFAULT_BLOCK_BYTES)  # 1,000 new tokens a turn
PROMPT_TOKENS = (1_000, 32_000, 200_000)
ENDPOINTS = (8, 64)
Row = dict[str, str]


def prompt_hashes(tokens: int, seed: int) -> list[int]:
    text = random.Random(seed).randbytes(tokens * 2).hex()  # tokens * 4 characters
    return block_hashes(text, DEFAULT_BLOCK_BYTES, MODEL)


def quantiles(samples: list[float]) -> str:
    ordered = sorted(samples)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return f"{statistics.median(ordered) * 1e3:.3f} / {p99 * 1e3:.3f}"


async def timed(n: int, op: Callable[[int], Awaitable[object]]) -> list[float]:
    samples = []
    for i in range(n):
        start = time.perf_counter()
        await op(i)
        samples.append(time.perf_counter() - start)
    return samples


class Turns:
    """Each endpoint's session chain, one turn longer at every call; and never-seen chains."""

    def __init__(self, hashes: list[int], ids: list[str], seed: int) -> None:
        self._rng = random.Random(seed)
        self._ids = ids
        self._chains = {e: hashes if i == 0 else hashes[: len(hashes) // 2]
                        for i, e in enumerate(ids)}
        self._length = len(hashes)

    def _fresh(self, blocks: int) -> list[int]:
        return [self._rng.getrandbits(64) for _ in range(blocks)]

    def next_turn(self, i: int) -> tuple[str, list[int]]:
        endpoint = self._ids[i % len(self._ids)]
        chain = self._chains[endpoint] + self._fresh(TURN_BLOCKS)
        self._chains[endpoint] = chain
        return endpoint, chain

    def new_chain(self, i: int) -> tuple[str, list[int]]:
        return self._ids[i % len(self._ids)], self._fresh(self._length)


async def bench_memory(hashes: list[int], ids: list[str], n: int) -> Row:
    index = InMemoryPrefixIndex()
    populate(index, hashes, ids)
    await settled(index)
    turns = Turns(hashes, ids, seed=len(hashes))

    async def lookup(i: int) -> object:
        return await index.match(hashes, ids)

    def record(make: Callable[[int], tuple[str, list[int]]]) -> Callable[[int], Awaitable[None]]:
        async def op(i: int) -> None:
            index.record(*make(i))
        return op

    return {"mem lookup": quantiles(await timed(n, lookup)),
            "mem record": quantiles(await timed(n, record(turns.next_turn))),
            "mem new chain": quantiles(await stalls(n, index, turns.new_chain))}


async def settled(index: InMemoryPrefixIndex) -> None:
    """Let the pieces of long records that wait for the event loop run."""
    for _ in range(100_000):
        if not index.pending_pieces:
            return
        await asyncio.sleep(0)


async def stalls(
    n: int, index: InMemoryPrefixIndex, make: Callable[[int], tuple[str, list[int]]]
) -> list[float]:
    """Per record, the longest time the event loop was held: the call, or one of the pieces
    of a long chain that it leaves to later turns of the loop."""
    samples = []
    for i in range(n):
        args = make(i)
        start = time.perf_counter()
        index.record(*args)
        longest = time.perf_counter() - start
        while index.pending_pieces:
            start = time.perf_counter()
            await asyncio.sleep(0)  # one turn of the loop: one piece
            longest = max(longest, time.perf_counter() - start)
        samples.append(longest)
    return samples


async def bench_redis(url: str, hashes: list[int], ids: list[str], n: int) -> Row:
    namespace = "bench" + uuid.uuid4().hex[:12]
    index = RedisPrefixIndex(url, namespace=namespace, timeout_ms=50, write_timeout_ms=1000)
    try:
        populate(index, hashes, ids)
        await index.flush()
        await settled(index.local)

        turns = Turns(hashes, ids, seed=len(hashes))

        async def lookup(i: int) -> object:
            return await index.match(hashes, ids)

        def update(
            make: Callable[[int], tuple[str, list[int]]]
        ) -> Callable[[int], Awaitable[None]]:
            async def op(i: int) -> None:
                index.record(*make(i))
                await index.flush()
            return op

        lookups = await timed(n, lookup)
        updates = await timed(n, update(turns.next_turn))
        cold = await timed(n, update(turns.new_chain))
        fallbacks = sum(m.samples[0].value for m in index.metrics.fallbacks.collect() if m.samples)
        row = {"redis lookup": quantiles(lookups), "redis update": quantiles(updates),
               "redis new chain": quantiles(cold)}
        if fallbacks:
            row["redis lookup"] += f" ({fallbacks:.0f} fallbacks)"
        return row
    finally:
        await index.aclose()
        await drop_namespace(url, namespace)


def populate(
    index: InMemoryPrefixIndex | RedisPrefixIndex, hashes: list[int], ids: list[str]
) -> None:
    # Other traffic first: a live index is large (and so is its Redis hash, which changes how
    # Redis encodes it: tiny hashes are scanned linearly).
    for e, endpoint_id in enumerate(ids):
        index.record(endpoint_id, prompt_hashes(8_000, -1 - e))
    for endpoint_id in ids[1:]:
        index.record(endpoint_id, hashes[: len(hashes) // 2])
    index.record(ids[0], hashes)


async def drop_namespace(url: str, namespace: str) -> None:
    client = redis.asyncio.Redis.from_url(url)
    try:
        keys = [k async for k in client.scan_iter(match=f"*pg:{namespace}*", count=1000)]
        if keys:
            await client.delete(*keys)
    finally:
        await client.aclose()


async def redis_answers(url: str) -> bool:
    client = redis.asyncio.Redis.from_url(url, socket_connect_timeout=0.5, socket_timeout=0.5)
    try:
        return bool(await client.ping())
    except (redis.RedisError, OSError):
        return False
    finally:
        await client.aclose()


async def bytes_per_entry(url: str, endpoints: int = 8, blocks: int = 20_000) -> str:
    """Redis bytes per holder field and per LRU entry, endpoints holding disjoint chains."""
    namespace = "bench" + uuid.uuid4().hex[:12]
    index = RedisPrefixIndex(url, namespace=namespace, write_timeout_ms=5000)
    client = redis.asyncio.Redis.from_url(url)
    try:
        for e in range(endpoints):
            index.record(f"e{e}", prompt_hashes(blocks * DEFAULT_BLOCK_BYTES // 4, 1000 + e))
            await index.flush()
        holders = await client.memory_usage(index._holders, samples=0) or 0
        lru = await client.memory_usage(index._lru_prefix + "e0", samples=0) or 0
        fields = await client.hlen(index._holders)
        per_holder, per_lru = holders / max(1, fields), lru / blocks
        bound = DEFAULT_CAPACITY_BLOCKS * (per_holder + per_lru)
        return (f"Redis memory: {per_holder:.0f} B per block in the holder hash + {per_lru:.0f} B "
                f"per (endpoint, block) LRU entry; default capacity {DEFAULT_CAPACITY_BLOCKS} "
                f"blocks -> at most {bound / 1e6:.1f} MB per endpoint (disjoint chains).")
    finally:
        await client.aclose()
        await index.aclose()
        await drop_namespace(url, namespace)


async def main(url: str, quick: bool) -> None:
    have_redis = await redis_answers(url)
    header = ["prompt tokens", "blocks", "endpoints", "mem lookup", "mem record",
              "redis lookup", "redis update", "mem new chain", "redis new chain"]
    print("p50 / p99 in ms" + ("" if have_redis else f" (no Redis at {url}: memory only)"))
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for tokens in PROMPT_TOKENS:
        hashes = prompt_hashes(tokens, tokens)
        n = {1_000: 400, 32_000: 200, 200_000: 120}[tokens] // (4 if quick else 1)
        for endpoints in ENDPOINTS:
            ids = [f"10.0.{i // 250}.{i % 250}:8000" for i in range(endpoints)]
            row: Row = {"prompt tokens": f"{tokens:,}", "blocks": str(len(hashes)),
                        "endpoints": str(endpoints)}
            row |= await bench_memory(hashes, ids, n)
            if have_redis:
                row |= await bench_redis(url, hashes, ids, n)
            print("| " + " | ".join(row.get(h, "n/a") for h in header) + " |", flush=True)
    if have_redis:
        print()
        print(await bytes_per_entry(url, blocks=5_000 if quick else 20_000))


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    default_url = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
    parser.add_argument("--redis-url", default=default_url)
    parser.add_argument("--quick", action="store_true", help="a quarter of the iterations")
    args = parser.parse_args()
    asyncio.run(main(args.redis_url, args.quick))


if __name__ == "__main__":
    cli()
