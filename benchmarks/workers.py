"""``prefixgate serve --workers N``: req/s and CPU per request for several N, side by side.

Starts one zero-latency simulated replica, then for each N a gateway of N workers in front of
it (N > 1: with its private Redis, as an unconfigured deployment gets), and drives it with
``wrk`` (C, so the load generator takes little of the CPU the gateway needs) at a fixed number
of connections. CPU is utime + stime of the gateway's whole process tree (supervisor, workers,
private Redis) over the measured run, divided by the requests wrk completed. Rounds alternate
the N values so that drift of a shared machine spreads over all of them.

    python -m benchmarks.workers [--workers 1 2 4] [--seconds 10] [--connections 32] [--rounds 2]
"""

from __future__ import annotations

import argparse
import contextlib
import math
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import orjson
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.bench.procs import HOST, free_port
from benchmarks.proc_cpu import Usage, tree_usage

READY_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Run:
    workers: int
    rps: float
    requests: int
    errors: int
    usage: Usage

    @property
    def cpu_s(self) -> float:
        return self.usage.cpu_s

    @property
    def cpu_ms_per_request(self) -> float:
        return 1000 * self.cpu_s / max(1, self.requests)

    def per_request(self, value: float) -> float:
        return value / max(1, self.requests)


def wrk_script(directory: Path, stream: bool) -> Path:
    messages = [{"role": "user", "content": "Summarise the design of a routing gateway. " * 8}]
    body = orjson.dumps(
        {"model": "sim-model", "messages": messages, "max_tokens": 16, "stream": stream}
    ).decode()
    path = directory / "post.lua"
    path.write_text(
        'wrk.method = "POST"\n'
        f"wrk.body = [[{body}]]\n"
        'wrk.headers["Content-Type"] = "application/json"\n'
    )
    return path


def run_wrk(url: str, script: Path, connections: int, seconds: float) -> tuple[int, float, int]:
    """(requests, req/s, errors) of one wrk run."""
    out = subprocess.run(
        ["wrk", "-t2", f"-c{connections}", f"-d{seconds:.0f}s", "-s", str(script),
         f"{url}/v1/chat/completions"],
        capture_output=True, text=True, check=True, timeout=seconds + 60,
    ).stdout
    return parse_wrk(out)


def parse_wrk(out: str) -> tuple[int, float, int]:
    """(requests, req/s, errors: non-2xx answers plus socket errors) from wrk's report."""
    done = re.search(r"(\d+) requests in", out)
    rate = re.search(r"Requests/sec:\s+([\d.]+)", out)
    if done is None or rate is None:
        raise ValueError(f"not a wrk report: {out[:200]!r}")
    bad = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    socket_errors = re.search(r"Socket errors: (.*)", out)
    errors = int(bad.group(1)) if bad else 0
    if socket_errors:
        errors += sum(int(n) for n in re.findall(r"\d+", socket_errors.group(1)))
    return int(done.group(1)), float(rate.group(1)), errors


def _workers_up(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=2).text
    return sum(
        s.value for f in text_string_to_metric_families(text) for s in f.samples
        if s.name == "prefixgate_worker_up"
    )


