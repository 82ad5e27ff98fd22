"""The prefix index shared through Redis, so that several gateway replicas route as one.

Every replica keeps an :class:`InMemoryPrefixIndex` warm and answers from it whenever Redis is
slow or down (fail-open); Redis only ever adds what the other replicas learned. A lookup is one
round trip (a Lua script binary-searches the chain server-side); a record is at most one,
shipped after the pick by a background task. All keys share one hash tag so every script runs
on one Redis Cluster slot. Key layout: docs/redis.md; memory per block:
docs/benchmarks/redis-index.md.
"""

from __future__ import annotations

import asyncio
import struct
import time
import uuid
from collections.abc import Collection, Sequence
from typing import Any

from prometheus_client import CollectorRegistry

from router.index.circuit_breaker import CircuitBreaker
from router.index.prefix_index import DEFAULT_CAPACITY_BLOCKS, InMemoryPrefixIndex, capped
from router.index.redis_index_scripts import FORGET as _FORGET
from router.index.redis_index_scripts import MATCH as _MATCH
from router.index.redis_index_scripts import RECORD as _RECORD
from router.index.redis_index_scripts import WITHDRAW as _WITHDRAW
from router.index.redis_link import (
    RedisLink,
    RedisMetrics,
    ScriptCall,
    Unavailable,
    as_text,
    default_metrics,
    eval_script,
    key_tag,
    pipeline_scripts,
)
from router.index.update_queue import UpdateQueue

DEFAULT_KEY_TTL_SECONDS = 86_400.0
DEFAULT_MAX_BLOCKS_PER_WRITE = 256  # ~1.5 ms of Redis time, evictions included
# Chunks of one purge shipped in a row, at most (then it waits for its next batch).
_FORGET_ROUNDS = 1000

# (kind: record | withdraw | trim | forget, endpoint id, packed hashes; a forget's: the engine
# life whose restart it clears, b"" for an endpoint that left)
_Op = tuple[str, str, bytes]
_MASK64 = (1 << 64) - 1


def pack_hashes(hashes: Sequence[int]) -> bytes:
    """Block hashes as 8 little-endian bytes each: one compact argument, not one per block."""
    try:
        return struct.pack(f"<{len(hashes)}Q", *hashes)
    except struct.error:
        return struct.pack(f"<{len(hashes)}Q", *(h & _MASK64 for h in hashes))


async def _yield_or_cancel(task: asyncio.Future[Any]) -> None:
    try:
        await asyncio.sleep(0)
    except BaseException:
        task.cancel()
        raise


