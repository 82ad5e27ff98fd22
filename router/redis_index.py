"""The prefix index shared through Redis, so that several gateway replicas route as one.

Every replica keeps an :class:`InMemoryPrefixIndex` warm and answers from it whenever Redis is
slow or down (fail-open); Redis only ever adds what the other replicas learned. One lookup is
one round trip (a Lua script walks the chain server-side); one record is at most one round trip,
shipped after the pick by a background task with a bounded, coalescing queue. The lookup is a
binary search over the chain (see ``_MATCH``), so its cost grows with the log of the prompt.

Data layout, all under one hash tag ``{pg:<namespace>}`` (or ``{pg:<namespace>:<partition>}``)
so that every key a script touches lives in one Redis Cluster slot:

- ``<tag>:h``  one hash: field = the block hash as 8 raw bytes, value = a bitmap of the endpoint
  slots that hold it (trailing zero bytes stripped, so one byte for up to 8 endpoints).
- ``<tag>:s``  one hash: endpoint id -> its slot number (lowest free slot, freed by a purge).
- ``<tag>:l:<endpoint>``  a sorted set per endpoint: member = block hash, score = its recency.
  The LRU: a chain head always scores at least as high as its tail, so eviction (ZPOPMIN past
  the capacity) frees a chain from its tail, exactly like the in-memory index, whose touch
  rules (touch only what is not fresh; see router/prefix_index.py) the record script repeats.
- ``<tag>:c``  one hash: endpoint id -> its touch clock (blocks touched so far).

Measured on Redis 7.0 (``python -m benchmarks.index_bench`` prints it): about 61 bytes per block
in the holder hash plus about 113 bytes per (endpoint, block) LRU entry. The bound for the
defaults (31,250 blocks per endpoint) is therefore 31,250 * (113 + 61) = 5.4 MB per endpoint when
no two endpoints share blocks: ~44 MB for 8 endpoints, ~350 MB for 64. Keys also carry a TTL
(a day by default, refreshed by every record) so that an abandoned namespace disappears.

One slot per namespace (no ``partition``) is the default: the caller hands over hashes only, and
the chain seed already separates models. The trade-off is that one namespace lives on one Cluster
node; give each large pool or model its own namespace or ``partition`` to spread the load.
"""

from __future__ import annotations

import asyncio
import struct
import time
from collections.abc import Collection, Sequence
from typing import Any

from prometheus_client import CollectorRegistry
from redis.exceptions import NoScriptError

from router.prefix_index import DEFAULT_CAPACITY_BLOCKS, InMemoryPrefixIndex
from router.redis_link import (
    HOLDER_BITMAP_LUA,
    CircuitBreaker,
    LuaScript,
    RedisLink,
    RedisMetrics,
    Unavailable,
    UpdateQueue,
    default_metrics,
    eval_script,
    key_tag,
)

DEFAULT_KEY_TTL_SECONDS = 86_400.0
_CHUNK = 1024  # hashes per HMGET/ZADD inside a script: well under Lua's unpack() limit
DEFAULT_MAX_BLOCKS_PER_WRITE = 256  # ~1.5 ms of Redis time, evictions included

# Shared by the scripts below. A holder bitmap is a string, one bit per endpoint slot; it stays
# canonical (no trailing zero bytes) so that equal holder sets are equal strings, which lets the
# walk skip the per-endpoint test while consecutive blocks have the same holders.
_PRELUDE = ("""
local CHUNK = @CHUNK@
local sub, band = string.sub, bit.band
""" + HOLDER_BITMAP_LUA + """
local function drop(holders, members, byte, mask)
  if #members == 0 then return end
  local vals = redis.call('HMGET', holders, unpack(members))
  local set, del = {}, {}
  for k = 1, #members do
    local nv = without_bit(vals[k], byte, mask)
    if nv == '' then del[#del + 1] = members[k]
    elseif nv then set[#set + 1] = members[k]; set[#set + 1] = nv end
  end
  if #set > 0 then redis.call('HSET', holders, unpack(set)) end
  if #del > 0 then redis.call('HDEL', holders, unpack(del)) end
end
local function pop_oldest(holders, lru, slot, count)
  while count > 0 do
    local c = math.min(count, CHUNK)
    local popped = redis.call('ZPOPMIN', lru, c)
    if #popped == 0 then return end
    local members = {}
    for k = 1, #popped, 2 do members[#members + 1] = popped[k] end
    if slot then drop(holders, members, math.floor(slot / 8) + 1, 2 ^ (slot % 8)) end
    count = count - c
  end
end
""").replace("@CHUNK@", str(_CHUNK))

