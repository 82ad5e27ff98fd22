"""One benchmark: simulated replicas in their own process, then each target in turn against the
same replicas (caches reset in between), the same seeded workload, one report.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from benchmarks.bench.client import ClientRun, WorkloadClient
from benchmarks.bench.conversation import ReuseLedger, estimate_reuse
from benchmarks.bench.metrics import ReplicaCounters, TargetResult, cache_delta, parse_counters
from benchmarks.bench.metrics import summarize as summarize_run
from benchmarks.bench.procs import HOST, Process, free_port_range, http_ok, wait_ready
from benchmarks.bench.progress import Progress
from benchmarks.bench.settings import BenchSettings
from benchmarks.bench.targets import Target, Unavailable
from benchmarks.workloads import Workload

IDLE_TIMEOUT_S = 60.0
SIM_READY_TIMEOUT_S = 60.0


@dataclass
class BenchReport:
    settings: BenchSettings
    workload: Workload
    estimate: ReuseLedger
    results: list[TargetResult] = field(default_factory=list)
    started_at: float = field(default_factory=time.time)


async def scrape(http: aiohttp.ClientSession, urls: Sequence[str]) -> dict[str, ReplicaCounters]:
    async def one(url: str) -> ReplicaCounters:
        async with http.get(f"{url}/metrics") as resp:
            resp.raise_for_status()
            return parse_counters(await resp.text())

    values = await asyncio.gather(*(one(u) for u in urls))
    return dict(zip(urls, values, strict=True))


async def wait_idle(http: aiohttp.ClientSession, urls: Sequence[str], timeout_s: float) -> None:
    """Until no replica runs or queues a request (aborted streams drain quickly)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        counters = await scrape(http, urls)
        if all(c.running == 0 and c.waiting == 0 for c in counters.values()):
            return
        if loop.time() > deadline:
            raise RuntimeError(f"replicas still busy after {timeout_s:.0f} s")
        await asyncio.sleep(0.1)


async def reset_caches(http: aiohttp.ClientSession, urls: Sequence[str]) -> None:
    """Idle, then ``POST /reset_prefix_cache`` on every replica; checked where the replica
    tells its cached blocks (the simulator's /sim/state)."""
    await wait_idle(http, urls, IDLE_TIMEOUT_S)
    for url in urls:
        async with http.post(f"{url}/reset_prefix_cache") as resp:
            resp.raise_for_status()
        async with http.get(f"{url}/sim/state") as resp:
            if resp.status == 200:
                state = await resp.json()
                if state.get("cached_blocks", 0) != 0:
                    raise RuntimeError(f"{url} kept {state['cached_blocks']} cached blocks")


def sim_command(
    settings: BenchSettings, base_port: int, replicas: int | None = None,
    extra: Sequence[str] = (),
) -> list[str]:
    """One simulator process serving ``replicas`` (all by default) from ``base_port``."""
    b = settings.bytes_per_token
    density = [] if b is None else ["--bytes-per-token", str(b)]
    events = []
    if settings.kv_events_offset is not None and settings.kv_replay_offset is not None:
        events = [
            "--kv-events-port",
            str(base_port + settings.kv_events_offset),
            "--kv-events-replay-port",
            str(base_port + settings.kv_replay_offset),
        ]
    return [
        sys.executable, "-m", "router.cli", "sim",
        "--host", HOST,
        "--replicas", str(settings.replicas if replicas is None else replicas),
        "--base-port", str(base_port),
        "--model", settings.model,
        "--block-size", str(settings.block_size),
        "--num-gpu-blocks", str(settings.num_gpu_blocks),
        "--max-num-seqs", str(settings.max_num_seqs),
        "--speed", str(settings.speed),
        "--log-level", "warning",
        *events,
        *density,
        *settings.sim_args,
        *extra,
    ]  # fmt: skip


def sim_processes(settings: BenchSettings, base_port: int) -> list[tuple[str, list[str]]]:
    """(name, command) per simulator process: one for all replicas, or one per run of
    consecutive replicas with the same ``replica_sim_args`` (ports stay consecutive)."""
    per = settings.replica_sim_args
    if not per:
        return [("sim", sim_command(settings, base_port))]
    if len(per) != settings.replicas:
        raise ValueError(f"replica_sim_args: {len(per)} lists for {settings.replicas} replicas")
    out: list[tuple[str, list[str]]] = []
    start = 0
    for i in range(1, len(per) + 1):
        if i == len(per) or per[i] != per[start]:
            name = f"sim-{start}" if start else "sim"
            out.append((name, sim_command(settings, base_port + start, i - start, per[start])))
            start = i
    return out


def check_fits(settings: BenchSettings, estimate: ReuseLedger, workload: Workload) -> None:
    """A request larger than a replica's whole KV cache is refused (400) by vLLM: fail early."""
    steps = [s for c in workload.conversations for s in c.steps]
    steps += [s for step in steps for agent in step.burst for s in agent.steps]
    need = estimate.max_prompt_tokens + max((s.max_tokens for s in steps), default=0)
    have = settings.num_gpu_blocks * settings.block_size
    if need > have:
        raise ValueError(
            f"the longest request needs ~{need} tokens of KV cache, a replica holds {have}: "
            f"raise --num-gpu-blocks or shrink the workload"
        )


