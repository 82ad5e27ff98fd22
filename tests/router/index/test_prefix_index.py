from __future__ import annotations

import asyncio

import pytest

from router.index.prefix_index import InMemoryPrefixIndex


@pytest.mark.parametrize(
    ("records", "query", "expected"),
    [
        ([], [1, 2, 3], {"a": 0, "b": 0}),
        ([("a", [1, 2, 3])], [1, 2, 3], {"a": 3, "b": 0}),
        ([("a", [1, 2, 3])], [1, 2, 3, 4, 5], {"a": 3, "b": 0}),
        ([("a", [1, 2]), ("b", [1, 2, 3, 4])], [1, 2, 3, 4], {"a": 2, "b": 4}),
        ([("a", [1, 2, 3])], [9, 2, 3], {"a": 0, "b": 0}),
        ([("a", [1, 2, 3]), ("b", [1])], [], {"a": 0, "b": 0}),
        # A hole in the chain ends the consecutive match even if later blocks are held.
        ([("a", [1, 3])], [1, 2, 3], {"a": 1, "b": 0}),
    ],
)
async def test_match_table(
    records: list[tuple[str, list[int]]], query: list[int], expected: dict[str, int]
) -> None:
    index = InMemoryPrefixIndex()
    for endpoint, hashes in records:
        index.record(endpoint, hashes)
    assert await index.match(query, ["a", "b"]) == expected


async def test_only_candidates_are_reported() -> None:
    index = InMemoryPrefixIndex()
    index.record("a", [1, 2])
    index.record("c", [1, 2])
    assert await index.match([1, 2], ["a"]) == {"a": 2}


def test_capacity_evicts_tail_first() -> None:
    index = InMemoryPrefixIndex(default_capacity=4)
    index.record("a", [1, 2, 3, 4])
    index.record("a", [10, 11])  # two more blocks: the oldest tail (4, 3) goes
    assert index.match_now([1, 2, 3, 4], ["a"]) == {"a": 2}
    assert index.match_now([10, 11], ["a"]) == {"a": 2}
    assert index.entries("a") == 4


def test_rerecording_refreshes_lru() -> None:
    index = InMemoryPrefixIndex(default_capacity=3)
    index.record("a", [1, 2])
    index.record("a", [5])
    index.record("a", [1, 2])  # refresh: 5 is now the oldest
    index.record("a", [7])
    assert index.match_now([1, 2], ["a"]) == {"a": 2}
    assert index.match_now([5], ["a"]) == {"a": 0}


def test_set_capacity_shrinks_and_forget_purges() -> None:
    index = InMemoryPrefixIndex()
    index.record("a", list(range(100)))
    index.record("b", list(range(100)))
    index.set_capacity("a", 10)
    assert index.entries("a") == 10
    assert index.match_now(list(range(100)), ["a", "b"]) == {"a": 10, "b": 100}
    index.forget_now("b")
    assert index.match_now(list(range(100)), ["a", "b"]) == {"a": 10, "b": 0}
    index.forget_now("a")
    assert len(index) == 0


def test_bits_are_reused_after_forget() -> None:
    index = InMemoryPrefixIndex()
    for i in range(50):
        index.record(f"e{i}", [i])
        index.forget_now(f"e{i}")
    index.record("x", [1])
    index.record("y", [1])
    assert index.match_now([1], ["x", "y"]) == {"x": 1, "y": 1}
    assert len(index) == 1


def test_invalid_capacity() -> None:
    with pytest.raises(ValueError):
        InMemoryPrefixIndex(default_capacity=0)


def test_a_fresh_head_is_not_touched_again() -> None:
    index = InMemoryPrefixIndex(default_capacity=1000)
    chain = list(range(1, 101))
    index.record("a", chain)
    lru = index._lru["a"]
    before = dict(lru.scores)
    index.record("a", [*chain, 500, 501])  # the next turn of a session: two new blocks
    assert lru.clock == 102, "only the new tail was touched"
    assert all(lru.scores[h] == before[h] for h in chain)
    # The new blocks sit just below the head they extend: the chain still evicts tail first.
    assert lru.scores[100] > lru.scores[500] > lru.scores[501] > before[100] - 1
    index.set_capacity("a", 101)
    assert index.match_now([*chain, 500, 501], ["a"]) == {"a": 101}


def test_a_hot_head_survives_pressure_it_is_part_of() -> None:
    """Blocks referenced at least every quarter capacity stay, however much else comes and goes."""
    index = InMemoryPrefixIndex(default_capacity=200)
    system = list(range(1, 21))
    for turn in range(300):
        session = [10_000 + turn * 10 + i for i in range(8)]  # a new 8-block tail each time
        index.record("a", [*system, *session])
        assert index.match_now(system, ["a"]) == {"a": 20}, turn
        assert index.entries("a") <= 200
    # Old sessions went, oldest first.
    assert index.match_now([10_000 + i for i in range(8)], ["a"]) == {"a": 0}
    assert index.match_now([*system, *(10_000 + 2990 + i for i in range(8))], ["a"]) == {"a": 28}


