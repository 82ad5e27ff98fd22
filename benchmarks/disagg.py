"""Aggregated vs disaggregated prefill/decode on 4 simulated replicas, side by side (issue 5).

The same seeded workload runs twice: against 4 replicas in one aggregated pool, then against 2
prefill + 2 decode replicas with disaggregation on (two-step). It mixes

- decode-heavy turns: closed-loop chat sessions whose short turns extend a cached context and
  ask for hundreds of tokens, streamed;
- long uncached prompts: Poisson arrivals of fresh prompts of thousands of tokens (a new agent
  session, a sub-agent start), asking for a few tokens.

In the aggregated pool every long prefill runs in the decode batches of a replica, and the
simulator (like vLLM's chunked prefill) stretches each step that carries a prefill chunk for
every stream decoding in it; behind that chunk, new turns also wait for their first token.

Each part (simulator, gateway, this load generator) runs in its own process. Times are measured
by the client in wall seconds and reported in simulated milliseconds (times ``--speed``), so
they read like a GPU's. ITL is per request, as GuideLLM defines it (vLLM calls it TPOT): the
mean gap between a request's streamed tokens; its p50/p90 are over the decode-heavy requests.
Per-token gaps measured by the client carry the load generator's own scheduling jitter (times
the speed-up), so the stalls are counted by the replicas instead, in simulated time, from their
``vllm:inter_token_latency_seconds`` histograms: gaps over 200 ms per thousand tokens. A long
prefill stretches only one step in a few hundred, but by ~100 decode steps, so its cost shows
in each stream's mean and in that count, hardly in the per-token median or p90.

    python -m benchmarks.disagg [--seconds 60] [--speed 4] [--long-rate 0.15 0.3]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import random
import socket
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import yaml
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.overhead import HOST, free_port, process
from benchmarks.workloads import words

MODEL = "sim-model"
# A gap over 200 ms: a decode step stretched by a prefill chunk of ~800 tokens or more.
STALL_LE = "0.2"
SETUPS = ("aggregated", "disaggregated")


@dataclass(frozen=True, slots=True)
class Settings:
    seconds: float = 60.0
    speed: float = 4.0
    seed: int = 7
    sessions: int = 24
    turn_tokens: int = 40
    answer_tokens: int = 256
    turns_per_session: int = 8
    think_seconds: float = 1.0
    long_rate: float = 0.25
    long_tokens: tuple[int, int] = (8_000, 24_000)
    long_answer_tokens: int = 16
    threshold: int | None = None
    max_num_batched_tokens: int = 8192


@dataclass(slots=True)
class Record:
    kind: str
    ok: bool
    ttft: float = 0.0
    gaps: list[float] = field(default_factory=list)


@dataclass(slots=True)
class Run:
    settings: Settings
    records: list[Record] = field(default_factory=list)

    def of(self, kind: str) -> list[Record]:
        return [r for r in self.records if r.kind == kind and r.ok]


# -- load ----------------------------------------------------------------------------------------


async def stream(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any], kind: str
) -> tuple[Record, str]:
    """One streamed request; the record (in wall seconds) and the text it produced."""
    started = time.perf_counter()
    record, times, text = Record(kind, False), [], []
    try:
        async with http.post(url, data=orjson.dumps(body)) as resp:
            if resp.status != 200:
                await resp.read()
                return record, ""
            async for line in resp.content:
                if not line.startswith(b"data: {"):
                    continue
                choices = orjson.loads(line[6:]).get("choices") or [{}]
                piece = choices[0].get("text") or (choices[0].get("delta") or {}).get("content")
                if piece:
                    times.append(time.perf_counter())
                    text.append(piece)
    except (aiohttp.ClientError, TimeoutError):
        return record, ""
    if times:
        record.ok, record.ttft = True, times[0] - started
        record.gaps = [b - a for a, b in itertools.pairwise(times)]
    return record, "".join(text)


async def session_loop(
    http: aiohttp.ClientSession, base: str, s: Settings, index: int, deadline: float, run: Run
) -> None:
    """Decode-heavy turns: short messages on a growing, cached context, long answers."""
    rng = random.Random(s.seed * 1000 + index)
    await asyncio.sleep(rng.random() * s.think_seconds / s.speed)
    while time.perf_counter() < deadline:
        messages = [{"role": "system", "content": words(rng, 300)}]
        for _ in range(s.turns_per_session):
            if time.perf_counter() >= deadline:
                return
            messages.append({"role": "user", "content": words(rng, s.turn_tokens)})
            body = {"model": MODEL, "messages": messages, "max_tokens": s.answer_tokens,
                    "stream": True}
            record, answer = await stream(http, f"{base}/v1/chat/completions", body, "decode")
            run.records.append(record)
            messages.append({"role": "assistant", "content": answer})
            await asyncio.sleep(rng.expovariate(1 / s.think_seconds) / s.speed)


async def long_arrivals(
    http: aiohttp.ClientSession, base: str, s: Settings, deadline: float, run: Run
) -> None:
    """Fresh long prompts, Poisson arrivals (rate in simulated seconds)."""
    rng = random.Random(s.seed)
    tasks: list[asyncio.Task[None]] = []

    async def one(prompt: str) -> None:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": s.long_answer_tokens,
                "stream": True}
        record, _ = await stream(http, f"{base}/v1/completions", body, "long")
        run.records.append(record)

    while True:
        await asyncio.sleep(rng.expovariate(s.long_rate) / s.speed)
        if time.perf_counter() >= deadline:
            break
        tokens = rng.randint(*s.long_tokens)
        tasks.append(asyncio.create_task(one(words(rng, tokens))))
    await asyncio.gather(*tasks)


async def drive(base: str, s: Settings) -> Run:
    run = Run(s)
    deadline = time.perf_counter() + s.seconds / s.speed
    timeout = aiohttp.ClientTimeout(total=max(120.0, 4 * s.seconds / s.speed))
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
        await asyncio.gather(
            long_arrivals(http, base, s, deadline, run),
            *(session_loop(http, base, s, i, deadline, run) for i in range(s.sessions)),
        )
    return run


# -- processes -----------------------------------------------------------------------------------


def free_ports(n: int) -> int:
    """The first of ``n`` consecutive free loopback ports."""
    for _ in range(50):
        base = free_port()
        try:
            with contextlib.ExitStack() as stack:
                for port in range(base, base + n):
                    sock = stack.enter_context(socket.socket())
                    sock.bind((HOST, port))
            return base
        except OSError:
            continue
    raise RuntimeError(f"no {n} consecutive free ports")


def gateway_config(setup: str, urls: Sequence[str], s: Settings, port: int) -> dict[str, Any]:
    roles = ["prefill", "prefill", "decode", "decode"] if setup == "disaggregated" else None
    pd: dict[str, Any] = {"enabled": setup == "disaggregated"}
    if s.threshold is not None:
        pd["nonCachedTokens"] = s.threshold
    return {
        "server": {"host": HOST, "port": port, "accessLog": False},
        "pool": {
            "endpoints": [
                {"url": u, "role": roles[i] if roles else "both"} for i, u in enumerate(urls)
            ],
            "metricsScrape": {"intervalSeconds": 0.05},
        },
        "disaggregation": pd,
        "seed": s.seed,
    }


@contextlib.contextmanager
def fleet(setup: str, s: Settings) -> Iterator[tuple[str, list[str]]]:
    """Fresh simulated replicas and a gateway for one setup: the gateway's URL, all metrics
    URLs (the gateway's first)."""
    sim_base, gw_port = free_ports(4), free_port()
    exe = [sys.executable, "-m", "router.cli"]
    sim = [*exe, "sim", "--replicas", "4", "--base-port", str(sim_base), "--host", HOST,
           "--speed", str(s.speed), "--max-num-batched-tokens", str(s.max_num_batched_tokens),
           "--log-level", "warning"]
    urls = [f"http://{HOST}:{sim_base + i}" for i in range(4)]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "gateway.yaml"
        path.write_text(yaml.safe_dump(gateway_config(setup, urls, s, gw_port)))
        gateway = [*exe, "serve", "--config", str(path), "--log-level", "warning"]
        with process(sim, f"{urls[-1]}/health"), process(
            gateway, f"http://{HOST}:{gw_port}/ready"
        ):
            gw = f"http://{HOST}:{gw_port}"
            yield gw, [f"{u}/metrics" for u in (gw, *urls)]


_COUNTED = ("prefixgate_disagg_decision_total", "prefixgate_disagg_fallbacks_total")
_ITL = "vllm:inter_token_latency_seconds"


async def scrape(urls: Sequence[str]) -> dict[str, float]:
    """The gateway's disaggregation counters, and the replicas' inter-token gaps summed:
    ``tokens`` in all, ``stalled`` of them after a gap over STALL_LE seconds (simulated)."""
    out = {"tokens": 0.0, "stalled": 0.0}
    async with aiohttp.ClientSession() as http:
        for url in urls:
            async with http.get(url) as resp:
                text = await resp.text()
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    if sample.name.startswith(_COUNTED):
                        out[",".join(sample.labels.values())] = sample.value
                    elif sample.name == f"{_ITL}_count":
                        out["tokens"] += sample.value
                    elif sample.name == f"{_ITL}_bucket" and sample.labels["le"] == STALL_LE:
                        out["stalled"] -= sample.value
                    elif sample.name == f"{_ITL}_bucket" and sample.labels["le"] == "+Inf":
                        out["stalled"] += sample.value
    return out


# -- report --------------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def summary(run: Run, scraped: dict[str, float]) -> dict[str, float]:
    ms = run.settings.speed * 1000  # wall seconds -> simulated milliseconds
    decode, long = run.of("decode"), run.of("long")
    itls = [sum(r.gaps) / len(r.gaps) for r in decode if r.gaps]
    return {
        "decode_requests": len(decode),
        "decode_ttft_p50": percentile([r.ttft for r in decode], 50) * ms,
        "decode_ttft_p90": percentile([r.ttft for r in decode], 90) * ms,
        "itl_p50": percentile(itls, 50) * ms,
        "itl_p90": percentile(itls, 90) * ms,
        "stalled": 1000 * scraped["stalled"] / max(1.0, scraped["tokens"]),
        "long_requests": len(long),
        "long_ttft_p50": percentile([r.ttft for r in long], 50) * ms,
        "long_ttft_p90": percentile([r.ttft for r in long], 90) * ms,
        "errors": sum(1 for r in run.records if not r.ok),
    }


COLUMNS = [
    ("decode_requests", "decode-heavy reqs", "{:.0f}"),
    ("decode_ttft_p50", "TTFT p50 ms", "{:.0f}"),
    ("decode_ttft_p90", "TTFT p90 ms", "{:.0f}"),
    ("itl_p50", "ITL p50 ms", "{:.1f}"),
    ("itl_p90", "ITL p90 ms", "{:.1f}"),
    ("stalled", "gaps > 200 ms per 1k tokens", "{:.1f}"),
    ("long_requests", "long reqs", "{:.0f}"),
    ("long_ttft_p50", "long TTFT p50 ms", "{:.0f}"),
    ("long_ttft_p90", "long TTFT p90 ms", "{:.0f}"),
    ("errors", "errors", "{:.0f}"),
]


def table(rows: dict[tuple[float, str], dict[str, float]]) -> str:
    lines = ["| long prompts/s | setup | " + " | ".join(t for _, t, _ in COLUMNS) + " |",
             "|---" * (len(COLUMNS) + 2) + "|"]
    for (rate, setup), row in rows.items():
        cells = [fmt.format(row[key]) for key, _, fmt in COLUMNS]
        lines.append(f"| {rate:g} | {setup} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> list[Settings]:
    d = Settings()
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--seconds", type=float, default=d.seconds, help="simulated seconds of arrivals")
    add("--speed", type=float, default=d.speed, help="simulator speed-up")
    add("--seed", type=int, default=d.seed)
    add("--sessions", type=int, default=d.sessions, help="concurrent decode-heavy sessions")
    add("--answer-tokens", type=int, default=d.answer_tokens)
    add("--long-rate", type=float, nargs="+", default=[0.15, 0.3],
        help="long prompts per simulated second: one load level each")
    add("--long-tokens", type=int, nargs=2, default=d.long_tokens, metavar=("MIN", "MAX"))
    add("--threshold", type=int, default=None, help="nonCachedTokens (default: the gateway's)")
    add("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens)
    a = parser.parse_args(argv)
    return [
        Settings(
            seconds=a.seconds, speed=a.speed, seed=a.seed, sessions=a.sessions,
            answer_tokens=a.answer_tokens, long_rate=rate,
            long_tokens=(a.long_tokens[0], a.long_tokens[1]), threshold=a.threshold,
            max_num_batched_tokens=a.max_num_batched_tokens,
        )
        for rate in a.long_rate
    ]


def main(argv: list[str] | None = None) -> int:
    rows: dict[tuple[float, str], dict[str, float]] = {}
    for s in parse_args(argv):
        for setup in SETUPS:
            with fleet(setup, s) as (url, metrics_urls):
                run = asyncio.run(drive(url, s))
                scraped = asyncio.run(scrape(metrics_urls))
            rows[s.long_rate, setup] = summary(run, scraped)
            found = ", ".join(f"{k} {v:.0f}" for k, v in sorted(scraped.items()))
            print(f"{s.long_rate:g}/s {setup}: {found}", file=sys.stderr)
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
