"""The queue structures: model -> priority level -> flow -> items, with band accounting.

A *flow* is (fairness id, priority). Each priority level of a model holds its active flows in
an ordered dict that the band's fairness policy picks from. Every structure is removed as soon
as it empties, so memory is bounded by what is queued, never by how many tenants were seen.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import islice
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from flow_control.request import FlowRequest, Ticket

if TYPE_CHECKING:
    from prometheus_client.metrics import Counter, Gauge, Histogram

    from flow_control.config import BandConfig


@dataclass(slots=True, eq=False)
class QueueItem:
    request: FlowRequest
    seq: int
    enqueued_at: float
    deadline: float
    future: asyncio.Future[Ticket]
    level: Level
    flow: FlowQueue
    queued: bool = True


class FlowQueue:
    """FCFS within a flow; an ordered dict so that a cancelled item leaves in O(1)."""

    __slots__ = ("bytes", "fairness_id", "gauge_bytes", "gauge_requests", "items", "priority")

    def __init__(
        self, fairness_id: str, priority: int, gauge_requests: Gauge, gauge_bytes: Gauge
    ) -> None:
        self.fairness_id = fairness_id
        self.priority = priority
        self.items: OrderedDict[int, QueueItem] = OrderedDict()
        self.bytes = 0
        self.gauge_requests = gauge_requests
        self.gauge_bytes = gauge_bytes

    def __len__(self) -> int:
        return len(self.items)

    def head(self) -> QueueItem:
        return next(iter(self.items.values()))


@runtime_checkable
class FairnessPolicy(Protocol):
    """Chooses which flow of a level goes next (implementations: flow_control/policies.py)."""

    name: str

    def select(self, flows: OrderedDict[str, FlowQueue]) -> FlowQueue:
        """The flow whose head request goes next; ``flows`` is non-empty."""
        ...

    def dispatched(
        self, flows: OrderedDict[str, FlowQueue], flow: FlowQueue, request: FlowRequest
    ) -> None:
        """Called after ``flow`` gave up its head, ``request``, to be served (not when a
        cancelled or expired head leaves); ``flow`` may be empty now, and leaves ``flows``
        after this."""
        ...


@dataclass(slots=True, eq=False)
class BandState:
    """A band's limits, policy and live totals (shared by every model's queues)."""

    name: str
    priority: int | None
    limits: BandConfig
    policy: FairnessPolicy
    gauge_requests: Gauge
    gauge_bytes: Gauge
    wait: Histogram
    fast: Counter
    queued: Counter
    count: int = 0
    bytes: int = 0


@dataclass(slots=True, eq=False)
class Level:
    """The flows of one priority for one model."""

    priority: int
    band: BandState
    flows: OrderedDict[str, FlowQueue] = field(default_factory=OrderedDict)


@dataclass(slots=True, eq=False)
class ModelQueue:
    levels: dict[int, Level] = field(default_factory=dict)
    count: int = 0
    # When a dispatch first found the model's pool empty (None: it had endpoints); kept here
    # so that it goes with the queue and a later queue starts its own count.
    empty_since: float | None = None

    def top(self) -> Level:
        return self.levels[max(self.levels)]

    def max_priority(self) -> int | None:
        return max(self.levels) if self.levels else None


def pick_victim(
    queues: Iterable[ModelQueue],
    newcomer: FlowRequest,
    band: BandState | None,
    chosen: Sequence[QueueItem] = (),
) -> QueueItem | None:
    """The queued request to push out so that ``newcomer`` fits in full queues, or None when
    the newcomer is the one to refuse.

    Tail drop for whoever holds most: the newest request of the longest flow at the lowest
    priority below the newcomer's, or at the newcomer's own priority when that flow is longer
    than the newcomer's would be (so a tenant flooding the queues cannot lock a light one
    out, and a full queue never turns a higher priority away for a lower one). ``band``
    limits the search to one band (when that band is what is full). ``chosen``: victims
    already picked for the same newcomer, counted as gone (each is the newest left of its
    flow). Runs only when a limit is hit, so a scan over the queued flows is fine.
    """
    gone: dict[FlowQueue, int] = {}
    for item in chosen:
        gone[item.flow] = gone.get(item.flow, 0) + 1
    own = 0
    found: tuple[int, int] | None = None  # (priority, -length): lowest priority, then longest
    victim: FlowQueue | None = None
    for queue in queues:
        for level in queue.levels.values():
            if level.priority > newcomer.priority or (band is not None and level.band is not band):
                continue
            for flow in level.flows.values():
                length = len(flow) - gone.get(flow, 0)
                if flow.priority == newcomer.priority and flow.fairness_id == newcomer.fairness_id:
                    own = max(own, length)
                if not length:
                    continue
                key = (level.priority, -length)
                if found is None or key < found:
                    found, victim = key, flow
    if found is None or victim is None:
        return None
    if found[0] == newcomer.priority and -found[1] <= own + 1:
        return None  # evicting would only swap who holds more
    return next(islice(reversed(victim.items.values()), gone.get(victim, 0), None))
