"""Soak: minutes of mixed load through the gateway while its resident memory is sampled.

Starts simulated replicas and a gateway, each in its own process, then runs a closed-loop mix
for ``--minutes``: multi-turn conversations that keep being replaced by new ones (new sessions,
new prefixes: unbounded structures would grow), shared system prompts, streaming and not, chat
and completions, several tenants, clients that leave mid-stream, and malformed requests. The
gateway's RSS is read from /proc every few seconds. After the warm-up, growth beyond the bound
fails the run (exit 1). ``--minutes 10`` is the full run; CI-sized runs are a minute or two.

    python -m benchmarks.soak --minutes 10
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from benchmarks.overhead import HOST, free_port, process
from benchmarks.workloads import words

MODEL = "sim-model"
SYSTEM_PROMPTS = 8
ACTIVE_CONVERSATIONS = 400
TURNS_PER_CONVERSATION = 6


def rss_mb(pid: int) -> float:
    """Resident set size of ``pid`` in MiB (Linux /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


@dataclass
class Conversation:
    session: str
    tenant: str
    messages: list[dict[str, str]]
    turns: int = 0


@dataclass
class Tally:
    outcomes: Counter[str] = field(default_factory=Counter)
    samples: list[tuple[float, float]] = field(default_factory=list)  # (seconds, MiB)


class Mix:
    """Chooses and sends the next request; conversations are replaced once they are done."""

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng
        self._systems = [words(rng, 400 + 200 * i) for i in range(SYSTEM_PROMPTS)]
        self._next_id = 0
        self._conversations = [self._new() for _ in range(ACTIVE_CONVERSATIONS)]

    def _new(self) -> Conversation:
        self._next_id += 1
        system = self._rng.choice(self._systems)
        tenant = f"tenant-{self._rng.randrange(6)}"
        messages = [{"role": "system", "content": system}]
        return Conversation(f"soak-{self._next_id}", tenant, messages)

    async def send(self, http: httpx.AsyncClient) -> str:
        roll = self._rng.random()
        if roll < 0.04:
            return await self._bad(http)
        if roll < 0.14:
            return await self._completion(http)
        return await self._turn(http, leave_early=roll < 0.22)

    async def _bad(self, http: httpx.AsyncClient) -> str:
        body: Any = self._rng.choice(
            [b"{not json", b'{"model": "nope", "messages": [{"role": "user"}]}', b"\xff\xfe"]
        )
        resp = await http.post("/v1/chat/completions", content=body)
        if 400 <= resp.status_code < 500:
            return "rejected-as-expected"
        return f"bad-{resp.status_code}"

    async def _completion(self, http: httpx.AsyncClient) -> str:
        body = {"model": MODEL, "prompt": words(self._rng, self._rng.randrange(50, 4000)),
                "max_tokens": self._rng.randrange(1, 40)}
        resp = await http.post("/v1/completions", json=body)
        return "ok" if resp.status_code == 200 else f"error-{resp.status_code}"

    async def _turn(self, http: httpx.AsyncClient, leave_early: bool) -> str:
        i = self._rng.randrange(len(self._conversations))
        conv = self._conversations[i]
        conv.messages.append({"role": "user", "content": words(self._rng, 30 + 200 * conv.turns)})
        stream = leave_early or self._rng.random() < 0.6
        body = {"model": MODEL, "messages": conv.messages, "stream": stream,
                "max_tokens": self._rng.randrange(8, 120)}
        headers = {"x-session-id": conv.session, "x-gateway-inference-fairness-id": conv.tenant}
        conv.turns += 1
        if conv.turns >= TURNS_PER_CONVERSATION:
            self._conversations[i] = self._new()
        if not stream:
            resp = await http.post("/v1/chat/completions", json=body, headers=headers)
            if resp.status_code != 200:
                return f"error-{resp.status_code}"
            answer = resp.json()["choices"][0]["message"]["content"]
            conv.messages.append({"role": "assistant", "content": answer})
            return "ok"
        async with http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
            if r.status_code != 200:
                return f"error-{r.status_code}"
            text = b""
            async for chunk in r.aiter_bytes():
                text += chunk
                if leave_early:
                    return "left-mid-stream"
        if b'"error"' in text or not text.rstrip().endswith(b"[DONE]"):
            return "stream-error"
        conv.messages.append({"role": "assistant", "content": "(streamed answer)"})
        return "ok"


async def _worker(mix: Mix, http: httpx.AsyncClient, deadline: float, tally: Tally) -> None:
    while time.monotonic() < deadline:
        try:
            async with asyncio.timeout(60):
                outcome = await mix.send(http)
        except TimeoutError:
            outcome = "hung"
        except httpx.HTTPError as exc:
            outcome = f"transport-{type(exc).__name__}"
        tally.outcomes[outcome] += 1


async def _sampler(pid: int, started: float, deadline: float, every: float, tally: Tally) -> None:
    while time.monotonic() < deadline:
        tally.samples.append((time.monotonic() - started, rss_mb(pid)))
        await asyncio.sleep(every)
    tally.samples.append((time.monotonic() - started, rss_mb(pid)))


async def soak(url: str, pid: int, args: argparse.Namespace) -> Tally:
    tally = Tally()
    started = time.monotonic()
    deadline = started + args.minutes * 60
    limits = httpx.Limits(max_connections=args.concurrency * 2)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as http:
        mix = Mix(random.Random(args.seed))
        await asyncio.gather(
            _sampler(pid, started, deadline, args.sample_seconds, tally),
            *(_worker(mix, http, deadline, tally) for _ in range(args.concurrency)),
        )
    return tally


def report(tally: Tally, args: argparse.Namespace) -> bool:
    samples = tally.samples
    warmup = args.warmup_seconds
    after = [mb for t, mb in samples if t >= warmup] or [samples[-1][1]]
    head, tail = after[:3], after[-3:]
    at_warm, at_end = statistics.median(head), statistics.median(tail)
    growth = at_end - at_warm
    sent = sum(tally.outcomes.values())
    unexpected = {k: v for k, v in tally.outcomes.items()
                  if k not in ("ok", "left-mid-stream", "rejected-as-expected")}
    print(f"duration: {args.minutes:g} min, concurrency {args.concurrency}, "
          f"warm-up {warmup:g} s, {len(samples)} RSS samples")
    print(f"requests: {sent} sent ({sent / (args.minutes * 60):.0f}/s); "
          + ", ".join(f"{k} {v}" for k, v in sorted(tally.outcomes.items())))
    print(f"RSS: start {samples[0][1]:.1f} MiB, after warm-up {at_warm:.1f} MiB, "
          f"end {at_end:.1f} MiB, max {max(mb for _, mb in samples):.1f} MiB; "
          f"growth after warm-up {growth:+.1f} MiB (bound {args.max_growth_mb:g} MiB)")
    ok = growth <= args.max_growth_mb and not unexpected
    if unexpected:
        print(f"FAIL: unexpected outcomes {unexpected}")
    if growth > args.max_growth_mb:
        print("FAIL: memory grew past the bound after warm-up")
    print("PASS" if ok else "FAIL")
    return ok


def _gateway_config(sim_base: int, replicas: int, port: int) -> dict[str, Any]:
    return {
        "server": {"host": HOST, "port": port, "accessLog": False},
        "pool": {"endpoints": [{"url": f"http://{HOST}:{sim_base + i}"} for i in range(replicas)]},
        # Sessions expire within the warm-up, so the affinity table reaches its steady size.
        "sessionAffinity": {"ttlSeconds": 30},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--speed", type=float, default=20.0, help="simulator speed-up")
    parser.add_argument("--warmup-seconds", type=float, default=None,
                        help="default: a fifth of the run, at most 60 s")
    parser.add_argument("--sample-seconds", type=float, default=2.0)
    parser.add_argument("--max-growth-mb", type=float, default=32.0)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args(argv)
    if args.warmup_seconds is None:
        args.warmup_seconds = min(60.0, args.minutes * 60 / 5)
    sim_base = free_port()  # the replicas take it and the ports right after it
    gw_port = free_port()
    exe = [sys.executable, "-m", "router.cli"]
    sim = [*exe, "sim", "--replicas", str(args.replicas), "--base-port", str(sim_base),
           "--host", HOST, "--speed", str(args.speed), "--log-level", "warning"]
    with tempfile.TemporaryDirectory() as tmp:
        config_path = Path(tmp) / "soak.yaml"
        config_path.write_text(yaml.safe_dump(_gateway_config(sim_base, args.replicas, gw_port)))
        gateway = [*exe, "serve", "--config", str(config_path), "--log-level", "warning"]
        ready = [f"http://{HOST}:{sim_base + i}/health" for i in range(args.replicas)]
        with process(sim, ready[-1]), process(gateway, f"http://{HOST}:{gw_port}/ready") as gw:
            tally = asyncio.run(soak(f"http://{HOST}:{gw_port}", gw.pid, args))
            with contextlib.suppress(Exception):
                stats = httpx.get(f"http://{HOST}:{gw_port}/metrics", timeout=5).text
                lines = stats.splitlines()
                retries = [ln for ln in lines if ln.startswith("prefixgate_retries_total")]
                print("gateway:", "; ".join(retries) or "no retries")
    return 0 if report(tally, args) else 1


if __name__ == "__main__":
    sys.exit(main())
