"""How long one huge request stalls the gateway's event loop (every other request waits as long).

Starts a zero-latency simulated replica and a gateway, sends one request of ``--mb`` megabytes
(one long user message, or ``--messages`` short ones), and reads the gateway's own loop-lag
histogram (``prefixgate_event_loop_lag_seconds``, a timer every 50 ms recording how late it ran)
before and after: the new observations, by bucket, bound the longest stall.

    python -m benchmarks.loop_stall [--mb 30] [--messages 0] [--gateway-src DIR]
                                    [--max-blocks N]

``--max-blocks`` caps the blocks a request records in the prefix index
(``prefixIndex.maxBlocksPerRequest``): with a small cap, what is left is the stall of the
rest of the request's path.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import time
from pathlib import Path

import httpx
import orjson
import yaml

from benchmarks.bench.procs import HOST, free_port
from benchmarks.overhead import started

METRIC = "prefixgate_event_loop_lag_seconds_bucket"
# The monitor's interval: the request's effects are over once a few more wake-ups ran.
SETTLE_S = 0.5


def lag_buckets(url: str) -> dict[float, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    out = {}
    for match in re.finditer(rf'^{METRIC}{{le="([^"]+)"}} (\S+)$', text, re.M):
        out[float(match[1])] = float(match[2])
    if not out:
        raise RuntimeError(f"{url} exposes no {METRIC}")
    return out


def body(megabytes: float, messages: int) -> bytes:
    size = int(megabytes * 1_000_000)
    if messages:
        each = max(1, size // messages - 40)
        history = [
            {"role": "user" if i % 2 == 0 else "assistant", "content": "x" * each}
            for i in range(messages - 1 + messages % 2)
        ]
    else:
        history = [{"role": "user", "content": "word " * (size // 5)}]
    return orjson.dumps({"model": "sim-model", "messages": history, "max_tokens": 4})


def worst(before: dict[float, float], after: dict[float, float]) -> tuple[float, float]:
    """(new observations, the smallest bucket bound holding all of them)."""
    new = {le: after[le] - before.get(le, 0.0) for le in after}
    total = new[float("inf")]
    bound = min((le for le, n in new.items() if n >= total), default=float("inf"))
    return total, bound


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=float, default=30.0, help="request body size")
    parser.add_argument("--messages", type=int, default=0, help="0: one long message")
    parser.add_argument("--gateway-src", type=Path, default=Path.cwd())
    parser.add_argument("--max-blocks", type=int, default=None,
                        help="prefixIndex.maxBlocksPerRequest (default: the gateway's)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        return _run(args, Path(tmp))


def _run(args: argparse.Namespace, tmp: Path) -> int:
    payload = body(args.mb, args.messages)
    sim_port, gw_port = free_port(), free_port()
    replica, url = f"http://{HOST}:{sim_port}", f"http://{HOST}:{gw_port}"
    exe = [sys.executable, "-m", "router.cli"]
    sim = [*exe, "sim", "--zero-latency", "--host", HOST, "--port", str(sim_port),
           "--log-level", "warning"]
    gateway = [*exe, "serve", "--host", HOST, "--port", str(gw_port), "--log-level", "warning"]
    if args.max_blocks is None:
        gateway += ["--backend", replica]
    else:
        config = tmp / "gateway.yaml"
        config.write_text(yaml.safe_dump({
            "pool": {"endpoints": [{"url": replica}]},
            "prefixIndex": {"maxBlocksPerRequest": args.max_blocks},
        }))
        gateway += ["--config", str(config)]
    with started("replica", sim, [f"{replica}/health"], replica), started(
        "gateway", gateway, [f"{url}/ready"], url, cwd=args.gateway_src.resolve()
    ), httpx.Client(base_url=url, timeout=120) as http:
        http.post("/v1/chat/completions", content=body(0.001, 0))  # warm-up
        time.sleep(SETTLE_S)
        before = lag_buckets(url)
        started_at = time.perf_counter()
        resp = http.post("/v1/chat/completions", content=payload,
                         headers={"content-type": "application/json"})
        elapsed = time.perf_counter() - started_at
        time.sleep(SETTLE_S)
        after = lag_buckets(url)
    count, bound = worst(before, after)
    print(f"body {len(payload) / 1e6:.1f} MB, {args.messages or 1} message(s): status "
          f"{resp.status_code}, {elapsed * 1e3:.0f} ms; {count:.0f} loop-lag observations, "
          f"all <= {bound * 1e3:g} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
