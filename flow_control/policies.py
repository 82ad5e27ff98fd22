"""Fairness policies: which active flow of a priority level is served next.

Round-robin and FCFS are stateless: the order they need lives in the level's ordered dict of
flows, which the controller keeps (new flows join at the end, empty flows leave at once).
Program-aware keeps each flow's attained service. Within a flow, requests are always served
first come, first served.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

from flow_control.config import FairnessPolicyName, ProgramAwareConfig
from flow_control.queues import FairnessPolicy, FlowQueue
from flow_control.request import FlowRequest
from router.core.hashing import estimate_tokens


class RoundRobinPolicy:
    """One request per active flow in turn: a flooding tenant gets one slot per round."""

    name = "round-robin"

    def select(self, flows: OrderedDict[str, FlowQueue]) -> FlowQueue:
        return next(iter(flows.values()))

    def dispatched(
        self, flows: OrderedDict[str, FlowQueue], flow: FlowQueue, request: FlowRequest
    ) -> None:
        flows.move_to_end(flow.fairness_id)


class FCFSPolicy:
    """Global first come, first served across the flows of a level."""

    name = "fcfs"

    def select(self, flows: OrderedDict[str, FlowQueue]) -> FlowQueue:
        return min(flows.values(), key=lambda f: f.head().seq)

    def dispatched(
        self, flows: OrderedDict[str, FlowQueue], flow: FlowQueue, request: FlowRequest
    ) -> None:
        return None


class ProgramAwarePolicy:
    """Least attained service first: the flow (agent program, tenant) that has received the
    fewest prompt tokens lately goes next, with a nudge for the flow whose head waited longest.

    A flow is charged its head request's estimated prompt tokens when that request is
    dispatched (not when a head that was cancelled or expired leaves); service decays with a
    half-life,
    so a program that flooded a minute ago is not punished forever. Output tokens are not
    known at dispatch and are not charged. Flows served on the fast path (nothing queued)
    are not charged either: fairness only orders what waits.
    """

    name = "program-aware"

    def __init__(
        self, config: ProgramAwareConfig, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._config = config
        self._clock = clock
        # fairness id -> (attained service in tokens, when it was last decayed); oldest first.
        self._service: OrderedDict[str, tuple[float, float]] = OrderedDict()

    def service(self, fairness_id: str, now: float | None = None) -> float:
        """The flow's attained service, decayed to ``now``."""
        now = self._clock() if now is None else now
        found = self._service.get(fairness_id)
        if found is None:
            return 0.0
        value, since = found
        half_life = self._config.half_life_seconds
        if half_life > 0 and now > since:
            value *= 2.0 ** (-(now - since) / half_life)
        return value

    def select(self, flows: OrderedDict[str, FlowQueue]) -> FlowQueue:
        now = self._clock()
        candidates = list(flows.values())
        service = [self.service(f.fairness_id, now) for f in candidates]
        waited = [now - f.head().enqueued_at for f in candidates]
        cfg = self._config
        scores = [
            cfg.service_weight * (1.0 - _normalise(s, service))
            + cfg.head_wait_weight * _normalise(w, waited)
            for s, w in zip(service, waited, strict=True)
        ]
        return candidates[scores.index(max(scores))]  # ties: the flow that became active first

    def dispatched(
        self, flows: OrderedDict[str, FlowQueue], flow: FlowQueue, request: FlowRequest
    ) -> None:
        self._charge(flow.fairness_id, estimate_tokens(max(0, request.size)), self._clock())

    def _charge(self, fairness_id: str, tokens: int, now: float) -> None:
        self._service[fairness_id] = (self.service(fairness_id, now) + tokens, now)
        self._service.move_to_end(fairness_id)
        while len(self._service) > self._config.max_programs:
            self._service.popitem(last=False)


def _normalise(value: float, values: list[float]) -> float:
    lo, hi = min(values), max(values)
    return 0.0 if hi <= lo else (value - lo) / (hi - lo)


def make_policy(
    name: FairnessPolicyName,
    program_aware: ProgramAwareConfig | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> FairnessPolicy:
    if name == "fcfs":
        return FCFSPolicy()
    if name == "program-aware":
        return ProgramAwarePolicy(program_aware or ProgramAwareConfig(), clock)
    return RoundRobinPolicy()
