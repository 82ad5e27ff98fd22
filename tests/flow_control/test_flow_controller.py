"""The flow controller: fast path, queue order, limits, shedding, TTL, cancellation, metrics.

Deterministic: a fake clock, a fake pool whose load the test sets, and dispatch driven by
explicit releases and ``dispatch()`` calls. ``settle()`` only lets woken tasks run.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Coroutine
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from flow_control.config import FlowControlConfig
from flow_control.controller import FlowController
from flow_control.request import FlowRequest, Ticket
from router.core.endpoints import Endpoint, EndpointSnapshot
from router.core.errors import NoEndpointsError, SaturatedError, TTLExpiredError
from router.core.pool import EndpointPool


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class FakePool:
    """Endpoints that were never scraped, so only in-flight counts (tickets, here) matter,
    unless ``overloaded`` reports fresh metrics with a long engine queue, one of the
    gateway's requests among it (with none, liveness would let one through)."""

    def __init__(self, endpoints: int = 1) -> None:
        self.endpoints = endpoints
        self.overloaded = False
        self.calls = 0

    def __call__(self, model: str) -> list[EndpointSnapshot]:
        self.calls += 1
        age, waiting = (0.0, 100.0) if self.overloaded else (math.inf, 0.0)
        return [
            EndpointSnapshot(
                id=f"e{i}", url=f"http://e{i}:8000", role="both", in_flight=int(self.overloaded),
                pending_prefill_tokens=0, waiting=waiting, running=0.0, kv_usage=0.0,
                metrics_age=age,
            )
            for i in range(self.endpoints)
        ]


def make(
    config: dict[str, Any] | None = None, slots: int = 1, endpoints: int = 1
) -> tuple[FlowController, FakePool, Clock, CollectorRegistry]:
    data: dict[str, Any] = {"saturationDetector": {"inFlightThreshold": slots}}
    data.update(config or {})
    pool, clock, registry = FakePool(endpoints), Clock(), CollectorRegistry()
    cfg = FlowControlConfig.model_validate(data)
    return FlowController(cfg, pool, clock=clock, registry=registry), pool, clock, registry


def req(tag: str, flow: str = "default", priority: int = 0, **kw: Any) -> FlowRequest:
    # The session id doubles as a tag to identify requests in dispatch order.
    return FlowRequest(model="m", fairness_id=flow, priority=priority, session_id=tag, **kw)


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def run_now(coro: Coroutine[Any, Any, Ticket]) -> Ticket:
    """Run ``admit`` and insist it finished without ever suspending (the fast path)."""
    try:
        coro.send(None)
    except StopIteration as stop:
        assert isinstance(stop.value, Ticket)
        return stop.value
    coro.close()
    raise AssertionError("admit suspended")


async def queue_all(ctl: FlowController, requests: list[FlowRequest]) -> list[asyncio.Task[Ticket]]:
    tasks = []
    for r in requests:
        tasks.append(asyncio.create_task(ctl.admit(r)))
        await settle()  # one at a time, so that arrival order is the list order
    return tasks


async def serve_one_by_one(
    held: Ticket, tasks: list[asyncio.Task[Ticket]], clock: Clock | None = None
) -> list[str]:
    """Free one slot at a time; return the tags in dispatch order."""
    order: list[str] = []
    waiting = set(tasks)
    current = held
    while waiting:
        if clock is not None:
            clock.now += 1.0
        current.release()
        await settle()
        done = [t for t in waiting if t.done()]
        assert len(done) == 1, f"{len(done)} dispatched for one free slot"
        waiting -= set(done)
        current = done[0].result()
        assert current.request.session_id is not None
        order.append(current.request.session_id)
    current.release()
    return order


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    value = registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


