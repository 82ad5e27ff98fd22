from __future__ import annotations

import pytest

from router.prefix_index import InMemoryPrefixIndex


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
