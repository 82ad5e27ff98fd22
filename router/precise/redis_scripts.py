"""Lua scripts of the shared precise index (router/precise/shared_index.py describes the layout).

Every key a script touches shares one hash tag, so each script runs on one Redis Cluster slot,
and is one the caller gives in KEYS, as stores and proxies that route or check scripts by their
declared keys require. Garbage maps (``<p>d:<slot>``) are named from a slot number the caller
learns from earlier answers: a script that would need another one changes nothing and answers
``moved`` with the slot, and the caller sends it again.

Blobs are 8-byte fields packed back to back: engine hash ids, keys. A holder bitmap is a string,
one bit per endpoint slot, kept canonical (no trailing zero bytes).
"""

from __future__ import annotations

from router.index.redis_link import HOLDER_BITMAP_LUA, LuaScript

# Batches whose publish time is older than the last applied one by more than this are from an
# earlier incarnation of the publisher (a replica restart takes far longer).
STALE_SLACK_SECONDS = 1.0
_GC_BUDGET = 256  # garbage entries one script call reclaims: bounds its time on the server

_PRELUDE = """
local sub, band, floor = string.sub, bit.band, math.floor
local T = ARGV[1]
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + floor(tonumber(t[2]) / 1000)
end
local function int(x) return string.format('%d', x)
end
""" + HOLDER_BITMAP_LUA + """
local function gname(s) return T .. 'd:' .. s end
local function drop_bit(holders, key, byte, mask)
  local nv = without_bit(redis.call('HGET', holders, key), byte, mask)
  if nv == '' then redis.call('HDEL', holders, key)
  elseif nv then redis.call('HSET', holders, key, nv) end
end
-- The endpoint's slot when `old`, the garbage map the caller named for it, is not the one a
-- clear would make of its map. Read before any write: such a call changes nothing.
local function moved_slot(slots, map, ep, old)
  local s = redis.call('HGET', slots, ep)
  if s and old ~= gname(s) and redis.call('EXISTS', map) == 1 then return s end
  return nil
end
-- Reclaim up to `budget` entries of the garbage map `d` (one the caller named, from an earlier
-- answer; a map already reclaimed, or no map, is left alone). Returns the maps left and one of
-- them to name next time ('' when none).
local function gc_step(holders, slots, garbage, d, budget)
  local g = sub(d, #T + 3)
  if g ~= '' and d == gname(g) and redis.call('SISMEMBER', garbage, g) == 1 then
    local s = tonumber(g)
    local byte, mask = floor(s / 8) + 1, 2 ^ (s % 8)
    -- Random fields, not a scan from cursor 0: once the scan's first buckets are empty (Redis
    -- does not shrink a hash until it is 90% empty) such a scan returns nothing, step after
    -- step.
    local kv = redis.call('HRANDFIELD', d, budget, 'WITHVALUES')
    if #kv > 0 then
      local fields, keys = {}, {}
      for x = 1, #kv, 2 do fields[#fields + 1] = kv[x]; keys[#keys + 1] = kv[x + 1] end
      local vals = redis.call('HMGET', holders, unpack(keys))
      local cur = {}  -- two engine hashes may share a key: the second sees the first's update
      for k = 1, #keys do
        local key = keys[k]
        local v = cur[key]
        if v == nil then v = vals[k] end
        local nv = without_bit(v, byte, mask)
        if nv == '' then redis.call('HDEL', holders, key); cur[key] = false
        elseif nv then redis.call('HSET', holders, key, nv); cur[key] = nv end
      end
      redis.call('HDEL', d, unpack(fields))
    end
    if redis.call('EXISTS', d) == 0 then
      redis.call('SREM', garbage, g)
      redis.call('HDEL', slots, '#' .. g)
    end
  end
  return {redis.call('SCARD', garbage), redis.call('SRANDMEMBER', garbage) or ''}
end
-- Forget everything an endpoint holds. The map the call found (`old`, as moved_slot checked)
-- becomes garbage of its old slot in O(1), reclaimed by gc_step, and the endpoint gets a fresh
-- slot at its next store. A map made since, in this call, holds this call's stores only: its
-- bits are dropped here, in no more steps than the stores took.
local function clear(holders, slots, garbage, map, refs, ep, ttl, old)
  local s = redis.call('HGET', slots, ep)
  if s and redis.call('EXISTS', map) == 1 then
    if old == gname(s) then
      redis.call('RENAME', map, old)
      redis.call('PEXPIRE', old, ttl)
      redis.call('SADD', garbage, s)
      redis.call('HSET', slots, '#' .. s, s)
    else
      local n = tonumber(s)
      local byte, mask = floor(n / 8) + 1, 2 ^ (n % 8)
      for _, k in ipairs(redis.call('HVALS', map)) do drop_bit(holders, k, byte, mask) end
      redis.call('DEL', map)
    end
    redis.call('HDEL', slots, ep)
  end
  redis.call('DEL', refs)
end
"""