class Runner:
    def __init__(self, settings: BenchSettings, workload: Workload) -> None:
        self.settings = settings
        self.workload = workload
        self.replicas: list[str] = []

    async def run(self, targets: Sequence[Target]) -> BenchReport:
        s = self.settings
        estimate = estimate_reuse(self.workload, s.block_size, s.bytes_per_token)
        check_fits(s, estimate, self.workload)
        report = BenchReport(s, self.workload, estimate)
        base = s.base_port or free_port_range(s.replicas)
        self.replicas = [f"http://{HOST}:{base + i}" for i in range(s.replicas)]
        if any(getattr(t, "needs_kv_events", False) for t in targets):
            events = free_port_range(2 * s.replicas, first=base + s.replicas)
            s.kv_events_offset, s.kv_replay_offset = events - base, events + s.replicas - base
        sims: list[Process] = []
        try:
            for name, cmd in sim_processes(s, base):  # those started are stopped if one fails
                sims.append(Process(name, cmd, s.out / "logs" / f"{name}.log"))
            probes = [http_ok(f"{u}/health") for u in self.replicas]
            await wait_ready(sims, probes, SIM_READY_TIMEOUT_S)
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
                for target in targets:
                    report.results.append(await self._target(http, target))
        finally:
            for sim in sims:
                await sim.stop()
        return report

    async def _target(self, http: aiohttp.ClientSession, target: Target) -> TargetResult:
        reason = target.unavailable()
        if reason is not None:
            _say(f"{target.name}: skipped ({reason})")
            return TargetResult(target.name, target.kind, status="skipped", note=reason)
        try:
            return await self._measure(http, target)
        except Unavailable as exc:
            _say(f"{target.name}: skipped ({exc})")
            return TargetResult(target.name, target.kind, status="skipped", note=str(exc))
        except (RuntimeError, OSError, aiohttp.ClientError, TimeoutError) as exc:
            _say(f"{target.name}: failed ({exc})")
            note = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            return TargetResult(target.name, target.kind, status="failed", note=note)

    async def _measure(self, http: aiohttp.ClientSession, target: Target) -> TargetResult:
        s = self.settings
        async with contextlib.AsyncExitStack() as stack:
            urls = await target.start(self.replicas, stack)
            await asyncio.sleep(s.settle_s)
            # Reset once the target listens: a gateway following KV events then sees the caches
            # cleared, as one that has been running would. (Joining mid-stream it cannot replay
            # the earlier targets' history, and distrusts the streams for resyncSeconds.)
            await reset_caches(http, self.replicas)
            await asyncio.sleep(s.settle_s / 2)
            before = await scrape(http, self.replicas)
            progress = Progress(target.name, self.workload.num_requests) if s.progress else None
            client = WorkloadClient(
                urls,
                self.workload,
                model=s.model,
                speed=s.speed,
                deadline_s=s.deadline_s,
                bytes_per_token=s.bytes_per_token,
                block_size=s.block_size,
                on_record=progress.update if progress else None,
            )
            run = await client.run()
            if progress is not None:
                progress.close("deadline reached: run cut short" if run.timed_out else "")
            await self._save_target_metrics(http, target.name, urls)
            self._save_records(target.name, run)
            # Cut streams are aborted by the replicas; count what they had done by then.
            await wait_idle(http, self.replicas, IDLE_TIMEOUT_S)
            after = await scrape(http, self.replicas)
        result = summarize_run(target.name, target.kind, run, cache_delta(before, after), s.speed)
        if run.timed_out:
            result.note = (
                f"deadline {s.deadline_s:.0f} s reached: {run.incomplete} requests not run"
            )
        elif run.errors:
            result.note = _first_error(run.records)
        return result

    def _save_records(self, name: str, run: ClientRun) -> None:
        """One JSON line per request (times in simulated seconds), for diagnosis."""
        path = self.settings.out / "logs" / f"{name}.requests.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        speed = self.settings.speed
        with path.open("wb") as f:
            for r in run.records:
                row = dataclasses.asdict(r)
                for key in ("sent_at", "ttft", "e2e", "tpot"):
                    if row[key] is not None:
                        row[key] *= speed
                f.write(orjson.dumps(row) + b"\n")

    async def _save_target_metrics(
        self, http: aiohttp.ClientSession, name: str, urls: Sequence[str]
    ) -> None:
        """The router's own /metrics after the run, kept next to its log for diagnosis
        (best effort: peers serve metrics on another port)."""
        for i, url in enumerate(urls):
            suffix = f"-{i}" if len(urls) > 1 else ""
            with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError):
                async with http.get(f"{url}/metrics") as resp:
                    if resp.status == 200:
                        path = self.settings.out / "logs" / f"{name}{suffix}.metrics.txt"
                        path.write_text(await resp.text())


def _first_error(records: Sequence[Any]) -> str:
    for r in records:
        if not r.ok:
            return f"first error: HTTP {r.status} {r.error or ''}"[:200]
    return ""


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)