async def test_fast_path_returns_without_suspending() -> None:
    ctl, _, _, _ = make(slots=2)
    a = run_now(ctl.admit(req("a")))
    b = run_now(ctl.admit(req("b")))
    assert ctl.outstanding("m") == 2 and a.waited == 0.0
    # Two tickets not yet leased fill both slots: the third must queue.
    task = asyncio.create_task(ctl.admit(req("c")))
    await settle()
    assert not task.done() and ctl.queued == 1
    a.release()
    a.release()  # idempotent: frees one slot only
    await settle()
    assert task.done() and ctl.outstanding("m") == 2
    b.release()
    task.result().release()
    assert ctl.outstanding("m") == 0


async def test_disabled_always_admits_at_once() -> None:
    ctl, pool, _, _ = make({"enabled": False})
    pool.endpoints = 0
    tickets = [run_now(ctl.admit(req(str(i), priority=-5))) for i in range(10)]
    assert all(not t.released for t in tickets)
    ctl.start()  # no tick task when disabled
    await ctl.stop()


async def test_no_endpoints_is_503() -> None:
    ctl, pool, _, registry = make()
    pool.endpoints = 0
    with pytest.raises(NoEndpointsError) as info:
        await ctl.admit(req("a"))
    assert info.value.status_code == 503
    assert info.value.headers()["x-gateway-request-dropped-reason"] == "rejected-no-endpoints"
    assert info.value.headers()["x-llm-d-request-dropped-reason"] == "rejected-no-endpoints"
    assert sample(registry, "prefixgate_flow_rejections_total", reason="no-endpoints") == 1


async def test_strict_priority_across_bands_and_levels() -> None:
    ctl, _, _, _ = make({"priorityBands": [{"priority": 0}, {"priority": 10}]})
    held = run_now(ctl.admit(req("held")))
    tasks = await queue_all(
        ctl,
        [req("low1"), req("low2"), req("high1", priority=10), req("mid", priority=5),
         req("high2", "other", priority=12)],
    )
    order = await serve_one_by_one(held, tasks)
    assert order == ["high2", "high1", "mid", "low1", "low2"]


async def test_round_robin_across_flows_fcfs_within_a_flow() -> None:
    ctl, _, _, _ = make()
    held = run_now(ctl.admit(req("held")))
    arrivals = [req(f"A{i}", "A") for i in range(3)] + [req(f"B{i}", "B") for i in range(3)]
    arrivals.append(req("C0", "C"))
    order = await serve_one_by_one(held, await queue_all(ctl, arrivals))
    assert order == ["A0", "B0", "C0", "A1", "B1", "A2", "B2"]


async def test_fcfs_policy_serves_in_arrival_order() -> None:
    ctl, _, _, _ = make({"defaultBand": {"fairnessPolicy": "fcfs"}})
    held = run_now(ctl.admit(req("held")))
    flows = "AABABCA"
    arrivals = [req(f"{f}{i}", f) for i, f in enumerate(flows)]
    order = await serve_one_by_one(held, await queue_all(ctl, arrivals))
    assert order == [f"{f}{i}" for i, f in enumerate(flows)]


async def test_new_arrival_queues_behind_equal_priority_even_when_not_saturated() -> None:
    ctl, pool, _, _ = make(slots=1)
    pool.overloaded = True
    first = asyncio.create_task(ctl.admit(req("first")))
    await settle()
    pool.overloaded = False  # capacity appeared between two ticks
    second = asyncio.create_task(ctl.admit(req("second")))
    await settle()
    assert first.done() and not second.done()  # the queued one went first
    first.result().release()
    await settle()
    assert second.done()
    second.result().release()


