"""Learning an engine's sequence-slot limit from scrapes, and how long a request holds a slot."""

from __future__ import annotations

from router.core.slots import SlotLimit


def full(slots: SlotLimit, running: int, now: float, waiting: int = 2) -> None:
    """A scrape of an engine at its limit: requests wait, every running one is decoding."""
    slots.observe_scrape(running, waiting, 0.3, running, now)


def test_two_full_scrapes_in_a_row_at_one_count_teach_the_limit() -> None:
    slots = SlotLimit()
    full(slots, 16, 1.0)
    assert not slots.live(1.0), "one scrape may be a request caught before the engine's step"
    full(slots, 16, 1.1)
    assert slots.live(1.1) and slots.limit == 16


def test_a_count_that_moves_between_scrapes_teaches_nothing() -> None:
    slots = SlotLimit()
    full(slots, 5, 1.0)
    full(slots, 6, 1.1)
    slots.observe_scrape(6, 0, 0.3, 6, 1.2)  # nothing waits
    full(slots, 6, 1.3)
    assert not slots.live(1.3)


def test_waiting_for_prefill_or_for_kv_blocks_is_not_waiting_for_slots() -> None:
    prefilling = SlotLimit()
    for now in (1.0, 1.1, 1.2):
        # Six running, five of them the gateway's decoding ones: one is prefilling, and the
        # waiting requests wait for its token budget.
        prefilling.observe_scrape(6, 3, 0.3, 5, now)
    assert not prefilling.live(1.2)
    kv_bound = SlotLimit()
    for now in (1.0, 1.1, 1.2):
        kv_bound.observe_scrape(6, 3, 0.97, 6, now)
    assert not kv_bound.live(1.2)


def test_an_unconfirmed_limit_expires_and_a_bigger_batch_raises_it() -> None:
    slots = SlotLimit(ttl_s=60.0)
    full(slots, 8, 0.0)
    full(slots, 8, 0.1)
    full(slots, 8, 50.0)
    full(slots, 8, 50.1)
    assert slots.live(110.0), "confirmed again at 50 s"
    assert not slots.live(110.2)
    full(slots, 8, 200.0)
    full(slots, 8, 200.1)
    slots.observe_scrape(12, 0, 0.3, 12, 200.2)
    assert slots.limit == 12, "the engine ran twelve: its limit is at least that"


def test_an_endpoint_not_seen_full_takes_the_fleets_limit_unless_it_ran_more() -> None:
    slots = SlotLimit()
    assert slots.limit_at(1.0, fleet=16) == 16
    slots.observe_scrape(20, 0, 0.3, 20, 1.0)
    assert slots.limit_at(1.1, fleet=16) == 0, "it has run twenty: its limit is not the fleet's"
    full(slots, 24, 2.0)
    full(slots, 24, 2.1)
    assert slots.limit_at(2.2, fleet=16) == 24, "its own limit wins"
    assert SlotLimit().limit_at(1.0, fleet=0) == 0


def test_the_hold_is_an_average_of_answers_and_before_any_the_oldest_ones_age() -> None:
    slots = SlotLimit()
    assert slots.hold(5.0) == 0.0
    slots.busy_since = 2.0
    assert slots.hold(5.0) == 3.0, "nothing has finished: the first request has held 3 s"
    slots.observe_hold(4.0)
    assert slots.hold(100.0) == 4.0
    slots.observe_hold(14.0)
    assert slots.hold(100.0) == 5.0
    slots.observe_hold(0.0)
    assert slots.hold(100.0) == 5.0, "a zero-length lease says nothing"


def test_a_full_looking_pair_below_the_most_ever_running_is_a_wait_for_something_else() -> None:
    slots = SlotLimit(ttl_s=60.0)
    slots.observe_scrape(20, 0, 0.3, 20, 0.0)
    full(slots, 6, 1.0)  # e.g. a long prompt waiting for KV blocks below the 90% mark
    full(slots, 6, 1.1)
    assert not slots.live(1.1), "it has run twenty: six cannot be its limit"
    full(slots, 20, 2.0)
    full(slots, 20, 2.1)
    for now in (50.0, 50.1, 100.0, 100.1):
        full(slots, 12, now)
    assert not slots.live(62.2), "pairs below the limit do not keep it alive"


def test_two_full_scrapes_far_apart_are_not_in_a_row() -> None:
    slots = SlotLimit()
    full(slots, 16, 1.0)
    full(slots, 16, 30.0)  # the scrapes in between failed, or the endpoint was out
    assert not slots.live(30.0)
    slots.observe_scrape(16, 2, 0.3, 16, 30.5, max_gap_s=1.0)
    assert slots.live(30.5)


def test_an_endpoint_that_ran_exactly_the_fleets_limit_takes_it() -> None:
    slots = SlotLimit()
    slots.observe_scrape(16, 0, 0.3, 16, 1.0)
    assert slots.limit_at(1.0, fleet=16) == 16
