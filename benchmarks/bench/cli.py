"""``prefixgate bench``: routing strategies and peer routers side by side on simulated replicas.

    prefixgate bench --workload agentic --preset medium --replicas 8 --out bench-out
    prefixgate bench --strategies default,round-robin --peers none --set think_s=1.0
    prefixgate bench --list
    prefixgate bench --sweep 24 --sweep-seed 7 --trace mooncake.jsonl --no-progress --out sweep

Writes results.json, results.md and PNG plots into --out and prints the table. Heavy imports
happen in ``run`` so that building the ``prefixgate`` parser stays cheap.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any

ALL = "all"
NONE = "none"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--workload", default="agentic", choices=["agentic", "shared-prefix", "chat"])
    add("--preset", default="small", choices=["tiny", "small", "medium", "large"])
    add("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="workload parameter, e.g. --set burst_prob=0.2 (repeat; see --list)")
    add("--sessions", type=int, help="conversations (agentic, chat)")
    add("--turns", type=int, help="turns per conversation (agentic, chat)")
    add("--concurrency", type=int, help="live conversations at most (closed loop)")
    add("--rate", type=float, help="conversation arrivals per simulated second (open loop)")
    add("--seed", type=int)
    add("--replicas", type=int, default=8)
    add("--strategies", default=ALL,
        help="comma list of built-in strategies, <strategy>-2gw (two gateways sharing "
             "nothing), <strategy>-2w (one gateway, --workers 2), default-nofc (flow control "
             "off), default-redis-2gw, "
             "label=config.yaml; 'all' (default) or 'none'")
    add("--peers", default=ALL,
        help="comma list of peers; 'all' (default: those installed) or 'none'")
    add("--peers-dir", action="append", default=[], type=Path,
        help="folder holding peer venvs <dir>/<router>/bin/... (repeat; also "
             "$PREFIXGATE_PEERS_DIR; default ~/.cache/prefixgate-peers)")
    add("--redis-url", default=os.environ.get("REDIS_URL"),
        help="Redis for default-redis-2gw (default $REDIS_URL, else a private redis-server)")
    add("--out", type=Path, default=Path("bench-out"), help="output folder")
    add("--num-gpu-blocks", type=int, default=2048, help="KV cache blocks per replica")
    add("--block-size", type=int, default=16)
    add("--bytes-per-token", type=float, default=None,
        help="replicas' (and the client's) tokenizer density, characters a token (default ~4)")
    add("--max-num-seqs", type=int, default=256)
    add("--speed", type=float, default=5.0,
        help="simulate this many times faster than real (higher: faster runs, but the "
             "client's and router's wall-clock overhead is multiplied by it too)")
    add("--sim-arg", action="append", default=[], metavar="FLAG",
        help="extra simulator flag, e.g. --sim-arg=--prefill-ms-per-token=0.3 (repeat)")
    add("--deadline", type=float, default=600.0, help="wall seconds per target run")
    add("--base-port", type=int, help="first replica port (default: a free range)")
    add("--no-plots", action="store_true")
    add("--gateway-log-level", default="warning",
        choices=["debug", "info", "warning", "error"],
        help="prefixgate gateways' log level; debug logs each routing decision's cost terms")
    add("--no-progress", action="store_true")
    add("--sweep", type=int, metavar="N",
        help="scenario sweep: N worlds drawn from wide ranges (replicas and workload), every "
             "target in each; --workload, --preset and the replica flags are then drawn")
    add("--sweep-seed", type=int, default=0, help="seed of the sweep's worlds")
    add("--sweep-scale", type=float, default=1.0,
        help="size of each world's run (1: about 5 s wall per target run, plus its "
             "start-up; 0.3: a quick check)")
    add("--sweep-repeat", type=int, default=1, metavar="K",
        help="run every target K times in each world and rank TTFT over the pooled requests "
             "(each run's p90 shown beside it)")
    add("--sweep-unranked", metavar="A,B",
        help="targets reported with their ratio to the best of the others but never counted "
             "as a world's best (an ablation, or a second copy of a scheduler)")
    add("--sweep-only", metavar="I,J",
        help="run only these worlds of the sweep (indices from 0), e.g. to look at one again")
    add("--trace", type=Path,
        help="Mooncake-style JSONL trace; with --sweep, some worlds replay windows of it")
    add("--list", action="store_true", help="list strategies, peers and workload parameters")
    add("--log-level", default="warning")


def _coerce(value: str, default: Any) -> Any:
    if isinstance(default, bool):
        return value.lower() in ("1", "true", "yes", "on")
    if isinstance(default, int):
        return int(value)
    if isinstance(default, float) or default is None:
        return None if value.lower() == "none" else float(value)
    return value


def workload_overrides(args: argparse.Namespace) -> dict[str, Any]:
    from benchmarks.workloads import WORKLOADS

    defaults = {f.name: f.default for f in fields(WORKLOADS[args.workload][1])}
    out: dict[str, Any] = {}
    for item in args.overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--set {item!r}: expected KEY=VALUE")
        if key not in defaults:
            raise ValueError(f"--set {key}: unknown {args.workload} parameter "
                             f"(known: {', '.join(defaults)})")
        out[key] = _coerce(value, defaults[key])
    for key in ("sessions", "turns", "concurrency", "rate", "seed"):
        value = getattr(args, key)
        if value is not None:
            out[key] = value
    return out


def _names(spec: str, everything: list[str]) -> list[str]:
    if spec == ALL:
        return everything
    if spec == NONE:
        return []
    return [n.strip() for n in spec.split(",") if n.strip()]


def _command_line() -> str:
    """The command as typed, for the report (empty when called from code)."""
    argv = sys.argv[1:]
    return shlex.join(["prefixgate", *argv]) if argv[:1] == ["bench"] else ""


def _list(settings: Any) -> int:
    from benchmarks.bench.targets import (
        PEERS,
        REDIS_VARIANT,
        SPLIT_SUFFIX,
        VARIANTS,
        find_peer_binary,
        peer_dirs,
    )
    from benchmarks.workloads import WORKLOADS
    from router.config.strategies import STRATEGIES

    print("strategies:", ", ".join([*STRATEGIES, *VARIANTS, REDIS_VARIANT]),
          f"(each also as <strategy>{SPLIT_SUFFIX}: two gateways sharing nothing)")
    for name, spec in PEERS.items():
        binary = find_peer_binary(spec, peer_dirs(settings.peer_dirs))
        print(f"peer {name}: {binary or 'not installed'}")
    for name, (_, params, presets) in WORKLOADS.items():
        keys = ", ".join(f"{f.name}={f.default}" for f in fields(params))
        print(f"workload {name} (presets {', '.join(presets)}): {keys}")
    return 0


def run(args: argparse.Namespace) -> int:
    from benchmarks.bench.settings import BenchSettings
    from benchmarks.bench.targets import PEERS, REDIS_VARIANT, make_targets, peer_dirs
    from benchmarks.workloads import build_workload
    from router.config.strategies import STRATEGIES

    settings = BenchSettings(
        out=args.out, replicas=args.replicas, speed=args.speed,
        num_gpu_blocks=args.num_gpu_blocks, block_size=args.block_size,
        max_num_seqs=args.max_num_seqs, sim_args=list(args.sim_arg),
        deadline_s=args.deadline, peer_dirs=peer_dirs(args.peers_dir),
        redis_url=args.redis_url, base_port=args.base_port, plots=not args.no_plots,
        progress=not args.no_progress, command=_command_line(),
        gateway_log_level=args.gateway_log_level, bytes_per_token=args.bytes_per_token,
    )  # fmt: skip
    if args.list:
        return _list(settings)
    if args.sweep is not None:
        return _sweep(args, settings)
    try:
        workload = build_workload(args.workload, args.preset, **workload_overrides(args))
        strategies = _names(args.strategies, [*STRATEGIES, REDIS_VARIANT])
        targets = make_targets(strategies, _names(args.peers, list(PEERS)), settings)
    except ValueError as exc:
        print(f"prefixgate bench: {exc}", file=sys.stderr)
        return 2
    if not targets:
        print("prefixgate bench: nothing to compare (--strategies none --peers none)",
              file=sys.stderr)
        return 2
    return _execute(settings, workload, targets)


def _sweep(args: argparse.Namespace, settings: Any) -> int:
    from benchmarks.bench.sweep import SWEEP_PEERS, SWEEP_STRATEGIES, SweepSpec, run_sweep, write
    from benchmarks.bench.targets import make_targets

    if args.sweep < 1 or args.sweep_scale <= 0 or args.sweep_repeat < 1:
        print("prefixgate bench: --sweep needs N >= 1, --sweep-scale > 0 and --sweep-repeat "
              ">= 1", file=sys.stderr)
        return 2
    if args.trace is not None and not args.trace.is_file():
        print(f"prefixgate bench: --trace {args.trace}: no such file", file=sys.stderr)
        return 2
    try:
        only = None if args.sweep_only is None else [int(i) for i in args.sweep_only.split(",")]
        spec = SweepSpec(args.sweep, args.sweep_seed, args.sweep_scale, args.trace,
                         _names(args.strategies, SWEEP_STRATEGIES),
                         _names(args.peers, SWEEP_PEERS), only, args.sweep_repeat,
                         [n.strip() for n in (args.sweep_unranked or "").split(",") if n.strip()])
        # Unknown names fail here, before anything starts.
        labels = {t.name for t in make_targets(spec.strategies, spec.peers, settings)}
        if unknown := [n for n in spec.unranked if n not in labels]:
            raise ValueError(f"--sweep-unranked: not a target of this sweep: {', '.join(unknown)}")
    except ValueError as exc:
        print(f"prefixgate bench: {exc}", file=sys.stderr)
        return 2
    runs = _loop_runner()(run_sweep(settings, spec))
    paths = write(settings, spec, runs)
    print(paths[1].read_text())
    print("wrote " + ", ".join(str(p) for p in paths), file=sys.stderr)
    return 0 if any(r.results for r in runs) else 1


def _execute(settings: Any, workload: Any, targets: Any) -> int:
    from benchmarks.bench.report import markdown, write
    from benchmarks.bench.runner import Runner

    try:
        report = _loop_runner()(Runner(settings, workload).run(targets))
    except ValueError as exc:
        print(f"prefixgate bench: {exc}", file=sys.stderr)
        return 2
    paths = write(report, settings.out)
    print(markdown(report))
    print("wrote " + ", ".join(str(p) for p in paths), file=sys.stderr)
    return 0 if any(r.status == "ok" for r in report.results) else 1


def _loop_runner() -> Any:
    try:
        import uvloop
    except ImportError:
        return asyncio.run
    return uvloop.run