async def test_ttl_expiry_per_objective_and_default() -> None:
    ctl, _, clock, registry = make(
        {"defaultRequestTTL": 60, "objectives": [{"name": "quick", "priority": 0,
                                                   "ttlSeconds": 5}]}
    )
    held = run_now(ctl.admit(req("held")))
    quick, slow = await queue_all(ctl, [req("q", objective="quick"), req("s")])
    clock.now += 5.5
    assert ctl.expire() == 1
    await settle()
    with pytest.raises(TTLExpiredError) as info:
        quick.result()
    assert info.value.status_code == 429
    assert info.value.headers()["x-gateway-request-dropped-reason"] == "rejected-ttl-expired"
    assert "retry-after" in info.value.headers()
    assert not slow.done()
    clock.now += 60
    held.release()  # the head of the queue has expired: it is failed, not dispatched
    await settle()
    with pytest.raises(TTLExpiredError):
        slow.result()
    assert ctl.queued == 0 and ctl.active_flows() == 0
    assert sample(registry, "prefixgate_flow_rejections_total", reason="ttl-expired") == 2


async def test_ttl_counts_from_arrival() -> None:
    ctl, _, clock, _ = make({"defaultRequestTTL": 10})
    held = run_now(ctl.admit(req("held")))
    (task,) = await queue_all(ctl, [req("late", arrival=clock.now - 9.5)])
    clock.now += 1
    ctl.dispatch()
    await settle()
    with pytest.raises(TTLExpiredError):
        task.result()
    held.release()


@pytest.mark.parametrize(
    ("config", "sizes"),
    [
        ({"defaultBand": {"maxRequests": 2}}, [1, 1]),
        ({"defaultBand": {"maxBytes": 100}}, [60, 40]),
        ({"maxRequests": 2}, [1, 1]),
        ({"maxBytes": 100}, [50, 50]),
    ],
)
async def test_capacity_limits(config: dict[str, Any], sizes: list[int]) -> None:
    ctl, _, _, registry = make(config)
    held = run_now(ctl.admit(req("held", size=10**6)))  # fast path: never counted as queued
    tasks = await queue_all(ctl, [req(str(i), size=s) for i, s in enumerate(sizes)])
    assert ctl.queued == 2 and ctl.queued_bytes == sum(sizes)
    with pytest.raises(SaturatedError) as info:
        await ctl.admit(req("over", size=1))
    assert info.value.status_code == 429
    assert info.value.headers()["x-gateway-request-dropped-reason"] == "rejected-saturated"
    assert info.value.headers()["retry-after"] == "1"
    assert sample(registry, "prefixgate_flow_rejections_total", reason="queue-full") == 1
    await serve_one_by_one(held, tasks)


async def test_band_limits_are_per_band_and_global_limits_span_bands() -> None:
    ctl, _, _, _ = make(
        {"maxRequests": 3, "priorityBands": [{"priority": 0, "maxRequests": 1},
                                             {"priority": 5, "maxRequests": 5}]}
    )
    held = run_now(ctl.admit(req("held")))
    low, hi1, hi2 = await queue_all(
        ctl, [req("low"), req("hi1", priority=5), req("hi2", priority=5)]
    )
    with pytest.raises(SaturatedError):
        await ctl.admit(req("low2"))  # band 0 full, and its only flow is the newcomer's own
    # Band 5 has room, the global limit not: the lower-priority request makes way.
    (hi3,) = await queue_all(ctl, [req("hi3", priority=5)])
    assert isinstance(low.exception(), SaturatedError)
    with pytest.raises(SaturatedError):
        await ctl.admit(req("hi4", priority=5))  # nothing below it, and its own flow is longest
    assert await serve_one_by_one(held, [hi1, hi2, hi3]) == ["hi1", "hi2", "hi3"]


async def test_sheddable_requests() -> None:
    ctl, pool, _, registry = make()
    ticket = run_now(ctl.admit(req("shed-ok", priority=-1)))  # not saturated: goes through
    with pytest.raises(SaturatedError) as info:
        run_now(ctl.admit(req("shed", priority=-1)))  # saturated: at once, never queued
    assert info.value.headers()["x-gateway-request-dropped-reason"] == "rejected-saturated"
    assert ctl.queued == 0
    assert sample(registry, "prefixgate_flow_rejections_total", reason="sheddable") == 1
    ticket.release()
    pool.overloaded = True
    with pytest.raises(SaturatedError):
        run_now(ctl.admit(req("shed2", priority=-3)))