def test_stale_blocks_are_touched_again() -> None:
    index = InMemoryPrefixIndex(default_capacity=8)  # fresh window: 2 touches
    index.record("a", [1, 2])
    index.record("a", [5, 6, 7])  # 1, 2 are now stale
    index.record("a", [1, 2, 3])  # so the whole chain is touched: 1, 2 become the newest
    index.record("a", [8, 9, 10, 11])  # 10 entries > 8: the two oldest, 7 then 6, go
    assert index.match_now([5, 6, 7], ["a"]) == {"a": 1}
    assert index.match_now([1, 2, 3], ["a"]) == {"a": 3}


async def test_a_long_cold_chain_is_touched_in_pieces_between_loop_turns() -> None:
    index = InMemoryPrefixIndex(default_capacity=1000, max_blocks_per_step=4)
    chain = list(range(1, 11))
    index.record("a", chain)
    assert index.match_now(chain, ["a"]) == {"a": 4}, "the head at once"
    assert index.pending_pieces == 1
    for _ in range(10):
        await asyncio.sleep(0)
    assert index.pending_pieces == 0
    assert index.match_now(chain, ["a"]) == {"a": 10}
    scores = index._lru["a"].scores
    assert [scores[h] for h in chain] == sorted(scores.values(), reverse=True), "tail lowest"
    index.record("b", chain)
    await index.forget_endpoint("b")  # its remaining pieces find it gone: no resurrection
    for _ in range(10):
        await asyncio.sleep(0)
    assert index.entries("b") == 0 and index.pending_pieces == 0


async def test_a_chain_longer_than_the_fresh_window_is_touched_once_in_pieces() -> None:
    """The pieces of one record share the freshness judged when it began: a chain longer than
    the fresh window does not outlive its own head and get re-touched piece after piece."""
    index = InMemoryPrefixIndex(default_capacity=64, max_blocks_per_step=4)  # window: 16
    chain = list(range(1, 41))
    index.record("a", chain)
    for _ in range(10):  # 9 pieces after the first
        await asyncio.sleep(0)
    assert index.pending_pieces == 0
    lru = index._lru["a"]
    assert lru.clock == 40, "every block touched once"
    assert index.match_now(chain, ["a"]) == {"a": 40}
    scores = [lru.scores[h] for h in chain]
    assert scores == sorted(scores, reverse=True) and len(set(scores)) == 40, "tail lowest"


def test_a_chain_past_the_capacity_touches_only_what_can_be_held() -> None:
    index = InMemoryPrefixIndex(default_capacity=10)
    index.record("a", [100, 101])
    index.record("a", list(range(1, 26)))
    assert index._lru["a"].clock == 12, "the head's 10 blocks, not all 25"
    assert index.entries("a") == 10
    assert index.match_now(list(range(1, 26)), ["a"]) == {"a": 10}
    assert index.match_now([100, 101], ["a"]) == {"a": 0}


def test_an_eviction_behind_many_superseded_entries_rebuilds_the_queue_first() -> None:
    index = InMemoryPrefixIndex(default_capacity=2000)  # fresh window: 500
    a, b = list(range(1, 1501)), list(range(10_000, 10_500))
    for chain in (a, b, a, b, a):  # each re-touch leaves the chain's old entries behind
        index.record("a", chain)
    lru = index._lru["a"]
    assert len(lru.ordered) + len(lru.heap) > 2 * index.entries("a") == 4000
    index.record("a", list(range(20_000, 20_100)))  # 100 new blocks: 100 must go
    assert len(lru.ordered) + len(lru.heap) == index.entries("a") == 2000, "rebuilt"
    # The least recently touched went, as without the rebuild: b's tail.
    assert index.match_now(b, ["a"]) == {"a": 400}
    assert index.match_now(a, ["a"]) == {"a": 1500}


async def test_a_departed_endpoint_leaves_no_capacity_behind() -> None:
    index = InMemoryPrefixIndex(default_capacity=100)
    for i in range(3):
        index.set_capacity(f"gone{i}", 7)
        index.record(f"gone{i}", [1, 2])
        await index.forget_endpoint(f"gone{i}")
        assert index.capacity(f"gone{i}") == 100
    # A restart empties the cache of an engine of the same size: its capacity stays.
    index.set_capacity("restarted", 7)
    await index.clear_endpoint("restarted")
    assert index.capacity("restarted") == 7
