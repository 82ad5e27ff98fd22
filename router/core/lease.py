"""One request's claim on an endpoint (a lease): what it adds to the endpoint's live state
while it runs (in flight, prefill queued until its first byte, a slot's hold time), and what
its outcome tells the pool's passive health."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

from router.core.endpoints import SharedPrefix
from router.core.slots import SlotLimit


class LeasedState(Protocol):
    """What a lease changes of its endpoint's live state (router.core.endpoints.EndpointState)."""

    slots: SlotLimit
    in_flight: int
    headers_only: int
    failure_streak: int

    def add_pending(self, tokens: int, requests: int, now: float) -> None: ...

    def hold_kv(
        self,
        tokens: int,
        session: str | None,
        own: int | None = None,
        shared: SharedPrefix | None = None,
    ) -> None: ...

    def free_kv(
        self,
        tokens: int,
        session: str | None,
        own: int | None = None,
        shared: SharedPrefix | None = None,
    ) -> None: ...


class LeasePool(Protocol):
    """What a lease needs of its pool: the clock its queue averages are read with, and where
    a failure is counted (outlier ejection)."""

    @property
    def clock(self) -> Callable[[], float]: ...

    def record_failure(self, state: Any) -> bool: ...


class Lease:
    """One request's claim on an endpoint: counted in-flight until released, exactly once.

    Its uncached prompt tokens count as prefill queued on the endpoint until the first byte
    (or until presumed done: a non-streaming answer's first byte is its last, and decode time
    must not pass for queued prefill). ``on_first_byte`` learns the time to first byte, and
    whether it came with tokens (not only headers). ``on_release`` hears of the release, once,
    after the counts are lowered: the place the lease held is free (flow control dispatches
    into it; given up before a first byte, nothing else would tell it).
    """

    __slots__ = (
        "_answered", "_clock", "_first_byte_seen", "_headers_only", "_on_first_byte",
        "_on_release", "_pool", "_released", "_sent_at", "_session", "_shared", "_started",
        "kv_own", "kv_tokens", "prefill_tokens", "state",
    )

    def __init__(
        self,
        state: LeasedState,
        prefill_tokens: int,
        pool: LeasePool | None = None,
        on_first_byte: Callable[[float, bool], None] | None = None,
        on_release: Callable[[], None] | None = None,
        kv_tokens: int = 0,
        session: str | None = None,
        kv_own: int | None = None,
        shared: SharedPrefix | None = None,
    ) -> None:
        self.state = state
        self.kv_tokens = kv_tokens
        # The part of kv_tokens that is its own, computed or answered (the rest its session's
        # other requests in flight may share: EndpointState.hold_kv); None: all of it.
        self.kv_own = kv_own
        self._session = session
        self._shared = shared
        self._pool = pool
        self.prefill_tokens = prefill_tokens
        self._first_byte_seen = self._answered = self._headers_only = False
        self._released = False
        self._on_first_byte = on_first_byte
        self._on_release = on_release
        self._started = time.monotonic() if on_first_byte is not None else 0.0
        # The pool's clock: the queue average is read with it (EndpointPool.candidates).
        self._clock = pool.clock if pool is not None else time.monotonic
        now = self._sent_at = self._clock()
        if state.in_flight <= 0:
            state.slots.busy_since = now
        state.in_flight += 1
        state.hold_kv(kv_tokens, session, kv_own, shared)
        state.add_pending(prefill_tokens, 1, now)

    def first_byte(self, tokens: bool = True, answered: bool = True) -> None:
        """The reply's first byte; ``answered=False`` for an error reply, whose time says
        nothing of how long an answer holds a slot; ``tokens=False`` where only its headers
        were seen (Envoy's ext_proc), which a streaming vLLM sends before the request is even
        scheduled, so it is not counted among the requests known to decode."""
        if not self._first_byte_seen:
            self._settle()
            self._answered = answered
            if not tokens:
                self._headers_only = True
                self.state.headers_only += 1
            if self._on_first_byte is not None:
                self._on_first_byte(time.monotonic() - self._started, tokens)

    def presume_prefilled(self) -> None:
        """The prefill is surely done by now, though no byte has come back yet."""
        if not self._first_byte_seen:
            self._settle()

    def _settle(self) -> None:
        self._first_byte_seen = True
        self.state.add_pending(-self.prefill_tokens, -1, self._clock())

    def release(self) -> None:
        if self._released:
            return
        state = self.state
        if self._answered:
            state.slots.observe_hold(self._clock() - self._sent_at)
        if not self._first_byte_seen:
            self._settle()
        if self._headers_only:
            state.headers_only -= 1
        self._released = True
        state.in_flight -= 1
        state.free_kv(self.kv_tokens, self._session, self.kv_own, self._shared)
        if state.in_flight <= 0:
            state.slots.busy_since = 0.0
        if self._on_release is not None:
            self._on_release()

    def upstream_ok(self) -> None:
        """The endpoint answered (any status below 500): its failure streak ends."""
        self.state.failure_streak = 0

    def upstream_failed(self) -> bool:
        """A connect error, timeout or 5xx; True if it got the endpoint ejected."""
        return self._pool.record_failure(self.state) if self._pool is not None else False