async def test_cancellation_removes_the_item() -> None:
    ctl, _, _, registry = make()
    held = run_now(ctl.admit(req("held")))
    a, b, c = await queue_all(ctl, [req("a", "A", size=5), req("b", "B", size=7), req("c", "A")])
    b.cancel()
    await settle()
    assert b.cancelled()
    assert ctl.queued == 2 and ctl.queued_bytes == 5 and ctl.active_flows() == 1
    assert sample(registry, "prefixgate_flow_rejections_total", reason="cancelled") == 1
    a.cancel()
    c.cancel()
    await settle()
    assert ctl.queued == 0 and ctl.active_flows() == 0 and not ctl._room.queues
    held.release()
    assert ctl.outstanding("m") == 0


async def test_cancelled_after_dispatch_gives_the_slot_back() -> None:
    ctl, _, _, _ = make()
    held = run_now(ctl.admit(req("held")))
    (task,) = await queue_all(ctl, [req("a")])
    held.release()  # dispatches: the ticket is issued, the task has not resumed yet
    assert ctl.outstanding("m") == 1
    task.cancel()
    await settle()
    assert task.cancelled()
    assert ctl.outstanding("m") == 0


async def test_cancelled_before_dispatch_runs_is_skipped() -> None:
    ctl, _, _, _ = make()
    held = run_now(ctl.admit(req("held")))
    a, b = await queue_all(ctl, [req("a"), req("b")])
    a.cancel()  # the future is cancelled now; the task's cleanup runs later
    held.release()
    await settle()
    assert a.cancelled() and b.done()
    b.result().release()
    assert ctl.outstanding("m") == 0 and ctl.queued == 0


async def test_nothing_is_left_behind_after_many_flows() -> None:
    ctl, _, _, _ = make()
    held = run_now(ctl.admit(req("held")))
    tasks = await queue_all(ctl, [req(f"r{i}", f"tenant{i}", priority=i % 3) for i in range(50)])
    await serve_one_by_one(held, tasks)
    assert ctl.queued == 0 and ctl.queued_bytes == 0 and ctl.active_flows() == 0
    assert not ctl._room.queues and not ctl._tickets.issued
    assert len(ctl._room._deadlines) <= 64


async def test_empty_pool_keeps_the_queue_until_endpoints_return() -> None:
    ctl, pool, _, _ = make()
    held = run_now(ctl.admit(req("held")))
    (task,) = await queue_all(ctl, [req("a")])
    pool.endpoints = 0
    held.release()
    assert ctl.dispatch() == 0 and ctl.queued == 1
    pool.endpoints = 1
    assert ctl.dispatch() == 1
    await settle()
    task.result().release()


async def test_tick_dispatches_when_metrics_change_and_stop_rejects_the_rest() -> None:
    ctl, pool, _, _ = make({"dispatchIntervalSeconds": 0.001}, slots=5)
    pool.overloaded = True
    ctl.start()
    tasks = [asyncio.create_task(ctl.admit(req(f"r{i}"))) for i in range(3)]
    await settle()
    assert ctl.queued == 3
    pool.overloaded = False  # no release happens: only the tick can notice
    tickets = await asyncio.wait_for(asyncio.gather(*tasks), timeout=2)
    assert len(tickets) == 3
    pool.overloaded = True
    late = asyncio.create_task(ctl.admit(req("late")))
    await settle()
    await ctl.stop()
    with pytest.raises(SaturatedError):
        await late
    assert ctl.queued == 0
    with pytest.raises(SaturatedError):
        await ctl.admit(req("after-stop"))
    for t in tickets:
        t.release()


