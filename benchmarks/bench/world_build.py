"""A drawn world made concrete: its workload, KV size and simulator speed, sized to stay short.

Every target runs each world, so a world's run must be short and about the same length
whichever world it is. The builder estimates a workload's simulated length (per-conversation
latency chains, and the fleet's prefill capacity) and shrinks the workload until that, its
request count and its streamed tokens fit a wall-clock budget; the simulator's speed then
stretches the simulated length over that budget. Streamed tokens are capped because the
client, the gateway and the replicas share two cores: beyond a few thousand SSE chunks a
second the machine, not the router, sets the latencies.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from benchmarks.bench.conversation import estimate_reuse
from benchmarks.bench.worlds import WORDS_BPT, World
from benchmarks.sim.config import SimConfig
from benchmarks.trace_replay import TraceParams, TraceRow, trace_workload
from benchmarks.workloads import Conversation, Step, Workload, build_workload

WALL_TARGET_S = 5.0  # one target's run, at --sweep-scale 1
MAX_SPEED = 10.0
MIN_SPEED = 1.0
REQUESTS_PER_WALL_S = 15.0
TOKENS_PER_WALL_S = 1500.0  # streamed (output) tokens
KV_FIT_MARGIN = 1.25
MIN_TURNS = 3


@dataclass(frozen=True)
class BuiltWorld:
    world: World
    workload: Workload
    num_gpu_blocks: int
    speed: float
    est_sim_s: float
    distinct_tokens: int  # client tokens an infinite cache would hold
    kv_ratio: float  # fleet KV / distinct tokens, after the fit minimum
    sim_args: list[str]

    def summary(self) -> dict[str, Any]:
        return {
            "num_gpu_blocks": self.num_gpu_blocks, "speed": round(self.speed, 3),
            "est_sim_s": round(self.est_sim_s, 2), "distinct_tokens": self.distinct_tokens,
            "kv_ratio": round(self.kv_ratio, 3), "requests": self.workload.num_requests,
            "conversations": len(self.workload.conversations),
            "concurrency": self.workload.concurrency, "rate": self.workload.rate,
            "workload_params": self.workload.params,
        }  # fmt: skip


@dataclass(frozen=True)
class _Costs:
    """Per-request latency figures of the world, in simulated ms and client tokens."""

    per_token: float
    overhead: float
    itl: float

    @classmethod
    def of(cls, world: World, sim_ratio: float) -> _Costs:
        d = SimConfig()
        slow = sum(world.slow) / len(world.slow)
        return cls(d.prefill_ms_per_token * world.cost_per_token * sim_ratio * slow,
                   d.prefill_overhead_ms * world.cost_per_request * slow, world.itl_ms * slow)


def _tokens(text: str) -> int:
    return len(text.split())  # the workloads' words are one token each


def _chain_ms(steps: Sequence[Step], c: _Costs) -> float:
    """One script's latency at no load: think, prefill of the new tokens, decode."""
    t = 0.0
    for step in steps:
        t += step.think_s * 1000 + c.overhead + c.per_token * (_tokens(step.content) + 8)
        t += step.max_tokens * c.itl
        if step.burst:
            t += max(_chain_ms(a.steps, c) for a in step.burst)
    return t


def _work_ms(steps: Sequence[Step], c: _Costs) -> tuple[float, int]:
    """Prefill work (ms, new tokens only) and output tokens of a script and its sub-agents."""
    work, out = 0.0, 0
    for step in steps:
        work += c.overhead + c.per_token * (_tokens(step.content) + step.max_tokens)
        out += step.max_tokens
        for a in step.burst:
            w, o = _work_ms(a.steps, c)
            work, out = work + w, out + o
    return work, out


def _conv_work(conv: Conversation, c: _Costs) -> tuple[float, int]:
    work, out = _work_ms(conv.steps, c)
    return work + c.per_token * _tokens(conv.system), out


@dataclass(frozen=True)
class _Size:
    est_sim_s: float
    requests: int
    out_tokens: int


def _size(wl: Workload, c: _Costs, replicas: int) -> _Size:
    chains = [_chain_ms(conv.steps, c) / 1000 for conv in wl.conversations]
    works = [_conv_work(conv, c) for conv in wl.conversations]
    capacity = sum(w for w, _ in works) / 1000 / replicas
    if wl.arrivals is not None:
        latency = max(a + ch for a, ch in zip(wl.arrivals, chains, strict=True))
    elif wl.rate:
        latency = len(chains) / wl.rate + max(chains)
    else:
        latency = max(max(chains), sum(chains) / max(1, wl.concurrency))
    return _Size(1.2 * max(latency, capacity), wl.num_requests, sum(o for _, o in works))


def _shrink(size: _Size, wall_s: float, time: bool = True) -> float:
    """Below 1: the share of the workload that fits the budget (its length too if ``time``)."""
    return min(1.0, wall_s * MAX_SPEED / size.est_sim_s if time else 1.0,
               wall_s * REQUESTS_PER_WALL_S / max(1, size.requests),
               wall_s * TOKENS_PER_WALL_S / max(1, size.out_tokens))


