"""The client's reuse ledger bounds what the replicas can hit: same tokens, same blocks.

The sweep's *reuse captured* is the replicas' hits over the ledger's reusable tokens, so the
ledger must count exactly what one infinitely large simulated cache hits: the replicas' own
tokenizer density and block size, and a block missed only by the first request that holds it.
"""

from __future__ import annotations

import random

import pytest

from benchmarks.bench.conversation import ConversationState, ReuseLedger, estimate_reuse
from benchmarks.sim.config import SimConfig
from benchmarks.sim.engine import Engine
from benchmarks.sim.kv_cache import KVCache, extend_block_hashes
from benchmarks.sim.request import SimRequest
from benchmarks.sim.tokenizer import Tokenizer
from benchmarks.workloads import Workload, build_workload, shared_prefix

BIG = 1 << 16  # blocks: nothing is ever evicted


def _hashes(ids: list[int], block_size: int) -> list[int]:
    out: list[int] = []
    extend_block_hashes(out, ids, block_size, None)
    return out


def _replica(block_size: int, density: float | None) -> Engine:
    """One simulated replica with an infinite cache, answering at once (cache accounting as
    its engine does it: the answers it samples, the blocks it computes of them)."""
    config = SimConfig(
        zero_latency=True, block_size=block_size, num_gpu_blocks=BIG, bytes_per_token=density
    )
    return Engine(config, tokenizer=Tokenizer(density))


def _ask(replica: Engine, ids: list[int], max_tokens: int) -> SimRequest:
    plan = replica.tokenizer.generate(max_tokens, len(ids), chat=True)
    req = SimRequest(f"r{replica.stats.requests_succeeded}", ids, max_tokens, plan)
    replica.add_request(req)
    assert req.done and len(req.output) == max_tokens
    return req


def _replay(workload: Workload, block_size: int, density: float) -> tuple[ReuseLedger, KVCache]:
    """Send order, one replica with an infinite cache: the ledger beside the simulator's."""
    replica = _replica(block_size, density)
    tok = replica.tokenizer
    ledger = ReuseLedger(block_size)
    for conv in workload.conversations:
        state = ConversationState(tok, conv.system, conv.tools, block_size)
        for step in conv.steps:
            state.add("user", step.content)
            prompt = state.prompt()
            # The replica encodes the request's messages itself.
            ids = tok.encode_chat(prompt.messages, list(conv.tools) or None)
            assert ids == prompt.ids
            reusable = ledger.sent(len(ids), prompt.chain)
            req = _ask(replica, ids, step.max_tokens)
            assert req.num_cached_tokens == reusable
            ledger.answered(state.answer_chain(prompt, req.output))
            state.add("assistant", tok.decode(req.output))
    return ledger, replica.kv


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


@pytest.mark.parametrize("density", [2.6, 8.0])
def test_the_estimate_answers_as_many_tokens_as_the_replicas(density: float) -> None:
    # A replica answers ``max_tokens`` tokens at its density, whatever that is; the estimate's
    # prompts grow by its answers, so its stand-ins must be as long (one-token words of four
    # bytes come to 4 / density times too many tokens).
    wl = build_workload("chat", "tiny", seed=3)
    ledger, kv = _replay(wl, 16, density)
    estimate = estimate_reuse(wl, 16, density)
    assert estimate.prompt_tokens == ledger.prompt_tokens == kv.queries
    assert estimate.max_prompt_tokens == ledger.max_prompt_tokens
    assert estimate.reusable_tokens == kv.hits


@pytest.mark.parametrize(("block_size", "density"), [(16, None), (32, 5.8)])
def test_an_answers_last_token_is_never_cached(block_size: int, density: float | None) -> None:
    # A replica samples its last answer token but never feeds it back, so it never computes
    # (nor caches) it: when prompt + answer ends on a block boundary, that block is missed by
    # the next turn, and the ledger must not count it.
    replica = _replica(block_size, density)
    tok = replica.tokenizer
    ledger = ReuseLedger(block_size)
    state = ConversationState(tok, "you help " * 40, (), block_size)
    state.add("user", "a first question")
    first = state.prompt()
    answer_len = block_size - len(first.ids) % block_size + block_size
    ledger.sent(len(first.ids), first.chain)
    answer = _ask(replica, first.ids, answer_len).output
    assert (len(first.ids) + len(answer)) % block_size == 0
    ledger.answered(state.answer_chain(first, answer))
    state.add("assistant", tok.decode(answer))
    state.add("user", "and a second one, a little longer")
    second = state.prompt()
    reusable = ledger.sent(len(second.ids), second.chain)
    assert reusable == _ask(replica, second.ids, 4).num_cached_tokens
    assert reusable == len(first.ids) + len(answer) - block_size


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
