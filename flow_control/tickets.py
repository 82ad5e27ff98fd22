"""The tickets a flow controller has issued and not yet released, counted per model.

Saturation is judged from these counts, not inferred from the endpoints' in-flight counts:
those also hold other gateways' requests, and not those of endpoints that have left the
candidates while their streams go on. A ticket is *unplaced* until its request takes an endpoint
(``Ticket.leased``): no endpoint's in-flight count shows it yet. Models share endpoints (a base
model and its adapters), so one model's unplaced tickets take room in another's pool too.
"""

from __future__ import annotations

from router.core.endpoints import EndpointSnapshot


class IssuedTickets:
    """Per model: tickets issued, those of them unplaced, and where those may land."""

    def __init__(self) -> None:
        self.issued: dict[str, int] = {}  # tickets not yet released
        # Of those, the ones whose request has not taken an endpoint yet.
        self.unplaced: dict[str, int] = {}
        # Where those may land: their model's candidates when the last was issued.
        self.placing: dict[str, list[EndpointSnapshot]] = {}

    def issue(self, model: str, snapshots: list[EndpointSnapshot]) -> None:
        self.issued[model] = self.issued.get(model, 0) + 1
        self.unplaced[model] = self.unplaced.get(model, 0) + 1
        self.placing[model] = snapshots

    def placed(self, model: str) -> None:
        """A ticket's request took an endpoint (or was released without taking one)."""
        _decrement(self.unplaced, model)
        if model not in self.unplaced:
            self.placing.pop(model, None)

    def released(self, model: str, leased: bool) -> None:
        _decrement(self.issued, model)
        if not leased:
            self.placed(model)

    def pending(self, model: str, snapshots: list[EndpointSnapshot]) -> int:
        """The unplaced tickets that may land in ``model``'s pool (``snapshots``): its own, and
        another model's when that one's pool overlaps this one."""
        unplaced = self.unplaced
        pending = unplaced.get(model, 0)
        if len(unplaced) > (model in unplaced):
            ids = {s.id for s in snapshots}
            for other, count in unplaced.items():
                if other != model and any(s.id in ids for s in self.placing.get(other, ())):
                    pending += count
        return pending

    def outstanding(self, model: str) -> int:
        return self.issued.get(model, 0)


def _decrement(counts: dict[str, int], model: str) -> None:
    left = counts.get(model, 0) - 1
    if left > 0:
        counts[model] = left
    else:
        counts.pop(model, None)
