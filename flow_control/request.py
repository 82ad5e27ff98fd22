"""What the gateway hands the flow controller, and what it gets back."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

DEFAULT_FLOW = "default"


@dataclass(frozen=True, slots=True)
class FlowRequest:
    """One request as flow control sees it; ``priority`` is already resolved (boost included).

    ``arrival`` is on the controller's clock; None means "now". The TTL counts from it.
    """

    model: str
    fairness_id: str = DEFAULT_FLOW
    priority: int = 0
    objective: str | None = None
    session_id: str | None = None
    size: int = 0
    arrival: float | None = None


class Ticket:
    """Permission to send one request upstream; release it when the request is finished.

    :meth:`release` is idempotent, so it can sit in every ``finally`` that might end the
    request; only the first call frees the slot and lets the controller dispatch more.
    :meth:`leased` says the request has taken an endpoint (its first lease; idempotent too):
    from then on the endpoint's in-flight count shows it, and the controller stops counting it
    as admitted but not yet placed.
    """

    __slots__ = ("_leased", "_on_leased", "_on_release", "_released", "request", "waited")

    def __init__(
        self,
        request: FlowRequest,
        waited: float = 0.0,
        on_release: Callable[[Ticket], None] | None = None,
        on_leased: Callable[[Ticket], None] | None = None,
    ) -> None:
        self.request = request
        self.waited = waited
        self._on_release = on_release
        self._on_leased = on_leased
        self._released = False
        self._leased = False

    @property
    def released(self) -> bool:
        return self._released

    @property
    def was_leased(self) -> bool:
        return self._leased

    def leased(self) -> None:
        if self._leased or self._released:
            return
        self._leased = True
        if self._on_leased is not None:
            self._on_leased(self)

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        if self._on_release is not None:
            self._on_release(self)
