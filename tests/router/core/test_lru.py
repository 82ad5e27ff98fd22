"""The size-bounded LRU behind the tokenizer caches."""

from __future__ import annotations

from router.core.lru import SizedLRU


def test_bounded_by_entries_and_by_summed_length_oldest_out_first() -> None:
    lru: SizedLRU[str, list[int]] = SizedLRU(max_entries=3, max_size=10)
    for key in "abc":
        lru.put(key, [0, 0])
    assert lru.get("a") == [0, 0]  # "a" is now the most recent
    lru.put("d", [0])
    assert "b" not in lru and all(k in lru for k in "acd") and len(lru) == 3
    lru.put("e", [0] * 8)  # 2 + 2 + 1 + 8 > 10: the oldest go until it fits
    assert list(k for k in "acde" if k in lru) == ["d", "e"] and lru.size == 9
    lru.put("huge", [0] * 11)  # larger than the whole bound: not kept, nothing evicted
    assert "huge" not in lru and lru.size == 9


def test_replacing_an_entry_keeps_the_size_right_and_gets_are_counted() -> None:
    lru: SizedLRU[int, list[int]] = SizedLRU(max_entries=4, max_size=100)
    lru.put(1, [0] * 5)
    lru.put(1, [0] * 3)
    assert lru.size == 3 and len(lru) == 1
    assert 2 not in lru and (lru.hits, lru.misses) == (0, 0)  # membership is not a use
    assert lru.get(2) is None and lru.get(1) == [0, 0, 0]
    assert (lru.hits, lru.misses) == (1, 1)
    lru.put(3, [])  # an empty value is a value
    assert lru.get(3) == [] and lru.hits == 2


def test_get_many_is_get_for_each_key() -> None:
    lru: SizedLRU[str, list[int]] = SizedLRU(max_entries=3, max_size=100)
    for key in "abc":
        lru.put(key, [1])
    assert lru.get_many(["a", "x", "b"]) == [[1], None, [1]]
    assert (lru.hits, lru.misses) == (2, 1)
    lru.put("d", [1])  # "a" and "b" were used since "c": "c" is the oldest
    assert "c" not in lru and all(k in lru for k in "abd")