async def test_session_boost_lets_a_live_session_overtake() -> None:
    ctl, _, clock, _ = make({"sessionBoost": {"enabled": True, "windowSeconds": 30}})
    turn1 = run_now(ctl.admit(ctl.build_request({"x-session-id": "s1"}, "m")))
    turn1.release()
    held = run_now(ctl.admit(req("held")))
    new = ctl.build_request({"x-gateway-inference-fairness-id": "new"}, "m")
    turn2 = ctl.build_request({"x-session-id": "s1"}, "m", size=3)
    assert (new.priority, turn2.priority, turn2.size) == (0, 1, 3)
    tasks = await queue_all(ctl, [new, turn2])
    held.release()
    await settle()
    assert tasks[1].done() and not tasks[0].done()
    tasks[1].result().release()
    await settle()
    tasks[0].result().release()
    clock.now += 31
    assert ctl.build_request({"x-session-id": "s1"}, "m").priority == 0


def test_build_request_resolves_headers() -> None:
    ctl, _, _, _ = make({"objectives": [{"name": "chat", "priority": 7}]})
    r = ctl.build_request(
        {"x-llm-d-inference-objective": "chat", "x-llm-d-inference-fairness-id": "t"},
        "m", size=9, arrival=5.0,
    )
    assert r == FlowRequest(model="m", fairness_id="t", priority=7, objective="chat",
                            session_id=None, size=9, arrival=5.0)


async def test_metrics() -> None:
    ctl, _, _, registry = make(
        {"priorityBands": [{"priority": 0}, {"priority": 5}]}
    )
    ctl._metrics._max_flow_labels = 2
    held = run_now(ctl.admit(req("held")))
    assert sample(registry, "prefixgate_flow_dispatches_total", band="0", path="fast") == 1
    assert sample(registry, "prefixgate_flow_pool_saturated", model="m") == 0
    tasks = await queue_all(
        ctl, [req("a", "A", size=10), req("b", "B", size=20), req("c", "C", size=30),
              req("d", "D", priority=5, size=1)],
    )
    assert sample(registry, "prefixgate_flow_pool_saturated", model="m") == 1
    assert sample(registry, "prefixgate_flow_queue_requests", band="0") == 3
    assert sample(registry, "prefixgate_flow_queue_bytes", band="0") == 60
    assert sample(registry, "prefixgate_flow_queue_requests", band="5") == 1
    assert sample(registry, "prefixgate_flow_queue_flow_requests", flow="A", priority="0") == 1
    assert sample(registry, "prefixgate_flow_queue_flow_bytes", flow="B", priority="0") == 20
    # Label cap reached: C and D are summed as "other".
    assert sample(registry, "prefixgate_flow_queue_flow_bytes", flow="other", priority="0") == 30
    assert sample(registry, "prefixgate_flow_queue_flow_requests", flow="other", priority="5") == 1
    await serve_one_by_one(held, tasks)
    assert sample(registry, "prefixgate_flow_queue_requests", band="0") == 0
    assert sample(registry, "prefixgate_flow_queue_flow_bytes", flow="other", priority="0") == 0
    assert sample(registry, "prefixgate_flow_dispatches_total", band="0", path="queued") == 3
    assert sample(registry, "prefixgate_flow_queue_wait_seconds_count", band="0") == 4


def _pool(clock: Clock, *names: str) -> EndpointPool:
    pool = EndpointPool(clock=clock)
    for name in names:
        pool.add(Endpoint.from_url(f"http://{name}:8000", models=["m"])).healthy = True
    return pool


async def test_streams_on_an_endpoint_that_left_the_candidates_do_not_hold_an_idle_one() -> None:
    clock = Clock()
    pool = _pool(clock, "a", "b")
    ctl = FlowController(
        FlowControlConfig.model_validate({}), pool.candidates, clock=clock,
        registry=CollectorRegistry(),
    )
    for i in range(20):  # 20 streams of ours on a, past their first byte
        ticket = run_now(ctl.admit(req(f"s{i}")))
        ticket.leased()
        pool.lease("a:8000", 100).first_byte()
    state = pool.get("a:8000")
    assert state is not None
    state.ejected = True  # (or gone from discovery) while its streams go on; b is idle
    assert [s.id for s in pool.candidates("m")] == ["b:8000"]
    run_now(ctl.admit(req("new")))


