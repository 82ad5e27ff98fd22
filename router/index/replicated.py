"""The prefix index and session affinity replicated between processes (``backend: replicated``):
what the workers of ``prefixgate serve --workers N`` use on their private Redis.

Every process keeps the whole index and affinity map in memory and answers reads from it, with
no round trip; its writes (a pick's blocks, a session's endpoint) are published on one Redis
channel, in batches, and every other process applies them to its own copy. The Redis backend
(router/index/redis_index.py) instead asks Redis on every lookup: one round trip, about 0.25 ms of
the gateway's CPU per request in redis-py, which is what a second worker is meant to save.

Replication is asynchronous and fire-and-forget: a process learns another's pick a loop
iteration or two later, and a batch lost while Redis is away is lost (counted in
``prefixgate_redis_dropped_updates_total{op="replicate"}``), which costs routing quality for
a while, never a request. A process that starts (a replaced worker) starts empty and fills from
the traffic that follows, like a restarted single gateway. Capacities and forgotten endpoints
are not replicated: every process scrapes and discovers the same endpoints itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
import time
import uuid
from collections.abc import Awaitable, Callable, Collection, Sequence
from typing import Any

import msgpack
from redis.asyncio import Redis
from redis.exceptions import RedisError

from router.index.affinity import InMemoryAffinityStore
from router.index.prefix_index import InMemoryPrefixIndex, capped
from router.index.redis_index import pack_hashes
from router.index.redis_link import RedisMetrics, key_tag

log = logging.getLogger("prefixgate.replicated")
Op = tuple[str, str, bytes]  # (kind, key, value)
Apply = Callable[[str, bytes], None]

MAX_PENDING = 100_000  # ops waiting to be published; past it new ones are dropped
MAX_BATCH = 1024  # ops per published message
PUBLISH_TIMEOUT_S = 1.0
# How long each batch gathers ops before it is published: bounds the publishes (and every other
# process's reads) to ~100 a second whatever the request rate, for a delay far under any
# session's turn time.
LINGER_S = 0.01
RETRY_S = 0.5
READ_TIMEOUT_S = 0.5  # how often the subscription loop looks at its stop flag


class Replicator:
    """Publishes this process's ops and applies the other processes' (handlers by op kind)."""

    def __init__(
        self, url: str, namespace: str, metrics: RedisMetrics, *, linger: float = LINGER_S,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self._linger, self._sleep = linger, sleep
        self._channel = key_tag(namespace) + ":replicate"
        self._client: Redis = Redis.from_url(url, socket_timeout=PUBLISH_TIMEOUT_S)
        self._metrics = metrics
        self._sender = uuid.uuid4().bytes[:8]
        self._handlers: dict[str, Apply] = {}
        self._pending: list[Op] = []
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._closing = False
        self._unreadable_logged = False

    def on(self, kind: str, apply: Apply) -> None:
        self._handlers[kind] = apply

    def put(self, op: Op) -> None:
        if len(self._pending) >= MAX_PENDING:
            self._metrics.dropped.labels("replicate", "overflow").inc()
            return
        self._pending.append(op)
        self._wake.set()

    def start(self) -> None:
        if not self._tasks:
            loop = asyncio.get_running_loop()
            self._tasks = [
                loop.create_task(self._publish_loop(), name="prefixgate-replicate-out"),
                loop.create_task(self._read_loop(), name="prefixgate-replicate-in"),
            ]

    async def _publish_loop(self) -> None:
        # Ends on the flag too: redis-py may swallow a cancellation that lands mid-command.
        while not self._closing:
            await self._wake.wait()
            # Every batch waits a linger, the ones left over from a long publish too: at load a
            # publish a request is what the linger is for.
            await self._sleep(self._linger)
            self._wake.clear()
            if self._closing:
                break
            batch, self._pending = self._pending[:MAX_BATCH], self._pending[MAX_BATCH:]
            if batch:
                await self._publish(coalesced(batch))
            if self._pending:
                self._wake.set()

    async def _publish(self, batch: list[Op]) -> None:
        message = msgpack.packb([self._sender, batch])
        try:
            async with asyncio.timeout(PUBLISH_TIMEOUT_S):
                await self._client.publish(self._channel, message)
        except (RedisError, OSError, TimeoutError) as exc:
            self._metrics.dropped.labels("replicate", "error").inc(len(batch))
            log.warning("replication: %d update(s) not published: %r", len(batch), exc)

    async def _read_loop(self) -> None:
        # Ends on the flag too, like the publisher.
        while not self._closing:
            try:
                async with self._client.pubsub() as pubsub:
                    await pubsub.subscribe(self._channel)
                    while not self._closing:
                        message = await pubsub.get_message(
                            ignore_subscribe_messages=True, timeout=READ_TIMEOUT_S
                        )
                        if message is not None:
                            self._apply_or_skip(message["data"])
            except (RedisError, OSError) as exc:
                if self._closing:
                    return
                self._metrics.errors.labels("replicate", "error").inc()
                log.warning("replication: subscription lost (%r); again in %.1fs", exc, RETRY_S)
                await asyncio.sleep(RETRY_S)

    def _apply_or_skip(self, data: bytes) -> None:
        """Apply a batch; one this release cannot read (another release's format, anything
        else published on the channel) is counted and skipped, never the end of the
        subscription."""
        try:
            self.apply(data)
        except Exception as exc:
            self._metrics.errors.labels("replicate", "unreadable").inc()
            if not self._unreadable_logged:
                self._unreadable_logged = True
                log.warning(
                    "replication: skipping a message this release cannot read (%r); further "
                    "ones are only counted (prefixgate_redis_errors_total)", exc,
                )

    def apply(self, data: bytes) -> None:
        """Apply another process's published batch (our own comes back too: skipped)."""
        sender, ops = msgpack.unpackb(data)
        if sender == self._sender:
            return
        applied: dict[str, int] = {}
        for kind, key, value in ops:
            handler = self._handlers.get(kind)
            if handler is not None:
                handler(key, value)
                applied[kind] = applied.get(kind, 0) + 1
        for kind, count in applied.items():  # per batch: a labelled child costs a lookup
            self._metrics.replicated_applied.labels(kind).inc(count)

    async def aclose(self, grace: float = 0.5) -> None:
        """Publish what is pending (within ``grace``), then stop."""
        if self._pending:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(grace):
                    await self._publish(self._pending[:MAX_BATCH])
        self._pending.clear()
        self._closing = True
        self._wake.set()
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            # Within one read timeout (or one publish budget) each loop sees the flag.
            _, late = await asyncio.wait(
                self._tasks, timeout=READ_TIMEOUT_S + PUBLISH_TIMEOUT_S + 1.0
            )
            if late:
                log.warning("replication: %d task(s) did not stop in time", len(late))
        self._tasks = []
        await self._client.aclose()