# KEYS: holders, slots, garbage, meta, map, refs, the garbage map a clear would make of the map
# (`d:<its slot>`), a garbage map to reclaim a step of, then (with the refresh-all flag) every
# endpoint's meta, map and refs. ARGV: prefix, endpoint, seq, ts, capacity, ttl ms, resync ms,
# refresh-all flag, then ops as triples: 'S' hash-ids keys | 'R' hash-ids '' | 'C' '' ''.
# Returns {status, seq, the endpoint's slot now, a garbage map to name next}: status is applied,
# fresh, restart, gap, overflow (applied after a clear), dup or stale (skipped), or moved
# (nothing done: the seventh KEY was not the map's garbage name; the slot says which it is).
APPLY = LuaScript(_PRELUDE + """
local holders, slots, garbage = KEYS[1], KEYS[2], KEYS[3]
local meta, map, refs, old = KEYS[4], KEYS[5], KEYS[6], KEYS[7]
local ep, seq, ts = ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local cap, ttl, resync = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
local moved = moved_slot(slots, map, ep, old)
if moved then return {'moved', seq, moved, redis.call('SRANDMEMBER', garbage) or ''} end
local function reply(status, s, next_gc)
  return {status, s, redis.call('HGET', slots, ep) or '', next_gc}
end
local now = now_ms()
if ARGV[8] == '1' then
  -- First, before a duplicate's or a stale batch's early return: every endpoint's keys kept
  -- alive while any gateway writes (the caller read them from the slots hash).
  for k = 9, #KEYS do redis.call('PEXPIRE', KEYS[k], ttl) end
  for _, key in ipairs({holders, slots, garbage}) do redis.call('PEXPIRE', key, ttl) end
end
local m = redis.call('HMGET', meta, 'seq', 'ts', 'until')
local status, untl = 'applied', tonumber(m[3] or '0')
local function reset(why, trusted)
  clear(holders, slots, garbage, map, refs, ep, ttl, old)
  status = why
  if trusted then untl = 0 else untl = now + resync end
end
if not m[1] then
  reset('fresh', seq == 0)
else
  local s0, t0 = tonumber(m[1]), tonumber(m[2])
  if seq <= s0 then
    if ts <= t0 then return reply('dup', s0, redis.call('SRANDMEMBER', garbage) or '') end
    reset('restart', seq == 0)  -- an older seq published later: the publisher restarted
  elseif ts < t0 - @SLACK@ then
    -- a lagging delivery from before a restart
    return reply('stale', s0, redis.call('SRANDMEMBER', garbage) or '')
  elseif seq > s0 + 1 then
    reset('gap', false)  -- no replica delivered the batches in between
  end
end
local byte, mask
local function use_slot()
  local s = slot_of(slots, ep, true)
  byte, mask = floor(s / 8) + 1, 2 ^ (s % 8)
end
use_slot()
local function ref(k)
  local nv = with_bit(redis.call('HGET', holders, k), byte, mask)
  if nv then redis.call('HSET', holders, k, nv) else redis.call('HINCRBY', refs, k, 1) end
end
local function unref(k)
  local c = tonumber(redis.call('HGET', refs, k) or '0')
  if c > 1 then redis.call('HINCRBY', refs, k, -1) return end
  if c == 1 then redis.call('HDEL', refs, k) return end
  local nv = without_bit(redis.call('HGET', holders, k), byte, mask)
  if nv == '' then redis.call('HDEL', holders, k)
  elseif nv then redis.call('HSET', holders, k, nv) end
end
for x = 9, #ARGV, 3 do
  local kind, hs, ks = ARGV[x], ARGV[x + 1], ARGV[x + 2]
  if kind == 'S' then
    for i = 1, #hs / 8 do
      local h, k = sub(hs, i * 8 - 7, i * 8), sub(ks, i * 8 - 7, i * 8)
      local old = redis.call('HGET', map, h)
      if old == k then
        -- Another block cached under the hash (vLLM does not de-duplicate): it takes a
        -- removal of each copy to drop it. Counted in refs under 'c' .. h (9 bytes: no key).
        redis.call('HINCRBY', refs, 'c' .. h, 1)
      else
        if old then unref(old); redis.call('HDEL', refs, 'c' .. h) end
        redis.call('HSET', map, h, k)
        ref(k)
      end
    end
  elseif kind == 'R' then
    for i = 1, #hs / 8 do
      local h = sub(hs, i * 8 - 7, i * 8)
      local copies = tonumber(redis.call('HGET', refs, 'c' .. h) or '0')
      if copies > 1 then redis.call('HINCRBY', refs, 'c' .. h, -1)
      elseif copies == 1 then redis.call('HDEL', refs, 'c' .. h)
      else
        local k = redis.call('HGET', map, h)
        if k then redis.call('HDEL', map, h); unref(k) end
      end
    end
  else
    clear(holders, slots, garbage, map, refs, ep, ttl, old)
    untl = 0  -- a cleared cache is fully known from here on
    use_slot()
  end
end
if redis.call('HLEN', map) > cap then reset('overflow', false) end
-- 'at': when a batch was last applied (seconds): the refresh purges an endpoint idle for the TTL.
redis.call('HSET', meta, 'seq', ARGV[3], 'ts', ARGV[4], 'until', int(untl),
  'at', int(floor(now / 1000)))
local left = gc_step(holders, slots, garbage, KEYS[8], @GC@)
for _, key in ipairs({holders, slots, garbage, meta, map, refs}) do
  redis.call('PEXPIRE', key, ttl)
end
return reply(status, seq, left[2])
""".replace("@SLACK@", repr(STALE_SLACK_SECONDS)).replace("@GC@", str(_GC_BUDGET)))

