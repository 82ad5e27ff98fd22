"""Routing quality at four points: moderate load and overload, roomy and tight KV caches.

Runs ``prefixgate bench`` per point (each point runs every target side by side on the same 8
simulated replicas and the same seeded agentic workload), ``--repeat`` times, and prints one
condensed table per point: client TTFT p50/p90, the replicas' own TTFT p90, and the share of
the workload's reusable prompt tokens that was served from cache. With several runs each
figure is the median over the runs, with the range of TTFT p90 and reuse: on a small machine
that runs the replicas, the routers and the load generator at once, one run moves by 10-30%.

    python -m benchmarks.routing_quality --out bench-out/quality [--repeat 3] [--peers-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

TARGETS = "default,weighted,session-hash,prefix-only,round-robin"
PEERS = "smg-cache_aware,vllm-router-cache_aware"
# (label, --concurrency, --num-gpu-blocks): 32 live sessions of the medium preset at most.
POINTS = [
    ("moderate load, roomy KV (8,192 blocks)", 16, 8192),
    ("overload, roomy KV (8,192 blocks)", 48, 8192),
    ("moderate load, tight KV (2,048 blocks)", 16, 2048),
    ("overload, tight KV (2,048 blocks)", 48, 2048),
]


def table(results: list[dict[str, Any]]) -> str:
    rows = [
        "| target | TTFT mean s | TTFT p50 s | TTFT p90 s | TTFT p99 s | engine TTFT p90 s "
        "| reuse captured | errors |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if r.get("status") != "ok":
            rows.append(f"| {r['name']} | {r.get('status')}: {r.get('note', '')} | | | | | | |")
            continue
        t = r["ttft"]
        rows.append(
            f"| {r['name']} | {t['mean']:.2f} | {t['p50']:.2f} | {t['p90']:.2f} | {t['p99']:.2f} "
            f"| {r['server_ttft_p90']:.2f} | {r['captured']:.1%} | {r['errors']} |"
        )
    return "\n".join(rows)


def _median(runs: list[dict[str, Any]], get: Any) -> tuple[float, float, float]:
    values = [get(r) for r in runs]
    return statistics.median(values), min(values), max(values)


def median_table(runs: list[list[dict[str, Any]]]) -> str:
    """Per target, the median over runs (TTFT p90 and reuse with their range)."""
    if len(runs) == 1:
        return table(runs[0])
    rows = [
        "| target | TTFT p50 s | TTFT p90 s (range) | engine TTFT p90 s | reuse captured (range)"
        " | errors |",
        "|---|---|---|---|---|---|",
    ]
    names = [r["name"] for r in runs[0]]
    for name in names:
        mine = [r for run in runs for r in run if r["name"] == name and r.get("status") == "ok"]
        if not mine:
            rows.append(f"| {name} | not run | | | | |")
            continue
        p50 = _median(mine, lambda r: r["ttft"]["p50"])[0]
        p90, p90_lo, p90_hi = _median(mine, lambda r: r["ttft"]["p90"])
        engine = _median(mine, lambda r: r["server_ttft_p90"])[0]
        reuse, reuse_lo, reuse_hi = _median(mine, lambda r: r["captured"])
        errors = sum(r["errors"] for r in mine)
        rows.append(
            f"| {name} | {p50:.2f} | {p90:.2f} ({p90_lo:.2f}-{p90_hi:.2f}) | {engine:.2f} | "
            f"{reuse:.1%} ({reuse_lo:.1%}-{reuse_hi:.1%}) | {errors} |"
        )
    return "\n".join(rows)


def run_point(
    out: Path, concurrency: int, blocks: int, args: argparse.Namespace, run: int = 0
) -> Path:
    folder = out / f"c{concurrency}-kv{blocks}" / f"run{run}"
    command = [
        sys.executable, "-m", "router.cli", "bench", "--workload", "agentic",
        "--preset", args.preset, "--concurrency", str(concurrency),
        "--num-gpu-blocks", str(blocks), "--strategies", args.strategies,
        "--peers", args.peers, "--out", str(folder), "--no-progress",
    ]
    for peers_dir in args.peers_dir:
        command += ["--peers-dir", peers_dir]
    if args.speed is not None:
        command += ["--speed", str(args.speed)]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return folder / "results.json"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("bench-out/quality"))
    parser.add_argument("--preset", default="medium")
    parser.add_argument("--strategies", default=TARGETS)
    parser.add_argument("--peers", default=PEERS)
    parser.add_argument("--peers-dir", action="append", default=[])
    parser.add_argument("--repeat", type=int, default=1, help="runs per point (median shown)")
    parser.add_argument("--speed", type=float, help="the replicas' speed-up (bench's default)")
    parser.add_argument("--points", help="only these, e.g. c48-kv8192,c48-kv2048")
    args = parser.parse_args(argv)
    chosen = set(args.points.split(",")) if args.points else None
    known = {f"c{c}-kv{b}" for _, c, b in POINTS}
    if chosen is not None and not chosen <= known:
        parser.error(f"--points: unknown {sorted(chosen - known)}; known: {sorted(known)}")
    for label, concurrency, blocks in POINTS:
        if chosen is not None and f"c{concurrency}-kv{blocks}" not in chosen:
            continue
        runs = []
        for run in range(max(1, args.repeat)):
            path = run_point(args.out, concurrency, blocks, args, run)
            runs.append(json.loads(path.read_text())["results"])
        print(f"\n#### {label}, concurrency {concurrency}\n")
        print(median_table(runs), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
