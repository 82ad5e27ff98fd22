"""Fairness between tenants: per-tenant TTFT and rejections, flow control off and on.

Simulated replicas run in one process, and two gateways (flow control off, and on) in two
more, all in front of the same replicas; the load generator is this process. Three phases,
one after the other, each for ``--seconds``:

* tenant B alone through the flow-controlled gateway (the baseline B should keep);
* tenant A's bursts and tenant B's steady requests through the gateway without flow control;
* the same traffic (same seeds) through the gateway with flow control.

Tenant A is an agent fleet: ``--burst`` requests at once every ``--burst-every`` seconds,
more than the pool can take in that time. Tenant B is an interactive user: ``--b-rate``
requests a second. TTFT is client-side: request sent to first body byte of the stream (the
gateway answers once the replica produced its first token).

    python -m benchmarks.fairness [--seconds 15] [--replicas 4] [--max-num-seqs 4]
        [--mode tenants|priority] [--detector concurrency|utilization]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
import yaml

from benchmarks.workloads import words

HOST = "127.0.0.1"
MODEL = "sim-model"
FAIRNESS = "x-gateway-inference-fairness-id"
DROPPED = "x-gateway-request-dropped-reason"
OBJECTIVE = "x-gateway-inference-objective"
OBJECTIVES_CONFIG = {"name": "interactive", "priority": 10}


@dataclass(frozen=True, slots=True)
class Settings:
    seconds: float
    replicas: int
    max_num_seqs: int
    speed: float
    burst: int
    burst_every: float
    b_rate: float
    a_tokens: int
    b_tokens: int
    max_tokens: int
    max_queued: int
    ttl: float
    strategy: str
    seed: int
    # "priority": B is interactive (priority 10), A batch (0); "tenants": both priority 0.
    mode: str = "tenants"
    detector: str = "concurrency"


@dataclass(slots=True)
class Outcome:
    tenant: str
    status: int
    ttft: float | None  # seconds; None unless served
    reason: str | None = None  # x-gateway-request-dropped-reason of a rejection


# -- processes -----------------------------------------------------------------------------------


def free_ports(n: int) -> int:
    """The first of ``n`` consecutive free loopback ports."""
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(20000, 60000 - n)
        socks: list[socket.socket] = []
        try:
            for port in range(base, base + n):
                sock = socket.socket()
                socks.append(sock)
                sock.bind((HOST, port))
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise RuntimeError(f"no {n} consecutive free ports")


def wait_ready(url: str, proc: subprocess.Popen[bytes], seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"process for {url} exited with {proc.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=1).status_code == 200:
                return
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not become ready")


@contextlib.contextmanager
def process(args: list[str], ready_url: str, log: Path) -> Iterator[None]:
    # Output goes to a file: an unread pipe fills up and blocks the process writing to it.
    with log.open("wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
        try:
            wait_ready(ready_url, proc)
            yield
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)


def gateway_config(s: Settings, sim_urls: list[str], port: int, flow: bool) -> dict[str, Any]:
    flow_control: dict[str, Any] = {"enabled": False}
    if flow:
        # utilization: one request per engine slot, what vLLM would only queue is held here.
        # concurrency: the default detector, its limits learned.
        detector: dict[str, Any] = {"type": s.detector}
        if s.detector == "utilization":
            detector["inFlightThreshold"] = s.max_num_seqs
        flow_control = {
            "saturationDetector": detector,
            "maxRequests": s.max_queued,
            "defaultRequestTTL": s.ttl,
            "objectives": [OBJECTIVES_CONFIG],
        }
    return {
        "server": {"host": HOST, "port": port, "accessLog": False},
        "pool": {"endpoints": [{"url": u} for u in sim_urls]},
        "flowControl": flow_control,
        "strategy": s.strategy,
    }


# -- load ----------------------------------------------------------------------------------------


# Every request is cut off after this long, so a run stays bounded however overloaded.
REQUEST_LIMIT_SECONDS = 60.0


async def send(
    port: int, tenant: str, prompt: str, max_tokens: int, headers: str = ""
) -> Outcome:
    """One streamed completion on its own connection; TTFT is the first body byte.

    A bare HTTP/1.1 exchange on asyncio streams rather than an HTTP client library: under a
    burst of hundreds of streams a library's per-chunk cost stalls the load generator's own
    loop for seconds, and that stall would be measured as the gateway's TTFT.
    """
    body = orjson.dumps(
        {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": True}
    )
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {HOST}:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        f"{FAIRNESS}: {tenant}\r\n{headers}Connection: close\r\n\r\n"
    )
    started = time.perf_counter()
    writer: asyncio.StreamWriter | None = None
    try:
        async with asyncio.timeout(REQUEST_LIMIT_SECONDS):
            reader, writer = await asyncio.open_connection(HOST, port)
            writer.write(head.encode() + body)
            status, answer_headers = parse_head(await reader.readuntil(b"\r\n\r\n"))
            first = await reader.read(1)
            ttft = time.perf_counter() - started if first else None
            while await reader.read(65536):
                pass
    except TimeoutError:
        return Outcome(tenant, 0, None, "client-timeout")
    except (OSError, asyncio.IncompleteReadError, ValueError):
        return Outcome(tenant, 0, None, "client-error")
    finally:
        if writer is not None:
            writer.close()
    if status != 200:
        return Outcome(tenant, status, None, answer_headers.get(DROPPED))
    return Outcome(tenant, 200, ttft)


def parse_head(raw: bytes) -> tuple[int, dict[str, str]]:
    lines = raw.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if sep:
            headers[name.strip().lower()] = value.strip()
    return int(lines[0].split()[1]), headers


@dataclass(frozen=True, slots=True)
class Load:
    """One tenant's traffic: prompts of ``tokens`` (bursts: 0.5x-1.5x), answers of 1 to
    ``2 * max_tokens - 1`` tokens (varied, or whole batches would finish in lockstep)."""

    tenant: str
    seconds: float
    tokens: int
    max_tokens: int
    seed: int
    headers: str = ""


async def bursts(port: int, load: Load, size: int, every: float) -> list[Outcome]:
    """``size`` requests at once every ``every`` seconds."""
    rng = random.Random(load.seed)
    tasks: list[asyncio.Task[Outcome]] = []
    started = time.perf_counter()
    at = 0.0
    while at < load.seconds:
        await asyncio.sleep(max(0.0, started + at - time.perf_counter()))
        for _ in range(size):
            prompt = words(rng, rng.randint(load.tokens // 2, load.tokens * 3 // 2))
            max_tokens = rng.randint(1, 2 * load.max_tokens - 1)
            tasks.append(asyncio.create_task(
                send(port, load.tenant, prompt, max_tokens, load.headers)))
        at += every
    return list(await asyncio.gather(*tasks))


async def steady(port: int, load: Load, rate: float) -> list[Outcome]:
    """Poisson arrivals at ``rate`` requests a second."""
    rng = random.Random(load.seed)
    tasks: list[asyncio.Task[Outcome]] = []
    started = time.perf_counter()
    at = 0.0
    while at < load.seconds:
        await asyncio.sleep(max(0.0, started + at - time.perf_counter()))
        prompt = words(rng, load.tokens)
        max_tokens = rng.randint(1, 2 * load.max_tokens - 1)
        tasks.append(asyncio.create_task(
            send(port, load.tenant, prompt, max_tokens, load.headers)))
        at += rng.expovariate(rate)
    return list(await asyncio.gather(*tasks))


async def tenant_a(port: int, s: Settings) -> list[Outcome]:
    load = Load("A", s.seconds, s.a_tokens, s.max_tokens, s.seed)
    return await bursts(port, load, s.burst, s.burst_every)


async def tenant_b(port: int, s: Settings) -> list[Outcome]:
    headers = f"{OBJECTIVE}: interactive\r\n" if s.mode == "priority" else ""
    return await steady(port, Load("B", s.seconds, s.b_tokens, s.max_tokens, s.seed + 1, headers),
                        s.b_rate)


async def phase(port: int, s: Settings, with_a: bool) -> list[Outcome]:
    loads = [tenant_b(port, s)]
    if with_a:
        loads.append(tenant_a(port, s))
    results = await asyncio.gather(*loads)
    return [o for outcomes in results for o in outcomes]


# -- report --------------------------------------------------------------------------------------


def percentile(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))]


def cells(outcomes: list[Outcome], tenant: str) -> list[str]:
    mine = [o for o in outcomes if o.tenant == tenant]
    ttfts = [o.ttft for o in mine if o.ttft is not None]
    rejected = sum(1 for o in mine if o.status == 429)
    other = sum(1 for o in mine if o.status not in (200, 429))
    ms = [f"{percentile(ttfts, p) * 1000:,.0f}" for p in (50, 90)]
    errors = f" ({other} errors)" if other else ""
    return [str(len(mine)), *ms, f"{rejected}{errors}"]


def table(alone: list[Outcome], off: list[Outcome], on: list[Outcome]) -> str:
    lines = [
        "| tenant | off: requests | off: TTFT p50 ms | off: TTFT p90 ms | off: 429 "
        "| on: requests | on: TTFT p50 ms | on: TTFT p90 ms | on: 429 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for label, tenant in (("A (bursts)", "A"), ("B (steady)", "B")):
        lines.append("| " + " | ".join([label, *cells(off, tenant), *cells(on, tenant)]) + " |")
    dash = ["-"] * 4
    lines.append("| " + " | ".join(["B alone", *dash, *cells(alone, "B")]) + " |")
    return "\n".join(lines)


def reasons(outcomes: list[Outcome]) -> str:
    counts: dict[str, int] = {}
    for o in outcomes:
        if o.reason:
            counts[o.reason] = counts.get(o.reason, 0) + 1
    return ", ".join(f"{k}: {v}" for k, v in sorted(counts.items())) or "none"


# -- main ----------------------------------------------------------------------------------------


async def run_phases(off_port: int, on_port: int, s: Settings) -> None:
    print(f"phase 1/3: B alone, {s.seconds:.0f} s", file=sys.stderr, flush=True)
    alone = await phase(on_port, s, with_a=False)
    print("phase 2/3: A + B, flow control off", file=sys.stderr, flush=True)
    off = await phase(off_port, s, with_a=True)
    print("phase 3/3: A + B, flow control on", file=sys.stderr, flush=True)
    on = await phase(on_port, s, with_a=True)
    print(table(alone, off, on))
    print(f"\nrejection reasons, on: {reasons(on)}; off: {reasons(off)}")


def settings(argv: list[str] | None) -> Settings:
    parser = argparse.ArgumentParser(description=__doc__)
    add = parser.add_argument
    add("--seconds", type=float, default=15.0, help="length of each of the three phases")
    add("--replicas", type=int, default=4)
    add("--max-num-seqs", type=int, default=4, help="engine slots per replica")
    add("--speed", type=float, default=1.0, help="simulator speed-up")
    add("--burst", type=int, default=120, help="tenant A's requests per burst")
    add("--burst-every", type=float, default=5.0, help="seconds between A's bursts")
    add("--b-rate", type=float, default=2.0, help="tenant B's requests per second")
    add("--a-tokens", type=int, default=600, help="A's mean prompt tokens")
    add("--b-tokens", type=int, default=600, help="B's prompt tokens")
    add("--max-tokens", type=int, default=16, help="mean output tokens (1 to 2x-1)")
    add("--max-queued", type=int, default=200, help="flowControl.maxRequests (on)")
    add("--ttl", type=float, default=5.0, help="flowControl.defaultRequestTTL (on)")
    add("--strategy", default="default", help="the gateways' routing strategy")
    add("--seed", type=int, default=0)
    add("--mode", choices=["tenants", "priority"], default="tenants",
        help="priority: B's requests carry the objective 'interactive' (priority 10)")
    add("--detector", choices=["concurrency", "utilization"], default="concurrency",
        help="flowControl.saturationDetector.type of the gateway with flow control")
    a = parser.parse_args(argv)
    return Settings(
        a.seconds, a.replicas, a.max_num_seqs, a.speed, a.burst, a.burst_every, a.b_rate,
        a.a_tokens, a.b_tokens, a.max_tokens, a.max_queued, a.ttl, a.strategy, a.seed,
        a.mode, a.detector,
    )  # fmt: skip


def start_sims(
    stack: contextlib.ExitStack, work: Path, replicas: int, max_num_seqs: int, speed: float
) -> list[str]:
    """Simulated replicas in one process of their own, until ``stack`` closes; their urls."""
    base = free_ports(replicas)
    urls = [f"http://{HOST}:{base + i}" for i in range(replicas)]
    sim = [sys.executable, "-m", "router.cli", "sim", "--replicas", str(replicas),
           "--base-port", str(base), "--host", HOST, "--max-num-seqs", str(max_num_seqs),
           "--speed", str(speed), "--log-level", "warning"]  # fmt: skip
    stack.enter_context(process(sim, f"{urls[-1]}/health", work / "sim.log"))
    return urls


def start_gateway(
    stack: contextlib.ExitStack, work: Path, name: str, config: Callable[[int], dict[str, Any]]
) -> int:
    """A gateway in its own process from ``config(port)``, until ``stack`` closes; its port."""
    port = free_ports(1)
    path = work / f"gateway-{name}.yaml"
    path.write_text(yaml.safe_dump(config(port)))
    gateway = [sys.executable, "-m", "router.cli", "serve", "--config", str(path),
               "--log-level", "warning"]  # fmt: skip
    stack.enter_context(process(gateway, f"http://{HOST}:{port}/ready", work / f"{name}.log"))
    return port


def main(argv: list[str] | None = None) -> int:
    s = settings(argv)
    with tempfile.TemporaryDirectory(prefix="fairness-") as tmp, contextlib.ExitStack() as stack:
        work = Path(tmp)
        urls = start_sims(stack, work, s.replicas, s.max_num_seqs, s.speed)
        off = start_gateway(stack, work, "off", lambda port: gateway_config(s, urls, port, False))
        on = start_gateway(stack, work, "on", lambda port: gateway_config(s, urls, port, True))
        asyncio.run(run_phases(off, on, s))
    return 0


if __name__ == "__main__":
    sys.exit(main())
