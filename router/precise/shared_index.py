"""The precise index shared through Redis (``precisePrefix.index.backend: redis``).

Every gateway still subscribes to every endpoint's KV events and keeps its own index warm (no
leader, and the local index answers alone when Redis is slow or down). Redis adds what a
late-starting replica missed and the speculative entries of every gateway's picks, so a burst
spread over gateways follows one endpoint. Each event batch is applied once and in order,
whichever gateway delivers it first. Design, key layout and the rules of the ``APPLY`` script:
docs/precise-routing.md; memory and cost: docs/benchmarks/precise.md.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter

from router.index.circuit_breaker import CircuitBreaker
from router.index.redis_link import (
    RedisLink,
    RedisMetrics,
    ScriptCall,
    Unavailable,
    as_text,
    key_tag,
    pipeline_scripts,
)
from router.index.update_queue import UpdateQueue
from router.precise.event_codec import (
    AppliedOp,
    Cleared,
    Mapped,
    Removed,
    Stored,
    block_extras,
)
from router.precise.index import PreciseIndex, block_keys
from router.precise.redis_scripts import APPLY, FORGET, GC, MATCH, SPECULATE
from router.precise.shared_updates import (
    EventBatch,
    Purge,
    Speculation,
    Update,
    UpdateKey,
    hash_id,
    pack_ids,
    pack_keys,
    update_cost,
)

DEFAULT_KEY_TTL_SECONDS = 86_400.0
# Sends of one call at most: a script told to move (a garbage map it was not given) is sent
# again with the name it was told.
_SENDS = 3


@dataclass(frozen=True, slots=True)
class RemoteMatch:
    """What Redis knows of one endpoint for one request's chain."""

    trusted: bool
    confirmed: int
    speculative: int

    @property
    def held(self) -> int:
        return max(self.confirmed if self.trusted else 0, self.speculative)


