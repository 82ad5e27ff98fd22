"""The prefix index: which endpoint probably holds which prompt blocks in its KV cache.

:class:`PrefixIndex` is the extension point (the in-memory index below; a Redis-backed one shares
what several gateway replicas learn). It is approximate: it records where the gateway *sent*
prompts, bounded per endpoint by an LRU of about the endpoint's KV capacity, so that the guess
ages out roughly as the replica's own cache does.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Sequence
from typing import Protocol

DEFAULT_CAPACITY_BLOCKS = 31_250


class PrefixIndex(Protocol):
    """Lookup before scoring, record after the pick."""

    async def match(self, hashes: Sequence[int], endpoint_ids: Collection[str]) -> dict[str, int]:
        """Per endpoint, the number of leading blocks of ``hashes`` it holds (0 when none)."""
        ...

    def record(self, endpoint_id: str, hashes: Sequence[int]) -> None:
        """Note that ``endpoint_id`` now holds the chain ``hashes``.

        Synchronous so the next request of a burst already sees it: a remote-backed index
        applies the update to its local view at once and ships it in the background.
        """
        ...

    async def forget_endpoint(self, endpoint_id: str) -> None:
        """Drop everything known about an endpoint that left the pool."""
        ...

    def set_capacity(self, endpoint_id: str, blocks: int) -> None:
        """Bound the entries kept for ``endpoint_id`` (from its reported KV capacity)."""
        ...

    async def aclose(self) -> None: ...


class InMemoryPrefixIndex:
    """Block hash -> bitmask of holding endpoints, plus one LRU of hashes per endpoint.

    A bitmask per hash (instead of a set) keeps an entry small and makes the chain walk a few
    integer operations per block. Hashes of a request are touched last-block-first, so the
    LRU evicts a chain from its tail, the way vLLM frees a finished request's blocks.
    """

    def __init__(self, default_capacity: int = DEFAULT_CAPACITY_BLOCKS) -> None:
        if default_capacity < 1:
            raise ValueError("default_capacity must be >= 1")
        self._default_capacity = default_capacity
        self._holders: dict[int, int] = {}
        self._bits: dict[str, int] = {}
        self._lru: dict[str, OrderedDict[int, None]] = {}
        self._capacity: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._holders)

    def entries(self, endpoint_id: str) -> int:
        lru = self._lru.get(endpoint_id)
        return len(lru) if lru is not None else 0

    def capacity(self, endpoint_id: str) -> int:
        return self._capacity.get(endpoint_id, self._default_capacity)

    def _bit(self, endpoint_id: str) -> int:
        bit = self._bits.get(endpoint_id)
        if bit is None:
            used = set(self._bits.values())
            bit = next(1 << i for i in range(len(used) + 1) if (1 << i) not in used)
            self._bits[endpoint_id] = bit
            self._lru[endpoint_id] = OrderedDict()
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
        if not hashes:
            return
        bit = self._bit(endpoint_id)
        lru = self._lru[endpoint_id]
        holders = self._holders
        for h in reversed(hashes):
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
                holders[h] = holders.get(h, 0) | bit
        capacity = self.capacity(endpoint_id)
        while len(lru) > capacity:
            old, _ = lru.popitem(last=False)
            self._drop(old, bit)

    def _drop(self, h: int, bit: int) -> None:
        mask = self._holders.get(h, 0) & ~bit
        if mask:
            self._holders[h] = mask
        else:
            self._holders.pop(h, None)

    async def match(self, hashes: Sequence[int], endpoint_ids: Collection[str]) -> dict[str, int]:
        return self.match_now(hashes, endpoint_ids)

    async def forget_endpoint(self, endpoint_id: str) -> None:
        self.forget_now(endpoint_id)

    def forget_now(self, endpoint_id: str) -> None:
        bit = self._bits.pop(endpoint_id, None)
        lru = self._lru.pop(endpoint_id, None)
        if bit is None or lru is None:
            return
        for h in lru:
            self._drop(h, bit)

    def set_capacity(self, endpoint_id: str, blocks: int) -> None:
        self._capacity[endpoint_id] = max(1, blocks)
        lru = self._lru.get(endpoint_id)
        if lru is None:
            return
        bit = self._bits[endpoint_id]
        while len(lru) > self._capacity[endpoint_id]:
            old, _ = lru.popitem(last=False)
            self._drop(old, bit)

    async def aclose(self) -> None:
        return None
