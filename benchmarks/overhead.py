"""What a router costs per request: CPU, added latency and throughput, side by side.

Starts one zero-latency simulated replica, prefixgate in front of it (or several checkouts of
it, ``--gateway label=DIR``) and the peer routers installed (vllm-router and smg cache_aware,
see benchmarks/bench/targets.py), each in its own process, all on loopback. Then, for
non-streaming and streaming completions (``--tokens`` tokens) at each connection count, wrk
loads each router in turn, and the replica alone, for ``--seconds``; ``--repeat`` rounds
interleave the routers so that drift on a shared machine hits them alike.

Per router and row: CPU per request (utime + stime of its process tree over the requests it
served: the figure that depends least on the machine's other load), req/s, p50 and p99, and
the p50/p99 added over the replica alone in the same round; medians over the rounds.

    python -m benchmarks.overhead [--seconds 5] [--repeat 3] [--connections 1 32]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from benchmarks import wrk
from benchmarks.bench.procs import HOST, free_port

__all__ = ["HOST", "free_port", "process", "started"]
from benchmarks.bench.targets import PEERS, find_peer_binary, peer_args, peer_dirs
from benchmarks.proc_cpu import tree_cpu_seconds

REPLICA = "replica alone"
DEFAULT_PEERS = ("vllm-router-cache_aware", "smg-cache_aware")
MODEL = "sim-model"


@dataclass
class Runner:
    """A router (or the replica) under test: its process and where it listens."""

    name: str
    proc: subprocess.Popen[bytes]
    url: str
    # (stream, connections) -> one result per round
    results: dict[tuple[bool, int], list[wrk.WrkResult]] = field(default_factory=dict)
    cpu: dict[tuple[bool, int], list[float]] = field(default_factory=dict)


def wait_ready(urls: Sequence[str], proc: subprocess.Popen[bytes], seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited with {proc.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if all(httpx.get(u, timeout=1).status_code == 200 for u in urls):
                return
        time.sleep(0.2)
    raise RuntimeError(f"{urls} did not become ready")


@contextlib.contextmanager
def started(
    name: str, args: list[str], ready: Sequence[str], url: str, cwd: Path | None = None
) -> Iterator[Runner]:
    proc = subprocess.Popen(args, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            stdin=subprocess.DEVNULL)
    try:
        wait_ready(ready, proc)
        yield Runner(name, proc, url)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


@contextlib.contextmanager
def process(args: list[str], ready_url: str) -> Iterator[subprocess.Popen[bytes]]:
    """A child process, once ``ready_url`` answers 200; stopped on exit (other benchmarks)."""
    with started(args[0], args, [ready_url], ready_url) as runner:
        yield runner.proc


def _gateway(
    stack: contextlib.ExitStack, label: str, src: Path, replica: str, log_level: str
) -> Runner:
    port = free_port()
    args = [sys.executable, "-m", "router.cli", "serve", "--backend", replica, "--host", HOST,
            "--port", str(port), "--log-level", log_level]
    url = f"http://{HOST}:{port}"
    return stack.enter_context(started(label, args, [f"{url}/ready"], url, cwd=src))


def _peer(stack: contextlib.ExitStack, name: str, replica: str) -> Runner | None:
    spec = PEERS[name]
    binary = find_peer_binary(spec, peer_dirs())
    if binary is None:
        print(f"# {name}: not installed, skipped", flush=True)
        return None
    port, metrics_port = free_port(), free_port()
    url = f"http://{HOST}:{port}"
    args = peer_args(spec, binary, port, metrics_port, [replica])
    return stack.enter_context(started(name, args, [f"{url}/health", f"{url}/v1/models"], url))


def measure(runner: Runner, stream: bool, conns: int, seconds: float, tokens: int) -> None:
    lua = wrk.script(MODEL, tokens, stream)
    before = tree_cpu_seconds(runner.proc.pid)
    result = wrk.run(runner.url, lua, conns, seconds)
    cpu = tree_cpu_seconds(runner.proc.pid) - before
    key = (stream, conns)
    runner.results.setdefault(key, []).append(result)
    runner.cpu.setdefault(key, []).append(cpu / max(1, result.requests))
    print(
        f"# {runner.name:26} {'stream' if stream else 'plain':6} c={conns:<3} "
        f"{result.rps:8.0f} req/s  p50 {result.p50_s * 1e3:6.2f} ms  p99 "
        f"{result.p99_s * 1e3:6.2f} ms  cpu {cpu / max(1, result.requests) * 1e3:.3f} ms/req  "
        f"errors {result.errors}",
        flush=True,
    )


def _median_ms(values: Sequence[float]) -> str:
    return f"{statistics.median(values) * 1e3:.3f}" if values else "-"


def _added(runner: Runner, replica: Runner, key: tuple[bool, int], p99: bool) -> list[float]:
    own, base = runner.results.get(key, []), replica.results.get(key, [])
    return [
        (r.p99_s - b.p99_s) if p99 else (r.p50_s - b.p50_s) for r, b in zip(own, base, strict=False)
    ]


def report(runners: Sequence[Runner], connections: Sequence[int], reference: str) -> str:
    replica = next(r for r in runners if r.name == REPLICA)
    low, high = min(connections), max(connections)
    ref = next((r for r in runners if r.name == reference), None)
    lines = [
        f"| router | mode | CPU ms/req at {low} | CPU ms/req at {high} | x {reference} at {high} "
        f"| req/s at {high} | p50 ms at {low} | added p50 ms at {low} | added p99 ms at {low} "
        "| errors |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for stream in (False, True):
        for r in runners:
            lo, hi = (stream, low), (stream, high)
            ratio = "-"
            if ref is not None and ref.cpu.get(hi) and r.cpu.get(hi):
                ratio = f"{statistics.median(r.cpu[hi]) / statistics.median(ref.cpu[hi]):.2f}"
            rps = [x.rps for x in r.results.get(hi, [])]
            errors = sum(x.errors for runs in r.results.values() for x in runs)
            added = "-" if r is replica else _median_ms(_added(r, replica, lo, False))
            added99 = "-" if r is replica else _median_ms(_added(r, replica, lo, True))
            lines.append(
                f"| {r.name} | {'streaming' if stream else 'non-streaming'} "
                f"| {_median_ms(r.cpu.get(lo, []))} | {_median_ms(r.cpu.get(hi, []))} | {ratio} "
                f"| {statistics.median(rps) if rps else 0:,.0f} "
                f"| {_median_ms([x.p50_s for x in r.results.get(lo, [])])} | {added} "
                f"| {added99} | {errors} |"
            )
    return "\n".join(lines)


def _gateways(specs: Sequence[str]) -> list[tuple[str, Path]]:
    out = []
    for spec in specs:
        label, _, path = spec.partition("=")
        if not path or not (Path(path) / "router" / "cli.py").is_file():
            raise SystemExit(f"--gateway {spec!r}: expected label=DIR with DIR a checkout")
        out.append((label, Path(path).resolve()))
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=5.0, help="per wrk run")
    parser.add_argument("--repeat", type=int, default=3, help="rounds (medians are reported)")
    parser.add_argument("--connections", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--tokens", type=int, default=8, help="max_tokens of every request")
    parser.add_argument("--peers", nargs="*", default=list(DEFAULT_PEERS), choices=list(PEERS))
    parser.add_argument("--gateway", action="append", default=[], metavar="LABEL=DIR",
                        help="a prefixgate checkout to run (repeat); default: this one")
    parser.add_argument("--gateway-log-level", default="info",
                        help="info (the default deployment: access log on) or warning")
    parser.add_argument("--reference", default="vllm-router-cache_aware",
                        help="the router CPU ratios are taken against")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not wrk.available():
        print("wrk is not installed (apt-get install wrk)", file=sys.stderr)
        return 2
    gateways = _gateways(args.gateway) or [("prefixgate", Path.cwd())]
    sim_port = free_port()
    replica = f"http://{HOST}:{sim_port}"
    sim = [sys.executable, "-m", "router.cli", "sim", "--zero-latency", "--host", HOST,
           "--port", str(sim_port), "--log-level", "warning"]
    with contextlib.ExitStack() as stack:
        runners = [stack.enter_context(started(REPLICA, sim, [f"{replica}/health"], replica))]
        for label, src in gateways:
            runners.append(_gateway(stack, label, src, replica, args.gateway_log_level))
        runners += [p for name in args.peers if (p := _peer(stack, name, replica))]
        for r in runners:  # warm-up: connection pools, caches, JIT-less but lazy imports
            for stream in (False, True):
                wrk.run(r.url, wrk.script(MODEL, args.tokens, stream), 8, 1)
        for _ in range(args.repeat):
            for stream in (False, True):
                for conns in args.connections:
                    for r in runners:
                        measure(r, stream, conns, args.seconds, args.tokens)
    print(report(runners, args.connections, args.reference))
    return 0


if __name__ == "__main__":
    sys.exit(main())
