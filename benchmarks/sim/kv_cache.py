"""The simulated GPU KV cache, with vLLM v1's prefix-caching semantics.

- The cache is ``num_blocks`` blocks of ``block_size`` tokens. Only full blocks are hashed;
  a block's hash chains its parent's: ``xxh64(token bytes, seed=parent_hash)``, the first
  parent being a constant, or the hash of ``cache_salt`` when the request has one (so the
  salt enters the first block's hash and, through the chain, every later one).
- A lookup returns the longest run of leading full blocks that are cached, capped so that at
  least one prompt token is recomputed (vLLM caps the hit at ``num_tokens - 1`` tokens and
  rounds down to a whole block).
- Blocks are reference counted; a block with a non-zero count belongs to a running request
  and is never evicted. Blocks whose count drops to zero go to the tail of an LRU free queue;
  a request frees its blocks last block first, so the tail of a chain is evicted first.
  Allocation takes the head of the free queue and drops its hash; a cache hit on a free
  block takes it out of the queue.
- ``queries``/``hits`` (the exported ``vllm:prefix_cache_*`` counters) count a request's first
  admission only: vLLM books the lookup of a preempted request's re-admission under
  ``preempted_queries``/``preempted_hits``, which /metrics does not export. Counted there, a
  re-admission that finds its own blocks again would report reuse no workload offers.
- ``usage`` is the fraction of blocks held by running requests (vLLM's kv_cache_usage_perc).
- As in vLLM, cached blocks are not de-duplicated: a block recomputed while a copy is cached
  (the last block of a repeated prompt, say) is cached too, and its hash stays findable until
  its last copy is evicted.
- With events enabled, the cache records vLLM's KV events as they happen: ``BlockStored`` when
  full blocks are cached (each copy), ``BlockRemoved`` when a cached block is evicted for reuse
  (each copy), and ``AllBlocksCleared`` on a reset; the engine publishes them once per step
  (``take_events``).
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import xxhash

from .kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

ROOT_HASH_SEED = 0x9E3779B97F4A7C15


def first_parent(cache_salt: str | None) -> int:
    """The parent hash of a request's first block (the salt, when given, goes in here)."""
    if not cache_salt:
        return ROOT_HASH_SEED
    return int(xxhash.xxh64_intdigest(cache_salt.encode("utf-8"), ROOT_HASH_SEED))


def extend_block_hashes(
    hashes: list[int], tokens: Sequence[int], block_size: int, cache_salt: str | None
) -> None:
    """Append the hashes of the full blocks of ``tokens`` not yet in ``hashes``."""
    start = len(hashes)
    end = len(tokens) // block_size
    if end <= start:
        return
    parent = hashes[-1] if hashes else first_parent(cache_salt)
    raw = array("q", tokens[start * block_size : end * block_size]).tobytes()
    step = block_size * 8
    digest = xxhash.xxh64_intdigest
    for offset in range(0, len(raw), step):
        parent = int(digest(raw[offset : offset + step], parent))
        hashes.append(parent)


