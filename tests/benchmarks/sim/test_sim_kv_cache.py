"""KV cache against hand-computed cases (block size 4 keeps the arithmetic visible)."""

from __future__ import annotations

from benchmarks.sim.kv_cache import KVCache, extend_block_hashes

BS = 4


def hashes(tokens: list[int], salt: str | None = None) -> list[int]:
    out: list[int] = []
    extend_block_hashes(out, tokens, BS, salt)
    return out


def run_to_completion(kv: KVCache, tokens: list[int]) -> list[int]:
    """Admit, compute every full block, free: what a finished request leaves behind."""
    h = hashes(tokens)
    admitted = kv.admit(h, len(tokens))
    assert admitted is not None
    blocks, _ = admitted
    kv.cache_blocks(blocks, h, 0, len(tokens) // BS)
    kv.free(blocks)
    return blocks


def test_only_full_blocks_are_hashed_and_chained() -> None:
    assert len(hashes(list(range(11)))) == 2
    a, b = hashes([1, 2, 3, 4, 5, 6, 7, 8]), hashes([9, 2, 3, 4, 5, 6, 7, 8])
    assert a[1] != b[1]  # same tokens in block 1, different parent
    assert hashes([1, 2, 3, 4], "salt")[0] != hashes([1, 2, 3, 4])[0]
    grown = hashes(list(range(8)))
    extend_block_hashes(grown, list(range(12)), BS, None)
    assert grown == hashes(list(range(12)))


def test_hit_is_capped_at_prompt_minus_one_token() -> None:
    kv = KVCache(16, BS)
    prompt = list(range(8))
    run_to_completion(kv, prompt)
    # The same 8-token prompt: the cap is 7 tokens, rounded down to one block.
    assert kv.lookup(hashes(prompt), 8) == kv.lookup(hashes(prompt), 8)[:1]
    admitted = kv.admit(hashes(prompt), 8)
    assert admitted is not None and admitted[1] == 4
    kv.free(admitted[0])
    # One more token and both blocks count.
    longer = [*prompt, 99]
    admitted = kv.admit(hashes(longer), 9)
    assert admitted is not None and admitted[1] == 8
    assert (kv.queries, kv.hits) == (8 + 8 + 9, 0 + 4 + 8)


def test_blocks_are_freed_tail_first_and_evicted_from_the_head() -> None:
    kv = KVCache(4, BS)
    prompt = list(range(8))
    blocks = run_to_completion(kv, prompt)
    assert blocks == [0, 1]
    # Untouched blocks first, then the request's chain from its tail back to its head.
    assert kv.free_queue() == [2, 3, 1, 0]
    other = kv.admit(hashes(list(range(100, 112))), 12)  # needs 3 blocks: takes 2, 3, then 1
    assert other is not None and other[0] == [2, 3, 1]
    assert kv.block_hash(1) is None and kv.block_hash(0) is not None
    kv.free(other[0])
    found = kv.lookup(hashes([*prompt, 5]), 9)
    assert found == [0]  # the head of the chain survived its tail


def test_running_blocks_are_refcounted_and_never_evicted() -> None:
    kv = KVCache(4, BS)
    prompt = list(range(12))
    run_to_completion(kv, prompt)
    first = kv.admit(hashes(prompt), 12)
    assert first is not None and first[1] == 8
    second = kv.admit(hashes(prompt), 12)
    assert second is not None and second[1] == 8
    assert first[0][:2] == second[0][:2]
    assert kv.ref_count(first[0][0]) == 2
    assert kv.usage == 1.0
    # Nothing is free: a new prompt cannot evict the shared blocks.
    assert kv.admit(hashes(list(range(50, 54))), 4) is None
    assert kv.allocate_block() is None
    kv.free(second[0])
    assert kv.ref_count(first[0][0]) == 1
    kv.free(first[0])
    assert kv.usage == 0.0
    # The second request's fresh block came from the head of the free queue: the third
    # block of the chain (freed first by the earlier request) was the one evicted.
    assert kv.num_cached_blocks == 2


def test_hit_on_a_free_cached_block_takes_it_out_of_the_free_queue() -> None:
    kv = KVCache(8, BS)
    blocks = run_to_completion(kv, list(range(8)))
    admitted = kv.admit(hashes([*range(8), 1]), 9)
    assert admitted is not None
    assert blocks[0] not in kv.free_queue() and blocks[1] not in kv.free_queue()


def test_reset_refuses_while_blocks_are_held() -> None:
    kv = KVCache(8, BS)
    run_to_completion(kv, list(range(8)))
    held = kv.admit(hashes(list(range(20, 24))), 4)
    assert held is not None
    assert kv.reset() is False
    kv.free(held[0])
    assert kv.reset() is True
    assert kv.cached_hashes() == [] and kv.num_cached_blocks == 0


def test_a_recomputed_copy_of_a_cached_block_stays_findable_after_the_first_is_evicted() -> None:
    # vLLM does not de-duplicate cached blocks: a request that recomputes a block already
    # cached (here the last block of a repeated 8-token prompt, since the hit is capped at 7
    # tokens) caches its own copy too, and lookups find the hash until its last copy goes.
    kv = KVCache(8, BS)
    prompt = list(range(8))
    first = run_to_completion(kv, prompt)
    second = run_to_completion(kv, prompt)
    assert second[0] == first[0] and second[1] != first[1]
    assert kv.block_hash(second[1]) == kv.block_hash(first[1]) is not None
    # Evict up to and including the first copy of the second block (the older one in LRU).
    taken = []
    while kv.block_hash(first[1]) is not None:
        block = kv.allocate_block()
        assert block is not None
        taken.append(block)
    assert second[1] not in taken and kv.block_hash(second[1]) is not None
    kv.free(taken)
    assert kv.lookup(hashes([*prompt, 99]), 9) == [first[0], second[1]]
    assert kv.num_cached_blocks == 2
