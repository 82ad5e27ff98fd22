"""The bounded background queue that ships a Redis-backed store's updates off the hot path.

Updates are coalesced by key and shipped in batches by one task the queue owns; when Redis is
slow or away the oldest are dropped (and counted), since the newest say most about now. Updates
that must not be lost (``keep``: an endpoint's purge, whose leftovers nothing else would ever
remove) are neither pushed out by newer ones nor dropped when Redis is away: they wait for it.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

from router.core.tasks import cancel_and_wait
from router.index.redis_link import RedisLink, Unavailable

log = logging.getLogger("prefixgate.redis")

K = TypeVar("K")
V = TypeVar("V")


class UpdateQueue(Generic[K, V]):
    """Pending updates, coalesced by key and bounded, shipped by one task the queue owns.

    A burst never spawns more than that one task; when Redis cannot keep up the oldest updates
    are dropped (and counted), since the newest say most about what the endpoints hold now.
    """

    def __init__(
        self,
        ship: Callable[[list[tuple[K, V]]], Awaitable[None]],
        *,
        op: str,
        link: RedisLink,
        max_items: int = 1024,
        max_cost: int = 16 << 20,
        max_batch: int = 32,
        max_batch_cost: int | None = None,
        cost: Callable[[K, V], int] = lambda k, v: 1,
        keep: Callable[[K], bool] = lambda k: False,
    ) -> None:
        self._ship = ship
        self._keep = keep
        self._op = op
        self._link = link
        self._max_items = max(1, max_items)
        self._max_cost = max_cost
        self._max_batch = max(1, max_batch)
        self._max_batch_cost = max_batch_cost
        self._cost = cost
        self._items: OrderedDict[K, V] = OrderedDict()
        self._total_cost = 0
        self._busy = False
        self._wakeup = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._task: asyncio.Task[None] | None = None

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: object) -> bool:
        return key in self._items

    def put(self, key: K, value: V) -> None:
        if key in self._items:  # its value may be None (a deletion): test the key
            self._total_cost -= self._cost(key, self._items.pop(key))
        self._items[key] = value
        self._idle.clear()
        self._total_cost += self._cost(key, value)
        while len(self._items) > 1 and (
            len(self._items) > self._max_items or self._total_cost > self._max_cost
        ):
            oldest = next((k for k in self._items if not self._keep(k)), None)
            if oldest is None:
                break  # only updates to keep: a handful (purges), over the bound for a while
            self._total_cost -= self._cost(oldest, self._items.pop(oldest))
            self._link.metrics.dropped.labels(self._op, "overflow").inc()
        self._kick()

    def discard_if(self, predicate: Callable[[K], bool]) -> None:
        for key in [k for k in self._items if predicate(k)]:
            self._total_cost -= self._cost(key, self._items.pop(key))
        if not self._items and not self._busy:
            self._idle.set()

    def _kick(self) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # shipped once a loop runs: the next put or flush starts the task
        if self._task is None or self._task.done():
            self._task = loop.create_task(self._run(), name=f"prefixgate-{self._op}")
        self._wakeup.set()

    def _take(self) -> list[tuple[K, V]]:
        # A pipeline runs without interruption on the server: bound it so lookups of other
        # gateways do not queue behind it for long.
        batch: list[tuple[K, V]] = []
        batch_cost = 0
        limit = self._max_batch_cost
        while self._items and len(batch) < self._max_batch:
            k, v = next(iter(self._items.items()))
            cost = self._cost(k, v)
            if batch and limit is not None and batch_cost + cost > limit:
                break
            del self._items[k]
            self._total_cost -= cost
            batch_cost += cost
            batch.append((k, v))
        return batch

    async def _run(self) -> None:
        while True:
            if not self._items:
                self._idle.set()
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            wait = self._link.breaker.retry_in()
            if wait > 0:
                await asyncio.sleep(wait)
                continue
            batch = self._take()
            self._busy = True
            try:
                await self._ship(batch)
            except Unavailable as exc:
                kept = self.requeue([(k, v) for k, v in batch if self._keep(k)])
                self._link.metrics.dropped.labels(self._op, exc.reason).inc(len(batch) - kept)
            except Exception:
                log.exception("redis %s: shipping failed", self._op)
                self._link.metrics.dropped.labels(self._op, "bug").inc(len(batch))
            finally:
                self._busy = False

    def requeue(self, items: list[tuple[K, V]]) -> int:
        """Put updates that could not be shipped back at the head (unless a newer one for the
        same key came meanwhile); how many went back."""
        back = 0
        for k, v in reversed(items):
            if k in self._items:
                continue
            self._items[k] = v
            self._items.move_to_end(k, last=False)
            self._total_cost += self._cost(k, v)
            back += 1
        if back:
            self._idle.clear()
            self._kick()
        return back

    async def flush(self) -> None:
        """Wait until everything queued so far has been shipped (or given up on)."""
        self._kick()
        await self._idle.wait()

    async def aclose(self, grace: float) -> None:
        try:
            async with asyncio.timeout(grace):
                await self.flush()
        except TimeoutError:
            self._link.metrics.dropped.labels(self._op, "closing").inc(len(self._items))
            self._items.clear()
            self._idle.set()
        await cancel_and_wait(self._task)  # still set meanwhile: nothing starts another
        self._task = None
