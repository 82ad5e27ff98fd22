"""Full queues: who is pushed out (the newest request of the longest, lowest-priority flow)
and who is refused (a newcomer whose own flow already holds the most)."""

from __future__ import annotations

import asyncio

import pytest

from flow_control.queues import pick_victim
from flow_control.request import FlowRequest, Ticket
from router.core.errors import SaturatedError
from tests.flow_control.test_flow_controller import (
    make,
    queue_all,
    req,
    run_now,
    sample,
    serve_one_by_one,
    settle,
)


def evicted(task: asyncio.Task[Ticket]) -> bool:
    return task.done() and isinstance(task.exception(), SaturatedError)


async def test_a_flooding_tenant_is_tail_dropped_for_a_light_one() -> None:
    ctl, _, _, registry = make({"maxRequests": 4})
    held = run_now(ctl.admit(req("held")))
    a = await queue_all(ctl, [req(f"a{i}", "A") for i in range(4)])
    (b,) = await queue_all(ctl, [req("b", "B")])
    await settle()
    assert evicted(a[3]) and not any(t.done() for t in a[:3])
    error = a[3].exception()
    assert isinstance(error, SaturatedError)
    assert error.headers()["x-gateway-request-dropped-reason"] == "rejected-saturated"
    assert sample(registry, "prefixgate_flow_rejections_total", reason="evicted") == 1
    assert ctl.queued == 4
    # The flooding tenant itself is refused while it holds the most.
    with pytest.raises(SaturatedError):
        await ctl.admit(req("a4", "A"))
    assert sample(registry, "prefixgate_flow_rejections_total", reason="queue-full") == 1
    assert await serve_one_by_one(held, [*a[:3], b]) == ["a0", "b", "a1", "a2"]


async def test_equal_flows_refuse_the_newcomer_of_either() -> None:
    ctl, _, _, _ = make({"maxRequests": 4})
    held = run_now(ctl.admit(req("held")))
    tasks = await queue_all(ctl, [req("a0", "A"), req("b0", "B"), req("a1", "A"), req("b1", "B")])
    for tag, flow in (("a2", "A"), ("b2", "B")):
        with pytest.raises(SaturatedError):
            await ctl.admit(req(tag, flow))  # pushing the other out would only swap roles
    # A third tenant with nothing queued gets a place at the expense of a longest flow.
    (c,) = await queue_all(ctl, [req("c0", "C")])
    await settle()
    assert sum(evicted(t) for t in tasks) == 1
    assert evicted(tasks[2])  # A's newest: the first of the longest flows
    assert await serve_one_by_one(held, [t for t in tasks if not t.done()] + [c]) == [
        "a0", "b0", "c0", "b1",
    ]


async def test_a_higher_priority_pushes_out_the_lowest_priority_first() -> None:
    ctl, _, _, _ = make({"maxRequests": 3})
    held = run_now(ctl.admit(req("held")))
    low = await queue_all(ctl, [req("low0", "L"), req("mid0", "M", priority=2),
                                req("low1", "L")])
    (hi,) = await queue_all(ctl, [req("hi", "H", priority=5)])
    await settle()
    assert evicted(low[2]) and not low[0].done() and not low[1].done()
    assert await serve_one_by_one(held, [low[0], low[1], hi]) == ["hi", "mid0", "low0"]


async def test_bytes_limits_push_out_as_many_as_needed() -> None:
    ctl, _, _, _ = make({"defaultBand": {"maxBytes": 100}})
    held = run_now(ctl.admit(req("held")))
    a = await queue_all(ctl, [req(f"a{i}", "A", size=25) for i in range(4)])
    (b,) = await queue_all(ctl, [req("b", "B", size=60)])
    await settle()
    assert [evicted(t) for t in a] == [False, True, True, True]
    assert ctl.queued == 2 and ctl.queued_bytes == 85
    assert await serve_one_by_one(held, [a[0], b]) == ["a0", "b"]


async def test_nobody_is_pushed_out_for_a_newcomer_that_is_refused_anyway() -> None:
    """Pushing out the low-priority request frees too few bytes, and the rest could only
    come from a flow no longer than the newcomer's would be: the newcomer is refused, and
    the request it would have pushed out keeps its place."""
    ctl, _, _, registry = make({"maxBytes": 100})
    held = run_now(ctl.admit(req("held")))
    low, mid = await queue_all(ctl, [req("low", "L", size=30), req("x", "X", priority=5, size=60)])
    with pytest.raises(SaturatedError):
        await ctl.admit(req("new", "Y", priority=5, size=90))
    await settle()
    assert not low.done(), "pushed out for a newcomer that was refused anyway"
    assert ctl.queued == 2 and ctl.queued_bytes == 90
    assert sample(registry, "prefixgate_flow_rejections_total", reason="evicted") == 0
    assert await serve_one_by_one(held, [low, mid]) == ["x", "low"]


async def test_a_request_larger_than_a_limit_never_pushes_anyone_out() -> None:
    ctl, _, _, _ = make({"maxBytes": 100})
    held = run_now(ctl.admit(req("held")))
    a = await queue_all(ctl, [req("a0", "A", size=10), req("a1", "A", size=10)])
    with pytest.raises(SaturatedError):
        await ctl.admit(req("huge", "B", size=101))
    assert not any(t.done() for t in a) and ctl.queued == 2
    await serve_one_by_one(held, a)


async def test_band_limits_only_push_out_from_the_full_band() -> None:
    ctl, _, _, _ = make(
        {"priorityBands": [{"priority": 0, "maxRequests": 10},
                           {"priority": 5, "maxRequests": 2}]}
    )
    held = run_now(ctl.admit(req("held")))
    tasks = await queue_all(
        ctl, [req("low0", "L"), req("low1", "L"), req("hi0", "A", priority=5),
              req("hi1", "A", priority=5)]
    )
    # Band 5 is full; the low band's requests would free nothing there.
    (b,) = await queue_all(ctl, [req("hi-b", "B", priority=6)])
    await settle()
    assert [evicted(t) for t in tasks] == [False, False, False, True]
    assert await serve_one_by_one(held, [*tasks[:3], b]) == ["hi-b", "hi0", "low0", "low1"]


def test_pick_victim_with_nothing_queued() -> None:
    assert pick_victim([], FlowRequest(model="m"), None) is None
