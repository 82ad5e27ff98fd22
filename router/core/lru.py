"""A least-recently-used map bounded by entries and by the summed length of its values.

Token caches are bounded by how many tokens they hold, not only by how many entries: one
entry can be a 100K-token prompt or a three-token role line.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable, Sequence, Sized
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V", bound=Sized)


class SizedLRU(Generic[K, V]):
    """Safe to use from the event loop and a worker thread at once; ``hits`` and ``misses``
    count :meth:`get`."""

    def __init__(self, max_entries: int, max_size: int) -> None:
        self._max_entries = max(1, max_entries)
        self._max_size = max(1, max_size)
        self._items: OrderedDict[K, V] = OrderedDict()
        self._size = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: K) -> bool:
        """Whether ``key`` is held, without counting as a use."""
        return key in self._items

    @property
    def size(self) -> int:
        return self._size

    def get(self, key: K) -> V | None:
        with self._lock:
            return self._use(key)

    def get_many(self, keys: Sequence[K]) -> list[V | None]:
        """:meth:`get` for each of ``keys``, under one acquisition of the lock."""
        with self._lock:
            return [self._use(key) for key in keys]

    def _use(self, key: K) -> V | None:
        # Under the lock: a lookup that counts, and makes a hit the most recent entry.
        value = self._items.get(key)
        if value is None:
            self.misses += 1
            return None
        self._items.move_to_end(key)
        self.hits += 1
        return value

    def put(self, key: K, value: V) -> None:
        """Keep ``value`` as the most recent entry; one larger than the whole bound is not kept."""
        if len(value) > self._max_size:
            return
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self._size -= len(old)
            self._items[key] = value
            self._size += len(value)
            while self._size > self._max_size or len(self._items) > self._max_entries:
                _, gone = self._items.popitem(last=False)
                self._size -= len(gone)
