"""The Redis link shared by every Redis-backed store: time budgets, a circuit breaker
(router/index/circuit_breaker.py), metrics and Lua scripts (router/index/update_queue.py ships
their updates in the background), to one server or to a Redis Cluster (``cluster: true``;
every call's keys share one hash slot).

Every call has a small time budget; after a few failures in a row the breaker skips Redis for a
growing interval, so a slow or absent Redis costs requests nothing (callers fall back to local
state) and the link recovers by itself.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import xxhash
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from redis.asyncio import Redis, RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import MovedError, NoScriptError, RedisClusterException, RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from router.index.circuit_breaker import CircuitBreaker

T = TypeVar("T")
# One server or a Redis Cluster: the stores use only single-slot commands and scripts (the keys
# of one call share a hash tag), so either serves them alike.
RedisClient = Redis | RedisCluster
log = logging.getLogger("prefixgate.redis")

_LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05)


def key_tag(namespace: str, partition: str | None = None) -> str:
    """The Cluster hash tag shared by every key a script touches (one slot per tag)."""
    if not namespace or any(c in namespace for c in "{} "):
        raise ValueError(f"namespace must be non-empty without braces or spaces: {namespace!r}")
    if partition is None:
        return "{pg:" + namespace + "}"
    return "{pg:" + namespace + ":" + xxhash.xxh64_hexdigest(partition.encode()) + "}"


class RedisMetrics:
    """The Redis backend's metrics, on the registry it is given (never the global one)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.lookups = Counter("prefixgate_index_lookups", "Prefix index lookups.", registry=r)
        self.lookup_hits = Counter(
            "prefixgate_index_lookup_hits", "Lookups where some endpoint matched.", registry=r
        )
        self.lookup_seconds = Histogram(
            "prefixgate_index_lookup_seconds",
            "Prefix index lookup latency, Redis round trip or fallback included.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.errors = Counter(
            "prefixgate_redis_errors",
            "Redis calls that failed, by operation and kind (error, timeout).",
            ["op", "kind"],
            registry=r,
        )
        self.fallbacks = Counter(
            "prefixgate_redis_fallbacks",
            "Reads answered from the local view instead of Redis, by operation and reason.",
            ["op", "reason"],
            registry=r,
        )
        self.dropped = Counter(
            "prefixgate_redis_dropped_updates",
            "Updates never applied in Redis (queue overflow or failed shipment).",
            ["op", "reason"],
            registry=r,
        )
        self.replicated_applied = Counter(
            "prefixgate_replicated_ops_applied",
            "Updates applied from other worker processes (backend: replicated), by kind "
            "(r: a prefix record, s: a session's endpoint).",
            ["kind"],
            registry=r,
        )
        self.circuit_open = Gauge(
            "prefixgate_redis_circuit_open",
            "1 while calls to Redis are skipped after repeated failures.",
            ["component"],
            registry=r,
        )


class Unavailable(Exception):
    """Redis could not answer within budget; ``reason`` is timeout, error or circuit_open."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


# Lua shared by the index scripts: endpoint slots, and holder bitmaps (a string, one bit per
# endpoint slot, kept canonical, no trailing zero bytes, so equal sets are equal strings).
HOLDER_BITMAP_LUA = """
local function slot_of(slots, ep, create)
  local s = redis.call('HGET', slots, ep)
  if s then return tonumber(s) end
  if not create then return nil end
  local used = {}
  for _, v in ipairs(redis.call('HVALS', slots)) do used[tonumber(v)] = true end
  local i = 0
  while used[i] do i = i + 1 end
  redis.call('HSET', slots, ep, i)
  return i
end
local function with_bit(v, byte, mask)
  v = v or ''
  if #v < byte then v = v .. string.rep('\\0', byte - #v) end
  local b = string.byte(v, byte)
  if bit.band(b, mask) ~= 0 then return nil end
  return string.sub(v, 1, byte - 1) .. string.char(bit.bor(b, mask)) .. string.sub(v, byte + 1)
end
local function without_bit(v, byte, mask)
  if not v or #v < byte then return nil end
  local b = string.byte(v, byte)
  if bit.band(b, mask) == 0 then return nil end
  v = string.sub(v, 1, byte - 1) .. string.char(b - mask) .. string.sub(v, byte + 1)
  local e = #v
  while e > 0 and string.byte(v, e) == 0 do e = e - 1 end
  return string.sub(v, 1, e)
