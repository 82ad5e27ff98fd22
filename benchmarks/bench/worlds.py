"""Worlds of a scenario sweep: simulator settings and a workload drawn from wide ranges.

A router tuned on one simulator and one workload can lose on the next, so ``prefixgate bench
--sweep N`` draws N worlds from a seeded RNG and runs every target in each. What varies:

- the replicas: prefill scheduling (``serial``: one prompt at a time; ``batched``: chunked
  under a token budget shared with the decodes; ``independent``), prefill cost per token and
  per request (0.25x-4x the simulator's defaults), decode step time, KV size (a fraction of the
  workload's distinct tokens to several times them, over the fleet), ``max_num_seqs`` 8-256,
  block size 16/32/64, tokenizer density 2.5-10 bytes a token, some replicas slower than others;
- the workload: agentic sessions with sub-agent fan-out 1-50, multi-turn chat, shared-prefix
  questions, or a window of a Mooncake-style trace; load from light to overload (closed-loop
  concurrency, or an open-loop rate / trace time scale set for a target utilisation; a trace
  window thinned to one conversation in 1-100, so it spans seconds to tens of minutes); think
  times; answer lengths.

Drawing is pure (``draw_worlds``); ``build_world`` turns a world into the workload and the
replica settings, sized so one target's run lasts about ``scale`` x ``WALL_TARGET_S`` seconds.
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass, field
from typing import Any

from benchmarks.sim.config import SimConfig

PREFILL_MODES = ("serial", "batched", "independent")
BLOCK_SIZES = (16, 32, 64)
COST_RANGE = (0.25, 4.0)  # prefill cost, x the simulator's defaults
ITL_RANGE_MS = (6.0, 40.0)
KV_RANGE = (0.25, 4.0)  # fleet KV / the workload's distinct tokens
SEQS_RANGE = (8, 256)
BPT_RANGE = (2.5, 10.0)  # bytes a token
SLOW_RANGE = (1.5, 4.0)  # a slow replica's latencies, x the others'
FANOUT_RANGE = (1, 50)
TRACE_KEEP_RANGE = (1, 100)  # a trace window keeps one conversation in this many
LOAD_RANGE = (0.2, 1.6)  # open loop: offered prefill work / fleet capacity
CLOSED_LOOP = ("agentic", "chat")
WORKLOAD_WEIGHTS = {"agentic": 4, "chat": 2, "shared-prefix": 2, "trace": 3}
# Bytes a token of the workloads' text under the client's tokenizer (one-token words of three
# letters and a space): sim tokens = client tokens x WORDS_BPT / bytes_per_token.
WORDS_BPT = 4.0


@dataclass(frozen=True)
class World:
    index: int
    seed: int
    replicas: int
    prefill_mode: str
    max_num_batched_tokens: int
    cost_per_token: float  # x the default prefill_ms_per_token
    cost_per_request: float  # x the default prefill_overhead_ms
    itl_ms: float
    slow: tuple[float, ...]  # latency factor per replica (1.0: a fast one)
    max_num_seqs: int
    block_size: int
    bytes_per_token: float
    kv_factor: float
    workload: str
    load: float  # closed loop: live sessions per replica; open loop: target utilisation
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def closed_loop(self) -> bool:
        return self.workload in CLOSED_LOOP

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        slow = sum(1 for f in self.slow if f > 1.0)
        load = (f"{self.load:.2f} live sessions a replica" if self.closed_loop
                else f"offered {self.load:.2f}x the prefill capacity")
        return (f"{self.workload}, {load}, {self.replicas} replicas"
                f"{f' ({slow} slow)' if slow else ''}, {self.prefill_mode} prefill, "
                f"cost x{self.cost_per_token:.2f}/x{self.cost_per_request:.2f}, "
                f"itl {self.itl_ms:.0f} ms, KV x{self.kv_factor:.2f}, seqs {self.max_num_seqs}, "
                f"block {self.block_size}, {self.bytes_per_token:.1f} B/token")


def _log_uniform(rng: random.Random, lo: float, hi: float) -> float:
    return math.exp(rng.uniform(math.log(lo), math.log(hi)))


def _slow_factors(rng: random.Random, replicas: int) -> tuple[float, ...]:
    if rng.random() < 0.5:
        return (1.0,) * replicas
    n = rng.randint(1, max(1, replicas // 2))
    factor = round(rng.uniform(*SLOW_RANGE), 2)
    return tuple(factor if i < n else 1.0 for i in range(replicas))


def _agentic(rng: random.Random) -> dict[str, Any]:
    fanout = round(_log_uniform(rng, *FANOUT_RANGE))
    return dict(
        turns=rng.randint(3, 8), agent_types=rng.randint(1, 4),
        system_tokens=round(_log_uniform(rng, 300, 3000)), tool_count=rng.randint(1, 8),
        tool_tokens=round(_log_uniform(rng, 100, 1500)),
        first_user_tokens=round(_log_uniform(rng, 50, 600)),
        answer_tokens=round(_log_uniform(rng, 16, 300)),
        tool_result_tokens=round(_log_uniform(rng, 50, 800)),
        think_s=round(_log_uniform(rng, 0.05, 4.0), 3),
        burst_prob=round(rng.uniform(0.05, 0.4), 3), burst_size=max(1, fanout // 2),
        burst_max=fanout, subagent_turns=rng.randint(1, 3),
        subagent_task_tokens=round(_log_uniform(rng, 20, 300)),
        reset_prob=round(rng.uniform(0.0, 0.05), 3), reset_tokens=200,
    )  # fmt: skip


def _chat(rng: random.Random) -> dict[str, Any]:
    return dict(
        turns=rng.randint(2, 10), agent_types=rng.randint(1, 4),
        system_tokens=round(_log_uniform(rng, 200, 3000)),
        user_tokens=round(_log_uniform(rng, 30, 600)),
        max_tokens=round(_log_uniform(rng, 16, 300)), think_s=round(_log_uniform(rng, 0.1, 5), 3),
    )  # fmt: skip


def _shared_prefix(rng: random.Random) -> dict[str, Any]:
    return dict(
        groups=rng.randint(2, 24), system_tokens=round(_log_uniform(rng, 300, 4000)),
        question_tokens=round(_log_uniform(rng, 20, 400)),
        output_tokens=round(_log_uniform(rng, 8, 300)),
    )  # fmt: skip


def _trace(rng: random.Random, trace_rows: int) -> dict[str, Any]:
    return dict(start=rng.randrange(max(1, trace_rows)), block_tokens=rng.choice((16, 32, 64)),
                max_output=round(_log_uniform(rng, 16, 256)),
                keep=round(_log_uniform(rng, *TRACE_KEEP_RANGE)))


def draw_world(rng: random.Random, index: int, max_replicas: int, trace_rows: int) -> World:
    """One world; ``trace_rows`` 0 leaves trace replay out."""
    kinds = [k for k in WORKLOAD_WEIGHTS if k != "trace" or trace_rows > 0]
    kind = rng.choices(kinds, [WORKLOAD_WEIGHTS[k] for k in kinds])[0]
    replicas = rng.randint(max(2, max_replicas // 2), max(2, max_replicas))
    params = {"agentic": _agentic, "chat": _chat, "shared-prefix": _shared_prefix}.get(kind)
    drawn = params(rng) if params is not None else _trace(rng, trace_rows)
    closed = kind in CLOSED_LOOP
    return World(
        index=index, seed=rng.randrange(2**31), replicas=replicas,
        prefill_mode=rng.choice(PREFILL_MODES),
        max_num_batched_tokens=rng.choice((512, 1024, 2048, 4096, 8192)),
        cost_per_token=round(_log_uniform(rng, *COST_RANGE), 3),
        cost_per_request=round(_log_uniform(rng, *COST_RANGE), 3),
        itl_ms=round(_log_uniform(rng, *ITL_RANGE_MS), 2),
        slow=_slow_factors(rng, replicas),
        max_num_seqs=round(_log_uniform(rng, *SEQS_RANGE)),
        block_size=rng.choice(BLOCK_SIZES),
        bytes_per_token=round(_log_uniform(rng, *BPT_RANGE), 2),
        kv_factor=round(_log_uniform(rng, *KV_RANGE), 3), workload=kind,
        load=round(_log_uniform(rng, 0.5, 8.0) if closed else rng.uniform(*LOAD_RANGE), 3),
        params=drawn,
    )  # fmt: skip


def draw_worlds(n: int, seed: int, max_replicas: int = 8, trace_rows: int = 0) -> list[World]:
    """``n`` worlds from ``seed``: the same seed always gives the same worlds."""
    rng = random.Random(f"prefixgate-sweep-{seed}")
    return [draw_world(rng, i, max_replicas, trace_rows) for i in range(n)]


def replica_latency_args(world: World) -> list[list[str]]:
    """Each replica's latency flags: the world's base figures times its slow factor."""
    d = SimConfig()
    out = []
    per_token = d.prefill_ms_per_token * world.cost_per_token
    overhead = d.prefill_overhead_ms * world.cost_per_request
    for f in world.slow:
        out.append(["--prefill-ms-per-token", f"{per_token * f:.5g}",
                    "--prefill-overhead-ms", f"{overhead * f:.5g}",
                    "--itl-ms", f"{world.itl_ms * f:.5g}"])
    return out
