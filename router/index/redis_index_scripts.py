"""Lua scripts of the Redis prefix index (router/index/redis_index.py describes the data layout).

Every key a script touches shares one hash tag, so each script runs on one Redis Cluster slot.
"""

from __future__ import annotations

from router.index.redis_link import HOLDER_BITMAP_LUA, LuaScript

CHUNK = 1024  # hashes per HMGET/ZADD inside a script: well under Lua's unpack() limit

# Shared by the scripts below. A holder bitmap is a string, one bit per endpoint slot; it stays
# canonical (no trailing zero bytes) so that equal holder sets are equal strings, which lets the
# walk skip the per-endpoint test while consecutive blocks have the same holders.
PRELUDE = ("""
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
""").replace("@CHUNK@", str(CHUNK))

# KEYS: holders, slots. ARGV: packed hashes, then the candidate endpoint ids.
# Returns the consecutive match length per candidate, in ARGV order.
#
# A binary search, not a walk: the blocks an endpoint holds of one chain are always a prefix of
# it. Every record touches a whole chain from its first block, last block first, and eviction
# takes the least recently touched, so a block is never touched less recently than any block
# after it in a chain. So each endpoint's match length is where "held" turns to "not held", and
# the search partitions the candidates at each probe: O(log n) lookups for endpoints that agree,
# about 12 for a 200K-token prompt instead of 3,000.
MATCH = LuaScript(PRELUDE + """
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

# KEYS: holders, slots, this endpoint's LRU, clocks, last records, then (with the refresh-all flag)
# every endpoint's LRU. ARGV: endpoint, capacity, ttl ms, refresh-all flag, packed hashes (possibly
# empty: then it only trims), the most blocks to touch in this call (0: no limit), and the fresh
# bound of the record this call is a piece of ('' for a record of its own). Returns 0, or
# {1 + the fresh head's length, the fresh bound} when the touch would exceed that limit (nothing
# is written: the caller ships the chain in pieces, each with that bound, as
# InMemoryPrefixIndex's pieces share theirs), or, for a trim,
# the entries over capacity left for the next call.
# The touch rules of InMemoryPrefixIndex.record (router/index/prefix_index.py), step for step and in
# the same double arithmetic, so both indexes score and evict alike: a binary search for the
# fresh head of the chain, then only the rest is touched.
RECORD = LuaScript(PRELUDE + """
local holders, slots, lru, clocks, seen = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local ep, cap, ttl, blob = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[5]
local most, bound = tonumber(ARGV[6]), ARGV[7]
if ARGV[4] == '1' then
  -- First, before any early return (a long record's pieces follow with the flag off): every
  -- endpoint's keys kept alive while any gateway writes. The caller gives the LRU keys (read
  -- from the slots hash): a script touches only keys it is given, as a Cluster requires.
  for k = 6, #KEYS do redis.call('PEXPIRE', KEYS[k], ttl) end
  redis.call('PEXPIRE', holders, ttl)
  redis.call('PEXPIRE', slots, ttl)
  redis.call('PEXPIRE', clocks, ttl)
  redis.call('PEXPIRE', seen, ttl)
end
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
  -- When a gateway last recorded the endpoint (seconds): the refresh purges one that none
  -- recorded for the TTL rather than keep it alive (router/index/redis_index.py).
  redis.call('HSET', seen, ep, redis.call('TIME')[1])
  local clock = tonumber(redis.call('HGET', clocks, ep) or false)
  if not clock then  -- entries written before the clock existed: continue above them
    local top = redis.call('ZREVRANGE', lru, 0, 0, 'WITHSCORES')
    clock = top[2] and math.ceil(tonumber(top[2])) or 0
  end
  local fresh = clock - math.max(1, math.floor(cap / 4))
  if bound and bound ~= '' then fresh = tonumber(bound) end
  local lo, hi = 0, n
  while lo < hi do
    local mid = math.floor((lo + hi + 1) / 2)
    local s = score_of(mid)
    if s and s > fresh then lo = mid else hi = mid - 1 end
  end
  if lo < n then
    local first, scores = lo + 1, nil
    if lo > 0 then scores = tail_scores(score_of(lo), fresh, n - lo) end
    if most > 0 and (scores and #scores or n) > most then return {lo + 1, fresh} end
    if not scores then
      first, scores = 1, {}
      for k = 1, n do scores[k] = clock + n - k + 1 end
    end
    touch(first, scores)
    redis.call('HSET', clocks, ep, clock + #scores)
  end
end
-- A trim (no blocks: the capacity shrank) pops at most `most` entries a script, as a purge
-- does by chunks: a shrink from 30K entries to 1K at once held the server for tens of ms.
local excess, left = redis.call('ZCARD', lru) - cap, 0
if n == 0 and most > 0 and excess > most then excess, left = most, excess - most end
pop_oldest(holders, lru, slot, excess)
redis.call('PEXPIRE', holders, ttl)
redis.call('PEXPIRE', slots, ttl)
redis.call('PEXPIRE', lru, ttl)
redis.call('PEXPIRE', clocks, ttl)
redis.call('PEXPIRE', seen, ttl)
return left
""")

# KEYS: holders, slots, the endpoint's LRU. ARGV: endpoint, packed hashes (the tail of a chain
# that a failed attempt's record added). Takes those blocks from the endpoint: out of its LRU and
# its bit off their holders (a block it does not hold has neither). Returns how many it held.
WITHDRAW = LuaScript(PRELUDE + """
local holders, lru, blob = KEYS[1], KEYS[3], ARGV[2]
local slot = slot_of(KEYS[2], ARGV[1], false)
if not slot then return 0 end
local byte, mask = math.floor(slot / 8) + 1, 2 ^ (slot % 8)
local n, i, removed = #blob / 8, 1, 0
while i <= n do
  local last = math.min(n, i + CHUNK - 1)
  local members = {}
  for k = i, last do members[#members + 1] = sub(blob, k * 8 - 7, k * 8) end
  removed = removed + redis.call('ZREM', lru, unpack(members))
  drop(holders, members, byte, mask)
  i = last + 1
end
return removed
""")

# KEYS: holders, slots, the endpoint's LRU, clocks, last records, and for a restart's clear its
# marker. ARGV: endpoint, chunk, and for a restart's clear this gateway's token and the marker's
# ttl ms. Purges one chunk of the endpoint's entries, frees its slot when none are left; returns
# how many are left. A restart's clear is done once per engine life, by the first gateway to
# notice it (its marker set): another noticing the same restart later would take the blocks
# recorded for the new engine since. Its owner's later chunks and retries carry on.
FORGET = LuaScript(PRELUDE + """
if KEYS[6] and not redis.call('SET', KEYS[6], ARGV[3], 'NX', 'PX', ARGV[4])
    and redis.call('GET', KEYS[6]) ~= ARGV[3] then
  return 0
end
local slot = slot_of(KEYS[2], ARGV[1], false)
pop_oldest(KEYS[1], KEYS[3], slot, tonumber(ARGV[2]))
local left = redis.call('ZCARD', KEYS[3])
if left == 0 then
  redis.call('HDEL', KEYS[2], ARGV[1])
  redis.call('HDEL', KEYS[4], ARGV[1])
  redis.call('HDEL', KEYS[5], ARGV[1])
end
return left
""")
