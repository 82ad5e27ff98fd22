"""The simulator's ``zero_latency`` mode: a request completes the moment it arrives.

For measuring a router's own overhead: the replica answers at once, yet its prefix cache and KV
events stay true, so routing sees the same hits it would with latencies on.
"""

from __future__ import annotations

from typing import Protocol

from .kv_cache import KVCache, extend_block_hashes
from .observers import EngineStats, LatencyObserver
from .request import SimRequest, Status


class Engine(Protocol):
    """What completing a request touches of its engine (the engine passes itself)."""

    kv: KVCache
    stats: EngineStats
    observer: LatencyObserver | None

    def publish_events(self) -> None: ...


def complete_instantly(engine: Engine, req: SimRequest) -> None:
    # Cache accounting only: every block is freed at once, so nothing can be evicted
    # that a running request holds and admission always fits (the server checks size).
    extend_block_hashes(req.block_hashes, req.all_tokens, engine.kv.block_size, req.cache_salt)
    admitted = engine.kv.admit(req.block_hashes, len(req.all_tokens))
    req.output = list(req.output_plan[: req.max_tokens])
    req.all_tokens.extend(req.output)
    if admitted is not None:
        req.blocks, req.cached_tokens = admitted
        total = len(req.all_tokens) - 1
        for _ in range(engine.kv.blocks_for(total) - len(req.blocks)):
            block = engine.kv.allocate_block()
            if block is None:
                break
            req.blocks.append(block)
        full = min(total // engine.kv.block_size, len(req.blocks))
        extend_block_hashes(req.block_hashes, req.all_tokens, engine.kv.block_size, req.cache_salt)
        engine.kv.cache_blocks(
            req.blocks, req.block_hashes, 0, full, req.all_tokens, req.cache_salt
        )
        req.transfer_block_ids = list(req.blocks)
        engine.kv.free(req.blocks)
        req.blocks = []
    engine.publish_events()
    req.status = Status.FINISHED
    engine.stats.prompt_tokens += req.num_prompt_tokens
    engine.stats.generation_tokens += len(req.output)
    engine.stats.requests_succeeded += 1
    if engine.observer is not None:
        engine.observer.on_queued(0.0)
        engine.observer.on_first_token(0.0)
        engine.observer.on_finished(0.0)
    req.event.set()
