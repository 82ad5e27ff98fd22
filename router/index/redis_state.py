"""State shared by gateway replicas through Redis (every call goes through
:class:`router.index.redis_link.RedisLink`, so a sick Redis means local fallback, never a wait).

- :class:`RedisAffinityStore`: the session affinity store (``AffinityStore``) shared by replicas.
- :class:`SharedInFlight`: each replica publishes its own load per endpoint (requests in flight,
  and the prefill it has queued there: uncached tokens and requests not at their first byte
  yet, and the tokens' recent average) and reads the sum of the others', so that replicas do
  not herd onto the endpoint each thinks is idle, and the cost scorer prices the whole queue,
  not this replica's share of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from router.core.endpoints import NO_REMOTE_LOAD, RemoteLoad
from router.core.pool import EndpointPool
from router.core.tasks import cancel_and_wait
from router.index.affinity import InMemoryAffinityStore
from router.index.circuit_breaker import CircuitBreaker, Clock
from router.index.redis_link import (
    LuaScript,
    RedisClient,
    RedisLink,
    RedisMetrics,
    Unavailable,
    as_text,
    default_metrics,
    eval_script,
    key_tag,
)
from router.index.update_queue import UpdateQueue

# Undo a session's pick that served nothing, unless the session moved on since (another
# gateway's set): one key, given as KEYS, so Cluster-safe. ARGV: the failed endpoint, ttl ms,
# then the previous endpoint (none: the session is forgotten).
_RESTORE = LuaScript(
    """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
if ARGV[3] then
  redis.call('SET', KEYS[1], ARGV[3], 'PX', ARGV[2])
else
  redis.call('DEL', KEYS[1])
end
return 1
"""
)

# A queued write of a session: its endpoint (a set), or the pick to undo and the endpoint
# before it (a restore, compared and set in Redis by _RESTORE).
_Write = str | tuple[str, str | None]


class RedisAffinityStore:
    """Session -> endpoint shared by replicas (``AffinityStore``), expiring by Redis TTL.

    ``set`` lands in the local store at once and ships in the background; ``get`` asks Redis
    within the budget and falls back to the local store. Sessions are keyed without a hash tag
    (``pg:<namespace>:sess:<id>``) so that on a Cluster they spread over all slots.
    """

    def __init__(
        self,
        url: str,
        *,
        namespace: str = "prefixgate",
        ttl_seconds: float = 600.0,
        max_sessions: int = 100_000,
        timeout_ms: float = 5.0,
        write_timeout_ms: float = 50.0,
        metrics: RedisMetrics | None = None,
        breaker: CircuitBreaker | None = None,
        cluster: bool = False,
        max_pending: int = 4096,
    ) -> None:
        key_tag(namespace)
        self.local = InMemoryAffinityStore(ttl_seconds, max_sessions)
        self._prefix = f"pg:{namespace}:sess:"
        self._ttl_ms = max(1, int(ttl_seconds * 1000))
        self._write_budget = write_timeout_ms / 1000.0
        self._link = RedisLink(
            url, component="affinity", metrics=default_metrics(metrics),
            timeout_ms=timeout_ms, breaker=breaker, cluster=cluster,
        )
        self._queue: UpdateQueue[str, _Write] = UpdateQueue(
            self._ship, op="affinity_set", link=self._link, max_items=max_pending, max_batch=256
        )
        # Sessions whose last set here could not be shipped: Redis holds an older answer.
        self._unshipped: OrderedDict[str, None] = OrderedDict()
        self._max_unshipped = max_pending

    async def get(self, session_id: str) -> str | None:
        local = self.local.get_now(session_id)
        if session_id in self._unshipped and local is not None:
            del self._unshipped[session_id]
            self._queue.put(session_id, local)  # try again
        if session_id in self._queue:
            return local  # our own newer answer has not reached Redis yet
        endpoint = await self._link.get_text("affinity_get", self._prefix + session_id)
        if endpoint is None:
            return local
        if endpoint != local:
            self.local.set(session_id, endpoint)  # so a Redis outage falls back to the latest
        return endpoint

    def set(self, session_id: str, endpoint_id: str) -> None:
        self.local.set(session_id, endpoint_id)
        self._queue.put(session_id, endpoint_id)

    def restore(self, session_id: str, endpoint_id: str, previous: str | None) -> None:
        if self.local.get_now(session_id) != endpoint_id:
            return  # a later set here: it ships, and Redis is left to it
        self.local.restore(session_id, endpoint_id, previous)
        self._unshipped.pop(session_id, None)
        # Replaces the pick's set if it is still queued; else undoes it in Redis unless
        # another gateway has moved the session on since.
        self._queue.put(session_id, (endpoint_id, previous))

    async def forget_endpoint(self, endpoint_id: str) -> None:
        # Remote entries are left to their TTL: scorers only credit an affinity endpoint that is
        # a live candidate, and finding them would mean scanning the keyspace.
        await self.local.forget_endpoint(endpoint_id)

    async def _ship(self, batch: list[tuple[str, _Write]]) -> None:
        sets = [(s, w) for s, w in batch if isinstance(w, str)]
        # Rare (a request every attempt of which failed): one script call each.
        restores = [(s, w) for s, w in batch if not isinstance(w, str)]

        async def run(client: RedisClient) -> None:
            if sets:
                pipe = client.pipeline(transaction=False)
                for session_id, endpoint_id in sets:
                    pipe.set(self._prefix + session_id, endpoint_id, px=self._ttl_ms)
                await pipe.execute()
            for session_id, (failed, previous) in restores:
                args = [failed, self._ttl_ms] + ([] if previous is None else [previous])
                await eval_script(client, _RESTORE, [self._prefix + session_id], args)

        try:
            await self._link.call("affinity_set", run, self._write_budget)
        except Unavailable:
            for session_id, _ in batch:
                self._unshipped[session_id] = None
                self._unshipped.move_to_end(session_id)
            while len(self._unshipped) > self._max_unshipped:
                self._unshipped.popitem(last=False)
            raise
        for session_id, _ in batch:
            self._unshipped.pop(session_id, None)

    async def flush(self) -> None:
        await self._queue.flush()

    async def aclose(self, grace: float = 0.5) -> None:
        """Ship what is pending (for at most ``grace`` seconds), then close the pool."""
        await self._queue.aclose(grace)
        await self._link.aclose()


# KEYS: the gateways' set, this gateway's counts, the other gateways' counts (a key touched by a
# script must be one it is given: a Redis Cluster routes it by them). A key of a gateway gone
# stale has expired with it. ARGV: gateway id, ttl ms, then endpoint/count pairs.
_INFLIGHT = LuaScript(
    """