# KEYS: holders, slots. ARGV: packed hashes, then the candidate endpoint ids.
# Returns the consecutive match length per candidate, in ARGV order.
#
# A binary search, not a walk: the blocks an endpoint holds of one chain are always a prefix of
# it. Every record touches a whole chain from its first block, last block first, and eviction
# takes the least recently touched, so a block is never touched less recently than any block
# after it in a chain. So each endpoint's match length is where "held" turns to "not held", and
# the search partitions the candidates at each probe: O(log n) lookups for endpoints that agree,
# about 12 for a 200K-token prompt instead of 3,000.
_MATCH = LuaScript(_PRELUDE + """
local holders, blob = KEYS[1], ARGV[1]
local n, m = #blob / 8, #ARGV - 1
local res, bytes, masks, cands = {}, {}, {}, {}
for j = 1, m do res[j] = 0 end
if m == 0 or n == 0 then return res end
local sl = redis.call('HMGET', KEYS[2], unpack(ARGV, 2))
for j = 1, m do
  if sl[j] then
    local s = tonumber(sl[j])
    bytes[j], masks[j] = math.floor(s / 8) + 1, 2 ^ (s % 8)
    cands[#cands + 1] = j
  end
end
local seen = {}
local function holders_of(i)
  local v = seen[i]
  if v == nil then
    local o = (i - 1) * 8
    v = redis.call('HGET', holders, sub(blob, o + 1, o + 8)) or false
    seen[i] = v
  end
  return v
end
-- Every endpoint in set has its match length in [lo, hi].
local function search(lo, hi, set)
  if #set == 0 then return end
  if lo == hi then
    for _, j in ipairs(set) do res[j] = lo end
    return
  end
  local mid = math.floor((lo + hi + 1) / 2)
  local v = holders_of(mid)
  local yes, no = {}, {}
  for _, j in ipairs(set) do
    local b = v and string.byte(v, bytes[j])
    if b and band(b, masks[j]) ~= 0 then yes[#yes + 1] = j else no[#no + 1] = j end
  end
  search(mid, hi, yes)
  search(lo, mid - 1, no)
end
search(0, n, cands)
return res
""")