class KVCache:
    """Block pool with prefix caching; all methods are O(blocks touched) and never await."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._ref = [0] * num_blocks
        self._hash: list[int | None] = [None] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        # hash -> the blocks holding it, oldest first: as vLLM, copies are not de-duplicated
        # (block tables stay append-only), and a hash is findable until its last copy goes.
        self._cached: dict[int, dict[int, None]] = {}
        self.queries = 0
        self.hits = 0
        self.preempted_queries = 0
        self.preempted_hits = 0
        self._events: list[KVEvent] | None = None

    # -- KV events ----------------------------------------------------------------------

    def enable_events(self) -> None:
        """Start recording KV events (off by default: nobody may be listening)."""
        if self._events is None:
            self._events = []

    def take_events(self) -> list[KVEvent]:
        """The events recorded since the last call, oldest first."""
        if not self._events:
            return []
        events, self._events = self._events, []
        return events

    def _stored(
        self, hashes: Sequence[int], tokens: Sequence[int], start: int, end: int,
        cache_salt: str | None,
    ) -> None:
        assert self._events is not None
        size = self.block_size
        extra: list[list[Any] | None] = [None] * (end - start)
        if cache_salt and start == 0:
            extra[0] = [cache_salt]  # vLLM folds the salt into the first block's hash only
        self._events.append(
            BlockStored(
                block_hashes=list(hashes[start:end]),
                parent_block_hash=hashes[start - 1] if start > 0 else None,
                token_ids=list(tokens[start * size : end * size]),
                block_size=size,
                extra_keys=extra,
            )
        )

    def _removed(self, block_hash: int) -> None:
        assert self._events is not None
        last = self._events[-1] if self._events else None
        if isinstance(last, BlockRemoved):
            last.block_hashes.append(block_hash)
        else:
            self._events.append(BlockRemoved([block_hash]))

    # -- lookup and allocation -------------------------------------------------------------

    def lookup(self, hashes: Sequence[int], num_tokens: int) -> list[int]:
        """Block ids of the longest cached prefix, capped at ``num_tokens - 1`` tokens."""
        limit = min(len(hashes), max(num_tokens - 1, 0) // self.block_size)
        found: list[int] = []
        cached = self._cached
        for i in range(limit):
            copies = cached.get(hashes[i])
            if not copies:
                break
            found.append(next(iter(copies)))
        return found

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def admit(
        self, hashes: Sequence[int], num_tokens: int, preempted: bool = False
    ) -> tuple[list[int], int] | None:
        """Take the cached prefix and fresh blocks for ``num_tokens``; None if they don't fit.

        Returns the request's blocks and its cached token count. Stats are counted only for
        an admission that succeeds, a ``preempted`` request's re-admission apart (as vLLM).
        """
        hit = self.lookup(hashes, num_tokens)
        need = self.blocks_for(num_tokens) - len(hit)
        hit_free = sum(1 for b in hit if self._ref[b] == 0)
        if need > len(self._free) - hit_free:
            return None
        for block in hit:
            if self._ref[block] == 0:
                del self._free[block]
            self._ref[block] += 1
        cached_tokens = len(hit) * self.block_size
        blocks = hit
        for _ in range(need):
            blocks.append(self._take_free())
        if preempted:
            self.preempted_queries += num_tokens
            self.preempted_hits += cached_tokens
        else:
            self.queries += num_tokens
            self.hits += cached_tokens
        return blocks, cached_tokens

    def allocate_block(self) -> int | None:
        """One fresh block (evicting the least recently freed one), or None if all are held."""
        if not self._free:
            return None
        return self._take_free()

    def _take_free(self) -> int:
        block, _ = self._free.popitem(last=False)
        old = self._hash[block]
        if old is not None:
            copies = self._cached[old]
            del copies[block]
            if not copies:
                del self._cached[old]
            if self._events is not None:
                self._removed(old)  # one per copy, as vLLM
            self._hash[block] = None
        self._ref[block] = 1
        return block

    def cache_blocks(
        self,
        blocks: Sequence[int],
        hashes: Sequence[int],
        start: int,
        end: int,
        tokens: Sequence[int] = (),
        cache_salt: str | None = None,
    ) -> None:
        """Mark ``blocks[start:end]`` as holding the full blocks with ``hashes[start:end]``.

        ``tokens`` (the request's tokens) go into the ``BlockStored`` events when enabled: one
        event per run of consecutive blocks that became findable.
        """
        run = -1
        for i in range(start, end):
            block = blocks[i]
            fresh = False
            if self._hash[block] is None:
                # A second copy of a cached block (a recomputed last prompt block, or two
                # requests computing the same prefix at once) is cached too, as in vLLM.
                block_hash = hashes[i]
                self._cached.setdefault(block_hash, {})[block] = None
                self._hash[block] = block_hash
                fresh = True
            if self._events is None:
                continue
            if fresh and run < 0:
                run = i
            elif not fresh and run >= 0:
                self._stored(hashes, tokens, run, i, cache_salt)
                run = -1
        if run >= 0:
            self._stored(hashes, tokens, run, end, cache_salt)

    def free(self, blocks: Sequence[int]) -> None:
        """Drop one reference to each block, queueing the unreferenced ones tail first."""
        for block in reversed(blocks):
            self._ref[block] -= 1
            if self._ref[block] == 0:
                self._free[block] = None

    # -- inspection ---------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks not held by a running request (cached or empty)."""
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by running requests."""
        return (self.num_blocks - len(self._free)) / self.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Distinct block hashes currently findable by a lookup (copies count once)."""
        return len(self._cached)

    def cached_hashes(self) -> list[int]:
        """Hashes of every cached block (for tests and a later KV-events publisher)."""
        return list(self._cached)

    def free_queue(self) -> list[int]:
        """Free block ids in eviction order (head first)."""
        return list(self._free)

    def ref_count(self, block: int) -> int:
        """References held on ``block`` by running requests."""
        return self._ref[block]

    def block_hash(self, block: int) -> int | None:
        """The hash a block currently holds, if any."""
        return self._hash[block]

    def reset(self) -> bool:
        """Forget every cached hash, as ``POST /reset_prefix_cache``; False while blocks are held.

        vLLM refuses to reset while requests hold blocks, and so does this.
        """
        if len(self._free) != self.num_blocks:
            return False
        self._cached.clear()
        self._hash = [None] * self.num_blocks
        if self._events is not None:
            self._events.append(AllBlocksCleared())
        return True