def coalesced(batch: list[Op]) -> list[Op]:
    """The batch without the earlier copies of an op repeated in it (the last copy stays where
    it was). Every op is a record, a withdrawal, a set or a restore: the last copy leaves what
    all of them would (the last write, the latest recency; a record and a withdrawal of a chain,
    a set and a restore of a session, in the order of their last copies). A burst on one
    prefix repeats its record many times in a linger, and every other process applied each
    copy."""
    if len(batch) < 2:
        return batch
    return list(dict.fromkeys(reversed(batch)))[::-1]


# How long after this process forgot an endpoint the other processes' records of it are
# ignored: each runs its own discovery, so one that has not yet seen the pod leave may still
# pick it, and its record, applied here, would bring back entries nothing forgets again.
FORGOTTEN_FOR_S = 30.0
# A chain this process published for an endpoint less than this long ago is not published again:
# the other processes hold it already, and all a copy would change there is its recency, which
# orders their evictions and can lag by this much. A fleet's shared system prompt with short
# questions (under a block) records the same chain on every request.
RESEND_AFTER_S = 1.0
MAX_SENT = 65_536  # chains remembered as published; past it the oldest are forgotten


class ReplicatedPrefixIndex:
    """A :class:`PrefixIndex` whose records reach every process sharing the replicator."""

    def __init__(
        self, local: InMemoryPrefixIndex, replicator: Replicator,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.local = local
        self._replicator = replicator
        self._clock = clock
        self._forgotten: dict[str, float] = {}  # endpoint -> when this process forgot it
        # (endpoint, the chain's last hash) -> when published; oldest first
        self._sent: dict[tuple[str, int], float] = {}
        replicator.on("r", self._apply_record)
        replicator.on("w", self._apply_withdraw)

    def _apply_record(self, endpoint_id: str, blob: bytes) -> None:
        if self._forgotten:
            gone = self._forgotten.get(endpoint_id)
            if gone is not None:
                if self._clock() - gone < FORGOTTEN_FOR_S:
                    return
                del self._forgotten[endpoint_id]
        self.local.record(endpoint_id, struct.unpack(f"<{len(blob) // 8}Q", blob))

    def _apply_withdraw(self, endpoint_id: str, blob: bytes) -> None:
        # The tail the withdrawing process's record added (its whole chain may be longer).
        self.local.withdraw(endpoint_id, struct.unpack(f"<{len(blob) // 8}Q", blob), 0)

    async def match(self, hashes: Sequence[int], endpoint_ids: Collection[str]) -> dict[str, int]:
        return self.local.match_now(hashes, endpoint_ids)

    def withdraw(self, endpoint_id: str, hashes: Sequence[int], held: int) -> None:
        hashes = capped(hashes, self.local.capacity(endpoint_id))
        self.local.withdraw(endpoint_id, hashes, held)
        tail = hashes[max(0, held) :]
        if tail:
            # A record of the chain again (another request's, served) is published at once.
            self._sent.pop((endpoint_id, hashes[-1]), None)
            self._replicator.put(("w", endpoint_id, pack_hashes(tail)))

    def record(self, endpoint_id: str, hashes: Sequence[int]) -> None:
        if hashes:
            self._forgotten.pop(endpoint_id, None)  # picked here: back in this pool
            self.local.record(endpoint_id, hashes)
            if self._first_in_a_while(endpoint_id, hashes[-1]):
                self._replicator.put(("r", endpoint_id, pack_hashes(hashes)))

    def _first_in_a_while(self, endpoint_id: str, last: int) -> bool:
        """Whether the chain ending in ``last`` was not published for ``endpoint_id`` in the
        last :data:`RESEND_AFTER_S` (chained hashes: the last one names the whole chain)."""
        now, key, sent = self._clock(), (endpoint_id, last), self._sent
        published = sent.get(key)
        if published is not None and now - published < RESEND_AFTER_S:
            return False
        sent.pop(key, None)
        while sent:  # the stale, oldest first (each entry leaves once: amortised O(1))
            oldest, at = next(iter(sent.items()))
            if len(sent) < MAX_SENT and now - at < RESEND_AFTER_S:
                break
            del sent[oldest]
        sent[key] = now
        return True

    async def forget_endpoint(self, endpoint_id: str) -> None:
        await self.local.forget_endpoint(endpoint_id)
        self._sent.clear()  # rare: a pod at that address again publishes its chains at once
        now = self._clock()
        self._forgotten = {
            e: t for e, t in self._forgotten.items() if now - t < FORGOTTEN_FOR_S
        }
        self._forgotten[endpoint_id] = now

    async def clear_endpoint(self, endpoint_id: str, life: str | None = None) -> None:
        # Unlike a departed endpoint's, the other processes' records made after this are not
        # held back: each process sees the restart in its own scrapes and clears its copy.
        self.local.forget_now(endpoint_id)
        self._sent.clear()

    def set_capacity(self, endpoint_id: str, blocks: int) -> None:
        self.local.set_capacity(endpoint_id, blocks)

    def room(self, endpoint_id: str) -> int:
        return self.local.room(endpoint_id)

    async def aclose(self) -> None:
        pass  # the replicator is the stores' to close


class ReplicatedAffinityStore:
    """Session affinity (``AffinityStore``) whose sets reach every process."""

    def __init__(self, local: InMemoryAffinityStore, replicator: Replicator) -> None:
        self.local = local
        self._replicator = replicator
        replicator.on("s", self._apply_set)
        replicator.on("u", self._apply_restore)

    def _apply_set(self, session_id: str, endpoint: Any) -> None:
        self.local.set(session_id, endpoint.decode() if isinstance(endpoint, bytes) else endpoint)

    def _apply_restore(self, session_id: str, packed: Any) -> None:
        failed, previous = msgpack.unpackb(packed)
        self.local.restore(session_id, failed, previous)

    async def get(self, session_id: str) -> str | None:
        return self.local.get_now(session_id)

    def set(self, session_id: str, endpoint_id: str) -> None:
        self.local.set(session_id, endpoint_id)
        self._replicator.put(("s", session_id, endpoint_id.encode()))

    def restore(self, session_id: str, endpoint_id: str, previous: str | None) -> None:
        if self.local.get_now(session_id) != endpoint_id:
            return  # moved on here since: that later set is published, and wins everywhere
        # Every process compares with its own copy: one whose session moved on keeps it.
        self.local.restore(session_id, endpoint_id, previous)
        self._replicator.put(("u", session_id, msgpack.packb([endpoint_id, previous])))

    async def forget_endpoint(self, endpoint_id: str) -> None:
        await self.local.forget_endpoint(endpoint_id)
