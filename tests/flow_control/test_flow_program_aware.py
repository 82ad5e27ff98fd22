"""program-aware fairness: least attained service (prompt tokens, decayed) goes first.

Program A has just had a large share of the pool; then A and B queue equally. Least attained
service serves B until B has caught up; round-robin alternates regardless of history; after
many half-lives A's history is forgotten. Time is a fake clock advanced by the fake server.
"""

from __future__ import annotations

import asyncio
import math

import pytest
from prometheus_client import CollectorRegistry

from flow_control.config import FlowControlConfig, ProgramAwareConfig
from flow_control.controller import FlowController
from flow_control.policies import ProgramAwarePolicy, make_policy
from flow_control.request import FlowRequest, Ticket
from router.core.endpoints import EndpointSnapshot
from router.core.errors import TTLExpiredError
from tests.manual_clock import ManualClock


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


async def run_phase(
    ctl: FlowController, clock: Clock, arrivals: list[tuple[str, int]]
) -> list[str]:
    """Requests (program, body bytes) arrive in this order into a pool that serves one at a
    time (a second each); returns the order in which they were dispatched."""
    order: list[str] = []
    inbox: asyncio.Queue[Ticket] = asyncio.Queue()

    async def client(program: str, size: int) -> None:
        ticket = await ctl.admit(FlowRequest(model="m", fairness_id=program, size=size))
        order.append(program)
        await inbox.put(ticket)

    async def server() -> None:
        for _ in arrivals:
            ticket = await inbox.get()
            clock.now += 1.0
            ticket.release()

    await asyncio.wait_for(
        asyncio.gather(server(), *(client(p, s) for p, s in arrivals)), timeout=10
    )
    return order


async def history_then_contention(policy: str, pause: float) -> list[str]:
    clock = Clock()
    config = FlowControlConfig.model_validate(
        {
            "defaultBand": {"fairnessPolicy": policy},
            "saturationDetector": {"inFlightThreshold": 1},
            "defaultRequestTTL": 10_000,
        }
    )
    ctl = FlowController(config, one_endpoint, clock=clock, registry=CollectorRegistry())
    # A's burst queues behind its own first request: 5 x 10,000 prompt tokens charged to A.
    await run_phase(ctl, clock, [("A", 40_000)] * 6)
    clock.now += pause
    contention = [("A", 4_000)] * 5 + [("B", 4_000)] * 5
    return (await run_phase(ctl, clock, contention))[1:]  # the first passes at once


async def test_least_attained_service_lets_the_light_program_catch_up() -> None:
    assert await history_then_contention("program-aware", 0.0) == ["B"] * 5 + ["A"] * 4
    assert await history_then_contention("round-robin", 0.0) == ["A", "B"] * 4 + ["B"]


async def test_attained_service_decays() -> None:
    # Ten half-lives later A's 50,000 tokens weigh ~49: B gets one request ahead, then the
    # two alternate as their service stays level.
    order = await history_then_contention("program-aware", 600.0)
    assert order[:4] == ["B", "A", "B", "A"]


def test_service_is_charged_per_selection_and_bounded() -> None:
    clock = Clock()
    policy = ProgramAwarePolicy(ProgramAwareConfig(half_life_seconds=10, max_programs=2), clock)
    policy._charge("a", 1000, clock.now)
    clock.now = 10.0
    assert policy.service("a") == pytest.approx(500.0)
    policy._charge("b", 1, clock.now)
    policy._charge("c", 1, clock.now)
    assert policy.service("a") == 0.0, "the least recently served program is forgotten"
    assert isinstance(make_policy("program-aware"), ProgramAwarePolicy)


def test_config_is_strict() -> None:
    with pytest.raises(ValueError, match="halfLifeSeconds"):
        FlowControlConfig.model_validate(
            {"defaultBand": {"fairnessPolicy": "program-aware",
                             "programAware": {"halfLifeSeconds": -1}}}
        )


def one_slot(model: str) -> list[EndpointSnapshot]:
    return [EndpointSnapshot("e", "http://e", "both", 0, 0, 0.0, 0.0, 0.0, math.inf)]


async def test_an_expired_head_is_not_charged_as_service() -> None:
    """A tenant whose queued requests expire got no service: charged for it, it would be
    ordered behind everyone else."""
    clock = ManualClock(0.0)
    cfg = FlowControlConfig.model_validate({
        "saturationDetector": {"inFlightThreshold": 1},
        "defaultBand": {"fairnessPolicy": "program-aware"},
        "defaultRequestTTL": 10,
    })
    ctl = FlowController(cfg, one_slot, clock=clock, registry=CollectorRegistry())
    held = await ctl.admit(FlowRequest(model="m", fairness_id="holder"))  # fills the one slot
    task = asyncio.create_task(ctl.admit(FlowRequest(model="m", fairness_id="A", size=400_000)))
    await asyncio.sleep(0)
    assert ctl.queued == 1
    clock.now = 11.0  # A's TTL passes between two ticks
    held.release()  # the release dispatches: A's head is selected, found expired, failed
    await asyncio.sleep(0)
    with pytest.raises(TTLExpiredError):
        await task
    policy = ctl._default_band.policy
    assert isinstance(policy, ProgramAwarePolicy)
    assert policy.service("A") == 0.0, f"A charged {policy.service('A'):.0f} tokens for nothing"
