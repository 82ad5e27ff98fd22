"""Session affinity: which endpoint served a session (``x-session-id``) last."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol


class AffinityStore(Protocol):
    async def get(self, session_id: str) -> str | None: ...

    def set(self, session_id: str, endpoint_id: str) -> None:
        """Applied locally at once; a remote store ships it in the background."""
        ...

    def restore(self, session_id: str, endpoint_id: str, previous: str | None) -> None:
        """Undo a pick that served nothing (every failover attempt failed): the session points
        at ``previous`` again, or at nothing, unless it has moved on from ``endpoint_id``
        since (a later request's pick). Applied locally at once, like ``set``."""
        ...

    async def forget_endpoint(self, endpoint_id: str) -> None: ...


class InMemoryAffinityStore:
    """A bounded LRU of session -> (endpoint, expiry); stale entries read as absent."""

    def __init__(
        self,
        ttl_seconds: float = 600.0,
        max_sessions: int = 100_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._ttl = ttl_seconds
        self._max = max_sessions
        self._clock = clock
        self._entries: OrderedDict[str, tuple[str, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get_now(self, session_id: str) -> str | None:
        entry = self._entries.get(session_id)
        if entry is None:
            return None
        endpoint_id, expires = entry
        if expires < self._clock():
            del self._entries[session_id]
            return None
        return endpoint_id

    def set(self, session_id: str, endpoint_id: str) -> None:
        self._entries[session_id] = (endpoint_id, self._clock() + self._ttl)
        self._entries.move_to_end(session_id)
        while len(self._entries) > self._max:
            self._entries.popitem(last=False)

    def restore(self, session_id: str, endpoint_id: str, previous: str | None) -> None:
        if self.get_now(session_id) != endpoint_id:
            return  # moved on since (or expired): a newer answer than the one to undo
        if previous is None:
            del self._entries[session_id]
        else:
            self.set(session_id, previous)

    async def get(self, session_id: str) -> str | None:
        return self.get_now(session_id)

    async def forget_endpoint(self, endpoint_id: str) -> None:
        stale = [s for s, (e, _) in self._entries.items() if e == endpoint_id]
        for session_id in stale:
            del self._entries[session_id]
