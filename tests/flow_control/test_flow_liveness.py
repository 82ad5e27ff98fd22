"""Liveness: a place freed is dispatched into at once and once, a queue whose pool is gone is
answered as admission would answer it, and a newcomer does not pass higher-priority work of
another model waiting for the same endpoints.

Deterministic, as tests/flow_control/test_flow_controller.py: a fake clock, no tick (a long
dispatch interval and no ``start``), so only releases, first bytes and explicit
``dispatch()`` calls dispatch.
"""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from flow_control.config import FlowControlConfig
from flow_control.controller import DEFAULT_HEALTH_CYCLE, FlowController
from flow_control.request import FlowRequest
from router.config.pool import HealthCheckConfig
from router.core.endpoints import EndpointSnapshot
from router.core.errors import NoEndpointsError
from router.core.pool import EndpointPool
from tests.flow_control.test_flow_controller import (
    Clock,
    _pool,
    make,
    queue_all,
    req,
    run_now,
    sample,
    settle,
)


def test_the_health_cycle_default_matches_the_gateway_config() -> None:
    health = HealthCheckConfig()
    assert health.interval_seconds + health.timeout_seconds == DEFAULT_HEALTH_CYCLE


def _limited(limit: int = 1) -> tuple[FlowController, EndpointPool, list[str]]:
    """One endpoint whose learned limit is ``limit``; the models whose candidates each
    dispatch pass read, in order (one read per queued model per pass)."""
    clock = Clock()
    pool = _pool(clock, "a")
    reads: list[str] = []

    def candidates(model: str) -> list[EndpointSnapshot]:
        reads.append(model)
        return pool.candidates(model)

    config = FlowControlConfig.model_validate(
        {"saturationDetector": {"concurrencyLimit": {"initialLimit": limit}},
         "dispatchIntervalSeconds": 5}
    )
    ctl = FlowController(config, candidates, clock=clock, registry=CollectorRegistry())
    return ctl, pool, reads


async def test_a_lease_given_up_before_its_first_byte_dispatches_once() -> None:
    """Failover moves on from an endpoint that failed before any byte; the request keeps its
    ticket. The place its lease held is free: queued work takes it at once (not on the next
    tick), and when the request then ends, its ticket's release (it took an endpoint, so it
    held no place of its own) runs no second pass."""
    ctl, pool, reads = _limited()
    held = run_now(ctl.admit(req("held")))
    held.leased()
    lease = pool.lease("a:8000", 100, on_release=ctl.poke)  # as Router.lease wires it
    first, second = await queue_all(ctl, [req("first"), req("second")])
    assert ctl.queued == 2
    lease.release()
    await settle()
    assert first.done() and not second.done(), "the place freed was not dispatched into"
    before = len(reads)
    lease.release()  # idempotent, as every finally that may end the request calls it
    held.release()
    assert len(reads) == before, "the request's end dispatched twice"
    first.result().release()  # never took an endpoint: its own place frees
    await settle()
    assert second.done()
    second.result().release()
    assert ctl.queued == 0 and not ctl._tickets.unplaced


async def test_a_queue_whose_pool_stays_empty_gets_the_admission_answer() -> None:
    """Every endpoint left (or failed its checks) while requests waited: once the pool has
    stayed empty for a health-check cycle they get the 503 a request arriving then gets, not
    the TTL's 429 (which reads as load) a minute later."""
    ctl, pool, clock, registry = make()
    held = run_now(ctl.admit(req("held")))
    a, b = await queue_all(ctl, [req("a"), req("b", "B", priority=3)])
    pool.endpoints = 0
    assert ctl.dispatch() == 0
    clock.now += 2.0  # the cycle is 3 s by default
    ctl.dispatch()
    await settle()
    assert not a.done() and not b.done() and ctl.queued == 2
    clock.now += 1.0
    ctl.dispatch()
    await settle()
    for task in (a, b):
        with pytest.raises(NoEndpointsError) as info:
            task.result()
        assert info.value.status_code == 503
        headers = info.value.headers()
        assert headers["x-gateway-request-dropped-reason"] == "rejected-no-endpoints"
    assert ctl.queued == 0 and ctl.active_flows() == 0 and not ctl._room.queues
    assert sample(registry, "prefixgate_flow_rejections_total", reason="no-endpoints") == 2
    held.release()


async def test_endpoints_back_within_the_cycle_serve_the_queue_and_restart_the_count() -> None:
    """A blip (every endpoint failing one round of checks, a replica restarting in place):
    the pool is back within the cycle, the queue keeps its place; when it empties again, the
    cycle counts from then."""
    ctl, pool, clock, _ = make()
    held = run_now(ctl.admit(req("held")))
    (task,) = await queue_all(ctl, [req("a")])
    pool.endpoints = 0
    ctl.dispatch()
    clock.now += 2.0
    pool.endpoints = 1  # back, and still saturated by the held request
    assert ctl.dispatch() == 0
    pool.endpoints = 0
    clock.now += 0.5
    ctl.dispatch()
    clock.now += 2.0  # 4.5 s since the pool first emptied, 2 s since it emptied again
    ctl.dispatch()
    await settle()
    assert not task.done(), "the count did not restart when the pool came back"
    pool.endpoints = 1
    held.release()
    await settle()
    assert task.done()
    task.result().release()


async def test_a_newcomer_does_not_pass_another_models_higher_priority_for_room() -> None:
    """Two models on the same endpoints (FakePool serves any model; a base model and its
    adapter, say). Room appears between two ticks while a request of the other model waits at
    a higher priority: that one takes it, as its own model's would, not the newcomer."""
    ctl, pool, _, _ = make(slots=1)
    pool.overloaded = True
    (high,) = await queue_all(ctl, [FlowRequest(model="n", priority=5, session_id="high")])
    pool.overloaded = False  # room for one, found by no dispatch yet
    (low,) = await queue_all(ctl, [req("low")])
    assert high.done(), "the higher priority of the other model still waits"
    assert not low.done()
    high.result().release()
    await settle()
    assert low.done()
    low.result().release()
    assert ctl.queued == 0 and not ctl._tickets.unplaced


async def test_what_goes_first_for_a_newcomer_is_only_what_outranks_it() -> None:
    """Room for two appears: the other model's request above the newcomer takes one place,
    the newcomer the other; the other model's request below it waits (it is not dispatched
    ahead of the newcomer on its way)."""
    ctl, pool, _, _ = make(slots=2)
    pool.overloaded = True
    high, below = await queue_all(
        ctl,
        [FlowRequest(model="n", priority=5, session_id="high"),
         FlowRequest(model="n", priority=0, session_id="below")],
    )
    pool.overloaded = False
    newcomer = run_now(ctl.admit(req("newcomer", priority=3)))
    await settle()
    assert high.done() and not below.done()
    high.result().release()
    newcomer.release()
    await settle()
    assert below.done()
    below.result().release()
