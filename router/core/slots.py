"""A replica's sequence slots: how many requests it runs at once, and how long each holds one.

vLLM runs at most ``max_num_seqs`` requests at a time; the others wait in ``waiting`` until a
running one finishes, however much of their prompt is cached. No metric reports the limit, so
it is learned from scrapes. Requests can wait for three reasons: the slots are full, the KV
cache is full, or prefill work is ahead of them (a token budget, one prefill at a time). A
scrape where requests wait while the KV cache has room and every running request is one of the
gateways' own past its first byte (nothing is prefilling) leaves only the first. One such
scrape can also be a request caught between its arrival and the engine's next step, so the
limit is taken only when two scrapes in a row show it at the same running count. Replicas of
one deployment share their engine settings, so an endpoint that has not been seen full takes
the largest limit learned on the others of its role, until it runs more requests than that.

A limit is at least the most requests the engine has been seen running, so a full-looking
scrape below that is not taken (the wait was for something else), and evidence expires: a
limit that no scrape has confirmed at that count for ``ttl_s`` is forgotten, so a wrong one
(which keeps requests away, so it would never be contradicted) lasts a minute at most, while a
right one is confirmed whenever the replica fills again. A replica restarted with fewer slots
is not learned again (its past count stands), which errs on the side of no price. Design:
docs/routing.md.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

# KV use at or above which waiting requests may be waiting for cache blocks, not slots.
KV_FULL = 0.9
# A sample's weight against the running average of slot-hold times.
HOLD_WEIGHT = 0.1


@dataclass(slots=True)
class SlotLimit:
    """One endpoint's learned slot limit and slot-hold time (mutated from the event loop)."""

    ttl_s: float = 60.0
    # The limit (0: unknown) and when it was last confirmed; the running count of the last
    # scrape that looked full (0: it did not) and when it was taken.
    limit: int = 0
    confirmed_at: float = 0.0
    candidate: int = 0
    candidate_at: float = 0.0
    # The most requests any scrape found running. A limit is at least that, so a full-looking
    # scrape below it is a wait for something else, and a fleet's limit this endpoint has
    # exceeded is not its own.
    most_running: int = 0
    # Average time from a request's send to its last byte (0: none answered yet), and when
    # this gateway's requests there last went from none to one (0: none in flight).
    hold_s: float = 0.0
    busy_since: float = 0.0

    def observe_scrape(
        self,
        running: float,
        waiting: float,
        kv_usage: float,
        decoding: int,
        now: float,
        max_gap_s: float = 1.0,
    ) -> None:
        """One scrape: the engine's running and waiting counts and KV use, and how many of the
        gateways' requests there were surely past their first byte while it ran; two scrapes
        more than ``max_gap_s`` apart are not "in a row"."""
        count = int(running)
        self.most_running = max(self.most_running, count)
        full = (
            waiting >= 1 and count >= 1 and kv_usage < KV_FULL and count <= decoding
            and count >= self.most_running
        )  # fmt: skip
        if full and count == self.candidate and now - self.candidate_at <= max_gap_s:
            self.limit, self.confirmed_at = count, now
        elif self.limit and count > self.limit:
            self.limit = count  # the engine ran more than we thought it could
        self.candidate, self.candidate_at = (count, now) if full else (0, 0.0)

    def live(self, now: float) -> bool:
        return self.limit > 0 and now - self.confirmed_at <= self.ttl_s

    def limit_at(self, now: float, fleet: int) -> int:
        """The endpoint's own live limit, else the fleet's (replicas of one deployment share
        their engine settings) unless this endpoint has run more than that."""
        if self.live(now):
            return self.limit
        return fleet if fleet >= self.most_running else 0

    def observe_hold(self, seconds: float) -> None:
        """An answered request's lease ended after ``seconds``: from its send, so it includes
        any wait for a slot (an overestimate only while the replica is already full)."""
        if seconds <= 0:
            return
        held = self.hold_s
        self.hold_s = seconds if held <= 0 else held + HOLD_WEIGHT * (seconds - held)

    def hold(self, now: float) -> float:
        """The average hold; before any answer, how long this gateway has had requests in
        flight there without a break (0 if none are)."""
        if self.hold_s > 0:
            return self.hold_s
        return max(0.0, now - self.busy_since) if self.busy_since else 0.0


def fleet_limits(slots: Iterable[tuple[str, SlotLimit]], now: float) -> dict[str, int]:
    """The largest live limit among the endpoints of each role (a prefill pool and a decode
    pool run different engine settings), from ``(role, slots)`` pairs; empty while none is
    known."""
    out: dict[str, int] = {}
    for role, limits in slots:
        if limits.limit and limits.live(now):
            out[role] = max(out.get(role, 0), limits.limit)
    return out
