"""Speculative entries of the precise index: keys marked as held by a pick's endpoint.

Right after a pick, the request's keys are marked as held by the chosen endpoint for a short
TTL, so the rest of a same-prefix burst follows it before the engine has computed (and
announced) the blocks. Entries expire in the order they were made, and their number is bounded:
past the bound the oldest picks' entries go first. An entry whose request has produced its first
byte is *settled*: its prefill is done, so the replica holds those blocks even if their events
have not arrived yet. A pick whose attempt failed before its first byte withdraws its own
batch (``withdraw``): the endpoint prefilled nothing of it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field


@dataclass(slots=True)
class _Holder:
    bit: int  # the endpoint's bit in the index's holder masks
    # Per key, how many live batches mark it: it stays until the last of them goes.
    refs: dict[int, int] = field(default_factory=dict)


@dataclass(slots=True, eq=False)
class Speculation:
    """One pick's batch of entries: its handle, to withdraw it should the pick fail."""

    until: float
    endpoint_id: str
    holder: _Holder
    keys: list[int]
    live: bool = True


class SpeculativeEntries:
    """Per key, the bitmask of endpoints speculated to hold it (and of those settled)."""

    def __init__(self, max_entries: int, clock: Callable[[], float]) -> None:
        self._max = max(1, max_entries)
        self._clock = clock
        self._holders: dict[str, _Holder] = {}
        self._held: dict[int, int] = {}
        # The part of _held whose request has produced its first byte.
        self._settled: dict[int, int] = {}
        self._queue: deque[Speculation] = deque()
        self.count = 0

    def add(self, endpoint_id: str, bit: int, keys: Sequence[int], ttl: float) -> Speculation:
        """Mark ``keys`` as about to be held by ``endpoint_id`` for ``ttl`` seconds."""
        holder = self._holders.get(endpoint_id)
        if holder is None:
            holder = self._holders[endpoint_id] = _Holder(bit)
        now = self._clock()
        self._expire(now)
        batch = Speculation(now + ttl, endpoint_id, holder, list(keys))
        refs = holder.refs
        for key in batch.keys:
            n = refs.get(key, 0)
            if not n:
                self._held[key] = self._held.get(key, 0) | holder.bit
            refs[key] = n + 1
        self._queue.append(batch)
        self.count += len(batch.keys)
        while self.count > self._max and self._queue:
            self._expire_one()
        return batch

    def withdraw(self, batch: Speculation) -> None:
        """Take one pick's entries back before their TTL (its attempt failed before its first
        byte); keys another live batch also marks stay, until that batch goes."""
        if batch.live:
            self._release(batch)

    def current(self, settled_only: bool = False) -> dict[int, int]:
        """The live entries (every one, or the settled ones), expired ones dropped first."""
        if self._held:
            self._expire(self._clock())
        return self._settled if settled_only else self._held

    def settle(self, endpoint_id: str, keys: Sequence[int]) -> None:
        """The request that speculated ``keys`` on ``endpoint_id`` has been prefilled."""
        holder = self._holders.get(endpoint_id)
        if holder is None:
            return
        for key in keys:
            if key in holder.refs:
                self._settled[key] = self._settled.get(key, 0) | holder.bit

    def forget(self, endpoint_id: str) -> None:
        """Drop every entry of an endpoint that left (its queued batches then expire as no-ops)."""
        holder = self._holders.pop(endpoint_id, None)
        if holder is not None:
            for key in holder.refs:
                self._drop_bit(key, holder.bit)

    def _expire(self, now: float) -> None:
        queue = self._queue
        while queue and queue[0].until <= now:
            self._expire_one()

    def _expire_one(self) -> None:
        batch = self._queue.popleft()
        if batch.live:  # a withdrawn batch was released then
            self._release(batch)

    def _release(self, batch: Speculation) -> None:
        batch.live = False
        self.count -= len(batch.keys)
        holder = batch.holder
        if self._holders.get(batch.endpoint_id) is not holder:
            return  # the endpoint was forgotten (and maybe came back under a new holder)
        refs = holder.refs
        for key in batch.keys:
            n = refs.get(key, 0) - 1
            if n > 0:
                refs[key] = n
            else:
                refs.pop(key, None)
                self._drop_bit(key, holder.bit)

    def _drop_bit(self, key: int, bit: int) -> None:
        for table in (self._held, self._settled):
            mask = table.get(key, 0) & ~bit
            if mask:
                table[key] = mask
            else:
                table.pop(key, None)