class RedisPrefixIndex:
    """A :class:`PrefixIndex` shared through Redis, fail-open to a local in-memory index."""

    def __init__(
        self,
        url: str,
        *,
        namespace: str = "prefixgate",
        partition: str | None = None,
        default_capacity: int = DEFAULT_CAPACITY_BLOCKS,
        timeout_ms: float = 5.0,
        write_timeout_ms: float = 100.0,
        key_ttl_seconds: float = DEFAULT_KEY_TTL_SECONDS,
        metrics: RedisMetrics | None = None,
        registry: CollectorRegistry | None = None,
        breaker: CircuitBreaker | None = None,
        cluster: bool = False,
        max_pending: int = 1024,
        max_pending_bytes: int = 16 << 20,
        forget_chunk: int = 1000,
        flush_timeout: float = 0.5,
        max_blocks_per_write: int = DEFAULT_MAX_BLOCKS_PER_WRITE,
    ) -> None:
        tag = key_tag(namespace, partition)
        self.local = InMemoryPrefixIndex(default_capacity)
        self._holders, self._slots, self._lru_prefix = tag + ":h", tag + ":s", tag + ":l:"
        self._clocks, self._seen = tag + ":c", tag + ":t"
        # A restart's clear marker (per endpoint and engine life) and this gateway's token in
        # it: the first gateway to notice a restart clears the shared entries, once.
        self._restarts, self._token = tag + ":r:", uuid.uuid4().hex
        if metrics is None and registry is not None:
            metrics = RedisMetrics(registry)
        self.metrics = default_metrics(metrics)
        self._link = RedisLink(
            url, component="index", metrics=self.metrics, timeout_ms=timeout_ms, breaker=breaker,
            cluster=cluster,
        )
        self._write_budget = write_timeout_ms / 1000.0
        self._ttl_ms = max(1, int(key_ttl_seconds * 1000))
        self._ttl_seconds = key_ttl_seconds
        self._refresh_every = key_ttl_seconds / 10
        self._refreshed_at = -float("inf")
        self._recorded: set[str] = set()  # endpoints recorded here since the last refresh
        self._forget_chunk = max(1, forget_chunk)
        self._max_touch = max(0, max_blocks_per_write)
        self._flush_timeout = flush_timeout
        # Value: the capacity at enqueue time, so a later set_capacity cannot rewrite history.
        self._queue: UpdateQueue[_Op, int] = UpdateQueue(
            self._ship, op="index_update", link=self._link, max_items=max_pending,
            max_cost=max_pending_bytes, max_batch=16, max_batch_cost=32 << 10,
            cost=lambda op, _: len(op[2]) + 64, keep=lambda op: op[0] == "forget",
        )

    @property
    def link(self) -> RedisLink:
        return self._link

    async def match(self, hashes: Sequence[int], endpoint_ids: Collection[str]) -> dict[str, int]:
        start = time.perf_counter()
        ids = list(endpoint_ids)
        remote_task = None
        if hashes and ids:
            if self._link.breaker.retry_in() > 0:
                self.metrics.fallbacks.labels("index_match", "circuit_open").inc()
            else:
                remote_task = asyncio.ensure_future(self._match_remote(hashes, ids))
                # Let it put the request on the wire, then walk locally while Redis works.
                await _yield_or_cancel(remote_task)
        result = self.local.match_now(hashes, ids)
        if remote_task is not None:
            remote = await remote_task
            if remote is not None:
                for endpoint_id, length in zip(ids, remote, strict=True):
                    # Our own records may still be on their way; never report less than we know.
                    result[endpoint_id] = max(result[endpoint_id], int(length))
        self.metrics.lookups.inc()
        if any(result.values()):
            self.metrics.lookup_hits.inc()
        self.metrics.lookup_seconds.observe(time.perf_counter() - start)
        return result

    async def _match_remote(self, hashes: Sequence[int], ids: list[str]) -> list[Any] | None:
        keys = [self._holders, self._slots]
        args: list[Any] = [pack_hashes(hashes), *ids]
        remote: list[Any] | None = await self._link.eval_or_none("index_match", _MATCH, keys, args)
        return remote

    def record(self, endpoint_id: str, hashes: Sequence[int]) -> None:
        if not hashes:
            return
        hashes = capped(hashes, self.local.capacity(endpoint_id))
        self.local.record(endpoint_id, hashes)
        self._recorded.add(endpoint_id)
        op = ("record", endpoint_id, pack_hashes(hashes))
        self._queue.put(op, self.local.capacity(endpoint_id))

    def withdraw(self, endpoint_id: str, hashes: Sequence[int], held: int) -> None:
        # After its record in the queue (a withdrawal is rare: only a failed attempt's), so
        # Redis applies the two in order; a record of the same chain put later goes after it.
        hashes = capped(hashes, self.local.capacity(endpoint_id))
        self.local.withdraw(endpoint_id, hashes, held)
        tail = hashes[max(0, held) :]
        if tail:
            self._queue.put(("withdraw", endpoint_id, pack_hashes(tail)), 0)

    async def forget_endpoint(self, endpoint_id: str) -> None:
        await self.local.forget_endpoint(endpoint_id)
        self._purge(endpoint_id)

    async def clear_endpoint(self, endpoint_id: str, life: str | None = None) -> None:
        # What it held is gone for every gateway alike, and records after the purge add anew;
        # its capacity stays (the same engine). With the engine's life known, only the first
        # gateway to notice this restart purges Redis (the others' purges would take what was
        # recorded since); unknown, every one does.
        await self.local.clear_endpoint(endpoint_id)
        self._purge(endpoint_id, life.encode() if life else b"")

    def _purge(self, endpoint_id: str, life: bytes = b"") -> None:
        self._queue.discard_if(lambda op: op[1] == endpoint_id)
        self._queue.put(("forget", endpoint_id, life), 0)

    def room(self, endpoint_id: str) -> int:
        # The local view, no round trip: it fills with this gateway's share of the traffic, so
        # with several gateways it reports room a while longer than the shared index would.
        return self.local.room(endpoint_id)

    def set_capacity(self, endpoint_id: str, blocks: int) -> None:
        self.local.set_capacity(endpoint_id, blocks)
        self._queue.put(("trim", endpoint_id, b""), self.local.capacity(endpoint_id))

    async def flush(self) -> None:
        """Wait until the updates queued so far are in Redis (or given up on)."""
        await self._queue.flush()

    async def aclose(self) -> None:
        await self._queue.aclose(self._flush_timeout)
        await self._link.aclose()

    def _script_args(
        self,
        op: _Op,
        capacity: int,
        refresh: bool,
        most: int = 0,
        bound: int | None = None,
        lrus: Sequence[str] = (),
    ) -> ScriptCall:
        """A script call for ``op``; a refresh renews ``lrus`` (every endpoint's LRU key)."""
        kind, endpoint_id, blob = op
        keys = [
            self._holders, self._slots, self._lru_prefix + endpoint_id, self._clocks, self._seen
        ]
        if kind == "forget" and blob:
            marker = f"{self._restarts}{endpoint_id}:{blob.decode()}"
            args = [endpoint_id, self._forget_chunk, self._token, self._ttl_ms]
            return _FORGET, [*keys, marker], args
        if kind == "forget":
            return _FORGET, keys, [endpoint_id, self._forget_chunk]
        if kind == "withdraw":
            return _WITHDRAW, keys[:3], [endpoint_id, blob]
        flag = "1" if refresh else "0"
        piece_of = "" if bound is None else bound
        args = [endpoint_id, capacity, self._ttl_ms, flag, blob, most, piece_of]
        return _RECORD, [*keys, *lrus] if refresh else keys, args

    async def _ship(self, batch: list[tuple[_Op, int]]) -> None:
        """Pipelined round trips for a batch of updates, in order: a purge is finished, chunk
        by chunk, before what was queued after it (a new pod at the same address records
        blocks its predecessor's purge must not take). A purge that cannot finish now (Redis
        away between its chunks, or its rounds used up) goes back to the head of the queue with
        its endpoint's later updates behind it; the other endpoints' go on."""
        refresh = time.monotonic() - self._refreshed_at > self._refresh_every
        start = 0
        for i, (op, _) in enumerate(batch):
            if op[0] == "forget" or i == len(batch) - 1:
                run = batch[start : i + 1]
                # Only a record refreshes the keys' TTL: the first run that has one does.
                refreshes = refresh and any(o[0] == "record" for o, _ in run)
                try:
                    finished = await self._ship_run(run, refreshes)
                except Unavailable as exc:
                    # Only what did not ship goes back (its purges, as the queue would): a
                    # purge done in an earlier run, run again, would take what a new pod at
                    # the same address recorded after it.
                    rest = batch[start:]
                    kept = self._queue.requeue([u for u in rest if u[0][0] == "forget"])
                    self.metrics.dropped.labels("index_update", exc.reason).inc(len(rest) - kept)
                    return
                refresh = refresh and not refreshes
                start = i + 1
                if not finished:
                    later = batch[start:]
                    self._queue.requeue([batch[i], *(u for u in later if u[0][1] == op[1])])
                    await self._ship([u for u in later if u[0][1] != op[1]])
                    return

    async def _ship_run(self, batch: list[tuple[_Op, int]], refresh: bool) -> bool:
        """One pipelined round trip (and the pieces it calls for); False when the run ends
        with a purge that is not finished yet."""
        lrus: list[str] = []
        if refresh:  # a script touches only the keys it is given: it is given every LRU key
            lrus = await self._lrus_to_keep({op[1] for op, _ in batch})
        calls = [
            self._script_args(op, capacity, refresh, self._max_touch, lrus=lrus)
            for op, capacity in batch
        ]
        results = await self._link.call(
            "index_update", lambda c: pipeline_scripts(c, calls), self._write_budget
        )
        failed = [r for r in results if isinstance(r, Exception)]
        if failed:
            self.metrics.errors.labels("index_update", "error").inc(len(failed))
            self.metrics.dropped.labels("index_update", "error").inc(len(failed))
        if refresh and not failed:
            self._refreshed_at = time.monotonic()
            self._recorded.clear()
        finished = True
        pieced: set[str] = set()  # endpoints whose records this run wrote in pieces
        # A record whose pieces Redis interrupted goes back to the queue, and its endpoint's
        # withdrawals after it in this run with it, in order (ahead of them, it would undo them).
        unfinished: list[tuple[_Op, int]] = []
        for (op, capacity), result in zip(batch, results, strict=True):
            if op[0] == "withdraw" and any(o[1] == op[1] for o, _ in unfinished):
                unfinished.append((op, capacity))
            elif op[0] == "withdraw" and op[1] in pieced:
                # Its record was written in pieces, after the pipeline: withdraw after them.
                await self._run_script(self._script_args(op, 0, False))
            elif op[0] == "forget" and isinstance(result, int) and result > 0:
                finished = await self._forget_rest(op)
            elif op[0] == "trim" and isinstance(result, int) and result > 0:
                if op not in self._queue:  # the next chunk (a newer trim would do it anyway)
                    self._queue.put(op, capacity)
            elif op[0] == "record" and isinstance(result, list) and len(result) == 2:
                pieced.add(op[1])
                if not await self._record_in_pieces(
                    op, capacity, int(result[0]) - 1, int(result[1])
                ):
                    unfinished.append((op, capacity))
        self._queue.requeue(unfinished)  # finished when Redis is back
        return finished

    async def _run_script(self, call: ScriptCall) -> None:
        """One script, one round trip; given up on (counted) when Redis is away."""
        script, keys, args = call

        async def run(client: Any) -> Any:
            return await eval_script(client, script, keys, args)

        try:
            await self._link.call("index_update", run, self._write_budget)
        except Unavailable as exc:
            self.metrics.dropped.labels("index_update", exc.reason).inc()

    async def _lrus_to_keep(self, shipping: set[str]) -> list[str]:
        """Every endpoint's LRU key, for the refresh, but an endpoint no gateway recorded for
        the keys' TTL: it is purged instead (it left while no gateway watched it, most likely),
        or the refresh would keep it for as long as the namespace is used, for a replica given
        its address later to inherit. Not one this gateway recorded since the last refresh
        (``shipping`` and :attr:`_recorded`): it is back."""

        async def read(client: Any) -> list[Any]:
            pipe = client.pipeline(transaction=False)
            pipe.hkeys(self._slots)
            pipe.hgetall(self._seen)
            found: list[Any] = await pipe.execute()
            return found

        ids, seen = await self._link.call("index_update", read, self._write_budget)
        now = time.time()
        lrus: list[str] = []
        unseen: dict[Any, int] = {}  # Any: redis-py types the mapping's keys invariantly
        for raw in ids:
            endpoint_id, at = as_text(raw), seen.get(raw)
            if at is None:  # recorded by an older release only: it ages from now
                unseen[endpoint_id] = int(now)
            elif now - int(at) > self._ttl_seconds and endpoint_id not in shipping | self._recorded:
                self._purge(endpoint_id)
                continue
            lrus.append(self._lru_prefix + endpoint_id)
        if unseen:
            await self._link.call(
                "index_update", lambda c: c.hset(self._seen, mapping=unseen), self._write_budget
            )
        return lrus

    async def _forget_rest(self, op: _Op) -> bool:
        """A purge's later chunks, one bounded script each (a script runs alone on the
        server); False when it is not finished (the caller queues the rest)."""
        _, keys, args = self._script_args(op, 0, False)

        async def run(client: Any) -> Any:
            return await eval_script(client, _FORGET, keys, args)

        for _ in range(_FORGET_ROUNDS):
            try:
                left = await self._link.call("index_update", run, self._write_budget)
            except Unavailable:
                return False  # finished when Redis is back
            if not isinstance(left, int) or left <= 0:
                return True
        return False

    async def _record_in_pieces(self, op: _Op, capacity: int, fresh: int, bound: int) -> bool:
        """Touch a long chain as growing prefixes, one round trip each.

        One script runs alone on the Redis server: a cold 200K-token prompt touched at once
        would hold it for 10 ms or more, and every gateway's lookups would time out meanwhile.
        Recorded piece by piece, each piece is the next turn of the one before, judged fresh
        or not against the bound the record began with (``bound``), as the in-memory index's
        pieces are: a chain longer than the fresh window costs its new blocks, not itself per
        piece. False when Redis went away before its last piece.
        """
        blob, step = op[2], self._max_touch
        # A capacity shrunk since the record was queued (its trim ran in the same batch,
        # before these pieces) holds for them too.
        capacity = min(capacity, self.local.capacity(op[1]))
        ends = range(fresh + step, len(blob) // 8 + step, step)
        for end in ends:
            piece = (op[0], op[1], blob[: min(end * 8, len(blob))])
            _, keys, args = self._script_args(piece, capacity, False, 0, bound)

            async def run(client: Any, keys: list[str] = keys, args: list[Any] = args) -> Any:
                return await eval_script(client, _RECORD, keys, args)

            try:
                await self._link.call("index_update", run, self._write_budget)
            except Unavailable:
                return False  # the caller queues it again
        return True
