"""The precise index: engine hashes mapped to the gateway's own keys, speculation, bounds."""

from __future__ import annotations

from array import array

import pytest

from router.precise.index import KEY_SEED, PreciseIndex, block_keys
from tests.manual_clock import ManualClock

BS = 4


def tokens(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def test_block_keys_chain_only_full_blocks_and_depend_on_the_prefix() -> None:
    keys = block_keys(tokens(10), BS)
    assert len(keys) == 2
    assert block_keys(tokens(8), BS) == keys
    assert block_keys(tokens(12), BS)[:2] == keys
    # The same block after another prefix is another key.
    assert block_keys([9, 9, 9, 9, *tokens(4, 4)], BS)[1] != keys[1]
    assert block_keys(tokens(4, 4), BS, parent=keys[0]) == keys[1:]
    assert block_keys(tokens(12), BS, max_blocks=1) == keys[:1]
    assert block_keys(tokens(3), BS) == []
    assert block_keys(tokens(4), BS, parent=KEY_SEED) == keys[:1]
    # A memo's 32-bit array and a list of the same ids are the same keys.
    assert block_keys(array("I", tokens(10)), BS) == keys


def stored_chain(index: PreciseIndex, eid: str, toks: list[int], hashes: list[int]) -> None:
    """Store ``toks`` as two events (the second names the first's last block as parent)."""
    half = len(hashes) // 2
    assert index.stored(eid, hashes[:half], None, toks[: half * BS], BS)
    assert index.stored(eid, hashes[half:], hashes[half - 1], toks[half * BS :], BS)


def test_stored_events_map_to_the_request_side_keys() -> None:
    index = PreciseIndex(BS)
    toks = tokens(16)
    stored_chain(index, "a", toks, [101, 102, 103, 104])
    keys = block_keys([*toks, 7, 7], BS)
    assert index.keys("a") == set(keys)
    assert index.engine_hashes("a") == {101, 102, 103, 104}
    assert index.match(keys, ["a", "b"]) == {"a": 4, "b": 0}
    # Engine hashes may be bytes too (newer vLLM).
    assert index.stored("b", [b"\x01" * 32], None, toks[:BS], BS)
    assert index.match(keys, ["a", "b"]) == {"a": 4, "b": 1}


def test_removed_and_cleared_update_the_match() -> None:
    index = PreciseIndex(BS)
    toks = tokens(16)
    stored_chain(index, "a", toks, [1, 2, 3, 4])
    stored_chain(index, "b", toks, [11, 12, 13, 14])
    keys = block_keys(toks, BS)
    index.removed("a", [4, 3])
    assert index.match(keys, ["a", "b"]) == {"a": 2, "b": 4}
    index.removed("a", [99])
    assert index.stats.unknown_removals == 1
    index.cleared("b")
    assert index.match(keys, ["a", "b"]) == {"a": 2, "b": 0}
    assert index.entries("b") == 0


def test_a_hole_in_the_chain_ends_the_match() -> None:
    index = PreciseIndex(BS)
    toks = tokens(16)
    stored_chain(index, "a", toks, [1, 2, 3, 4])
    index.removed("a", [2])
    assert index.match(block_keys(toks, BS), ["a"]) == {"a": 1}


def test_two_engine_hashes_with_one_key_need_both_removed() -> None:
    # Same tokens under two cache salts: two engine hashes, one gateway key.
    index = PreciseIndex(BS)
    toks = tokens(4)
    index.stored("a", [1], None, toks, BS)
    index.stored("a", [2], None, toks, BS)
    keys = block_keys(toks, BS)
    index.removed("a", [1])
    assert index.match(keys, ["a"]) == {"a": 1}
    index.removed("a", [2])
    assert index.match(keys, ["a"]) == {"a": 0}


def test_unknown_parent_is_an_orphan_but_a_recently_removed_parent_still_maps() -> None:
    index = PreciseIndex(BS)
    toks = tokens(8)
    assert not index.stored("a", [2], 1, toks[BS:], BS)
    assert index.stats.orphans == 1
    index.stored("a", [1], None, toks[:BS], BS)
    index.removed("a", [1])
    # The parent was evicted while a running request still held a copy of it.
    assert index.stored("a", [2], 1, toks[BS:], BS)
    assert index.keys("a") == {block_keys(toks, BS)[1]}


def test_wrong_block_size_is_refused() -> None:
    index = PreciseIndex(BS)
    assert not index.stored("a", [1], None, tokens(8), 8)
    assert index.stats.block_size_mismatch == 1
    assert index.entries("a") == 0


def test_memory_is_bounded_per_endpoint() -> None:
    index = PreciseIndex(BS, max_blocks=3)
    toks = tokens(4 * BS)
    stored_chain(index, "a", toks, [1, 2, 3, 4])
    assert index.entries("a") == 3
    assert index.stats.overflow == 1
    index.set_capacity("a", 2)
    assert index.entries("a") == 2
    assert index.engine_hashes("a") == {3, 4}


def test_speculative_entries_expire_and_can_be_excluded() -> None:
    clock = ManualClock(100.0)
    index = PreciseIndex(BS, clock=clock)
    keys = block_keys(tokens(12), BS)
    index.speculate("a", keys, ttl=2.0)
    assert index.match(keys, ["a", "b"]) == {"a": 3, "b": 0}
    assert index.match(keys, ["a"], speculative=False) == {"a": 0}
    clock.now += 1.0
    index.speculate("a", keys[:1], ttl=2.0)  # refreshed: outlives the first batch
    clock.now += 1.5
    assert index.match(keys, ["a"]) == {"a": 1}
    clock.now += 1.0
    assert index.match(keys, ["a"]) == {"a": 0}
    assert index.speculative_entries() == 0


def test_settled_entries_are_what_a_finished_prefill_computed() -> None:
    """The lower bound a replica certainly holds: announced blocks and the blocks of a prefill
    whose first byte came back; a pick still in flight counts only with ``speculative``."""
    clock = ManualClock(100.0)
    index = PreciseIndex(BS, clock=clock)
    keys = block_keys(tokens(16), BS)
    index.stored("a", [1], None, tokens(4), BS)  # the first block, announced
    index.speculate("a", keys, ttl=2.0)  # a sibling picked just now
    assert index.match(keys, ["a"], settled_only=True) == {"a": 1}
    assert index.match(keys, ["a"]) == {"a": 4}
    index.settle("a", keys[:3])  # that sibling's first byte: its prefill is done
    assert index.match(keys, ["a"], settled_only=True) == {"a": 3}
    index.settle("b", keys)  # unknown endpoint, or keys it never speculated: nothing
    assert index.match(keys, ["b"], settled_only=True) == {"b": 0}
    clock.now += 3.0  # speculation expired, settled marks with it
    assert index.match(keys, ["a"], settled_only=True) == {"a": 1}


def test_speculative_entries_are_bounded() -> None:
    index = PreciseIndex(BS, max_speculative=4, clock=ManualClock(100.0))
    for i in range(10):
        index.speculate("a", block_keys(tokens(8, i * 100), BS), ttl=60.0)
    assert index.speculative_entries() <= 4


def test_forget_drops_everything_and_frees_the_bit() -> None:
    index = PreciseIndex(BS, clock=ManualClock(100.0))
    toks = tokens(8)
    stored_chain(index, "a", toks, [1, 2])
    index.speculate("a", block_keys(toks, BS), ttl=5)
    index.forget("a")
    assert index.endpoints() == []
    index.stored("c", [5], None, toks[:BS], BS)
    assert index.match(block_keys(toks, BS), ["a", "c"]) == {"a": 0, "c": 1}


def test_trust_flags() -> None:
    index = PreciseIndex(BS)
    assert not index.trusted("a")
    index.set_trusted("a", False, "gap")
    assert index.untrusted_reason("a") == "gap"
    index.set_trusted("a", True)
    assert index.trusted("a")


def test_invalid_arguments() -> None:
    with pytest.raises(ValueError):
        PreciseIndex(0)


def test_a_block_stored_twice_stays_until_both_copies_are_removed() -> None:
    # vLLM does not de-duplicate cached blocks: two physical blocks may be cached under one
    # hash (one BlockStored each), and evicting one emits a BlockRemoved while the other copy
    # still serves prefix hits.
    index = PreciseIndex(BS)
    toks = tokens(8)
    keys = block_keys(toks, BS)
    stored_chain(index, "a", toks, [1, 2])
    assert index.stored("a", [2], 1, toks[BS:], BS)  # a second copy of block 2
    index.removed("a", [2])  # one copy evicted
    assert index.match(keys, ["a"]) == {"a": 2}
    index.removed("a", [2])  # the last copy
    assert index.match(keys, ["a"]) == {"a": 1}
    assert index.stats.unknown_removals == 0
    # A clear forgets the copies too.
    stored_chain(index, "a", toks, [1, 2])
    index.stored("a", [2], 1, toks[BS:], BS)
    index.cleared("a")
    stored_chain(index, "a", toks, [1, 2])
    index.removed("a", [2])
    assert index.match(keys, ["a"]) == {"a": 1}
