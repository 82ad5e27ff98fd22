"""From request headers to a flow: fairness id, objective -> priority and TTL, session boost."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from flow_control.config import FlowControlConfig, SessionBoostConfig
from flow_control.request import DEFAULT_FLOW, FlowRequest

FAIRNESS_HEADERS = ("x-gateway-inference-fairness-id", "x-llm-d-inference-fairness-id")
OBJECTIVE_HEADERS = ("x-gateway-inference-objective", "x-llm-d-inference-objective")
SESSION_HEADER = "x-session-id"
# Client-chosen ids become dict keys and metric labels: keep them short.
MAX_ID_CHARS = 256


def header_value(headers: Mapping[str, str], names: Sequence[str]) -> str | None:
    """The first non-empty value among ``names`` (starlette headers are case-insensitive)."""
    for name in names:
        value = headers.get(name)
        if value:
            value = value.strip()
            if value:
                return value[:MAX_ID_CHARS]
    return None


def fairness_id(headers: Mapping[str, str], default: str | None = None) -> str:
    """The request's fairness header, else ``default`` (an agent's session id), else the
    shared default flow."""
    return header_value(headers, FAIRNESS_HEADERS) or default or DEFAULT_FLOW


@dataclass(frozen=True, slots=True)
class Objective:
    """What an objective header resolves to; ``name`` is None when absent or unknown."""

    name: str | None
    priority: int
    ttl_seconds: float
    ttft_slo_ms: float | None = None


class ObjectiveResolver:
    """Maps the objective header through ``flowControl.objectives``; unknown names get 0."""

    def __init__(self, config: FlowControlConfig) -> None:
        self._default_ttl = config.default_request_ttl
        self._default = Objective(None, 0, config.default_request_ttl)
        self._objectives = {
            o.name: Objective(
                o.name, o.priority, o.ttl_seconds or config.default_request_ttl, o.ttft_slo_ms
            )
            for o in config.objectives
        }

    def resolve(self, headers: Mapping[str, str]) -> Objective:
        name = header_value(headers, OBJECTIVE_HEADERS)
        if name is None:
            return self._default
        return self._objectives.get(name, self._default)

    def ttft_slo_ms(self, objective: str | None) -> float | None:
        found = self._objectives.get(objective) if objective is not None else None
        return found.ttft_slo_ms if found is not None else None

    def ttl(self, objective: str | None) -> float:
        if objective is None:
            return self._default_ttl
        found = self._objectives.get(objective)
        return found.ttl_seconds if found is not None else self._default_ttl


class SessionMemory:
    """Recently served session ids: a bounded LRU whose entries expire after a window."""

    def __init__(
        self,
        window_seconds: float,
        max_sessions: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._window = window_seconds
        self._max = max_sessions
        self._clock = clock
        self._seen: OrderedDict[str, float] = OrderedDict()

    def __len__(self) -> int:
        return len(self._seen)

    def touch(self, session_id: str) -> None:
        now = self._clock()
        self._seen[session_id] = now
        self._seen.move_to_end(session_id)
        # Oldest first: drop what has expired as well as what exceeds the bound.
        while self._seen:
            oldest = next(iter(self._seen.values()))
            if len(self._seen) <= self._max and now - oldest <= self._window:
                break
            self._seen.popitem(last=False)

    def is_live(self, session_id: str) -> bool:
        seen = self._seen.get(session_id)
        if seen is None:
            return False
        if self._clock() - seen > self._window:
            del self._seen[session_id]
            return False
        return True


class SessionBoost:
    """Raises the priority of a request continuing a live session.

    A sheddable request (negative priority) stays sheddable: the boost never lifts it above
    -1, because shedding is a promise made by whoever chose the objective.
    """

    def __init__(
        self, config: SessionBoostConfig, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.enabled = config.enabled and config.priority_boost > 0
        self._boost = config.priority_boost
        self.memory = SessionMemory(config.window_seconds, config.max_sessions, clock)

    def apply(self, priority: int, session_id: str | None) -> int:
        if not self.enabled or session_id is None or not self.memory.is_live(session_id):
            return priority
        boosted = priority + self._boost
        return min(boosted, -1) if priority < 0 else boosted

    def served(self, session_id: str | None) -> None:
        if self.enabled and session_id is not None:
            self.memory.touch(session_id)


class RequestResolver:
    """Turns a request's headers into a :class:`FlowRequest`: fairness id, objective (priority,
    TTL) and the session boost, which it also keeps up to date as sessions are served."""

    def __init__(
        self, config: FlowControlConfig, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.objectives = ObjectiveResolver(config)
        self.boost = SessionBoost(config.session_boost, clock)

    def build(
        self,
        headers: Mapping[str, str],
        model: str,
        size: int = 0,
        session_id: str | None = None,
        arrival: float | None = None,
        default_fairness: str | None = None,
    ) -> FlowRequest:
        """``default_fairness``: the fairness id when the headers name none."""
        objective = self.objectives.resolve(headers)
        if session_id is None:
            session_id = header_value(headers, (SESSION_HEADER,))
        return FlowRequest(
            model=model,
            fairness_id=fairness_id(headers, default_fairness),
            priority=self.boost.apply(objective.priority, session_id),
            objective=objective.name,
            session_id=session_id,
            size=size,
            arrival=arrival,
        )