async def test_other_gateways_requests_do_not_hide_this_ones_unplaced_tickets() -> None:
    clock = Clock()
    pool = _pool(clock, "a")

    def with_remote(model: str) -> list[EndpointSnapshot]:
        return pool.candidates(model, lambda endpoint_id: (50, 0, 0, 0.0))

    ctl = FlowController(
        FlowControlConfig.model_validate({}), with_remote, clock=clock,
        registry=CollectorRegistry(),
    )
    tasks = [asyncio.create_task(ctl.admit(req(f"r{i}"))) for i in range(40)]
    await settle()
    # Another gateway decodes 50 there; a burst of ours, none placed yet, meets the learned
    # limit's room (16), not 16 plus the others' 50.
    assert sum(t.done() for t in tasks) == 16
    for task in tasks:
        task.cancel()
    await settle()


async def test_a_ticket_counts_as_placed_once_however_often_its_request_is_leased() -> None:
    clock = Clock()
    pool = _pool(clock, "a")
    ctl = FlowController(
        FlowControlConfig.model_validate(
            {"saturationDetector": {"concurrencyLimit": {"initialLimit": 2}}}
        ),
        pool.candidates, clock=clock, registry=CollectorRegistry(),
    )
    first = run_now(ctl.admit(req("first")))
    first.leased()
    first.leased()  # a retry on another endpoint
    pool.lease("a:8000", 100)  # its prefill, still waiting for a first byte
    second = run_now(ctl.admit(req("second")))  # room 2: one pending there, none unplaced
    queued = asyncio.create_task(ctl.admit(req("third")))
    await settle()
    assert not queued.done(), "one waiting there and one admitted, unplaced: the room is full"
    second.release()  # gave up before taking an endpoint
    await settle()
    assert queued.done()
    first.release()
    queued.result().release()


async def test_a_release_dispatches_another_models_queue_on_the_same_endpoint() -> None:
    """An endpoint serving two models (a base model and its LoRA adapter, say) has one room:
    a request of one that ends before its first byte frees it for the other's queue at once,
    not on the next tick."""
    clock = Clock()
    pool = EndpointPool(clock=clock)
    pool.add(Endpoint.from_url("http://a:8000", models=["m", "n"])).healthy = True
    ctl = FlowController(
        FlowControlConfig.model_validate(
            {"saturationDetector": {"concurrencyLimit": {"initialLimit": 1}},
             "dispatchIntervalSeconds": 5}
        ),
        pool.candidates, clock=clock, registry=CollectorRegistry(),
    )
    first = run_now(ctl.admit(req("first")))
    first.leased()
    lease = pool.lease("a:8000", 100, on_release=ctl.poke)  # as Router.lease; at the limit
    other = asyncio.create_task(ctl.admit(FlowRequest(model="n", session_id="other")))
    await settle()
    assert not other.done() and ctl.queued == 1
    lease.release()  # the replica refused it (or its client left) before any byte
    first.release()
    await settle()
    assert other.done(), "room freed on the shared endpoint, yet the other model's queue waits"
    other.result().release()



def _shared(limit: int = 1) -> tuple[FlowController, EndpointPool]:
    """One endpoint serving two models (a base model and its adapter, say), whose learned
    limit is ``limit``; no tick, so only releases, first bytes and pokes dispatch."""
    clock = Clock()
    pool = EndpointPool(clock=clock)
    pool.add(Endpoint.from_url("http://a:8000", models=["m", "n"])).healthy = True
    ctl = FlowController(
        FlowControlConfig.model_validate(
            {"saturationDetector": {"concurrencyLimit": {"initialLimit": limit}},
             "dispatchIntervalSeconds": 5}
        ),
        pool.candidates, clock=clock, registry=CollectorRegistry(),
    )
    return ctl, pool


