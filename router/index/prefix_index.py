"""The prefix index: which endpoint probably holds which prompt blocks in its KV cache.

:class:`PrefixIndex` is the extension point (the in-memory index below; a Redis-backed one shares
what several gateway replicas learn). It is approximate: it records where the gateway *sent*
prompts, bounded per endpoint by an LRU of about the endpoint's KV capacity, so that the guess
ages out roughly as the replica's own cache does.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections import deque
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Protocol

DEFAULT_CAPACITY_BLOCKS = 31_250
# Blocks one record touches before the event loop gets a turn (~0.3 ms of work).
DEFAULT_MAX_BLOCKS_PER_STEP = 256


class PrefixIndex(Protocol):
    """Lookup before scoring, record after the pick."""

    async def match(self, hashes: Sequence[int], endpoint_ids: Collection[str]) -> dict[str, int]:
        """Per endpoint, the number of leading blocks of ``hashes`` it holds (0 when none)."""
        ...

    def record(self, endpoint_id: str, hashes: Sequence[int]) -> None:
        """Note that ``endpoint_id`` now holds the chain ``hashes``.

        Synchronous so the next request of a burst already sees it (a long cold chain: its
        head at once, the rest within the next turns of the event loop); a remote-backed
        index applies the update to its local view at once and ships it in the background.
        """
        ...

    def withdraw(self, endpoint_id: str, hashes: Sequence[int], held: int) -> None:
        """Undo :meth:`record` of ``hashes`` on ``endpoint_id`` for a request whose attempt
        failed before its first byte (nothing was prefilled there): drop the chain's blocks
        past its first ``held``, the ones the endpoint held before (they stay, as recent)."""
        ...

    async def forget_endpoint(self, endpoint_id: str) -> None:
        """Drop everything known about an endpoint that left the pool."""
        ...

    async def clear_endpoint(self, endpoint_id: str, life: str | None = None) -> None:
        """The endpoint's cache was emptied (its engine restarted) but it stays in the pool:
        drop what it was thought to hold, and take its records again from now on. ``life``:
        the new engine's identity (its start time; None: unknown), so that an index shared by
        gateways clears once per restart, however many of them notice it."""
        ...

    def set_capacity(self, endpoint_id: str, blocks: int) -> None:
        """Bound the entries kept for ``endpoint_id`` (from its reported KV capacity)."""
        ...

    def room(self, endpoint_id: str) -> int:
        """Blocks ``endpoint_id`` can take before its entries must be evicted."""
        ...

    async def aclose(self) -> None: ...


def fresh_window(capacity: int) -> int:
    """How many touches ago a block may have been touched and still count as fresh.

    A fresh block is not touched again, and at most this many blocks can have been touched
    since, so it cannot be evicted while fresh: the window is a quarter of the capacity.
    """
    return max(1, capacity // 4)


def fresh_prefix(
    score_of: Callable[[int], float | None], hashes: Sequence[int], fresh: float
) -> int:
    """How many leading blocks of the chain have a score above ``fresh`` (a binary search).

    Scores never increase along a chain (a touch scores a chain head highest) and the held
    part of a chain is a prefix of it, so "fresh" holds for a prefix of the chain.
    """
    lo, hi = 0, len(hashes)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        score = score_of(hashes[mid - 1])
        if score is not None and score > fresh:
            lo = mid
        else:
            hi = mid - 1
    return lo


def capped(hashes: Sequence[int], capacity: int) -> Sequence[int]:
    """The part of a chain an endpoint of ``capacity`` blocks can hold: a touch evicts a
    chain from its tail, so blocks past the capacity would go at once (and a 30 MB prompt
    would cost its whole chain per record)."""
    return hashes if len(hashes) <= capacity else hashes[:capacity]


def tail_scores(top: float, fresh: float, count: int) -> list[float] | None:
    """Scores for ``count`` blocks touched after a fresh prefix whose last block scores ``top``.

    They go just below ``top`` (so the chain still evicts from its tail) and above ``fresh``
    (so above whatever stale score they had); None when doubles cannot tell them apart.
    """
    low = max(fresh, top - 1.0)
    step = (top - low) / (count + 1)
    scores = [top - k * step for k in range(1, count + 1)]
    if not scores or scores[0] >= top or scores[-1] <= low:
        return None
    if any(a <= b for a, b in itertools.pairwise(scores)):
        return None
    return scores


@dataclass(slots=True)
class _Lru:
    """Per-endpoint recency: block -> score, and a touch clock.

    Eviction order is kept lazily (an entry is live while it matches ``scores``) in two
    queues: whole touches score above everything, so they append to ``ordered`` in ascending
    order at C speed; tails slotted under a fresh head go to the min-heap ``heap``.
    """

    scores: dict[int, float] = field(default_factory=dict)
    ordered: deque[tuple[float, int]] = field(default_factory=deque)
    heap: list[tuple[float, int]] = field(default_factory=list)
    clock: int = 0

    def pop_oldest(self) -> tuple[float, int]:
        ordered, heap = self.ordered, self.heap
        if ordered and (not heap or ordered[0] <= heap[0]):
            return ordered.popleft()
        return heapq.heappop(heap)

    def compact(self, slack: float = 3.0) -> None:
        """Drop superseded entries once the queues hold ``slack`` times the live ones: rare
        (they pile up only while nothing is evicted)."""
        if len(self.ordered) + len(self.heap) > slack * len(self.scores) + 1024:
            self.heap = [(score, h) for h, score in self.scores.items()]
            heapq.heapify(self.heap)
            self.ordered.clear()


class InMemoryPrefixIndex:
    """Block hash -> bitmask of holding endpoints, plus a recency order per endpoint.

    A bitmask per hash (instead of a set) keeps an entry small and makes the chain walk a few
    integer operations per block. A record touches a chain last block first, so eviction (the
    lowest score first) frees a chain from its tail, the way vLLM frees a finished request's
    blocks. A record touches only what is not fresh (:func:`fresh_window`): an agent's next turn
    re-sends a long chain whose head was touched moments ago, and touching only its new tail
    makes the record cost the new blocks plus a binary search, not the whole chain. The same
    rules run in Redis (router/index/redis_index.py), so both indexes evict alike.
    """

    def __init__(
        self,
        default_capacity: int = DEFAULT_CAPACITY_BLOCKS,
        max_blocks_per_step: int = DEFAULT_MAX_BLOCKS_PER_STEP,
    ) -> None:
        if default_capacity < 1:
            raise ValueError("default_capacity must be >= 1")
        self._default_capacity = default_capacity
        self._step = max(0, max_blocks_per_step)
        self.pending_pieces = 0  # pieces of long records scheduled but not touched yet
        # (endpoint, chain's last hash) -> its records' pieces scheduled; and of those, how many
        # were due when the chain was withdrawn (a later record's pieces, due after them, stay)
        self._pieces: dict[tuple[str, int], int] = {}
        self._withdrawn: dict[tuple[str, int], int] = {}
        self._holders: dict[int, int] = {}
        self._bits: dict[str, int] = {}
        self._lru: dict[str, _Lru] = {}
        self._capacity: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._holders)

    def entries(self, endpoint_id: str) -> int:
        lru = self._lru.get(endpoint_id)
        return len(lru.scores) if lru is not None else 0

    def capacity(self, endpoint_id: str) -> int:
        return self._capacity.get(endpoint_id, self._default_capacity)

    def room(self, endpoint_id: str) -> int:
        return max(0, self.capacity(endpoint_id) - self.entries(endpoint_id))

    def _bit(self, endpoint_id: str) -> int:
        bit = self._bits.get(endpoint_id)
        if bit is None:
            used = set(self._bits.values())
            bit = next(1 << i for i in range(len(used) + 1) if (1 << i) not in used)
            self._bits[endpoint_id] = bit
            self._lru[endpoint_id] = _Lru()
        return bit

    def match_now(self, hashes: Sequence[int], endpoint_ids: Collection[str]) -> dict[str, int]:
        result = dict.fromkeys(endpoint_ids, 0)
        active = 0
        for endpoint_id in endpoint_ids:
            active |= self._bits.get(endpoint_id, 0)
        holders = self._holders
        matched = len(hashes)
        for i, h in enumerate(hashes):
            held = holders.get(h, 0) & active
            if held != active:
                self._settle(result, active & ~held, i)
                active = held
                if not active:
                    matched = i
                    break
        if active:
            self._settle(result, active, matched)
        return result

    def _settle(self, result: dict[str, int], mask: int, length: int) -> None:
        for endpoint_id in result:
            if self._bits.get(endpoint_id, 0) & mask:
                result[endpoint_id] = length

    def record(self, endpoint_id: str, hashes: Sequence[int]) -> None:
        """Touch the chain; a long cold one in growing pieces, the first one at once.

        Past ``max_blocks_per_step`` blocks to touch, the rest is touched in later turns of
        the event loop, so one new 200K-token prompt does not stall every other request for
        milliseconds; its head, which the next requests of a burst share, is there at once.
        The pieces score exactly as the Redis index's pieces do.
        """
        if not hashes:
            return
        hashes = capped(hashes, self.capacity(endpoint_id))
        fresh = self._fresh(endpoint_id)
        end = self._touch(endpoint_id, hashes, self._step, fresh)
        if end is not None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # no loop (a script, a test): all of it now
                self._touch(endpoint_id, hashes, 0, fresh)
                return
            self._schedule(endpoint_id, hashes)
            bit = self._bits[endpoint_id]
            loop.call_soon(self._resume, endpoint_id, hashes, end, bit, fresh)

    def _schedule(self, endpoint_id: str, hashes: Sequence[int]) -> None:
        self.pending_pieces += 1
        key = (endpoint_id, hashes[-1])
        self._pieces[key] = self._pieces.get(key, 0) + 1

    def _unschedule(self, endpoint_id: str, hashes: Sequence[int]) -> bool:
        """A piece of the chain's record is due: False when the record was withdrawn."""
        self.pending_pieces -= 1
        key = (endpoint_id, hashes[-1])
        left = self._pieces.pop(key) - 1
        if left:
            self._pieces[key] = left
        skip = self._withdrawn.pop(key, 0)
        if not skip:
            return True
        if skip > 1:
            self._withdrawn[key] = skip - 1
        return False

    def _resume(
        self, endpoint_id: str, hashes: Sequence[int], end: int, bit: int, fresh: float
    ) -> None:
        """The next piece of a long record: one touch spread over turns of the loop, so its
        freshness is the one judged when it began (judged anew, a chain longer than the fresh
        window would outlive its own head's freshness and each piece re-touch all of it)."""
        if not self._unschedule(endpoint_id, hashes):
            return  # withdrawn meanwhile: the rest of the chain must not come back
        if self._bits.get(endpoint_id) != bit:
            return  # forgotten meanwhile (or gone and back): its pieces are stale
        self._touch(endpoint_id, hashes[: end + self._step], 0, fresh)
        end += self._step
        if end < len(hashes):
            self._schedule(endpoint_id, hashes)
            asyncio.get_running_loop().call_soon(
                self._resume, endpoint_id, hashes, end, bit, fresh
            )

    def _fresh(self, endpoint_id: str) -> float:
        """Scores above this are fresh (:func:`fresh_window`)."""
        lru = self._lru.get(endpoint_id)
        return (lru.clock if lru else 0) - fresh_window(self.capacity(endpoint_id))

    def _touch(
        self, endpoint_id: str, hashes: Sequence[int], most: int, fresh: float
    ) -> int | None:
        """Touch what is not fresh; when that is more than ``most`` (> 0) blocks, touch only
        the chain up to the fresh head plus ``most`` and return where that piece ends."""
        bit = self._bit(endpoint_id)
        lru = self._lru[endpoint_id]
        capacity = self.capacity(endpoint_id)
        scores = lru.scores
        first = fresh_prefix(scores.get, hashes, fresh)
        if first == len(hashes):
            return None
        if most and len(hashes) - first > most:
            end = first + most
            self._touch(endpoint_id, hashes[:end], 0, fresh)
            return end
        tail = hashes[first:]
        new = tail_scores(scores[hashes[first - 1]], fresh, len(tail)) if first else None
        added = [h for h in (hashes if new is None else tail) if h not in scores]
        if new is None:
            # A whole touch: the chain head becomes the most recent block.
            tail = hashes[::-1]
            ascending = [float(lru.clock + 1 + k) for k in range(len(tail))]
            scores.update(zip(tail, ascending, strict=True))
            lru.ordered.extend(zip(ascending, tail, strict=True))
        else:
            scores.update(zip(tail, new, strict=True))
            for item in zip(new, tail, strict=True):
                heapq.heappush(lru.heap, item)
        lru.clock += len(tail)
        holders = self._holders
        for h in added:
            holders[h] = holders.get(h, 0) | bit
        self._evict(lru, bit, capacity)
        return None

    def _evict(self, lru: _Lru, bit: int, capacity: int) -> None:
        scores, pop, holders = lru.scores, lru.pop_oldest, self._holders
        if len(scores) > capacity:
            # Popping a re-touched long chain's superseded entries one by one would take a
            # turn of the loop 40 ms (31K of them); rebuilding the queue takes a few.
            lru.compact(1.5)
        while len(scores) > capacity:
            score, h = pop()
            if scores.get(h) == score:  # else a later touch superseded this entry
                del scores[h]
                mask = holders.get(h, 0) & ~bit
                if mask:
                    holders[h] = mask
                else:
                    holders.pop(h, None)
        lru.compact()

    def _drop(self, h: int, bit: int) -> None:
        mask = self._holders.get(h, 0) & ~bit
        if mask:
            self._holders[h] = mask
        else:
            self._holders.pop(h, None)

    async def match(self, hashes: Sequence[int], endpoint_ids: Collection[str]) -> dict[str, int]:
        return self.match_now(hashes, endpoint_ids)

    def withdraw(self, endpoint_id: str, hashes: Sequence[int], held: int) -> None:
        """Drop the chain's blocks past ``held`` (as recorded: capped), and the pieces of its
        record still to come. The held part of a chain is a prefix of it, so what is left is
        a chain still; its blocks keep their scores (the queues skip the dropped entries)."""
        if not hashes:
            return
        hashes = capped(hashes, self.capacity(endpoint_id))
        key = (endpoint_id, hashes[-1])
        if key in self._pieces:  # due first (the loop runs callbacks in order): skipped
            self._withdrawn[key] = self._pieces[key]
        bit, lru = self._bits.get(endpoint_id), self._lru.get(endpoint_id)
        if bit is None or lru is None:
            return
        scores = lru.scores
        for h in hashes[max(0, held) :]:
            if scores.pop(h, None) is not None:
                self._drop(h, bit)

    async def forget_endpoint(self, endpoint_id: str) -> None:
        self.forget_now(endpoint_id)
        self._capacity.pop(endpoint_id, None)  # gone: set again from its scrape if it is back

    async def clear_endpoint(self, endpoint_id: str, life: str | None = None) -> None:
        self.forget_now(endpoint_id)  # its capacity stays: the engine is the same size

    def forget_now(self, endpoint_id: str) -> None:
        bit = self._bits.pop(endpoint_id, None)
        lru = self._lru.pop(endpoint_id, None)
        if bit is None or lru is None:
            return
        for h in lru.scores:
            self._drop(h, bit)

    def set_capacity(self, endpoint_id: str, blocks: int) -> None:
        self._capacity[endpoint_id] = max(1, blocks)
        lru = self._lru.get(endpoint_id)
        if lru is not None:
            self._evict(lru, self._bits[endpoint_id], self._capacity[endpoint_id])

    async def aclose(self) -> None:
        return None