end
"""


@dataclass(frozen=True, slots=True)
class LuaScript:
    source: str

    @property
    def sha(self) -> str:
        return hashlib.sha1(self.source.encode()).hexdigest()


ScriptCall = tuple[LuaScript, list[str], list[Any]]  # script, KEYS, ARGV


async def pipeline_scripts(client: RedisClient, calls: Sequence[ScriptCall]) -> list[Any]:
    """Every call in one pipelined round trip (EVALSHA; errors returned, not raised). When
    the server lost a script (a restart, SCRIPT FLUSH), the scripts are loaded and the
    pipeline sent once more."""

    async def send() -> list[Any]:
        pipe = client.pipeline(transaction=False)
        for script, keys, args in calls:
            # Not pipe.evalsha, which a cluster pipeline refuses: each call's keys share one
            # slot, so the cluster routes it like any single-key command.
            pipe.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)
        results: list[Any] = await pipe.execute(raise_on_error=False)
        return results

    results = await send()
    if any(isinstance(r, NoScriptError) for r in results):
        for source in {script.source for script, _, _ in calls}:
            await client.script_load(source)
        results = await send()
    return results


async def eval_script(
    client: RedisClient, script: LuaScript, keys: Sequence[str], args: Sequence[Any]
) -> Any:
    """EVALSHA, falling back to EVAL (which caches the script) when the server lost it."""
    try:
        return await client.evalsha(script.sha, len(keys), *keys, *args)
    except NoScriptError:
        return await client.eval(script.source, len(keys), *keys, *args)


def _raise_if_cancelled(exc: BaseException | None) -> None:
    """A cancellation that lands mid-command can be swallowed by redis-py (seen with 8.1: the
    command completes, or fails as a connection error). The task's cancel request is still
    pending then: honour it, or a background loop cancelled at that moment goes on forever."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError from exc