async def test_models_sharing_an_endpoint_share_its_room() -> None:
    """A ticket of one model not placed yet takes the shared endpoint's one place: a request
    of the other model must wait for it, not be let through into the same place."""
    ctl, _ = _shared()
    first = run_now(ctl.admit(FlowRequest(model="m", session_id="first")))
    other = asyncio.create_task(ctl.admit(FlowRequest(model="n", session_id="other")))
    await settle()
    assert not other.done(), "two requests let through for the one place on the endpoint"
    first.release()
    await settle()
    assert other.done()
    other.result().release()
    assert ctl.outstanding("m") == ctl.outstanding("n") == 0 and not ctl._tickets.unplaced


@pytest.mark.parametrize("freed_by", ["release", "first-byte"])
async def test_a_place_freed_on_a_shared_endpoint_goes_to_the_highest_priority(
    freed_by: str,
) -> None:
    """One place frees on an endpoint two models share: the higher priority waiting for it
    goes, whichever model it asked for and whichever model's queue was made first, and only
    it (the lower one does not slip into the same place)."""
    ctl, pool = _shared()
    held = run_now(ctl.admit(FlowRequest(model="m", session_id="held")))
    held.leased()
    lease = pool.lease("a:8000", 100, on_release=ctl.poke)  # as Router.lease; at the limit
    low = asyncio.create_task(ctl.admit(FlowRequest(model="m", priority=0, session_id="low")))
    await settle()
    high = asyncio.create_task(ctl.admit(FlowRequest(model="n", priority=5, session_id="high")))
    await settle()
    assert ctl.queued == 2
    if freed_by == "release":
        lease.release()  # m's queue was made first
        held.release()
    else:
        lease.first_byte()
        ctl.poke()  # what the first byte's callback does; m's queue was made first
    await settle()
    assert high.done() and not low.done()
    high.result().release()
    await settle()
    assert low.done()
    low.result().release()
    if freed_by == "first-byte":
        lease.release()
        held.release()
    assert ctl.queued == 0 and not ctl._tickets.issued and not ctl._tickets.unplaced


async def test_a_sheddable_request_is_shed_when_the_work_ahead_takes_the_room() -> None:
    """Room appeared between two ticks, with work of higher priority queued: a sheddable
    newcomer is not shed at the door, but once that work has taken the room the pool is
    saturated, and it must be shed then, not wait out its TTL in the queue."""
    ctl, pool, _, registry = make(slots=1)
    pool.overloaded = True
    first = asyncio.create_task(ctl.admit(req("first")))
    await settle()
    pool.overloaded = False  # capacity for one appeared between two ticks
    shed = asyncio.create_task(ctl.admit(req("shed", priority=-1)))
    await settle()
    assert first.done()
    assert shed.done(), "a sheddable request waits in the queue of a saturated pool"
    with pytest.raises(SaturatedError) as info:
        shed.result()
    assert info.value.headers()["x-gateway-request-dropped-reason"] == "rejected-saturated"
    assert sample(registry, "prefixgate_flow_rejections_total", reason="sheddable") == 1
    assert ctl.queued == 0 and ctl.active_flows() == 0
    first.result().release()
    assert ctl.outstanding("m") == 0


async def test_models_sharing_endpoints_take_turns_at_equal_priority() -> None:
    """Two models on the same endpoints (FakePool serves any model), one place: a freed place
    goes to one request only, and the models' queues take turns rather than the one that
    released (or was queued first) keeping the place while the other's waits for it to
    empty."""
    ctl, _, _, _ = make(slots=1)
    held = run_now(ctl.admit(req("held")))
    tasks = await queue_all(
        ctl, [req("m1"), req("m2"), req("m3"), FlowRequest(model="n", session_id="n1")]
    )
    assert await serve_one_by_one(held, tasks) == ["m1", "n1", "m2", "m3"]
    assert not ctl._tickets.unplaced and not ctl._tickets.placing