local gid, ttl = ARGV[1], tonumber(ARGV[2])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('DEL', KEYS[2])
if #ARGV > 2 then
  redis.call('HSET', KEYS[2], unpack(ARGV, 3))
  redis.call('PEXPIRE', KEYS[2], ttl)
end
redis.call('ZADD', KEYS[1], now, gid)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - ttl)
redis.call('PEXPIRE', KEYS[1], ttl * 4)
local totals, out = {}, {}
for k = 3, #KEYS do
  local kv = redis.call('HGETALL', KEYS[k])
  for i = 1, #kv, 2 do totals[kv[i]] = (totals[kv[i]] or 0) + tonumber(kv[i + 1]) end
end
for k, v in pairs(totals) do out[#out + 1] = k; out[#out + 1] = v end
return {redis.call('ZRANGE', KEYS[1], 0, -1), out}
"""
)


# Field suffixes of the published load (endpoint ids never hold a space): the bare id counts
# requests in flight. A gateway of an older release sums these fields too, under names that
# match no endpoint, so mixed releases during a rolling upgrade still read each other's counts.
PENDING_TOKENS = " pending_tokens"
PENDING_REQUESTS = " pending_requests"
RECENT_TOKENS = " recent_tokens"

# While no gateway has anything in flight or queued, a sync would publish nothing and read
# nothing: the loop then calls Redis this often, not every tick, to stay a live member (well
# inside ``expiry``). Load here is still published at the next tick, and load elsewhere is
# seen by an idle gateway within this (instead of a tick) only after the whole fleet was idle.
IDLE_SYNC_S = 0.5


def gateway_load(pool: EndpointPool) -> dict[str, int]:
    """This replica's load per endpoint, as :class:`SharedInFlight` publishes it: in flight,
    the prefill queued (tokens, requests) and the queue's recent average in tokens."""
    now = pool.clock()
    load: dict[str, int] = {}
    for state in pool:
        eid = state.endpoint.id
        load[eid] = state.in_flight
        load[eid + PENDING_TOKENS] = state.pending_prefill_tokens
        load[eid + PENDING_REQUESTS] = state.pending_prefill_requests
        load[eid + RECENT_TOKENS] = round(state.recent_prefill_tokens(now))
    return load


class SharedInFlight:
    """Load per endpoint summed over the other gateway replicas (see :func:`gateway_load`).

    Every ``interval`` one script call publishes this replica's counts (a hash that expires after
    ``expiry`` seconds, so a crashed replica's counts vanish) and reads the others' sums; only
    every :data:`IDLE_SYNC_S` while neither has anything to tell (an idle worker made 13 round
    trips a second, about half its idle CPU, to publish and read zeros).
    """

    def __init__(
        self,
        url: str,
        counts: Callable[[], Mapping[str, int]],
        *,
        namespace: str = "prefixgate",
        gateway_id: str | None = None,
        interval: float = 0.075,
        expiry: float = 1.5,
        timeout_ms: float = 5.0,
        metrics: RedisMetrics | None = None,
        breaker: CircuitBreaker | None = None,
        cluster: bool = False,
        clock: Clock = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        tag = key_tag(namespace)
        self.gateway_id = gateway_id or uuid.uuid4().hex[:12]
        self._counts = counts
        self._interval = interval
        self._expiry = expiry
        self._clock = clock
        self._sleep = sleep
        self._members_key = tag + ":gw"
        self._prefix = tag + ":if:"
        self._link = RedisLink(
            url, component="inflight", metrics=default_metrics(metrics),
            timeout_ms=timeout_ms, breaker=breaker, cluster=cluster,
        )
        self._remote: dict[str, int] = {}
        self._others: list[str] = []  # the other gateways' keys, as the last sync read them
        self._read_at = -float("inf")
        self._task: asyncio.Task[None] | None = None

    def _live(self) -> Mapping[str, int]:
        """The other replicas' counts from the last read; none once that read is stale."""
        return {} if self._clock() - self._read_at > self._expiry else self._remote

    def remote_in_flight(self, endpoint_id: str) -> int:
        """The other replicas' in-flight count for ``endpoint_id`` (0 once the read is stale)."""
        return self._live().get(endpoint_id, 0)

    def remote_load(self, endpoint_id: str) -> RemoteLoad:
        """The other replicas' load on ``endpoint_id``: in flight, and the prefill they have
        queued (tokens, requests, recent average of the tokens); nothing once the read is
        stale."""
        remote = self._live()
        if not remote:
            return NO_REMOTE_LOAD
        return (
            remote.get(endpoint_id, 0),
            remote.get(endpoint_id + PENDING_TOKENS, 0),
            remote.get(endpoint_id + PENDING_REQUESTS, 0),
            remote.get(endpoint_id + RECENT_TOKENS, 0),
        )

    def remote_counts(self) -> dict[str, int]:
        return dict(self._live())

    async def sync_once(self, counts: Mapping[str, int] | None = None) -> bool:
        """Publish our counts (``counts``, else read now) and read the others' in one script,
        given the keys of the gateways the last sync saw (and again with a gateway that joined
        since); False on failure."""
        args: list[Any] = [self.gateway_id, max(1, int(self._expiry * 1000))]
        for endpoint_id, count in (self._counts() if counts is None else counts).items():
            if count > 0:
                args += [endpoint_id, int(count)]
        gid = self.gateway_id

        async def publish_and_read() -> tuple[list[str], list[Any]]:
            keys = [self._members_key, self._prefix + gid, *self._others]
            members, flat = await self._link.call(
                "inflight_sync", lambda c: eval_script(c, _INFLIGHT, keys, args)
            )
            return [self._prefix + as_text(m) for m in members if as_text(m) != gid], flat

        try:
            # The others' keys are those of the last sync, and the script names the gateways
            # now: one round trip, and a second only when a gateway joined since.
            others, flat = await publish_and_read()
            if not set(others) <= set(self._others):
                self._others = others
                others, flat = await publish_and_read()
            self._others = others
        except Unavailable as exc:
            self._link.metrics.fallbacks.labels("inflight_sync", exc.reason).inc()
            return False
        it = iter(flat)
        self._remote = {as_text(k): int(v) for k, v in zip(it, it, strict=True)}
        self._read_at = self._clock()
        return True

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(
                self._loop(), name="prefixgate-inflight"
            )

    async def _loop(self) -> None:
        quiet_since: float | None = None  # the last sync published and read nothing
        while True:
            counts = self._counts()
            busy = any(counts.values())
            if busy or quiet_since is None or self._clock() - quiet_since >= IDLE_SYNC_S:
                synced_at = self._clock()
                ok = await self.sync_once(counts)
                quiet_since = synced_at if ok and not busy and not self._remote else None
            await self._sleep(self._interval)

    async def aclose(self) -> None:
        await cancel_and_wait(self._task)  # still set meanwhile: nothing starts another
        self._task = None
        own = self._prefix + self.gateway_id
        with contextlib.suppress(Unavailable):
            # Leaving cleanly: the others stop counting us now rather than at expiry.
            await self._link.call("inflight_sync", lambda c: c.delete(own))
        await self._link.aclose()
