"""Where a target missed reusable prompt tokens: the reason a reuse figure is what it is.

Per request, the client knows the tokens one infinite cache would have served (the reuse
ledger) and the tokens the replica answered as cached (``usage``); the router says where it sent
the request (``x-gateway-destination-endpoint``). A miss is then put down to how the request
was placed against the conversation's previous request:

- *placed*: the conversation's first request (every request of single-turn traffic): its shared
  prefix (a system prompt, a document, an agent type's tools) was recomputed where it was
  placed, because another replica held it or because the cache there had lost it;
- *moved*: a later request (a sub-agent's too) sent to another replica than the conversation's
  previous one: its context recomputed there;
- *at home*: sent where the previous request went, which no longer held it (evicted, or
  preempted before it was cached).

Peers that do not name the replica they picked get no split.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from benchmarks.bench.client import RequestRecord


@dataclass(frozen=True, slots=True)
class ReuseMisses:
    reusable: int = 0
    placed: int = 0
    moved: int = 0
    at_home: int = 0
    known: bool = True  # False: the router did not name its destinations

    def points(self, tokens: int) -> float:
        """``tokens`` in points of the reusable tokens (percent)."""
        return 100.0 * tokens / self.reusable if self.reusable else 0.0

    def cell(self) -> str:
        """``placed / moved / at home`` in points, for a report's table; "-" without a split."""
        if not self.known or not self.reusable:
            return "-"
        return " / ".join(f"{self.points(t):.1f}" for t in (self.placed, self.moved, self.at_home))


def reuse_misses(records: Iterable[RequestRecord]) -> ReuseMisses:
    ok = sorted((r for r in records if r.ok), key=lambda r: r.sent_at)
    if any(r.destination is None for r in ok):
        return ReuseMisses(sum(r.reusable_tokens for r in ok), known=False)
    last: dict[str, str | None] = {}
    reusable = placed = moved = at_home = 0
    for r in ok:
        reusable += r.reusable_tokens
        missed = max(0, r.reusable_tokens - r.cached_tokens)
        if r.session not in last:
            placed += missed
        elif last[r.session] != r.destination:
            moved += missed
        else:
            at_home += missed
        last[r.session] = r.destination
    return ReuseMisses(reusable, placed, moved, at_home)
