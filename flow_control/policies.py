"""Fairness policies: which active flow of a priority level is served next.

Policies are small stateless plugins: the order they need lives in the level's ordered dict of
flows, which the controller keeps (new flows join at the end, empty flows leave at once).
Within a flow, requests are always served first come, first served.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Protocol, runtime_checkable

from flow_control.config import FairnessPolicyName
from flow_control.queues import FlowQueue


@runtime_checkable
class FairnessPolicy(Protocol):
    name: str

    def select(self, flows: OrderedDict[str, FlowQueue]) -> FlowQueue:
        """The flow whose head request goes next; ``flows`` is non-empty."""
        ...

    def dispatched(self, flows: OrderedDict[str, FlowQueue], flow: FlowQueue) -> None:
        """Called after ``flow`` (still non-empty) gave up its head request."""
        ...


class RoundRobinPolicy:
    """One request per active flow in turn: a flooding tenant gets one slot per round."""

    name = "round-robin"

    def select(self, flows: OrderedDict[str, FlowQueue]) -> FlowQueue:
        return next(iter(flows.values()))

    def dispatched(self, flows: OrderedDict[str, FlowQueue], flow: FlowQueue) -> None:
        flows.move_to_end(flow.fairness_id)


class FCFSPolicy:
    """Global first come, first served across the flows of a level."""

    name = "fcfs"

    def select(self, flows: OrderedDict[str, FlowQueue]) -> FlowQueue:
        return min(flows.values(), key=lambda f: f.head().seq)

    def dispatched(self, flows: OrderedDict[str, FlowQueue], flow: FlowQueue) -> None:
        return None


def make_policy(name: FairnessPolicyName) -> FairnessPolicy:
    if name == "fcfs":
        return FCFSPolicy()
    return RoundRobinPolicy()