# KEYS: holders, slots, garbage, meta, map, refs, speculative, the garbage map a clear would make
# of the map, a garbage map to reclaim a step of. ARGV: prefix, endpoint, ttl ms. Purges the
# endpoint; returns {garbage maps left to reclaim (see GC), one to name next, ''}, or {-1, '',
# the endpoint's slot} when the eighth KEY was not the map's garbage name (nothing done).
FORGET = LuaScript(_PRELUDE + """
local slots, old = KEYS[2], KEYS[8]
local moved = moved_slot(slots, KEYS[5], ARGV[2], old)
if moved then return {-1, '', moved} end
local s = redis.call('HGET', slots, ARGV[2])
clear(KEYS[1], slots, KEYS[3], KEYS[5], KEYS[6], ARGV[2], tonumber(ARGV[3]), old)
redis.call('HDEL', slots, ARGV[2])
redis.call('DEL', KEYS[4], KEYS[6], KEYS[7])
local d = KEYS[9]
if s and old == gname(s) then d = old end  -- its own garbage first
local left = gc_step(KEYS[1], slots, KEYS[3], d, @GC@)
return {left[1], left[2], ''}
""".replace("@GC@", str(_GC_BUDGET)))

# KEYS: holders, slots, garbage, a garbage map. ARGV: prefix. One bounded step of that map;
# returns {maps left, one to name next}.
GC = LuaScript(_PRELUDE + """
return gc_step(KEYS[1], KEYS[2], KEYS[3], KEYS[4], @GC@)
""".replace("@GC@", str(_GC_BUDGET)))