# KEYS: holders, slots, this endpoint's LRU, clocks. ARGV: endpoint, capacity, ttl ms,
# refresh-all flag, LRU key prefix, packed hashes (possibly empty: then it only trims), the most
# blocks to touch in this call (0: no limit). Returns 0, or 1 + the fresh head's length when the
# touch would exceed that limit (nothing is written: the caller ships the chain in pieces).
# The touch rules of InMemoryPrefixIndex.record (router/prefix_index.py), step for step and in
# the same double arithmetic, so both indexes score and evict alike: a binary search for the
# fresh head of the chain, then only the rest is touched.
_RECORD = LuaScript(_PRELUDE + """
local holders, slots, lru, clocks = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local ep, cap, ttl, blob = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[6]
local most = tonumber(ARGV[7])
local n = #blob / 8
local slot = slot_of(slots, ep, n > 0)
local function at(k) return sub(blob, k * 8 - 7, k * 8) end
local function score_of(k)
  local s = redis.call('ZSCORE', lru, at(k))
  return s and tonumber(s)
end
local function tail_scores(top, fresh, count)
  local low = math.max(fresh, top - 1)
  local step = (top - low) / (count + 1)
  local out, prev = {}, top
  for k = 1, count do
    local s = top - k * step
    if s >= prev then return nil end
    out[k] = s; prev = s
  end
  if out[count] <= low then return nil end
  return out
end
local function touch(first, scores)
  local byte, mask = math.floor(slot / 8) + 1, 2 ^ (slot % 8)
  local i = first
  while i <= n do
    local last = math.min(n, i + CHUNK - 1)
    local f, z = {}, {}
    for k = i, last do
      local h = at(k)
      f[#f + 1] = h; z[#z + 1] = scores[k - first + 1]; z[#z + 1] = h
    end
    redis.call('ZADD', lru, unpack(z))
    local vals = redis.call('HMGET', holders, unpack(f))
    local set = {}
    for k = 1, #f do
      local nv = with_bit(vals[k], byte, mask)
      if nv then set[#set + 1] = f[k]; set[#set + 1] = nv end
    end
    if #set > 0 then redis.call('HSET', holders, unpack(set)) end
    i = last + 1
  end
end
if n > 0 then
  local clock = tonumber(redis.call('HGET', clocks, ep) or false)
  if not clock then  -- entries written before the clock existed: continue above them
    local top = redis.call('ZREVRANGE', lru, 0, 0, 'WITHSCORES')
    clock = top[2] and math.ceil(tonumber(top[2])) or 0
  end
  local fresh = clock - math.max(1, math.floor(cap / 4))
  local lo, hi = 0, n
  while lo < hi do
    local mid = math.floor((lo + hi + 1) / 2)
    local s = score_of(mid)
    if s and s > fresh then lo = mid else hi = mid - 1 end
  end
  if lo < n then
    local first, scores = lo + 1, nil
    if lo > 0 then scores = tail_scores(score_of(lo), fresh, n - lo) end
    if most > 0 and (scores and #scores or n) > most then return lo + 1 end
    if not scores then
      first, scores = 1, {}
      for k = 1, n do scores[k] = clock + n - k + 1 end
    end
    touch(first, scores)
    redis.call('HSET', clocks, ep, clock + #scores)
  end
end
pop_oldest(holders, lru, slot, redis.call('ZCARD', lru) - cap)
redis.call('PEXPIRE', holders, ttl)
redis.call('PEXPIRE', slots, ttl)
redis.call('PEXPIRE', lru, ttl)
redis.call('PEXPIRE', clocks, ttl)
if ARGV[4] == '1' then
  -- LRU keys are derived from the slots hash; they share the hash tag, so the same Cluster slot.
  for _, e in ipairs(redis.call('HKEYS', slots)) do redis.call('PEXPIRE', ARGV[5] .. e, ttl) end
end
return 0
""")

# KEYS: holders, slots, the endpoint's LRU, clocks. ARGV: endpoint, chunk. Purges one chunk of
# the endpoint's entries, frees its slot when none are left; returns how many are left.
_FORGET = LuaScript(_PRELUDE + """
local slot = slot_of(KEYS[2], ARGV[1], false)
pop_oldest(KEYS[1], KEYS[3], slot, tonumber(ARGV[2]))
local left = redis.call('ZCARD', KEYS[3])
if left == 0 then
  redis.call('HDEL', KEYS[2], ARGV[1])
  redis.call('HDEL', KEYS[4], ARGV[1])
end
return left
""")

