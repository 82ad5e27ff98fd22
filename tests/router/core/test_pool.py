from __future__ import annotations

import math

import pytest

from router.core.endpoints import QUEUE_AVERAGE_S, Endpoint
from router.core.pool import DEPARTED_KEPT_S, EndpointPool, OutlierSettings
from tests.manual_clock import ManualClock


def test_a_lease_holds_its_kv_claim_until_released_and_snapshots_carry_it() -> None:
    """Unlike the prefill queue, KV is held past the first byte: the answer decodes in it."""
    clock = ManualClock(10.0)
    pool = EndpointPool([Endpoint.from_url("http://127.0.0.1:8000")], clock=clock)
    eid = "127.0.0.1:8000"
    lease = pool.lease(eid, prefill_tokens=300, kv_tokens=2_000)
    other = pool.lease(eid, prefill_tokens=100, kv_tokens=500)
    clock.now += 4.0
    lease.first_byte()
    snapshot = pool.get(eid).snapshot(clock())  # type: ignore[union-attr]
    assert snapshot.in_flight_kv_tokens == 2_500
    assert snapshot.hold_s == pytest.approx(4.0)  # no answer yet: busy this long
    lease.release()
    lease.release()
    other.release()
    assert pool.get(eid).in_flight_kv_tokens == 0  # type: ignore[union-attr]


def test_leases_keep_the_queue_average_on_the_pools_clock() -> None:
    now = [1_000.0]
    endpoint = Endpoint.from_url("http://127.0.0.1:8000", models=["m"])
    pool = EndpointPool([endpoint], clock=lambda: now[0])
    (s,) = list(pool)
    s.healthy = True
    lease = pool.lease(s.endpoint.id, prefill_tokens=8_000)
    now[0] += QUEUE_AVERAGE_S
    lease.first_byte()
    (snapshot,) = pool.candidates("m")
    assert snapshot.pending_prefill_tokens == 0
    assert snapshot.recent_prefill_tokens == pytest.approx(8_000 * (1 - math.exp(-1)))


def test_leases_time_how_long_an_answer_holds_a_slot_and_snapshots_carry_the_limit() -> None:
    clock = ManualClock(100.0)
    endpoints = [Endpoint.from_url(f"http://127.0.0.1:{p}", models=["m"]) for p in (1, 2)]
    pool = EndpointPool(endpoints, clock=clock)
    full, fresh = list(pool)
    full.healthy = fresh.healthy = True
    answered = pool.lease(full.endpoint.id)
    clock.now += 1.0
    dropped = pool.lease(full.endpoint.id)  # fails before its first byte: it held no slot
    clock.now += 2.0
    assert full.slots.hold(clock.now) == 3.0, "nothing answered yet: the oldest has held 3 s"
    answered.first_byte()
    answered.release()
    dropped.release()
    assert full.slots.hold_s == 3.0
    for now in (103.0, 103.1):
        full.slots.observe_scrape(8, 2, 0.5, 8, now)
    by_id = {s.id: s for s in pool.candidates("m")}
    full_now = by_id[full.endpoint.id]
    assert (full_now.slot_limit, full_now.hold_s) == (8, 3.0)
    assert by_id[fresh.endpoint.id].slot_limit == 8, "not seen full: the fleet's limit"
    clock.now += 61.0
    limits = [s.slot_limit for s in pool.candidates("m")]
    assert limits == [0, 0], "unconfirmed for a minute"


def test_only_answers_time_a_slots_hold_and_an_idle_endpoint_holds_nothing() -> None:
    clock = ManualClock(100.0)
    pool = EndpointPool([Endpoint.from_url("http://127.0.0.1:1", models=["m"])], clock=clock)
    (state,) = list(pool)
    refused = pool.lease(state.endpoint.id)
    presumed = pool.lease(state.endpoint.id)  # non-streaming, cut off after its presumed prefill
    headers = pool.lease(state.endpoint.id)  # ext_proc: headers seen, no token yet
    clock.now += 5.0
    refused.first_byte(answered=False)
    presumed.presume_prefilled()
    headers.first_byte(tokens=False)
    assert state.headers_only == 1 and state.pending_prefill_requests == 0
    refused.release()
    presumed.release()
    assert state.slots.hold_s == 0.0, "an error reply or a dropped request held no answer"
    assert state.slots.hold(clock.now) == 5.0, "one is still in flight since 100 s"
    headers.release()
    assert state.slots.hold_s == 5.0 and state.headers_only == 0
    state.slots.hold_s = 0.0
    assert state.slots.hold(clock.now + 60.0) == 0.0, "nothing in flight: no hold from idle time"


def test_an_endpoint_back_soon_after_it_left_keeps_its_requests_and_its_ejection() -> None:
    clock = ManualClock()
    endpoint = Endpoint.from_url("http://10.0.0.2:8000")
    pool = EndpointPool([endpoint], clock=clock)
    state = pool.get(endpoint.id)
    assert state is not None
    leases = [pool.lease(endpoint.id) for _ in range(5)]
    state.ejected = True
    pool.remove(endpoint.id, keep=True)  # its readiness probe failed once
    clock.now += 5.0
    back = pool.add(endpoint)
    assert back is state and back.in_flight == 5 and back.ejected
    for lease in leases:
        lease.release()
    assert back.in_flight == 0
    pool.remove(endpoint.id, keep=True)
    clock.now += DEPARTED_KEPT_S
    assert pool.add(endpoint) is not state, "kept a minute at most"
    pool.remove(endpoint.id)  # deleted: a new pod at its address starts afresh
    assert pool.add(endpoint) is not state


def test_an_ejected_endpoint_back_from_a_blip_keeps_the_ejection_cap() -> None:
    clock = ManualClock()
    a, b, c = (Endpoint.from_url(f"http://{n}:8000") for n in "abc")
    outliers = OutlierSettings(5, 30.0, 300.0, max_ejection_percent=50)
    pool = EndpointPool([a, b], clock=clock, outliers=outliers)
    for state in pool:
        state.healthy = True
    state_a = pool.get(a.id)
    assert state_a is not None
    state_a.ejected = True
    pool.remove(a.id, keep=True)
    pool.add(c).healthy = True
    state_b = pool.get(b.id)
    assert state_b is not None
    state_b.ejected = True  # allowed meanwhile: c was up
    pool.remove(c.id)
    back = pool.add(a)
    back.healthy = True
    assert not back.ejected, "two of two ejected would leave nothing to route to"
