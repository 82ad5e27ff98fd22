"""The client's reuse ledger bounds what the replicas can hit: same tokens, same blocks.

The sweep's *reuse captured* is the replicas' hits over the ledger's reusable tokens, so the
ledger must count exactly what one infinitely large simulated cache hits: the replicas' own
tokenizer density and block size, and a block missed only by the first request that holds it.
"""

from __future__ import annotations

import random

import pytest

from benchmarks.bench.conversation import ConversationState, ReuseLedger, estimate_reuse
from benchmarks.sim.kv_cache import KVCache, extend_block_hashes
from benchmarks.sim.tokenizer import Tokenizer
from benchmarks.workloads import Workload, build_workload, shared_prefix, words

BIG = 1 << 16  # blocks: nothing is ever evicted


def _hashes(ids: list[int], block_size: int) -> list[int]:
    out: list[int] = []
    extend_block_hashes(out, ids, block_size, None)
    return out


def _replay(workload: Workload, block_size: int, density: float) -> tuple[ReuseLedger, KVCache]:
    """Send order, one replica with an infinite cache: the ledger beside the simulator's."""
    tok = Tokenizer(density)
    ledger, kv = ReuseLedger(block_size), KVCache(BIG, block_size)
    rng = random.Random(0)
    for conv in workload.conversations:
        state = ConversationState(tok, conv.system, conv.tools, block_size)
        for step in conv.steps:
            state.add("user", step.content)
            prompt = state.prompt()
            # The replica encodes the request's messages itself.
            ids = tok.encode_chat(prompt.messages, list(conv.tools) or None)
            assert ids == prompt.ids
            reusable = ledger.sent(len(ids), prompt.chain)
            admitted = kv.admit(_hashes(ids, block_size), len(ids))
            assert admitted is not None
            blocks, cached = admitted
            assert cached == reusable
            answer = words(rng, step.max_tokens)
            full = [*ids, *tok.encode(answer)]
            hashes = _hashes(full, block_size)
            while len(blocks) < len(hashes):
                block = kv.allocate_block()
                assert block is not None
                blocks.append(block)
            kv.cache_blocks(blocks, hashes, 0, len(hashes))
            kv.free(blocks)
            ledger.answered(state.answer_chain(prompt, tok.encode(answer)))
            state.add("assistant", answer)
    return ledger, kv


@pytest.mark.parametrize(("block_size", "density"), [(16, 2.6), (32, 5.8), (64, 7.4)])
@pytest.mark.parametrize("name", ["shared-prefix", "chat"])
def test_the_ledger_counts_what_an_infinite_replica_cache_hits(
    name: str, block_size: int, density: float
) -> None:
    ledger, kv = _replay(build_workload(name, "tiny", seed=3), block_size, density)
    assert ledger.reusable_tokens == kv.hits > 0
    assert ledger.prompt_tokens == kv.queries


@pytest.mark.parametrize("block_size", [32, 64])
def test_the_estimate_is_at_the_replicas_block_size(block_size: int) -> None:
    # A ledger of 16-token blocks counted reuse no replica of larger blocks can reach.
    wl = build_workload("chat", "tiny", seed=3)
    ledger, kv = _replay(wl, block_size, 4.3)
    estimate = estimate_reuse(wl, block_size, 4.3)
    assert estimate.reusable_tokens == ledger.reusable_tokens == kv.hits
    assert estimate.reusable_tokens % block_size == 0
    assert estimate.distinct_tokens == kv.num_cached_blocks * block_size


def test_admission_order_does_not_change_what_an_infinite_cache_hits() -> None:
    # Replicas admit in their own order, not the client's: a block is still missed only by
    # the first request that holds it, so the total is the ledger's (single-turn prompts).
    wl = shared_prefix(groups=3, prompts_per_group=5, system_tokens=300, question_tokens=30)
    tok, block_size = Tokenizer(3.1), 32
    ledger = estimate_reuse(wl, block_size, 3.1)
    prompts = [tok.encode_chat([{"role": "system", "content": c.system},
                                {"role": "user", "content": c.steps[0].content}])
               for c in wl.conversations]
    random.Random(1).shuffle(prompts)
    kv = KVCache(BIG, block_size)
    for ids in prompts:
        hashes = _hashes(ids, block_size)
        admitted = kv.admit(hashes, len(ids))
        assert admitted is not None
        kv.cache_blocks(admitted[0], hashes, 0, len(hashes))
        kv.free(admitted[0])
    assert kv.hits == ledger.reusable_tokens > 0
