"""SLO-aware admission at overload: the share of SLO requests meeting their TTFT target.

One gateway (the default configuration) in front of simulated replicas, two phases of the same
traffic (same seeds), one after the other:

* **without:** tenant A's requests are sheddable (objective ``slo``, priority -1) and their
  target is known only to this load generator;
* **with:** the same requests also carry ``x-llm-d-slo-ttft-ms``, so the gateway rejects those it
  predicts will miss it.

Tenant B's steady requests carry no target in both phases (the mixed population). A request
meets its target when it is served with a TTFT at or under it; a rejected one does not.

    python -m benchmarks.slo [--seconds 15] [--slo-ms 1500] [--replicas 4] [--max-num-seqs 4]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.fairness import (
    HOST,
    OBJECTIVE,
    Load,
    Outcome,
    bursts,
    percentile,
    start_gateway,
    start_sims,
    steady,
)  # fmt: skip

SLO_HEADER = "x-llm-d-slo-ttft-ms"


@dataclass(frozen=True, slots=True)
class Settings:
    seconds: float
    slo_ms: float
    replicas: int
    max_num_seqs: int
    burst: int
    burst_every: float
    b_rate: float
    tokens: int
    max_tokens: int
    seed: int


def gateway_config(sim_urls: list[str], port: int) -> dict[str, Any]:
    return {
        "server": {"host": HOST, "port": port, "accessLog": False},
        "pool": {"endpoints": [{"url": u} for u in sim_urls]},
        "flowControl": {"objectives": [{"name": "slo", "priority": -1}]},
    }


async def tenant_a(port: int, s: Settings, with_header: bool) -> list[Outcome]:
    headers = f"{OBJECTIVE}: slo\r\n"
    if with_header:
        headers += f"{SLO_HEADER}: {s.slo_ms:g}\r\n"
    load = Load("A", s.seconds, s.tokens, s.max_tokens, s.seed, headers)
    return await bursts(port, load, s.burst, s.burst_every)


async def tenant_b(port: int, s: Settings) -> list[Outcome]:
    return await steady(port, Load("B", s.seconds, s.tokens, s.max_tokens, s.seed + 1), s.b_rate)


def row(label: str, outcomes: list[Outcome], slo_s: float) -> str:
    a = [o for o in outcomes if o.tenant == "A"]
    b = [o for o in outcomes if o.tenant == "B"]
    met = sum(1 for o in a if o.ttft is not None and o.ttft <= slo_s)
    served_a = [o.ttft for o in a if o.ttft is not None]
    rejected = sum(1 for o in a if o.status == 429)
    errors = sum(1 for o in outcomes if o.status not in (200, 429))
    b_ttft = [o.ttft for o in b if o.ttft is not None]
    cells = [
        label, str(len(a)), f"{met / max(1, len(a)):.1%}", str(len(served_a)),
        f"{percentile(served_a, 90) * 1000:,.0f}", str(rejected),
        f"{percentile(b_ttft, 90) * 1000:,.0f}", str(errors),
    ]  # fmt: skip
    return "| " + " | ".join(cells) + " |"


async def run(port: int, s: Settings) -> str:
    lines = [
        "| phase | SLO requests | met target | served | served TTFT p90 ms | rejected (429) "
        "| no-SLO TTFT p90 ms | errors |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for label, with_header in (("without SLO admission", False), ("with SLO admission", True)):
        print(f"phase: {label}, {s.seconds:.0f} s", file=sys.stderr, flush=True)
        a, b = await asyncio.gather(tenant_a(port, s, with_header), tenant_b(port, s))
        lines.append(row(label, [*a, *b], s.slo_ms / 1000))
    return "\n".join(lines)


def settings(argv: list[str] | None) -> Settings:
    parser = argparse.ArgumentParser(description=__doc__)
    add = parser.add_argument
    add("--seconds", type=float, default=15.0, help="length of each phase")
    add("--slo-ms", type=float, default=1500.0, help="tenant A's TTFT target")
    add("--replicas", type=int, default=4)
    add("--max-num-seqs", type=int, default=4)
    add("--burst", type=int, default=60, help="tenant A's requests per burst")
    add("--burst-every", type=float, default=3.0, help="seconds between A's bursts")
    add("--b-rate", type=float, default=2.0, help="tenant B's requests per second")
    add("--tokens", type=int, default=600, help="mean prompt tokens")
    add("--max-tokens", type=int, default=16, help="mean output tokens (1 to 2x-1)")
    add("--seed", type=int, default=0)
    a = parser.parse_args(argv)
    return Settings(
        a.seconds, a.slo_ms, a.replicas, a.max_num_seqs, a.burst, a.burst_every, a.b_rate,
        a.tokens, a.max_tokens, a.seed,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    s = settings(argv)
    with tempfile.TemporaryDirectory(prefix="slo-") as tmp, contextlib.ExitStack() as stack:
        work = Path(tmp)
        urls = start_sims(stack, work, s.replicas, s.max_num_seqs, 1.0)
        port = start_gateway(stack, work, "gateway", lambda port: gateway_config(urls, port))
        print(asyncio.run(run(port, s)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
