"""``prefixgate bench --sweep N``: every target side by side in N drawn worlds.

Each world gets its own simulated replicas (started for the world, stopped after it) and its
own workload; inside a world the targets run one after the other against the same replicas,
caches reset in between, exactly as a single ``prefixgate bench`` run. Each world's full
report goes to ``<out>/world-NN/``; the sweep's to ``<out>/results.{json,md}`` and
``<out>/sweep_ratios.png``, rewritten after every world so an interrupted sweep keeps what ran.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import platform
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.bench.metrics import TargetResult
from benchmarks.bench.repeats import pooled
from benchmarks.bench.report import clean_json
from benchmarks.bench.report import write as write_world
from benchmarks.bench.runner import Runner
from benchmarks.bench.settings import BenchSettings
from benchmarks.bench.sweep_report import (
    METRICS,
    clear_p90_losses,
    p90_intervals,
    reuse_gaps,
    summary_table,
    target_stats,
    world_table,
)
from benchmarks.bench.targets import make_targets
from benchmarks.bench.world_build import BuiltWorld, build_world
from benchmarks.bench.worlds import World, draw_worlds, replica_latency_args
from benchmarks.trace_replay import TraceRow, load_trace

SWEEP_STRATEGIES = ["round-robin", "session-hash", "prefix-only", "weighted", "default",
                    "default-nofc"]
SWEEP_PEERS = ["smg-cache_aware", "vllm-router-cache_aware"]
DEADLINE_FLOOR_S = 20.0


@dataclass
class SweepSpec:
    worlds: int
    seed: int
    scale: float = 1.0
    trace: Path | None = None
    strategies: list[str] = field(default_factory=lambda: list(SWEEP_STRATEGIES))
    peers: list[str] = field(default_factory=lambda: list(SWEEP_PEERS))
    only: list[int] | None = None  # run just these worlds (indices), e.g. to look again
    repeat: int = 1  # runs of every target per world, pooled (benchmarks/bench/repeats.py)
    # Reported, but never the world's best (benchmarks/bench/sweep_report.py).
    unranked: list[str] = field(default_factory=list)


@dataclass
class WorldRun:
    world: World
    built: BuiltWorld | None
    results: list[TargetResult]
    wall_s: float
    error: str = ""
    # Each target's p90 over the best's, 95% interval (benchmarks/bench/intervals.py): computed
    # once, as the report is rewritten after every world.
    intervals: dict[str, tuple[float, float]] = field(default_factory=dict)


def world_settings(template: BenchSettings, built: BuiltWorld, rep: int = 0) -> BenchSettings:
    w = built.world
    out = template.out / f"world-{w.index:02d}"
    return dataclasses.replace(
        template, out=out / f"repeat-{rep}" if rep else out, replicas=w.replicas,
        speed=built.speed, num_gpu_blocks=built.num_gpu_blocks, block_size=w.block_size,
        max_num_seqs=w.max_num_seqs,
        sim_args=[*template.sim_args, *built.sim_args],
        replica_sim_args=replica_latency_args(w), plots=False,
        deadline_s=max(DEADLINE_FLOOR_S, 4 * built.est_sim_s / built.speed),
        kv_events_offset=None, kv_replay_offset=None, bytes_per_token=w.bytes_per_token,
    )  # fmt: skip


async def run_world(
    template: BenchSettings, spec: SweepSpec, world: World, rows: Sequence[TraceRow]
) -> WorldRun:
    started = time.monotonic()
    runs: list[list[TargetResult]] = []
    try:
        built = build_world(world, spec.scale, rows)
        for rep in range(spec.repeat):
            # Every other run in reverse order, so that no target always runs first or last.
            settings = world_settings(template, built, rep)
            targets = make_targets(spec.strategies, spec.peers, settings)
            report = await Runner(settings, built.workload).run(targets[:: -1 if rep % 2 else 1])
            write_world(report, settings.out)
            runs.append(report.results)
    except (ValueError, RuntimeError, OSError) as exc:
        return WorldRun(world, None, [], time.monotonic() - started, str(exc).splitlines()[0])
    results = pooled(runs) if len(runs) > 1 else runs[0]
    intervals = p90_intervals(world.index, results, spec.unranked)
    return WorldRun(world, built, results, time.monotonic() - started, intervals=intervals)


async def run_sweep(template: BenchSettings, spec: SweepSpec) -> list[WorldRun]:
    rows = load_trace(spec.trace) if spec.trace is not None else []
    worlds = draw_worlds(spec.worlds, spec.seed, template.replicas, len(rows))
    if spec.only is not None:
        worlds = [w for w in worlds if w.index in spec.only]
    runs: list[WorldRun] = []
    for world in worlds:
        _say(f"world {world.index} ({len(runs) + 1} of {len(worlds)}): {world.describe()}")
        run = await run_world(template, spec, world, rows)
        runs.append(run)
        _say(f"world {world.index}: {run.wall_s:.0f} s wall"
             + (f", failed: {run.error}" if run.error else ""))
        write(template, spec, runs)
    return runs


def _commit() -> str:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10, check=False)
        if out.returncode == 0:
            return out.stdout.strip()
    return ""


def _target_names(runs: Sequence[WorldRun]) -> list[str]:
    names: list[str] = []
    for run in runs:
        names += [r.name for r in run.results if r.name not in names]
    return names


def _slim(r: TargetResult) -> dict[str, Any]:
    d = r.to_json()
    d.pop("ttft_samples", None)
    return d


def _intervals(runs: Sequence[WorldRun]) -> list[tuple[int, dict[str, tuple[float, float]]]]:
    return [(run.world.index, run.intervals) for run in runs]


def to_json(template: BenchSettings, spec: SweepSpec, runs: Sequence[WorldRun]) -> dict[str, Any]:
    ranked = [(run.world.index, run.results) for run in runs]
    names = _target_names(runs)
    stats = target_stats(ranked, names, spec.unranked)
    return {
        "command": template.command, "commit": _commit(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {"python": platform.python_version(), "platform": platform.platform()},
        "sweep": {"worlds": spec.worlds, "seed": spec.seed, "scale": spec.scale,
                  "repeat": spec.repeat, "unranked": spec.unranked,
                  "trace": str(spec.trace) if spec.trace else None},
        "worlds": [{
            "world": run.world.to_json(), "built": run.built.summary() if run.built else None,
            "wall_s": run.wall_s, "error": run.error,
            "results": [_slim(r) for r in run.results],
            "p90_intervals": {name: list(i) for name, i in run.intervals.items()},
        } for run in runs],
        "summary": {m: [s.to_json() for s in stats[m]] for m in METRICS},
        "reuse_gaps": {t: [[w, g] for w, g in gs]
                       for t, gs in reuse_gaps(ranked, names, spec.unranked).items()},
        "clear_p90_losses": {t: [list(i) for i in ls] for t, ls
                             in clear_p90_losses(_intervals(runs), names).items()},
    }  # fmt: skip


def markdown(template: BenchSettings, spec: SweepSpec, runs: Sequence[WorldRun]) -> str:
    ranked = [(run.world.index, run.results) for run in runs]
    names = _target_names(runs)
    lines = [
        f"# prefixgate bench sweep: {len(runs)} of {spec.worlds} worlds, seed {spec.seed}",
        "",
        f"- command: `{template.command}`" if template.command else "- command: (programmatic)",
        f"- commit {_commit() or '?'}, {time.strftime('%Y-%m-%d %H:%M %Z')}, "
        f"scale {spec.scale:g}, wall {sum(r.wall_s for r in runs):.0f} s"
        + (f", every target run {spec.repeat} times a world, TTFT over the pooled requests "
           "(each run's p90 in brackets)" if spec.repeat > 1 else ""),
        "",
        "Per target, its TTFT over the best target's in each world (1.00: the best). "
        "TTFT in simulated seconds; reuse captured: the replicas' prefix-cache hits over the "
        "tokens an infinite cache would have served. The intervals are the requests' sampling "
        "error alone (bootstrap; benchmarks/bench/intervals.py): a p90 loss whose interval "
        "holds the bar may not repeat, one above it is clear."
        + (f" Unranked (ratios to the best of the others, never the best themselves): "
           f"{', '.join(spec.unranked)}." if spec.unranked else ""),
        "",
        *summary_table(target_stats(ranked, names, spec.unranked),
                       reuse_gaps(ranked, names, spec.unranked),
                       clear_p90_losses(_intervals(runs), names)),
    ]
    for run in runs:
        lines += ["", f"## world {run.world.index}: {run.world.describe()}", ""]
        if run.built is not None:
            b = run.built.summary()
            lines += [f"{b['requests']} requests in {b['conversations']} conversations, "
                      f"concurrency {b['concurrency']}, KV x{b['kv_ratio']:.2f} of "
                      f"{b['distinct_tokens']:,} distinct tokens ({b['num_gpu_blocks']} blocks "
                      f"a replica), speed x{b['speed']:g}, {run.wall_s:.0f} s wall", ""]
        if run.error:
            lines += [f"failed: {run.error}"]
            continue
        lines += world_table(run.results, spec.unranked, run.intervals)
    return "\n".join(lines) + "\n"


def write(template: BenchSettings, spec: SweepSpec, runs: Sequence[WorldRun]) -> list[Path]:
    out = template.out
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "results.json", out / "results.md"]
    data = clean_json(to_json(template, spec, runs))
    paths[0].write_text(json.dumps(data, indent=2, allow_nan=False))
    paths[1].write_text(markdown(template, spec, runs))
    if template.plots:
        from benchmarks.bench.plots import write_sweep_plot

        panels = [(f"TTFT {m}", [(s["target"], [r for _, r in s["ratios"]])
                                 for s in data["summary"][m]]) for m in METRICS]
        plot = write_sweep_plot(panels, out / "sweep_ratios.png")
        if plot is not None:
            paths.append(plot)
    return paths


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)