def wait_ready(url: str, path: str, workers: int, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited with {proc.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            ready = httpx.get(f"{url}{path}", timeout=1).status_code == 200
            if ready and (workers == 1 or _workers_up(url) == workers):
                return
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not become ready")


@contextlib.contextmanager
def process(
    args: list[str], url: str, path: str = "/ready", workers: int = 1
) -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_ready(url, path, workers, proc)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


def measure(sim_url: str, workers: int, args: argparse.Namespace, script: Path) -> Run:
    port = free_port()
    url = f"http://{HOST}:{port}"
    cmd = [sys.executable, "-m", "router.cli", "serve", "--backend", sim_url, "--host", HOST,
           "--port", str(port), "--workers", str(workers), "--log-level", "warning"]
    with process(cmd, url, workers=workers) as gw:
        run_wrk(url, script, args.connections, 2)  # warm-up: connections, caches, JIT-free paths
        before = tree_usage(gw.pid)
        requests, rps, errors = run_wrk(url, script, args.connections, args.seconds)
        used = tree_usage(gw.pid) - before
    return Run(workers, rps, requests, errors, used)


def report(runs: list[Run]) -> None:
    print("| workers | req/s (median) | req/s per round | CPU ms/request (median) | "
          "user / system ms/request | context switches/request, voluntary / involuntary | "
          "CPU cores used | errors |")
    print("|---|---|---|---|---|---|---|---|")
    base = None
    for n in sorted({r.workers for r in runs}):
        mine = [r for r in runs if r.workers == n]
        rps = statistics.median(r.rps for r in mine)
        cpu = statistics.median(r.cpu_ms_per_request for r in mine)
        user = statistics.median(1000 * r.per_request(r.usage.user_s) for r in mine)
        system = statistics.median(1000 * r.per_request(r.usage.system_s) for r in mine)
        voluntary = statistics.median(r.per_request(r.usage.voluntary) for r in mine)
        involuntary = statistics.median(r.per_request(r.usage.involuntary) for r in mine)
        base = base or rps
        rounds = ", ".join(f"{r.rps:,.0f}" for r in mine)
        cores = statistics.median(r.cpu_ms_per_request * r.rps / 1000 for r in mine)
        print(f"| {n} | {rps:,.0f} ({rps / base:.2f}x) | {rounds} | {cpu:.3f} | "
              f"{user:.3f} / {system:.3f} | {voluntary:.2f} / {involuntary:.2f} | {cores:.2f} | "
              f"{sum(r.errors for r in mine)} |", flush=True)


# Two-sided 95% quantiles of Student's t by degrees of freedom (the normal's beyond the table).
_T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26,
        10: 2.23, 12: 2.18, 15: 2.13, 20: 2.09, 30: 2.04}


def _t95(df: int) -> float:
    return next((t for d, t in sorted(_T95.items()) if d >= df), 1.96)


def paired_ratio(runs: list[Run], n: int, base: int) -> tuple[float, float, float, int] | None:
    """CPU per request of ``n`` workers over ``base`` workers', paired by round (the rounds
    alternate, so each pair ran under the same drift of the shared machine): the geometric
    mean of the rounds' ratios and its 95% interval, and the number of rounds. One round's CPU
    a request moves by a tenth with what shares the cores, so one run's medians alone cannot
    tell a few percent."""
    a = [r.cpu_ms_per_request for r in runs if r.workers == base]
    b = [r.cpu_ms_per_request for r in runs if r.workers == n]
    logs = [math.log(y / x) for x, y in zip(a, b, strict=False) if x > 0 and y > 0]
    if len(logs) < 2:
        return None
    mean = statistics.fmean(logs)
    half = _t95(len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half), len(logs)


def report_paired(runs: list[Run]) -> None:
    counts = sorted({r.workers for r in runs})
    rows = [(n, paired_ratio(runs, n, counts[0])) for n in counts[1:]]
    if not any(ratio for _, ratio in rows):
        return
    print(f"\n| workers | CPU a request over {counts[0]} worker(s)', paired by round | "
          "95% interval | rounds |")
    print("|---|---|---|---|")
    for n, ratio in rows:
        if ratio is not None:
            mean, low, high, rounds = ratio
            print(f"| {n} | {mean:.3f}x | {low:.3f}x - {high:.3f}x | {rounds} |", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--seconds", type=float, default=10.0, help="per measured wrk run")
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--stream", action="store_true", help="streamed completions")
    parser.add_argument("--replica", choices=["sim", "static"], default="sim",
                        help="the zero-latency simulator, or benchmarks.static_replica (prepared "
                        "answers: far less CPU a request, so the gateway gets more of the cores)")
    args = parser.parse_args(argv)
    if shutil.which("wrk") is None:
        print("needs wrk on the PATH (apt-get install wrk)", file=sys.stderr)
        return 2
    sim_port = free_port()
    sim_url = f"http://{HOST}:{sim_port}"
    sim = [sys.executable, "-m", "router.cli", "sim", "--zero-latency", "--host", HOST,
           "--port", str(sim_port), "--log-level", "warning"]
    if args.replica == "static":
        sim = [sys.executable, "-m", "benchmarks.static_replica", "--port", str(sim_port),
               "--tokens", "16"]
    runs: list[Run] = []
    with tempfile.TemporaryDirectory() as tmp, process(sim, sim_url, "/health"):
        script = wrk_script(Path(tmp), args.stream)
        for _ in range(args.rounds):
            for n in args.workers:
                runs.append(measure(sim_url, n, args, script))
                print(f"workers={n}: {runs[-1]}", file=sys.stderr, flush=True)
    report(runs)
    report_paired(runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