def _closed(world: World, c: _Costs, wall_s: float) -> Workload:
    p = dict(world.params, seed=world.seed)
    concurrency = max(1, round(world.load * world.replicas))
    sessions = max(2, math.ceil(1.5 * concurrency))
    wl = build_workload(world.workload, "small", **p, sessions=sessions, concurrency=concurrency)
    for _ in range(16):
        size = _size(wl, c, world.replicas)
        factor = _shrink(size, wall_s)
        if factor >= 1.0:
            break
        # The load (live sessions) matters most: drop later waves, then turns, then fan-out,
        # and only then live sessions (not for length: one long session sets that).
        count = _shrink(size, wall_s, time=False)
        if sessions > concurrency:
            sessions = max(concurrency, math.floor(sessions * factor))
        elif p["turns"] > MIN_TURNS:
            p["turns"] = max(MIN_TURNS, math.floor(p["turns"] * factor))
        elif p.get("burst_max", 0) > 2:
            p["burst_max"] = max(2, math.floor(p["burst_max"] * factor))
            p["burst_size"] = max(1, min(p["burst_size"], p["burst_max"] // 2))
        elif p.get("subagent_turns", 0) > 1:
            p["subagent_turns"] -= 1
        elif sessions > 2 and count < 1.0:
            sessions = max(2, math.floor(sessions * count))
            concurrency = min(concurrency, sessions)
        else:
            break
        wl = build_workload(world.workload, "small", **p, sessions=sessions,
                            concurrency=concurrency)
    return wl


def _open_rate(wl: Workload, c: _Costs, world: World) -> float:
    """Conversations per simulated second that load the fleet's prefill at ``world.load``."""
    work = sum(_conv_work(conv, c)[0] for conv in wl.conversations) / 1000
    return max(1e-3, world.load * world.replicas * len(wl.conversations) / max(work, 1e-6))


def _shared_prefix(world: World, c: _Costs, wall_s: float) -> Workload:
    p = dict(world.params, seed=world.seed)
    total = max(4, math.floor(wall_s * REQUESTS_PER_WALL_S))
    for _ in range(12):
        p["prompts_per_group"] = max(1, total // p["groups"])
        wl = build_workload("shared-prefix", "small", **p)
        wl = replace(wl, rate=_open_rate(wl, c, world), concurrency=len(wl.conversations))
        factor = _shrink(_size(wl, c, world.replicas), wall_s)
        if factor >= 1.0 or total <= 4:
            break
        total = max(4, math.floor(total * factor))
        p["groups"] = min(p["groups"], total)
    return replace(wl, params={**wl.params, "rate": wl.rate})


def _trace(world: World, c: _Costs, wall_s: float, rows: Sequence[TraceRow]) -> Workload:
    n = max(4, math.floor(wall_s * REQUESTS_PER_WALL_S))
    p = TraceParams(**world.params, requests=n, seed=world.seed)
    for _ in range(12):
        wl = trace_workload(rows, replace(p, time_scale=1.0))  # the span in trace seconds
        assert wl.arrivals is not None
        span = max(wl.arrivals[-1], 1e-3)
        work = sum(_conv_work(conv, c)[0] for conv in wl.conversations) / 1000
        p = replace(p, time_scale=max(1e-3, work / (world.load * world.replicas * span)))
        wl = trace_workload(rows, p)
        factor = _shrink(_size(wl, c, world.replicas), wall_s)
        if factor >= 1.0 or p.requests <= 4:
            break
        p = replace(p, requests=max(4, math.floor(p.requests * factor)))
    return replace(wl, params={**wl.params, "time_scale": p.time_scale})


def build_world(world: World, scale: float = 1.0, rows: Sequence[TraceRow] = ()) -> BuiltWorld:
    wall_s = WALL_TARGET_S * scale
    sim_ratio = WORDS_BPT / world.bytes_per_token
    c = _Costs.of(world, sim_ratio)
    if world.workload == "trace":
        if not rows:
            raise ValueError("a trace world needs --trace")
        wl = _trace(world, c, wall_s, rows)
    elif world.workload == "shared-prefix":
        wl = _shared_prefix(world, c, wall_s)
    else:
        wl = _closed(world, c, wall_s)
    est = _size(wl, c, world.replicas).est_sim_s
    # The working set is measured in 16-token blocks whatever the world's block size, as when
    # the sweeps of record were drawn, so a seed keeps drawing the same KV sizes.
    ledger = estimate_reuse(wl)
    steps = [s for conv in wl.conversations for s in conv.steps]
    steps += [s for st in steps for a in st.burst for s in a.steps]
    need = (ledger.max_prompt_tokens + max(s.max_tokens for s in steps)) * max(1.0, sim_ratio)
    fit = math.ceil(need * KV_FIT_MARGIN / world.block_size)
    wanted = world.kv_factor * ledger.distinct_tokens * sim_ratio / world.replicas
    blocks = max(fit, math.ceil(wanted / world.block_size), 16)
    kv_ratio = blocks * world.block_size * world.replicas / max(
        1.0, ledger.distinct_tokens * sim_ratio)
    args = ["--prefill-mode", world.prefill_mode,
            "--max-num-batched-tokens", str(world.max_num_batched_tokens)]
    speed = min(MAX_SPEED, max(MIN_SPEED, est / wall_s))
    return BuiltWorld(world, wl, blocks, speed, est, ledger.distinct_tokens, kv_ratio,
                      args)
