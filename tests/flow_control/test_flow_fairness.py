"""Tenant A floods ten times more requests than tenant B into a saturated pool that frees one
slot at a time. Round-robin interleaves B's requests (its wait stays bounded); global FCFS
starves B behind A's burst. Time is a fake clock advanced by the simulated server."""

from __future__ import annotations

import asyncio
import math
import statistics
from typing import Any

from prometheus_client import CollectorRegistry

from flow_control.config import FlowControlConfig
from flow_control.controller import FlowController
from flow_control.request import FlowRequest, Ticket
from router.core.endpoints import EndpointSnapshot

SERVICE_TIME = 1.0


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def one_endpoint(model: str) -> list[EndpointSnapshot]:
    return [
        EndpointSnapshot(
            id="e", url="http://e:8000", role="both", in_flight=0, pending_prefill_tokens=0,
            waiting=0.0, running=0.0, kv_usage=0.0, metrics_age=math.inf,
        )
    ]


async def simulate(policy: str, a_requests: int, b_requests: int) -> dict[str, list[Any]]:
    """Queue waits per tenant, and the dispatch order; A's burst arrives just before B's."""
    clock = Clock()
    config = FlowControlConfig.model_validate(
        {
            "defaultBand": {"fairnessPolicy": policy},
            "saturationDetector": {"inFlightThreshold": 1},  # one request at a time
            "defaultRequestTTL": 10_000,
        }
    )
    ctl = FlowController(config, one_endpoint, clock=clock, registry=CollectorRegistry())
    order: list[str] = []
    waits: dict[str, list[Any]] = {"A": [], "B": [], "order": order}
    inbox: asyncio.Queue[Ticket] = asyncio.Queue()

    async def client(tenant: str) -> None:
        arrival = clock.now
        request = FlowRequest(model="m", fairness_id=tenant, arrival=arrival)
        ticket = await ctl.admit(request)
        waits[tenant].append(clock.now - arrival)
        order.append(tenant)
        await inbox.put(ticket)

    async def server(total: int) -> None:
        for _ in range(total):
            ticket = await inbox.get()
            clock.now += SERVICE_TIME
            ticket.release()  # frees the slot: the controller dispatches the next request

    clients = [client("A") for _ in range(a_requests)] + [client("B") for _ in range(b_requests)]
    await asyncio.wait_for(
        asyncio.gather(server(a_requests + b_requests), *clients), timeout=10
    )
    assert ctl.queued == 0 and ctl.active_flows() == 0 and ctl.outstanding("m") == 0
    return waits


def p90(values: list[Any]) -> float:
    return float(statistics.quantiles(values, n=10, method="inclusive")[-1])


async def test_round_robin_bounds_the_light_tenants_wait() -> None:
    alone = await simulate("round-robin", 0, 10)
    flooded = await simulate("round-robin", 100, 10)
    assert len(flooded["B"]) == 10
    # B gets every other slot: its wait is at most twice its wait alone, plus the two slots
    # A held before B's burst arrived (the one in service and the head of A's queue).
    assert p90(flooded["B"]) <= 2 * p90(alone["B"]) + 2 * SERVICE_TIME
    assert max(flooded["B"]) <= 2 * 10 * SERVICE_TIME
    # Interleaved: every other dispatch is B's until B has nothing left.
    assert flooded["order"][:21] == list("A" + "AB" * 10)
    # ... while A, who sent the burst, absorbs the delay.
    assert max(flooded["A"]) >= 100 * SERVICE_TIME


async def test_fcfs_starves_the_light_tenant_behind_the_burst() -> None:
    flooded = await simulate("fcfs", 100, 10)
    assert min(flooded["B"]) >= 100 * SERVICE_TIME
    assert flooded["order"] == ["A"] * 100 + ["B"] * 10
    round_robin = await simulate("round-robin", 100, 10)
    assert p90(flooded["B"]) > 4 * p90(round_robin["B"])
