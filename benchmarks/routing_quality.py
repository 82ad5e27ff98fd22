"""Routing quality at four points: moderate load and overload, roomy and tight KV caches.

Runs ``prefixgate bench`` once per point (each point runs every target side by side on the
same 8 simulated replicas and the same seeded agentic workload) and prints one condensed table
per point: client TTFT p50/p90, the replicas' own TTFT p90, and the share of the workload's
reusable prompt tokens that was served from cache.

    python -m benchmarks.routing_quality --out bench-out/quality [--peers-dir DIR]
"""

from __future__ import annotations

import argparse
import json
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
        "| target | TTFT p50 s | TTFT p90 s | engine TTFT p90 s | reuse captured | errors |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        if r.get("status") != "ok":
            rows.append(f"| {r['name']} | {r.get('status')}: {r.get('note', '')} | | | | |")
            continue
        rows.append(
            f"| {r['name']} | {r['ttft']['p50']:.2f} | {r['ttft']['p90']:.2f} | "
            f"{r['server_ttft_p90']:.2f} | {r['captured']:.1%} | {r['errors']} |"
        )
    return "\n".join(rows)


def run_point(out: Path, concurrency: int, blocks: int, args: argparse.Namespace) -> Path:
    folder = out / f"c{concurrency}-kv{blocks}"
    command = [
        sys.executable, "-m", "router.cli", "bench", "--workload", "agentic",
        "--preset", args.preset, "--concurrency", str(concurrency),
        "--num-gpu-blocks", str(blocks), "--strategies", args.strategies,
        "--peers", args.peers, "--out", str(folder), "--no-progress",
    ]
    for peers_dir in args.peers_dir:
        command += ["--peers-dir", peers_dir]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return folder / "results.json"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("bench-out/quality"))
    parser.add_argument("--preset", default="medium")
    parser.add_argument("--strategies", default=TARGETS)
    parser.add_argument("--peers", default=PEERS)
    parser.add_argument("--peers-dir", action="append", default=[])
    args = parser.parse_args(argv)
    for label, concurrency, blocks in POINTS:
        results = json.loads(run_point(args.out, concurrency, blocks, args).read_text())
        print(f"\n#### {label}, concurrency {concurrency}\n")
        print(table(results["results"]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