class SharedPreciseIndex:
    """Mirrors a local :class:`PreciseIndex` into Redis and reads the shared view back."""

    def __init__(
        self,
        local: PreciseIndex,
        url: str,
        *,
        metrics: RedisMetrics,
        namespace: str = "prefixgate",
        timeout_ms: float = 5.0,
        write_timeout_ms: float = 100.0,
        resync_seconds: float = 30.0,
        key_ttl_seconds: float = DEFAULT_KEY_TTL_SECONDS,
        max_speculative: int = 65_536,
        max_pending: int = 4096,
        breaker: CircuitBreaker | None = None,
        cluster: bool = False,
        flush_timeout: float = 0.5,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.local = local
        self.metrics = metrics
        self._p = key_tag(namespace) + ":p"
        self._link = RedisLink(
            url, component="precise_index", metrics=metrics, timeout_ms=timeout_ms,
            breaker=breaker,
            cluster=cluster,
        )
        self._write_budget = write_timeout_ms / 1000.0
        self._resync_ms = max(0, int(resync_seconds * 1000))
        self._ttl_ms = max(1, int(key_ttl_seconds * 1000))
        self._ttl_seconds = key_ttl_seconds
        self._refresh_every = key_ttl_seconds / 10
        self._refreshed_at = -float("inf")
        self._max_spec = max(1, max_speculative)
        self._flush_timeout = flush_timeout
        self._puts = itertools.count()
        # What earlier answers said, so that each script is given every key it will touch: the
        # slot of each endpoint (a clear renames its map to that slot's garbage map), and a
        # garbage map to reclaim a step of.
        self._slots: dict[str, str] = {}
        self._gc_next = ""
        self._delivered: set[str] = set()  # endpoints with batches here since the last refresh
        self.statuses: dict[str, int] = {}  # APPLY outcomes of this replica's deliveries
        self._outcomes = Counter(
            "prefixgate_precise_shared_batches",
            "KV event batches this gateway delivered to the shared precise index, by outcome: "
            "fresh, applied, dup, restart, gap, overflow, stale.",
            ["outcome"],
            registry=registry if registry is not None else CollectorRegistry(),
        )
        # Event batches must never be coalesced: each put gets its own key.
        self._queue: UpdateQueue[UpdateKey, Update] = UpdateQueue(
            self._ship, op="precise_update", link=self._link, max_items=max_pending,
            max_batch=16, max_batch_cost=64 << 10, cost=update_cost, keep=lambda k: k[0] == "purge",
        )

    @property
    def link(self) -> RedisLink:
        return self._link

    def _k(self, kind: str, endpoint_id: str = "") -> str:
        return self._p + kind + endpoint_id

    # -- writes (background) --------------------------------------------------------------

    def batch(self, endpoint_id: str, seq: int, ts: float, ops: list[AppliedOp]) -> None:
        """A batch the local subscriber just applied (router.precise.events.BatchMirror)."""
        capacity = self.local.capacity(endpoint_id)
        self._delivered.add(endpoint_id)
        item = EventBatch(seq, ts, ops, capacity)
        self._queue.put(("events", endpoint_id, next(self._puts)), item)

    def speculated(self, endpoint_id: str, keys: Sequence[int], ttl: float) -> None:
        """Share the speculative entries of a pick (the local index has its own)."""
        if not keys or ttl <= 0:
            return
        # A later pick of the same chain on the same endpoint supersedes this one.
        item = Speculation(pack_keys(keys), max(1, int(ttl * 1000)))
        self._queue.put(("spec", endpoint_id, keys[-1]), item)

    async def forget_endpoint(self, endpoint_id: str) -> None:
        """Purge an endpoint that left the pool, here and in Redis."""
        self.local.forget(endpoint_id)
        self._queue.discard_if(lambda key: key[1] == endpoint_id)
        self._queue.put(("purge", endpoint_id, 0), Purge())

    async def flush(self) -> None:
        await self._queue.flush()

    async def aclose(self) -> None:
        await self._queue.aclose(self._flush_timeout)
        await self._link.aclose()

    def _garbage(self, slot: str) -> str:
        """The garbage map of ``slot`` ('': a name no map has)."""
        return self._p + "d:" + slot

    def _call(self, key: UpdateKey, item: Update, keep: Sequence[str] | None) -> ScriptCall:
        """A script call for ``item``; ``keep``: every endpoint's keys, when their TTL is due."""
        eid, p = key[1], self._p
        if isinstance(item, Speculation):
            return SPECULATE, [self._k("z:", eid)], [p, item.ttl_ms, self._max_spec, item.keys]
        base = [self._k("h"), self._k("s"), self._k("g"), self._k("i:", eid),
                self._k("m:", eid), self._k("k:", eid)]
        old, gc = self._garbage(self._slots.get(eid, "")), self._garbage(self._gc_next)
        if isinstance(item, Purge):
            if not eid:
                return GC, [*base[:3], gc], [p]
            return FORGET, [*base, self._k("z:", eid), old, gc], [p, eid, self._ttl_ms]
        args: list[Any] = [
            p, eid, item.seq, repr(item.ts), item.capacity, self._ttl_ms, self._resync_ms,
            "0" if keep is None else "1",
        ]
        for op in item.ops:
            if isinstance(op, Mapped):
                args += ["S", pack_ids(op.block_hashes), pack_keys(op.keys)]
            elif isinstance(op, Removed):
                args += ["R", pack_ids(op.block_hashes), ""]
            elif isinstance(op, Cleared):
                args += ["C", "", ""]
            # A Stored left here could not be mapped even with Redis' help: skipped.
        return APPLY, [*base, old, gc, *(keep or ())], args

    async def _ship(self, batch: list[tuple[UpdateKey, Update]]) -> None:
        """One pipelined round trip (two when a late replica must learn parents first, one more
        every few hours to read the keys to refresh, one more when a script needed a garbage
        map other than the one it was given)."""
        await self._resolve_parents(batch)
        keep: list[str] | None = None
        if time.monotonic() - self._refreshed_at > self._refresh_every:
            keep = await self._every_endpoints_keys({k[1] for k, _ in batch} | self._delivered)
        failed, refreshed = 0, False
        for send in range(_SENDS):
            try:
                results = await self._send(batch, keep)
            except Unavailable as exc:
                if send == 0:
                    raise  # nothing shipped: the queue takes it back
                # Only what was told to move is left (a purge done before must not run again
                # after the records that followed it): its purges wait for Redis.
                kept = self._queue.requeue([u for u in batch if u[0][0] == "purge"])
                self.metrics.dropped.labels("precise_update", exc.reason).inc(len(batch) - kept)
                batch = []
                break
            batch, errors, applied = self._read_answers(batch, results)
            failed, refreshed = failed + errors, refreshed or applied
            if not batch:
                break
        failed += len(batch)  # told to move that often: other gateways clearing it meanwhile
        if failed:
            self.metrics.errors.labels("precise_update", "error").inc(failed)
            self.metrics.dropped.labels("precise_update", "error").inc(failed)
        elif keep is not None and refreshed:
            self._refreshed_at = time.monotonic()  # only an event batch's script refreshes
            self._delivered.clear()

    async def _send(
        self, batch: list[tuple[UpdateKey, Update]], keep: Sequence[str] | None
    ) -> list[Any]:
        calls = [self._call(key, item, keep) for key, item in batch]
        results: list[Any] = await self._link.call(
            "precise_update", lambda c: pipeline_scripts(c, calls), self._write_budget
        )
        return results

    async def _every_endpoints_keys(self, shipping: set[str]) -> list[str]:
        """Every endpoint's meta, map and refs, for a refresh (a script touches only keys it is
        given), learning every slot on the way; but an endpoint whose events no gateway applied
        for the keys' TTL is purged instead (it left unseen, most likely), unless this gateway
        delivered some since the last refresh (``shipping``)."""
        raw = await self._link.call(
            "precise_update", lambda c: c.hgetall(self._k("s")), self._write_budget
        )
        slots = {as_text(f): as_text(v) for f, v in raw.items() if not as_text(f).startswith("#")}
        self._slots.update(slots)

        async def applied_at(client: Any) -> list[Any]:
            pipe = client.pipeline(transaction=False)
            for eid in slots:
                pipe.hget(self._k("i:", eid), "at")
            found: list[Any] = await pipe.execute()
            return found

        ats = await self._link.call("precise_update", applied_at, self._write_budget)
        now, keys = time.time(), list[str]()
        for eid, at in zip(slots, ats, strict=True):
            # No 'at' (the meta of an older release): kept.
            if at is not None and now - int(at) > self._ttl_seconds and eid not in shipping:
                self._queue.put(("purge", eid, 0), Purge())
            else:
                keys += [self._k(kind, eid) for kind in ("i:", "m:", "k:")]
        return keys

    def _read_answers(
        self, batch: list[tuple[UpdateKey, Update]], results: list[Any]
    ) -> tuple[list[tuple[UpdateKey, Update]], int, bool]:
        """What the scripts answered: the calls to send again (told to move: nothing done),
        how many failed, and whether an event batch's script ran."""
        again: list[tuple[UpdateKey, Update]] = []
        failed, applied = 0, False
        for (key, item), result in zip(batch, results, strict=True):
            eid = key[1]
            if isinstance(result, Exception):
                failed += 1
            elif key[0] == "events":
                status, _, slot, self._gc_next = (as_text(x) for x in result)
                self._learn_slot(eid, slot)
                if status == "moved":
                    again.append((key, item))
                    continue
                applied = True
                self.statuses[status] = self.statuses.get(status, 0) + 1
                self._outcomes.labels(status).inc()
            elif key[0] == "purge":
                left, self._gc_next = int(result[0]), as_text(result[1])
                if left < 0:  # FORGET only (GC answers no slot)
                    self._slots[eid] = as_text(result[2])
                    again.append((key, item))
                    continue
                if eid:
                    self._slots.pop(eid, None)
                if left > 0:
                    self._queue.put(("purge", "", 0), Purge())  # the rest, bounded steps
        return again, failed, applied

    def _learn_slot(self, eid: str, slot: str) -> None:
        if slot:
            self._slots[eid] = slot
        else:
            self._slots.pop(eid, None)

    async def _resolve_parents(self, batch: list[tuple[UpdateKey, Update]]) -> None:
        """Map the blocks the local index could not (unknown parent) with keys from Redis."""
        wanted: dict[str, set[bytes]] = {}
        for (_, eid, _), item in batch:
            if isinstance(item, EventBatch):
                for op in item.ops:
                    if isinstance(op, Stored) and op.parent is not None:
                        wanted.setdefault(eid, set()).add(hash_id(op.parent))
        if not wanted:
            return
        order = [(eid, sorted(ids)) for eid, ids in wanted.items()]

        async def fetch(client: Any) -> list[Any]:
            pipe = client.pipeline(transaction=False)
            for eid, ids in order:
                pipe.hmget(self._k("m:", eid), ids)
            found: list[Any] = await pipe.execute()
            return found

        try:
            found = await self._link.call("precise_parents", fetch, self._write_budget)
        except Unavailable:
            return  # shipped unmapped (skipped): Redis is away anyway
        known: dict[str, dict[bytes, int]] = {
            eid: {i: int.from_bytes(v, "little") for i, v in zip(ids, vals, strict=True) if v}
            for (eid, ids), vals in zip(order, found, strict=True)
        }
        for (_, eid, _), item in batch:
            if isinstance(item, EventBatch):
                item.ops = [self._map(eid, op, known.setdefault(eid, {})) for op in item.ops]

    def _map(self, eid: str, op: AppliedOp, known: dict[bytes, int]) -> AppliedOp:
        if not isinstance(op, Stored) or op.parent is None:
            return op
        parent = known.get(hash_id(op.parent))
        bs = self.local.block_size
        if parent is None or len(op.token_ids) < len(op.block_hashes) * bs:
            return op
        keys = block_keys(op.token_ids, bs, parent, len(op.block_hashes), block_extras(op))
        for engine_hash, key in zip(op.block_hashes, keys, strict=True):
            known[hash_id(engine_hash)] = key  # a later orphan in the same batch may need it
            self.local.learn_parent(eid, engine_hash, key)
        return Mapped(op.block_hashes, keys)

    # -- reads ----------------------------------------------------------------------------

    async def lookup(
        self, keys: Sequence[int], endpoint_ids: Sequence[str]
    ) -> dict[str, RemoteMatch] | None:
        """Redis' view of ``keys`` per endpoint in one round trip; None when Redis is away."""
        ids = list(endpoint_ids)
        if not keys or not ids:
            return {}
        if self._link.breaker.retry_in() > 0:
            self.metrics.fallbacks.labels("precise_match", "circuit_open").inc()
            return None
        redis_keys = [self._k("h"), self._k("s")]
        for eid in ids:
            redis_keys += [self._k("i:", eid), self._k("z:", eid)]
        args: list[Any] = [self._p, pack_keys(keys), *ids]
        raw = await self._link.eval_or_none("precise_match", MATCH, redis_keys, args)
        if raw is None:
            return None
        return {
            eid: RemoteMatch(bool(raw[3 * j]), int(raw[3 * j + 1]), int(raw[3 * j + 2]))
            for j, eid in enumerate(ids)
        }
