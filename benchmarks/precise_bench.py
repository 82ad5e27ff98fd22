"""Approximate vs precise prefix routing, side by side on one fleet, with prediction accuracy.

    python -m benchmarks.precise_bench --replicas 8 --num-gpu-blocks 1024 --sessions 32

Simulated replicas (their own process, KV events on) serve an agentic workload
(benchmarks.workloads.agentic_sessions) through an in-process gateway, once per strategy, caches
reset in between. Per strategy: client-side TTFT, the cached share of prompt tokens, the share of
the available reuse captured (benchmarks.reuse: "one infinite cache"), and for both indexes the
share of requests whose cached tokens were predicted within one block (router.api.prediction; the
precise index is tracked in both runs, so each run reports both).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from benchmarks.reuse import ReuseTracker
from benchmarks.sim.tokenizer import Tokenizer
from benchmarks.workloads import Conversation, Step, SubAgent, Workload, agentic_sessions
from router.app import Gateway
from router.config.model import parse_config
from router.serve.server import running_gateway

MODEL = "sim-model"
Message = dict[str, Any]


@dataclass
class Record:
    ttft: float
    prompt_tokens: int
    cached_tokens: int
    messages: list[Message]
    tools: list[Message]
    answer: str


@dataclass
class Run:
    strategy: str
    records: list[Record] = field(default_factory=list)
    errors: int = 0
    wall_s: float = 0.0


class Client:
    """Streams chat requests through the gateway; reports each usage to its prediction."""

    def __init__(
        self, url: str, gateway: Gateway, http: aiohttp.ClientSession, speed: float
    ) -> None:
        self.url, self.gateway, self.http, self.speed = url, gateway, http, speed
        self.run = Run("")

    async def chat(self, conv: Conversation, messages: list[Message], max_tokens: int) -> str:
        rid = uuid.uuid4().hex
        body = {"model": MODEL, "messages": messages, "tools": list(conv.tools) or None,
                "max_tokens": max_tokens, "stream": True,
                "stream_options": {"include_usage": True}}
        headers = {"x-request-id": rid, "x-session-id": conv.session_id}
        started = time.perf_counter()
        ttft, parts, usage = 0.0, [], None
        async with self.http.post(self.url + "/v1/chat/completions", json=body,
                                  headers=headers) as resp:
            if resp.status != 200:
                self.run.errors += 1
                await resp.read()
                return ""
            async for line in resp.content:
                if not line.startswith(b"data: {"):
                    continue
                chunk = orjson.loads(line[6:])
                for choice in chunk.get("choices") or ():
                    if choice["delta"].get("content"):
                        ttft = ttft or time.perf_counter() - started
                        parts.append(choice["delta"]["content"])
                usage = chunk.get("usage") or usage
        # The gateway compares each index's prediction with this usage itself (UsageTap).
        answer = "".join(parts)
        details = (usage or {}).get("prompt_tokens_details") or {}
        self.run.records.append(Record(
            ttft * self.speed, (usage or {}).get("prompt_tokens", 0),
            details.get("cached_tokens", 0), list(messages), list(conv.tools), answer,
        ))
        return answer

    async def think(self, step: Step) -> None:
        if step.think_s:
            await asyncio.sleep(step.think_s / self.speed)

    async def sub_agent(self, conv: Conversation, parent: list[Message], agent: SubAgent) -> None:
        messages = list(parent)
        for step in agent.steps:
            await self.think(step)
            messages.append({"role": "user", "content": step.content})
            answer = await self.chat(conv, messages, step.max_tokens)
            messages.append({"role": "assistant", "content": answer})

    async def conversation(self, conv: Conversation) -> None:
        system = {"role": "system", "content": conv.system}
        messages: list[Message] = [system]
        for step in conv.steps:
            await self.think(step)
            if step.reset:
                messages = [system, {"role": "user", "content": step.reset}]
            messages.append({"role": "user", "content": step.content})
            if step.burst:
                await asyncio.gather(*(self.sub_agent(conv, messages, a) for a in step.burst))
            answer = await self.chat(conv, messages, step.max_tokens)
            messages.append({"role": "assistant", "content": answer})


async def drive(client: Client, workload: Workload) -> None:
    gate = asyncio.Semaphore(workload.concurrency)

    async def one(conv: Conversation) -> None:
        async with gate:
            await client.conversation(conv)

    await asyncio.gather(*(one(c) for c in workload.conversations))


def summarize(run: Run, gateway: Gateway) -> dict[str, Any]:
    tok = Tokenizer()
    reuse = ReuseTracker(16)
    for r in run.records:  # completion order is close enough to arrival order for the ledger
        reuse.observe(tok.encode_chat(r.messages, r.tools or None), tok.encode(r.answer))
    ttfts = sorted(r.ttft for r in run.records)
    prompt = sum(r.prompt_tokens for r in run.records)
    cached = sum(r.cached_tokens for r in run.records)

    def pct(q: float) -> float:
        return ttfts[min(len(ttfts) - 1, int(q * len(ttfts)))] if ttfts else 0.0

    out: dict[str, Any] = {
        "strategy": run.strategy, "requests": len(run.records), "errors": run.errors,
        "ttft_p50_s": pct(0.5), "ttft_p90_s": pct(0.9), "cached_ratio": cached / max(prompt, 1),
        "reuse_captured": cached / max(reuse.reusable_tokens, 1),
        "reusable_fraction": reuse.reusable_fraction, "wall_s": run.wall_s,
    }
    for mode, s in gateway.prediction.summary.items():
        out[f"{mode}_within_one_block"] = s.as_dict()["within_one_block_ratio"]
        out[f"{mode}_predictions"] = s.count
        out[f"{mode}_over"], out[f"{mode}_under"] = s.over, s.under
    out["prediction_skipped"] = dict(gateway.prediction.skips)
    return out


async def wait_healthy(http: aiohttp.ClientSession, urls: list[str]) -> None:
    async with asyncio.timeout(30):
        for url in urls:
            while True:
                with contextlib.suppress(aiohttp.ClientError):
                    async with http.get(url + "/health") as resp:
                        if resp.status == 200:
                            break
                await asyncio.sleep(0.1)


async def reset(http: aiohttp.ClientSession, urls: list[str]) -> None:
    for url in urls:
        async with http.post(url + "/reset_prefix_cache") as resp:
            await resp.read()


def gateway_config(args: argparse.Namespace, urls: list[str], strategy: str) -> Any:
    return parse_config({
        "server": {"port": 0},
        "pool": {"endpoints": [{"url": u} for u in urls],
                 "metricsScrape": {"intervalSeconds": 0.05}},
        "strategy": strategy,
        "seed": 1,
        "precisePrefix": {
            "enabled": True,
            "tokenizer": {"type": "sim"},
            "kvEvents": {"portOffset": args.kv_events_port - args.base_port,
                         "replayPortOffset": args.kv_events_port + 100 - args.base_port},
        },
    })


async def main_async(args: argparse.Namespace) -> list[dict[str, Any]]:
    urls = [f"http://127.0.0.1:{args.base_port + i}" for i in range(args.replicas)]
    sim = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "benchmarks.sim", "--replicas", str(args.replicas),
        "--base-port", str(args.base_port), "--kv-events-port", str(args.kv_events_port),
        "--kv-events-replay-port", str(args.kv_events_port + 100),
        "--num-gpu-blocks", str(args.num_gpu_blocks), "--speed", str(args.speed),
        "--max-num-batched-tokens", "4096",
    )
    workload = agentic_sessions(sessions=args.sessions, turns=args.turns,
                                concurrency=args.concurrency, seed=args.seed)
    results = []
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
            await wait_healthy(http, urls)
            for strategy in args.strategies.split(","):
                async with running_gateway(gateway_config(args, urls, strategy)) as gw:
                    # Caches are reset once the gateway listens: it sees them cleared, as a
                    # gateway that has been running does. (One that joins mid-stream cannot
                    # replay a long history and distrusts the stream for resyncSeconds.)
                    await asyncio.sleep(0.5)
                    await reset(http, urls)
                    await asyncio.sleep(0.2)
                    client = Client(gw.url, gw.gateway, http, args.speed)
                    client.run.strategy = strategy
                    started = time.perf_counter()
                    async with asyncio.timeout(args.deadline):
                        await drive(client, workload)
                    client.run.wall_s = time.perf_counter() - started
                    results.append(summarize(client.run, gw.gateway))
                    print(results[-1], file=sys.stderr)
    finally:
        sim.terminate()
        await sim.wait()
    return results


def table(results: list[dict[str, Any]]) -> str:
    cols = ["strategy", "requests", "errors", "ttft_p50_s", "ttft_p90_s", "cached_ratio",
            "reuse_captured", "approximate_within_one_block", "precise_within_one_block",
            "precise_confirmed_within_one_block"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in results:
        cells = [f"{r[c]:.3f}" if isinstance(r[c], float) else str(r[c]) for c in cols]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="benchmarks.precise_bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=int, default=8)
    p.add_argument("--num-gpu-blocks", type=int, default=1024)
    p.add_argument("--sessions", type=int, default=32)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--speed", type=float, default=10.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--base-port", type=int, default=18100)
    p.add_argument("--kv-events-port", type=int, default=18300)
    p.add_argument("--strategies", default="default,precise")
    p.add_argument("--deadline", type=float, default=300.0)
    args = p.parse_args(argv)
    print(table(asyncio.run(main_async(args))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