_Op = tuple[str, str, bytes]  # (kind: record | trim | forget, endpoint id, packed hashes)
_Call = tuple[LuaScript, list[str], list[Any]]
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
        max_pending: int = 1024,
        max_pending_bytes: int = 16 << 20,
        forget_chunk: int = 1000,
        flush_timeout: float = 0.5,
        max_blocks_per_write: int = DEFAULT_MAX_BLOCKS_PER_WRITE,
    ) -> None:
        tag = key_tag(namespace, partition)
        self.local = InMemoryPrefixIndex(default_capacity)
        self._holders, self._slots, self._lru_prefix = tag + ":h", tag + ":s", tag + ":l:"
        self._clocks = tag + ":c"
        if metrics is None and registry is not None:
            metrics = RedisMetrics(registry)
        self.metrics = default_metrics(metrics)
        self._link = RedisLink(
            url, component="index", metrics=self.metrics, timeout_ms=timeout_ms, breaker=breaker
        )
        self._write_budget = write_timeout_ms / 1000.0
        self._ttl_ms = max(1, int(key_ttl_seconds * 1000))
        self._refresh_every = key_ttl_seconds / 10
        self._refreshed_at = -float("inf")
        self._forget_chunk = max(1, forget_chunk)
        self._max_touch = max(0, max_blocks_per_write)
        self._flush_timeout = flush_timeout
        # Value: the capacity at enqueue time, so a later set_capacity cannot rewrite history.
        self._queue: UpdateQueue[_Op, int] = UpdateQueue(
            self._ship, op="index_update", link=self._link, max_items=max_pending,
            max_cost=max_pending_bytes, max_batch=16, max_batch_cost=32 << 10,
            cost=lambda op, _: len(op[2]) + 64,
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
        self.local.record(endpoint_id, hashes)
        op = ("record", endpoint_id, pack_hashes(hashes))
        self._queue.put(op, self.local.capacity(endpoint_id))

    async def forget_endpoint(self, endpoint_id: str) -> None:
        self.local.forget_now(endpoint_id)
        self._queue.discard_if(lambda op: op[1] == endpoint_id)
        self._queue.put(("forget", endpoint_id, b""), 0)

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

    def _script_args(self, op: _Op, capacity: int, refresh: bool, most: int = 0) -> _Call:
        kind, endpoint_id, blob = op
        keys = [self._holders, self._slots, self._lru_prefix + endpoint_id, self._clocks]
        if kind == "forget":
            return _FORGET, keys, [endpoint_id, self._forget_chunk]
        flag = "1" if refresh else "0"
        args = [endpoint_id, capacity, self._ttl_ms, flag, self._lru_prefix, blob, most]
        return _RECORD, keys, args

    async def _ship(self, batch: list[tuple[_Op, int]]) -> None:
        """One pipelined round trip for a batch of updates; purges continue chunk by chunk."""
        refresh = time.monotonic() - self._refreshed_at > self._refresh_every
        calls = [
            self._script_args(op, capacity, refresh, self._max_touch) for op, capacity in batch
        ]

        async def run(client: Any) -> list[Any]:
            results = await self._pipeline(client, calls)
            if any(isinstance(r, NoScriptError) for r in results):
                await client.script_load(_RECORD.source)
                await client.script_load(_FORGET.source)
                results = await self._pipeline(client, calls)
            return results

        results = await self._link.call("index_update", run, self._write_budget)
        failed = [r for r in results if isinstance(r, Exception)]
        if failed:
            self.metrics.errors.labels("index_update", "error").inc(len(failed))
            self.metrics.dropped.labels("index_update", "error").inc(len(failed))
        if refresh and not failed:
            self._refreshed_at = time.monotonic()
        for (op, capacity), result in zip(batch, results, strict=True):
            if op[0] == "forget" and isinstance(result, int) and result > 0:
                self._queue.put(op, capacity)  # bounded work per call: the rest in a later batch
            elif op[0] == "record" and isinstance(result, int) and result > 0:
                await self._record_in_pieces(op, capacity, result - 1)

    async def _record_in_pieces(self, op: _Op, capacity: int, fresh: int) -> None:
        """Touch a long chain as growing prefixes, one round trip each.

        One script runs alone on the Redis server: a cold 200K-token prompt touched at once
        would hold it for 10 ms or more, and every gateway's lookups would time out meanwhile.
        Recorded piece by piece, each piece is the next turn of the one before.
        """
        blob, step = op[2], self._max_touch
        ends = range(fresh + step, len(blob) // 8 + step, step)
        for end in ends:
            piece = (op[0], op[1], blob[: min(end * 8, len(blob))])
            _, keys, args = self._script_args(piece, capacity, False)

            async def run(client: Any, keys: list[str] = keys, args: list[Any] = args) -> Any:
                return await eval_script(client, _RECORD, keys, args)

            try:
                await self._link.call("index_update", run, self._write_budget)
            except Unavailable as exc:
                self.metrics.dropped.labels("index_update", exc.reason).inc()
                return

    @staticmethod
    async def _pipeline(client: Any, calls: list[_Call]) -> list[Any]:
        pipe = client.pipeline(transaction=False)
        for script, keys, args in calls:
            pipe.evalsha(script.sha, len(keys), *keys, *args)
        results: list[Any] = await pipe.execute(raise_on_error=False)
        return results
