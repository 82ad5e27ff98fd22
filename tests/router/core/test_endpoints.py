from __future__ import annotations

import math

import pytest

from router.core.endpoints import (
    QUEUE_AVERAGE_S,
    Endpoint,
    EndpointState,
    SharedPrefix,
    session_kv_added,
    session_kv_held,
)
from router.core.lease import Lease


def state() -> EndpointState:
    return EndpointState(Endpoint.from_url("http://127.0.0.1:8000"))


def test_a_lease_counts_its_prefill_until_the_first_byte_and_itself_until_released() -> None:
    s = state()
    lease = Lease(s, prefill_tokens=3_000)
    other = Lease(s, prefill_tokens=500)
    assert (s.in_flight, s.pending_prefill_tokens, s.pending_prefill_requests) == (2, 3_500, 2)
    lease.first_byte()
    lease.first_byte()  # a second chunk settles nothing more
    assert (s.in_flight, s.pending_prefill_tokens, s.pending_prefill_requests) == (2, 500, 1)
    lease.release()
    lease.release()
    other.release()  # released before its first byte: its prefill leaves the queue too
    assert (s.in_flight, s.pending_prefill_tokens, s.pending_prefill_requests) == (0, 0, 0)


def test_a_sessions_requests_in_flight_together_hold_its_context_once() -> None:
    """Sub-agents forked from one context share its blocks in the engine: the session holds
    its largest claim once, and each sub-agent adds what it computes beyond it."""
    s = state()
    parent = Lease(s, prefill_tokens=0, kv_tokens=10_000, session="a", kv_own=300)
    sub = Lease(s, prefill_tokens=0, kv_tokens=10_200, session="a", kv_own=500)
    other = Lease(s, prefill_tokens=0, kv_tokens=3_000, session="b")
    single = Lease(s, prefill_tokens=0, kv_tokens=500)
    assert s.in_flight_kv_tokens == 10_200 + 300 + 3_000 + 500
    assert session_kv_held(s.snapshot(0.0).session_kv["a"]) == 10_200 + 300
    sub.release()
    sub.release()
    assert s.in_flight_kv_tokens == 10_200 + 3_000 + 500, "held while one of them runs"
    parent.release()
    other.release()
    single.release()
    assert (s.in_flight_kv_tokens, s.session_kv) == (0, {})


def test_a_session_without_its_own_share_told_shares_nothing() -> None:
    s = state()
    first = Lease(s, prefill_tokens=0, kv_tokens=4_000, session="a")
    second = Lease(s, prefill_tokens=0, kv_tokens=5_000, session="a")
    assert s.in_flight_kv_tokens == 9_000
    first.release()
    second.release()
    assert (s.in_flight_kv_tokens, s.session_kv) == (0, {})


def test_sessions_sharing_a_prefix_hold_it_once() -> None:
    """Sessions of one agent type start with the same system prompt: the engine holds its
    blocks once for every request running with it."""
    s = state()
    system = SharedPrefix(key=7, tokens=4_000, blocks=40)
    a = Lease(s, prefill_tokens=0, kv_tokens=5_000, session="a", kv_own=500, shared=system)
    b = Lease(s, prefill_tokens=0, kv_tokens=6_000, session="b", kv_own=600, shared=system)
    other = SharedPrefix(key=8, tokens=3_000, blocks=30)
    c = Lease(s, prefill_tokens=0, kv_tokens=3_500, session="c", kv_own=300, shared=other)
    assert s.in_flight_kv_tokens == 4_000 + 1_000 + 2_000 + 3_500
    assert set(s.snapshot(0.0).prefix_kv) == {7, 8}
    a.release()
    assert s.in_flight_kv_tokens == 4_000 + 2_000 + 3_500, "held while one of them runs"
    b.release()
    b.release()
    c.release()
    assert (s.in_flight_kv_tokens, s.session_kv, s.prefix_kv) == (0, {}, {})


def test_a_shared_prefix_is_held_at_its_latest_count() -> None:
    """A prefix held without a break by one request after another keeps the latest count of
    its tokens (the estimate of tokens a byte improves), and nothing is left when all end."""
    s = state()
    early = SharedPrefix(key=7, tokens=4_000, blocks=40)  # counted at a prior 4 bytes a token
    a = Lease(s, prefill_tokens=0, kv_tokens=5_000, session="a", kv_own=500, shared=early)
    learned = SharedPrefix(key=7, tokens=1_600, blocks=40)
    b = Lease(s, prefill_tokens=0, kv_tokens=2_100, session="b", kv_own=200, shared=learned)
    assert s.in_flight_kv_tokens == 1_000 + 1_600 + 500
    a.release()
    assert s.in_flight_kv_tokens == 1_600 + 500
    b.release()
    assert (s.in_flight_kv_tokens, s.session_kv, s.prefix_kv) == (0, {}, {})


@pytest.mark.parametrize(
    ("requests", "claim", "own", "added"),
    [
        ([], 8_000, 200, 8_000),  # nothing of the session in flight: all of it
        ([(8_000, 300)], 8_100, 200, 300),  # grows the largest by 100 and adds 200 of its own
        ([(8_000, 300)], 7_900, 200, 200),  # smaller: its own part only
        ([(8_000, 8_000)], 8_000, 200, 200),  # the first computed the context: it is held
        ([(8_000, 300), (8_100, 400)], 8_000, 300, 300),  # a third sub-agent: its own part
    ],
)
def test_what_one_more_request_of_a_session_adds(
    requests: list[tuple[int, int]], claim: int, own: int, added: int
) -> None:
    s = state()
    for tokens, computed in requests:
        s.hold_kv(tokens, "a", computed)
    before = s.in_flight_kv_tokens
    assert session_kv_added(s.session_kv.get("a"), claim, own) == added
    s.hold_kv(claim, "a", own)
    assert s.in_flight_kv_tokens - before == added


def test_waiting_requests_are_foreign_only_beyond_the_gateways_own() -> None:
    s = state()
    s.metrics.waiting = 3.0
    s.metrics.gateway_in_flight = 2  # in flight when scraped, so possibly among the 3
    assert s.snapshot(0.0).foreign_waiting == 1.0
    leases = [Lease(s, prefill_tokens=10) for _ in range(3)]
    assert s.snapshot(0.0).foreign_waiting == 0.0  # the scrape may not have seen these yet
    for lease in leases:
        lease.release()
    s.metrics.gateway_in_flight = 0
    assert s.snapshot(0.0).foreign_waiting == 3.0


def test_the_recent_queue_remembers_a_queue_that_just_drained() -> None:
    s = state()
    s.add_pending(10_000, 1, now=100.0)
    # Held for one time constant: the average has climbed 63% of the way.
    assert s.recent_prefill_tokens(100.0 + QUEUE_AVERAGE_S) == pytest.approx(
        10_000 * (1 - math.exp(-1)), rel=1e-6
    )
    s.add_pending(-10_000, -1, now=100.0 + QUEUE_AVERAGE_S)
    drained = s.recent_prefill_tokens(100.0 + QUEUE_AVERAGE_S)
    assert s.pending_prefill_tokens == 0 and drained > 6_000
    # Empty since then: it decays, and the snapshot carries it.
    later = 100.0 + 3 * QUEUE_AVERAGE_S
    assert s.snapshot(later).recent_prefill_tokens == pytest.approx(drained * math.exp(-2))
    assert s.snapshot(later).pending_prefill_tokens == 0
