"""How many requests a session sends: what its first request commits the session's home to.

A session's first request decides where its later requests will queue, so the cost scorer
charges it for that queue as many times as sessions send requests after their first
(``RoutingRequest.later_requests``). Two estimates of that number, the larger taken:

- requests per session started, both counted over a moving window (halved once the starts
  reach ``LENGTH_WINDOW``): exact in steady traffic, but short while the sessions counted are
  still young (a gateway just started, a benchmark ramping up);
- the mean length of the sessions that ended (quiet for the live-session horizon), starting
  from a prior of ``PRIOR_REQUESTS`` requests worth ``PRIOR_SESSIONS`` sessions: until sessions
  are seen to end, a session is taken for a short agent session. Single-turn traffic ends its
  sessions after one request each and pulls the figure to nothing within a horizon.

A session that comes back after it ended counts as a new one. Each gateway replica counts the
requests it served.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

# The prior: a session of this many requests, weighing as much as this many ended sessions.
PRIOR_REQUESTS = 8.0
PRIOR_SESSIONS = 4.0
# Sessions counted after which every sum is halved (a moving window).
LENGTH_WINDOW = 2_000


@dataclass(slots=True)
class _Open:
    requests: int
    last_seen: float


class SessionLengths:
    def __init__(self, max_sessions: int = 100_000) -> None:
        self._max = max_sessions
        # Sessions not ended yet, least recently seen first (expiry pops from the front).
        self._open: OrderedDict[str, _Open] = OrderedDict()
        self._requests = 0.0
        self._starts = 0.0
        self._ended_requests = 0.0
        self._ended = 0.0

    @property
    def later_requests(self) -> float:
        """The requests a new session is expected to send after its first."""
        started = self._requests / self._starts if self._starts else 0.0
        ended = (self._ended_requests + PRIOR_SESSIONS * PRIOR_REQUESTS) / (
            self._ended + PRIOR_SESSIONS
        )
        return max(0.0, max(started, ended) - 1.0)

    def is_new(self, session_id: str) -> bool:
        return session_id not in self._open

    def on_request(self, session_id: str, now: float) -> None:
        self._requests += 1
        session = self._open.get(session_id)
        if session is not None:
            session.requests += 1
            session.last_seen = now
            self._open.move_to_end(session_id)
            return
        self._open[session_id] = _Open(1, now)
        while len(self._open) > self._max:
            self._open.popitem(last=False)  # dropped unseen to its end: not counted
        self._starts += 1
        if self._starts >= LENGTH_WINDOW:
            self._starts /= 2
            self._requests /= 2

    def expire(self, cutoff: float) -> None:
        """Count as ended the sessions last seen before ``cutoff``."""
        while self._open:
            session = next(iter(self._open.values()))
            if session.last_seen >= cutoff:
                return
            self._open.popitem(last=False)
            self._ended += 1
            self._ended_requests += session.requests
            if self._ended >= LENGTH_WINDOW:
                self._ended /= 2
                self._ended_requests /= 2
