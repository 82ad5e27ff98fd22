"""Engine: step model, TTFT on the simulated clock, preemption, aborts, KV transfer.

Times are asserted on the engine's simulated clock with a large ``speed``, never on wall time.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator

import pytest

from benchmarks.sim.config import SimConfig
from benchmarks.sim.engine import Engine
from benchmarks.sim.request import SimRequest, Status

_ids = itertools.count()


def make(engine: Engine, prompt: list[int], max_tokens: int, **kw: bool) -> SimRequest:
    return SimRequest(
        request_id=str(next(_ids)),
        prompt_ids=prompt,
        max_tokens=max_tokens,
        output_plan=engine.tokenizer.generate(max_tokens, len(prompt), chat=True),
        **kw,
    )


def unique(n: int, base: int) -> list[int]:
    return [base + i for i in range(n)]


async def done(*reqs: SimRequest) -> None:
    async with asyncio.timeout(10):
        for req in reqs:
            while not req.done:
                req.event.clear()
                await req.event.wait()


def ttft(req: SimRequest) -> float:
    assert req.first_token_at is not None
    return req.first_token_at - req.arrival


@pytest.fixture
async def engine_factory() -> AsyncIterator[type[Engine]]:
    engines: list[Engine] = []

    class Tracked(Engine):
        def __init__(self, config: SimConfig) -> None:
            super().__init__(config)
            engines.append(self)

    yield Tracked
    for engine in engines:
        await engine.stop()


async def test_ttft_is_overhead_plus_uncached_tokens(engine_factory: type[Engine]) -> None:
    engine = engine_factory(SimConfig(speed=20))
    small = make(engine, unique(256, 0), 2)
    engine.add_request(small)
    await done(small)
    big = make(engine, unique(4096, 10_000), 2)
    engine.add_request(big)
    await done(big)
    assert ttft(small) == pytest.approx(0.030 + 256 * 0.0002, abs=0.01)
    assert ttft(big) == pytest.approx(0.030 + 4096 * 0.0002, abs=0.01)
    # The same prompt again: only its last block is recomputed.
    again = make(engine, unique(4096, 10_000), 2)
    engine.add_request(again)
    await done(again)
    assert again.num_cached_tokens == 4080
    assert ttft(again) == pytest.approx(0.030 + 16 * 0.0002, abs=0.01)
    # One decode step between the two tokens of a lone request.
    assert big.last_token_at - big.first_token_at == pytest.approx(0.012)  # type: ignore[operator]


async def test_concurrent_prefills_queue_behind_one_another(engine_factory: type[Engine]) -> None:
    cfg = SimConfig(speed=50, max_num_batched_tokens=2048)
    alone_engine = engine_factory(cfg)
    alone = make(alone_engine, unique(2000, 0), 1)
    alone_engine.add_request(alone)
    await done(alone)

    engine = engine_factory(cfg)
    reqs = [make(engine, unique(2000, 10_000 * (i + 1)), 1) for i in range(3)]
    for req in reqs:
        engine.add_request(req)
    await done(*reqs)
    ttfts = [ttft(r) for r in reqs]
    assert ttfts[0] < ttfts[1] < ttfts[2]
    assert ttfts[2] > 2.5 * ttft(alone)


async def test_independent_prefills_run_side_by_side(engine_factory: type[Engine]) -> None:
    # llm-d-inference-sim's world: three concurrent 2000-token prefills each take their own
    # time, slowed only by the load factor (3 running of 5: 1 + (2 - 1) * 2 / 4 = 1.5).
    cfg = SimConfig(speed=50, max_num_seqs=5, prefill_mode="independent")
    engine = engine_factory(cfg)
    reqs = [make(engine, unique(2000, 10_000 * (i + 1)), 1) for i in range(3)]
    for req in reqs:
        engine.add_request(req)
    await done(*reqs)
    alone = 0.030 + 2000 * 0.0002
    factors = [1.0, 1.25, 1.5]  # each admitted with the ones before it running
    for req, factor in zip(reqs, factors, strict=True):
        # Plus the decode step that computes the first token (12 ms at up to 1.5x).
        assert ttft(req) == pytest.approx(alone * factor + 0.015, abs=0.01)
    # A repeat of a prompt recomputes only its last block.
    again = make(engine, unique(2000, 10_000), 1)
    engine.add_request(again)
    await done(again)
    assert again.num_cached_tokens == 1984
    assert ttft(again) == pytest.approx(0.030 + 16 * 0.0002 + 0.012, abs=0.01)


async def test_serial_prefills_run_one_at_a_time(engine_factory: type[Engine]) -> None:
    # Batched, three 500-token prompts share one step and all wait for all of it (3 x 30 ms
    # overhead + 1500 tokens); serial, the first is done alone and the others follow in turn.
    ttfts: dict[str, list[float]] = {}
    for mode in ("batched", "serial"):
        engine = engine_factory(SimConfig(speed=50, prefill_mode=mode))
        reqs = [make(engine, unique(500, 10_000 * (i + 1)), 2) for i in range(3)]
        for req in reqs:
            engine.add_request(req)
        await done(*reqs)
        ttfts[mode] = [ttft(r) for r in reqs]
    alone = 0.030 + 500 * 0.0002
    assert ttfts["batched"] == pytest.approx([3 * alone] * 3, abs=0.01)
    assert ttfts["serial"][0] == pytest.approx(alone, abs=0.01)
    assert ttfts["serial"][0] < ttfts["serial"][1] < ttfts["serial"][2]
    assert ttfts["serial"][2] >= 3 * alone


def test_prefill_mode_is_checked() -> None:
    with pytest.raises(ValueError, match="prefill_mode"):
        SimConfig(prefill_mode="parallel")


@pytest.mark.parametrize(
    ("budget", "sibling_len", "expected"),
    [
        (4096, 1000, 992),  # admitted in the same step as the first: 1040 tokens fit beside it
        (2048, 3000, 2992),  # admitted a step later, while the first's last chunk is scheduled
    ],
)
async def test_blocks_are_findable_once_scheduled(
    engine_factory: type[Engine], budget: int, sibling_len: int, expected: int
) -> None:
    # vLLM v1 caches the blocks a step computes when it schedules them (allocate_slots), so a
    # sibling scheduled in the same step, or while the first is in chunked prefill, hits them.
    engine = engine_factory(SimConfig(speed=50, max_num_batched_tokens=budget))
    shared = unique(3000, 0)
    first = make(engine, [*shared, *unique(40, 90_000)], 1)
    sibling = make(engine, [*shared[:sibling_len], *unique(40, 80_000)], 1)
    engine.add_request(first)
    engine.add_request(sibling)
    await done(first, sibling)
    assert first.num_cached_tokens == 0
    assert sibling.num_cached_tokens == expected


async def test_prefill_chunk_slows_decoding_requests(engine_factory: type[Engine]) -> None:
    engine = engine_factory(SimConfig(speed=50))
    decoder = make(engine, unique(32, 0), 40)
    engine.add_request(decoder)
    async with asyncio.timeout(10):
        while len(decoder.output) < 2:
            decoder.event.clear()
            await decoder.event.wait()
    engine.add_request(make(engine, unique(4000, 50_000), 1))
    await done(decoder)
    gaps = [b - a for a, b in itertools.pairwise(decoder.token_times)]
    assert max(gaps) > 0.5  # a step carrying a 4000-token prefill chunk
    assert min(gaps) < 0.02


async def test_preemption_when_kv_is_exhausted(engine_factory: type[Engine]) -> None:
    engine = engine_factory(SimConfig(speed=200, block_size=4, num_gpu_blocks=10))
    reqs = [make(engine, unique(12, 1000 * (i + 1)), 14) for i in range(2)]
    for req in reqs:
        engine.add_request(req)
    await done(*reqs)
    assert engine.stats.preemptions >= 1
    for req in reqs:
        assert req.status is Status.FINISHED
        assert req.output == req.output_plan
    assert engine.kv.usage == 0.0
    # Exported counters: each request's first lookup only (vLLM books a re-admission's under
    # preempted_*): counted there, re-found own blocks read as reuse the workload never had.
    assert (engine.kv.queries, engine.kv.hits) == (24, 0)
    assert engine.kv.preempted_queries > 12


async def test_abort_frees_blocks_and_slots(engine_factory: type[Engine]) -> None:
    engine = engine_factory(SimConfig(speed=5, max_num_seqs=1))
    running = make(engine, unique(64, 0), 10_000)
    queued = make(engine, unique(64, 5000), 10)
    engine.add_request(running)
    engine.add_request(queued)
    async with asyncio.timeout(10):
        while not running.output:
            running.event.clear()
            await running.event.wait()
    assert engine.kv.usage > 0 and len(engine.waiting) == 1
    engine.abort(queued)
    engine.abort(running)
    assert running.status is Status.ABORTED and queued.status is Status.ABORTED
    assert engine.state()["running"] == 0 and engine.state()["waiting"] == 0
    assert engine.kv.usage == 0.0
    assert engine.kv.num_cached_blocks >= 4  # computed prompt blocks stay cached


async def test_remote_prefill_skips_prefill_compute(engine_factory: type[Engine]) -> None:
    engine = engine_factory(SimConfig(speed=20))
    req = make(engine, unique(4000, 0), 3, remote_prefill=True)
    engine.add_request(req)
    await done(req)
    assert ttft(req) == pytest.approx(4000 * 0.00002 + 0.012, abs=0.01)
    # Its blocks are cached locally like any request's.
    assert engine.kv.num_cached_blocks >= 4000 // 16


async def test_simulated_time_starts_at_the_first_arrival(engine_factory: type[Engine]) -> None:
    # The engine's clock is anchored when it starts; the first request may arrive later (a
    # loaded machine deschedules us in between). Its TTFT is counted from its arrival.
    engine = engine_factory(SimConfig(speed=20))
    engine._ensure_started()
    time.sleep(0.01)  # noqa: ASYNC251 (on purpose: 0.2 simulated s pass before the arrival)
    req = make(engine, unique(4000, 0), 3, remote_prefill=True)
    engine.add_request(req)
    await done(req)
    assert req.arrival >= 0.2
    assert ttft(req) == pytest.approx(4000 * 0.00002 + 0.012, abs=0.01)


async def test_zero_latency_answers_at_once_and_accounts_cache(
    engine_factory: type[Engine],
) -> None:
    engine = engine_factory(SimConfig(zero_latency=True))
    first = make(engine, unique(100, 0), 20)
    engine.add_request(first)
    assert first.done and first.output == first.output_plan
    # Prompt + output minus the last token: 119 tokens, 7 full blocks.
    nxt = make(engine, [*first.all_tokens, 7, 8, 9], 5)
    engine.add_request(nxt)
    assert nxt.num_cached_tokens == 112
    assert engine.kv.queries == 100 + 123 and engine.kv.hits == 112
