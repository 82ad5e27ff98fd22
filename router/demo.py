"""``prefixgate demo``: the gateway in front of simulated vLLM replicas, all on loopback.

``--smoke`` sends a short, bounded multi-session workload through it and prints what each
replica served and how much of its prompt work came from its prefix cache.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys

from benchmarks.driver import cache_stats, drive
from benchmarks.sim.cli import start_replicas
from benchmarks.sim.config import SimConfig
from benchmarks.workloads import multi_session_chat
from router.config.model import parse_config
from router.serve.server import running_gateway

_COMMANDS = """\
  curl -s {url}/v1/chat/completions -H 'content-type: application/json' \\
    -H 'x-session-id: demo-1' \\
    -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "hello"}}]}}'

  python -c "from openai import OpenAI; c = OpenAI(base_url='{url}/v1', api_key='none'); \\
print(c.chat.completions.create(model='{model}', \\
messages=[{{'role': 'user', 'content': 'hello'}}]).choices[0].message.content)"
"""
_EXAMPLE = """\
prefixgate is routing on {url} over {n} simulated vLLM replicas ({model!r}).

{commands}
Metrics: {url}/metrics   Replicas: {replicas}
Press Ctrl-C to stop.
"""
_AFTER_SMOKE = """
Run `prefixgate demo{port}` to keep the gateway up, then try:

{commands}"""


def _sim_config(smoke: bool) -> SimConfig:
    # Small KV caches, so that where a session lands matters; faster than real time.
    return SimConfig(num_gpu_blocks=2048, speed=50.0 if smoke else 5.0)


async def _demo(args: argparse.Namespace) -> int:
    sim = _sim_config(args.smoke)
    if args.smoke:
        # Its output is the table and the commands; health transitions are not news here.
        logging.getLogger().setLevel(logging.WARNING)
    async with start_replicas(args.replicas, sim) as replicas:
        urls = [r.url for r in replicas]
        config = parse_config(
            {
                # The smoke run prints a table: one access line per request would bury it.
                "server": {"port": 0 if args.smoke else args.port, "accessLog": not args.smoke},
                "pool": {"endpoints": [{"url": u} for u in urls]},
                "strategy": args.strategy,
            }
        )
        async with running_gateway(config) as gw:
            if args.smoke:
                code = await _smoke(gw.url, urls, sim.model)
                port = "" if args.port == 8000 else f" --port {args.port}"
                url = f"http://127.0.0.1:{args.port}"
                commands = _COMMANDS.format(url=url, model=sim.model)
                print(_AFTER_SMOKE.format(port=port, commands=commands), flush=True)
                return code
            commands = _COMMANDS.format(url=gw.url, model=sim.model)
            example = _EXAMPLE.format(
                url=gw.url, n=len(urls), model=sim.model, replicas=" ".join(urls),
                commands=commands,
            )
            print(example, flush=True)
            await _wait_for_signal()
    return 0


async def _wait_for_signal() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    await stop.wait()


async def _smoke(url: str, replicas: list[str], model: str) -> int:
    workload = multi_session_chat(sessions=8, turns=4, system_tokens=800, user_tokens=120)
    before = await cache_stats(replicas)
    result = await drive(url, workload, model=model, deadline=120)
    after = await cache_stats(replicas)
    header = ("replica", "requests", "prompt tokens", "cached tokens", "cached")
    print(f"{header[0]:<24} {header[1]:>8} {header[2]:>14} {header[3]:>14} {header[4]:>7}")
    hits = queries = 0.0
    for u in replicas:
        h = after[u].hits - before[u].hits
        q = after[u].queries - before[u].queries
        hits, queries = hits + h, queries + q
        served = result.destinations.get(u.removeprefix("http://"), 0)
        ratio = h / q if q else 0.0
        print(f"{u:<24} {served:>8} {q:>14.0f} {h:>14.0f} {ratio:>7.1%}")
    reusable = result.reuse.reusable_tokens
    print(f"{'total':<24} {result.requests:>8} {queries:>14.0f} {hits:>14.0f} "
          f"{(hits / queries if queries else 0):>7.1%}")
    captured = hits / reusable if reusable else 0.0
    print(f"\nreusable prompt tokens in the workload: {reusable} "
          f"({result.reuse.reusable_fraction:.1%} of all); captured by routing: {captured:.1%}")
    if result.errors:
        print(f"{result.errors} requests failed", file=sys.stderr)
        return 1
    return 0


def run_demo(args: argparse.Namespace) -> int:
    try:
        return asyncio.run(_demo(args))
    except OSError as exc:
        print(f"prefixgate demo: {exc} (is port {args.port} free? try --port)", file=sys.stderr)
        return 1



