"""A first pick that failed before its first byte takes back its speculative entries
(router/precise/routing.py on_unpick, router/precise/speculation.py withdraw)."""

from __future__ import annotations

import orjson

from router.config.precise import PrecisePrefixConfig
from router.core.framework import RoutingRequest, UnpickObserver
from router.precise.index import PreciseIndex
from router.precise.keys import request_keys
from router.precise.routing import PreciseSettings, PreciseTracker
from router.protocol.parsing import parse_request
from tests.manual_clock import ManualClock
from tests.router.precise.test_extra_keys import BS, TOKENS, A, B, FixedTokenizer, feed, snapshot
from tests.router.precise.test_extra_keys import stored as stored_event

KEYS = request_keys(TOKENS, BS)
TTL = 2.0


def tracker_at(clock: ManualClock) -> tuple[PreciseTracker, PreciseIndex]:
    index = PreciseIndex(BS, clock=clock)
    settings = PreciseSettings(PrecisePrefixConfig(block_size=BS, speculative_ttl_seconds=TTL))
    return PreciseTracker(index, FixedTokenizer(), settings, clock=clock), index


async def routed(tracker: PreciseTracker, serial: int) -> RoutingRequest:
    """A request of the same prompt as every other, tokenized and scored as the router does."""
    body = {"model": "base", "messages": [{"role": "user", "content": "hi"}]}
    parsed = parse_request("chat", orjson.dumps(body))
    tracker.attach(serial, parsed)
    request = RoutingRequest(f"r{serial}", parsed.model, serial=serial)
    endpoints = [snapshot(A), snapshot(B)]
    await tracker.produce(request, endpoints)
    assert tracker.scores(request, endpoints) is not None
    return request


async def test_an_unpick_withdraws_its_own_speculation_and_leaves_a_sibling_s() -> None:
    clock = ManualClock(100.0)
    tracker, index = tracker_at(clock)
    assert isinstance(tracker, UnpickObserver)
    first, second = await routed(tracker, 1), await routed(tracker, 2)
    tracker.on_pick(first, A)
    clock.now = 101.0
    tracker.on_pick(second, A)  # a same-prefix sibling, newer, still in flight there
    tracker.on_unpick(first, B)  # not where it was picked: nothing
    assert index.match(KEYS, [A]) == {A: 3}
    tracker.on_unpick(second, A)  # the newest batch goes; the older one still holds the keys
    assert index.match(KEYS, [A]) == {A: 3}
    assert index.speculative_entries() == 3
    tracker.on_unpick(first, A)
    assert index.match(KEYS, [A]) == {A: 0}
    assert index.speculative_entries() == 0


async def test_after_an_unpick_a_sibling_s_entries_expire_at_their_own_ttl() -> None:
    clock = ManualClock(100.0)
    tracker, index = tracker_at(clock)
    first, second = await routed(tracker, 1), await routed(tracker, 2)
    tracker.on_pick(first, A)
    clock.now = 101.0
    tracker.on_pick(second, A)
    tracker.on_unpick(second, A)
    clock.now = 100.0 + TTL - 0.5
    assert index.match(KEYS, [A]) == {A: 3}
    clock.now = 100.0 + TTL  # the first pick's TTL, not the withdrawn one's
    assert index.match(KEYS, [A]) == {A: 0}


async def test_an_unpick_keeps_what_the_endpoint_s_events_announced() -> None:
    clock = ManualClock(100.0)
    tracker, index = tracker_at(clock)
    feed(index, A, stored_event([1, 2], None, TOKENS[:8]))
    request = await routed(tracker, 1)
    tracker.on_pick(request, A)
    assert index.match(KEYS, [A]) == {A: 3}
    tracker.on_unpick(request, A)
    assert index.match(KEYS, [A]) == {A: 2}
    assert index.speculative_entries() == 0