class RedisLink:
    """A Redis connection pool whose every call is budgeted, breaker-guarded and counted."""

    def __init__(
        self,
        url: str,
        *,
        component: str,
        metrics: RedisMetrics,
        timeout_ms: float = 5.0,
        breaker: CircuitBreaker | None = None,
        log_interval: float = 10.0,
        max_connections: int = 64,
        cluster: bool = False,
    ) -> None:
        self.timeout = timeout_ms / 1000.0
        self.component = component
        self.metrics = metrics
        self.breaker = breaker or CircuitBreaker()
        self.client = _client(url, cluster, max(self.timeout, 0.05), max_connections)
        self._log_interval = log_interval
        self._last_log = -float("inf")
        self._suppressed = 0
        self._closed = False
        self._cluster_init: asyncio.Task[Any] | None = None
        self._pending: set[asyncio.Future[Any]] = set()  # calls past their budget, cleaning up

    async def call(
        self, op: str, fn: Callable[[RedisClient], Awaitable[T]], budget: float | None = None
    ) -> T:
        if self._closed or not self.breaker.allow():
            raise Unavailable("circuit_open")
        try:
            result = await self._within(self.timeout if budget is None else budget, fn)
        except (TimeoutError, RedisTimeoutError) as exc:
            _raise_if_cancelled(exc)
            self._failed(op, "timeout", exc)
            raise Unavailable("timeout") from exc
        except (RedisError, RedisClusterException, OSError) as exc:
            # RedisClusterException is no RedisError: a cluster client raises it when no node
            # it knows answers, and it must fall back like any other failure.
            _raise_if_cancelled(exc)
            self._failed(op, "error", exc)
            raise Unavailable("error") from exc
        _raise_if_cancelled(None)
        if self.breaker.is_open:
            log.info("redis %s: reachable again", self.component)
        self.breaker.success()
        self.metrics.circuit_open.labels(self.component).set(0)
        return result

    async def _within(self, budget: float, fn: Callable[[RedisClient], Awaitable[T]]) -> T:
        client = self.client
        if not isinstance(client, RedisCluster):
            async with asyncio.timeout(budget):
                return await fn(client)
        # Cancelled, a cluster client cleans up with awaits of its own (closing a lost node's
        # connections: hundreds of ms in a failover), which would hold the caller past its
        # budget. The call runs as a task the caller stops waiting for at the budget.
        work = asyncio.ensure_future(self._on_cluster(client, fn))
        self._pending.add(work)
        work.add_done_callback(self._settled)
        try:
            return await asyncio.wait_for(asyncio.shield(work), budget)
        except BaseException:
            work.cancel()
            raise

    async def _on_cluster(
        self, client: RedisCluster, fn: Callable[[RedisClient], Awaitable[T]]
    ) -> T:
        await self._cluster_ready(client)
        return await fn(client)

    def _settled(self, task: asyncio.Future[Any]) -> None:
        self._pending.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: the caller has had its answer (or its timeout)

    async def eval_or_none(
        self, op: str, script: LuaScript, keys: Sequence[str], args: Sequence[Any]
    ) -> Any | None:
        """A script within the budget; None when not answered (counted as a fallback)."""
        try:
            return await self.call(op, lambda c: eval_script(c, script, keys, args))
        except Unavailable as exc:
            self.metrics.fallbacks.labels(op, exc.reason).inc()
            return None

    async def get_text(self, op: str, key: str) -> str | None:
        """GET within the budget; None when absent or not answered (counted as a fallback:
        the caller goes on with its local state)."""
        try:
            raw = await self.call(op, lambda c: c.get(key))
        except Unavailable as exc:
            self.metrics.fallbacks.labels(op, exc.reason).inc()
            return None
        return None if raw is None else as_text(raw)

    async def _cluster_ready(self, client: RedisCluster) -> None:
        """A cluster client learns the slot map first, a round trip to every primary (tens of
        ms). Inside a few-ms budget it would be cut short every time and never finish: it runs
        as a task of its own that a call waits for only within its budget (a no-op once the
        map is known, until a failure makes the client relearn it)."""
        task = self._cluster_init
        if task is None or (task.done() and (task.cancelled() or task.exception() is not None)):
            task = self._cluster_init = asyncio.get_running_loop().create_task(
                client.initialize(), name=f"redis-{self.component}-cluster-init"
            )
        if not task.done():
            await asyncio.shield(task)

    def _failed(self, op: str, kind: str, exc: BaseException) -> None:
        # A node gone or the slots moved: the cluster client wants the map again. Left to
        # itself it relearns it inside the next calls, whose few-ms budgets cut it short every
        # time (a failover was never noticed at 2 ms); the next call starts a task for it
        # instead (a no-op while the map holds).
        task = self._cluster_init
        if task is not None and task.done():
            self._cluster_init = None
        self.metrics.errors.labels(op, kind).inc()
        self.breaker.failure()
        self.metrics.circuit_open.labels(self.component).set(1 if self.breaker.is_open else 0)
        now = time.monotonic()
        if now - self._last_log < self._log_interval:
            self._suppressed += 1
            return
        reason = str(exc) or type(exc).__name__
        if isinstance(exc, MovedError):
            reason = f"MOVED {reason}: the url is a Redis Cluster node; set cluster: true"
        log.warning(
            "redis %s: %s %s (%s); using local state (%d similar failures not logged)",
            self.component, op, kind, reason, self._suppressed,
        )
        self._last_log = now
        self._suppressed = 0

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            for work in list(self._pending):
                work.cancel()
            if self._pending:
                await asyncio.wait(list(self._pending), timeout=2.0)
            task = self._cluster_init
            if task is not None:
                task.cancel()
                await asyncio.wait([task])
                if not task.cancelled():
                    task.exception()  # retrieved: a failed start is no news at shutdown
            await self.client.aclose()


def _client(url: str, cluster: bool, connect_timeout: float, max_connections: int) -> RedisClient:
    if cluster:
        # A cluster client keeps its own retries, bounded by each call's budget: they are how it
        # reaches a slot's new primary after a failover (redirections it follows anyway).
        return RedisCluster.from_url(
            url,
            socket_connect_timeout=connect_timeout,
            socket_timeout=1.0,
            max_connections=max_connections,
        )
    # No client-side retries: the budget is the caller's, and the breaker does the waiting.
    return Redis.from_url(
        url,
        socket_connect_timeout=connect_timeout,
        socket_timeout=1.0,
        retry=Retry(NoBackoff(), 0),
        max_connections=max_connections,
    )


def as_text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def default_metrics(metrics: RedisMetrics | None) -> RedisMetrics:
    return metrics if metrics is not None else RedisMetrics(CollectorRegistry())
