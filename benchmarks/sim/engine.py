"""Step-based batching engine of one simulated replica.

Steps as in vLLM's scheduler with chunked prefill (decode tokens first, then prefill chunks,
then FIFO admission), because routing quality depends on how prefills queue behind one another
and slow every co-batched stream. A step's full blocks are findable from the moment it is
scheduled, as in vLLM v1; its tokens and KV events land at its end. All reported times are
simulated seconds. The step, the clock, the serial and independent prefill modes and remote
prefill: docs/simulator.md.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from .clock import SimClock
from .config import SimConfig
from .kv_cache import KVCache, extend_block_hashes
from .observers import EngineStats, KVEventSink, LatencyObserver
from .request import SimRequest, Status
from .tokenizer import Tokenizer
from .zero_latency import complete_instantly


@dataclass
class _Plan:
    decodes: list[SimRequest] = field(default_factory=list)
    prefills: list[tuple[SimRequest, int]] = field(default_factory=list)
    duration_s: float = 0.0
    next_ready: float | None = None
    starts: int = 0  # requests whose prefill starts in the step (each pays the overhead)


class Engine:
    """The scheduler, KV cache and clock of one replica; runs as one asyncio task."""

    def __init__(
        self,
        config: SimConfig,
        engine_id: str = "sim-engine",
        observer: LatencyObserver | None = None,
        tokenizer: Tokenizer | None = None,
        kv_events: KVEventSink | None = None,
    ) -> None:
        self.config = config
        self.engine_id = engine_id
        self.observer = observer
        self.tokenizer = tokenizer or Tokenizer(config.bytes_per_token)
        self.kv = KVCache(config.num_gpu_blocks, config.block_size)
        self.kv_events = kv_events
        if kv_events is not None:
            self.kv.enable_events()
        self.stats = EngineStats()
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.clock = SimClock(config.speed)

    # -- public API ---------------------------------------------------------------------

    def fits(self, num_tokens: int) -> bool:
        """Whether a request of ``num_tokens`` (prompt + output) can ever be held at once."""
        return self.kv.blocks_for(num_tokens) <= self.kv.num_blocks

    def now(self) -> float:
        """The simulated time now (never ahead of the step being computed)."""
        return self.clock.arrival_time()

    def add_request(self, req: SimRequest) -> None:
        """Queue ``req`` (or, with ``zero_latency``, complete it at once)."""
        if self.config.zero_latency:
            complete_instantly(self, req)
            return
        self._ensure_started()
        req.arrival = self.now()
        req.status = Status.WAITING
        self.waiting.append(req)
        self._wake.set()

    def abort(self, req: SimRequest) -> None:
        """Drop ``req`` wherever it is, freeing its blocks (client went away)."""
        if req.done:
            return
        if req.status is Status.WAITING:
            with contextlib.suppress(ValueError):
                self.waiting.remove(req)
        else:
            self.running.remove(req)
            self.kv.free(req.blocks)
            req.blocks = []
        req.status = Status.ABORTED
        self.stats.requests_aborted += 1
        req.event.set()

    def reset_prefix_cache(self) -> bool:
        """Forget cached prefixes; False while requests hold blocks (as vLLM)."""
        done = self.kv.reset()
        self.publish_events()
        return done

    def publish_events(self) -> None:
        if self.kv_events is not None:
            self.kv_events.publish(self.kv.take_events())

    async def stop(self) -> None:
        """Stop the engine task and abort everything still queued or running."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for req in [*self.running, *self.waiting]:
            self.abort(req)

    def state(self) -> dict[str, Any]:
        """A JSON-able snapshot for ``GET /sim/state`` and tests."""
        return {
            "engine_id": self.engine_id,
            "running": len(self.running),
            "waiting": len(self.waiting),
            "cached_blocks": self.kv.num_cached_blocks,
            "free_blocks": self.kv.num_free_blocks,
            "num_gpu_blocks": self.kv.num_blocks,
            "kv_cache_usage": self.kv.usage,
            "prefix_cache_queries": self.kv.queries,
            "prefix_cache_hits": self.kv.hits,
            "preempted_prefix_cache_queries": self.kv.preempted_queries,
            "preempted_prefix_cache_hits": self.kv.preempted_hits,
            "prompt_tokens": self.stats.prompt_tokens,
            "generation_tokens": self.stats.generation_tokens,
            "requests_succeeded": self.stats.requests_succeeded,
            "requests_aborted": self.stats.requests_aborted,
            "preemptions": self.stats.preemptions,
            "steps": self.stats.steps,
            "sim_time": self.clock.now,
        }

    # -- the loop -----------------------------------------------------------------------

    def _ensure_started(self) -> None:
        if self._task is None or self._task.done():
            loop = asyncio.get_running_loop()
            self.clock.restart(self.clock.now)  # anchor the clock; simulated time starts at 0
            self._task = loop.create_task(self._run(), name=f"sim-engine-{self.engine_id}")

    def _resync(self) -> None:
        # Start at the arrival that woke us, not at the (later) moment the task ran.
        fresh = [r.arrival for r in self.waiting if r.arrival >= self.clock.now]
        self.clock.restart(min(fresh, default=None))

    async def _run(self) -> None:
        # The request that started us arrived after the clock was anchored, by however long
        # this task took to run: simulated time starts at its arrival, as after any idle.
        self._resync()
        while True:
            if not self.running and not self.waiting:
                self._wake.clear()
                await self._wake.wait()
                self._resync()
            plan = self._schedule()
            if not plan.decodes and not plan.prefills:
                self.publish_events()
                await self._idle_until(plan.next_ready)
                continue
            await self.clock.run_step(plan.duration_s)
            self.stats.steps += 1
            self._apply(plan)
            # One batch per step, as vLLM publishes: evictions made while scheduling the
            # step come first, then the blocks it filled.
            self.publish_events()

    async def _idle_until(self, ready: float | None) -> None:
        """Nothing to compute: wait for an arrival or the next KV transfer to land."""
        self._wake.clear()
        timeout = None if ready is None else max(ready - self.clock.now, 0.0) / self.config.speed
        try:
            await asyncio.wait_for(self._wake.wait(), timeout)
        except TimeoutError:
            self.clock.restart(ready)
        else:
            self._resync()

    # -- scheduling -----------------------------------------------------------------------

    def _schedule(self) -> _Plan:
        plan = _Plan()
        budget = self.config.max_num_batched_tokens
        for req in list(self.running):
            if budget <= 0:
                break
            if req.status is not Status.RUNNING or req.prefilling or not self._ready(req, plan):
                continue
            if self._grow(req, req.num_computed + 1):
                self._register(req, req.num_computed + 1)
                plan.decodes.append(req)
                budget -= 1
        for req in self.running:
            if budget <= 0:
                break
            if req.prefilling and self._ready(req, plan):
                self._plan_prefill(plan, req, budget)
                budget -= plan.prefills[-1][1]
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            if self._serial_busy():
                break
            req = self.waiting[0]
            if not self._admit(req):
                break
            self.waiting.popleft()
            self.running.append(req)
            if req.prefilling:
                self._plan_prefill(plan, req, budget)
                budget -= plan.prefills[-1][1]
            elif req.ready_at is not None:
                plan.next_ready = min(plan.next_ready or req.ready_at, req.ready_at)
        plan.duration_s = self._duration_ms(plan) / 1000.0
        return plan

    def _serial_busy(self) -> bool:
        """Serial mode: the next admission waits while a running request still prefills."""
        return self.config.prefill_mode == "serial" and any(r.prefilling for r in self.running)

    def _plan_prefill(self, plan: _Plan, req: SimRequest, budget: int) -> None:
        chunk = min(len(req.all_tokens) - req.num_computed, budget)
        plan.starts += self._start_prefill(req)
        plan.prefills.append((req, chunk))
        self._register(req, req.num_computed + chunk)

    def _ready(self, req: SimRequest, plan: _Plan) -> bool:
        if req.ready_at is None or req.ready_at <= self.clock.now:
            return True
        plan.next_ready = min(plan.next_ready or req.ready_at, req.ready_at)
        return False

    @staticmethod
    def _start_prefill(req: SimRequest) -> int:
        if req.prefill_started:
            return 0
        req.prefill_started = True
        return 1

    def _duration_ms(self, plan: _Plan) -> float:
        cfg = self.config
        ms = 0.0
        if plan.decodes:
            ms += cfg.itl_ms * self._load_factor(len(self.running))
        ms += cfg.prefill_ms_per_token * sum(chunk for _, chunk in plan.prefills)
        ms += cfg.prefill_overhead_ms * plan.starts
        return ms

    def _load_factor(self, running: int) -> float:
        cfg = self.config
        if cfg.max_num_seqs <= 1:
            return 1.0
        return 1.0 + (cfg.time_factor_under_load - 1.0) * (running - 1) / (cfg.max_num_seqs - 1)

    def _admit(self, req: SimRequest) -> bool:
        extend_block_hashes(req.block_hashes, req.all_tokens, self.kv.block_size, req.cache_salt)
        admitted = self.kv.admit(
            req.block_hashes, len(req.all_tokens), preempted=req.cached_tokens >= 0
        )
        if admitted is None:
            return False
        req.blocks, cached = admitted
        req.num_computed = cached
        req.num_registered = cached // self.kv.block_size
        req.status = Status.RUNNING
        req.prefilling, req.prefill_started = True, False
        if req.cached_tokens < 0:
            req.cached_tokens = cached
        if req.admitted_at is None:
            req.admitted_at = self.clock.now
            if self.observer is not None:
                self.observer.on_queued(max(self.clock.now - req.arrival, 0.0))
        uncached = len(req.all_tokens) - cached
        if req.remote_prefill:
            ms = uncached * self.config.kv_transfer_ms_per_token
        elif self.config.prefill_mode == "independent":
            ms = self._independent_prefill_ms(uncached)
            self._register(req, len(req.all_tokens))
        else:
            return True
        req.ready_at = self.clock.now + ms / 1000.0
        # The pulled (or separately timed) KV covers the prompt but its last token, computed
        # by the first decode step (as vLLM).
        req.num_computed = len(req.all_tokens) - 1
        req.prefilling = False
        return True

    def _independent_prefill_ms(self, uncached: int) -> float:
        """llm-d-inference-sim's prefill: its own overhead and per-token time, slowed only by
        the load factor (the request itself counts as running)."""
        cfg = self.config
        ms = cfg.prefill_overhead_ms + cfg.prefill_ms_per_token * uncached
        return ms * self._load_factor(len(self.running) + 1)

    def _grow(self, req: SimRequest, num_tokens: int) -> bool:
        """Give ``req`` blocks for ``num_tokens``, preempting the newest requests if needed."""
        need = self.kv.blocks_for(num_tokens)
        while len(req.blocks) < need:
            block = self.kv.allocate_block()
            if block is not None:
                req.blocks.append(block)
                continue
            victim = self.running[-1]
            self._preempt(victim)
            if victim is req:
                return False
        return True

    def _preempt(self, req: SimRequest) -> None:
        self.running.remove(req)
        self.kv.free(req.blocks)
        req.blocks = []
        req.num_computed = req.num_registered = 0
        req.prefilling, req.prefill_started = True, False
        # Recompute preemption: the pulled KV is gone, the request now prefills locally.
        req.remote_prefill, req.ready_at = False, None
        req.status = Status.WAITING
        self.waiting.appendleft(req)
        self.stats.preemptions += 1

    # -- applying a finished step -------------------------------------------------------

    def _apply(self, plan: _Plan) -> None:
        for req in plan.decodes:
            if req.status is Status.RUNNING:
                req.num_computed += 1
                self._emit(req)
        for req, chunk in plan.prefills:
            if req.status is not Status.RUNNING:
                continue
            req.num_computed += chunk
            if req.num_computed >= len(req.all_tokens):
                req.prefilling = False
                self._emit(req)

    def _register(self, req: SimRequest, num_tokens: int) -> None:
        """Make the full blocks of ``req``'s first ``num_tokens`` tokens findable."""
        full = min(num_tokens // self.kv.block_size, len(req.blocks))
        if full > req.num_registered:
            extend_block_hashes(
                req.block_hashes, req.all_tokens, self.kv.block_size, req.cache_salt
            )
            self.kv.cache_blocks(
                req.blocks, req.block_hashes, req.num_registered, full, req.all_tokens,
                req.cache_salt,
            )
            req.num_registered = full

    def _emit(self, req: SimRequest) -> None:
        now = self.clock.now
        token = req.output_plan[len(req.output)]
        req.output.append(token)
        req.all_tokens.append(token)
        req.token_times.append(now)
        self.stats.generation_tokens += 1
        if req.first_token_at is None:
            req.first_token_at = now
            self.stats.prompt_tokens += req.num_prompt_tokens
            if self.observer is not None:
                self.observer.on_first_token(now - req.arrival)
        elif self.observer is not None and req.last_token_at is not None:
            self.observer.on_token(now - req.last_token_at)
        req.last_token_at = now
        if len(req.output) >= req.max_tokens:
            self._finish(req)
        req.event.set()

    def _finish(self, req: SimRequest) -> None:
        self.running.remove(req)
        req.transfer_block_ids = list(req.blocks)
        self.kv.free(req.blocks)
        req.blocks = []
        req.status = Status.FINISHED
        req.finished_at = self.clock.now
        self.stats.requests_succeeded += 1
        if self.observer is not None:
            self.observer.on_finished(self.clock.now - req.arrival)