# KEYS: the endpoint's speculative zset. ARGV: prefix, ttl ms, cap, packed keys.
SPECULATE = LuaScript(_PRELUDE + """
local z, ttl, cap, blob = KEYS[1], tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4]
local now = now_ms()
local until_ms = int(now + ttl)
local n = #blob / 8
local i = 1
while i <= n do
  local args = {}
  for k = i, math.min(n, i + 511) do
    args[#args + 1] = until_ms; args[#args + 1] = sub(blob, k * 8 - 7, k * 8)
  end
  redis.call('ZADD', z, 'GT', unpack(args))
  i = i + 512
end
redis.call('ZREMRANGEBYSCORE', z, '-inf', now)
local extra = redis.call('ZCARD', z) - cap
if extra > 0 then redis.call('ZPOPMIN', z, extra) end
redis.call('PEXPIRE', z, ttl + 1000)
return n
""")

# KEYS: holders, slots, then per candidate: meta, speculative. ARGV: prefix, packed keys, then
# the candidate ids. Returns per candidate {trusted, confirmed, speculative}: the leading blocks
# held by events (trusted endpoints only) and by live speculative entries.
MATCH = LuaScript(_PRELUDE + """
local holders, blob = KEYS[1], ARGV[2]
local n, m = #blob / 8, #ARGV - 2
local now = now_ms()
local out, conf, spec, bytes, masks, trusted = {}, {}, {}, {}, {}, {}
for j = 1, m do conf[j] = 0; spec[j] = 0 end
if m == 0 or n == 0 then
  for j = 1, m do out[#out + 1] = 0; out[#out + 1] = 0; out[#out + 1] = 0 end
  return out
end
local sl = redis.call('HMGET', KEYS[2], unpack(ARGV, 3))
local active = {}
for j = 1, m do
  local u = redis.call('HGET', KEYS[1 + 2 * j], 'until')
  trusted[j] = u ~= false and tonumber(u) <= now
  if trusted[j] and sl[j] then
    local s = tonumber(sl[j])
    bytes[j], masks[j] = floor(s / 8) + 1, 2 ^ (s % 8)
    active[#active + 1] = j
  end
end
local function field(k) return sub(blob, k * 8 - 7, k * 8) end
-- Walk in growing chunks and stop at the first block no active candidate holds.
local i, chunk = 0, 32
while i < n and #active > 0 do
  local hi = math.min(n, i + chunk)
  local f = {}
  for k = i + 1, hi do f[#f + 1] = field(k) end
  local vals = redis.call('HMGET', holders, unpack(f))
  for k = 1, #vals do
    local v, still = vals[k], {}
    for _, j in ipairs(active) do
      local b = v and string.byte(v, bytes[j])
      if b and band(b, masks[j]) ~= 0 then still[#still + 1] = j else conf[j] = i + k - 1 end
    end
    active = still
    if #active == 0 then break end
  end
  i = hi
  chunk = math.min(chunk * 2, 1024)
end
for _, j in ipairs(active) do conf[j] = n end
for j = 1, m do
  local z = KEYS[2 + 2 * j]
  if redis.call('EXISTS', z) == 1 then
    local done, pos, step = false, 0, 32
    while not done and pos < n do
      local hi = math.min(n, pos + step)
      local f = {}
      for k = pos + 1, hi do f[#f + 1] = field(k) end
      local scores = redis.call('ZMSCORE', z, unpack(f))
      for k = 1, #scores do
        if not scores[k] or tonumber(scores[k]) <= now then done = true; break end
        spec[j] = pos + k
      end
      pos = hi
      step = math.min(step * 2, 1024)
    end
  end
  out[#out + 1] = trusted[j] and 1 or 0; out[#out + 1] = conf[j]; out[#out + 1] = spec[j]
end
return out
""")
