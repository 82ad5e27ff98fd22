"""Command line and programmatic entry points of the simulator.

``python -m benchmarks.sim --replicas 4 --base-port 8100`` serves four replicas in one
process; ``start_replicas`` does the same on ephemeral ports from async code::

    async with start_replicas(2, SimConfig(speed=10)) as replicas:
        urls = [r.url for r in replicas]

Latency flags are per-GPU figures in milliseconds; ``--speed X`` runs the whole simulation X
times faster than real time while every reported latency (metrics, ``/sim/state``) stays in
simulated seconds, so numbers look like a real GPU's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import socket
from collections.abc import AsyncIterator, Callable, Coroutine, Generator
from dataclasses import dataclass
from typing import Any

import uvicorn

from .config import DEFAULT_MODEL, PREFILL_MODES, SimConfig
from .engine import Engine
from .server import SimServer, create_app

SHUTDOWN_TIMEOUT_S = 5.0
STARTUP_TIMEOUT_S = 10.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the simulator's flags to ``parser`` (the gateway CLI reuses this)."""
    d = SimConfig()
    add = parser.add_argument
    add("--host", default="127.0.0.1", help="address to bind (default: loopback)")
    add("--port", type=int, default=8000, help="port of a single replica")
    add("--replicas", type=int, default=1, help="replicas to serve in this process")
    add("--base-port", type=int, default=None, help="first port when --replicas > 1")
    add("--model", default=DEFAULT_MODEL, help="model name reported and accepted")
    add("--served-model-name", nargs="+", default=None, help="names to answer to instead")
    add("--block-size", type=int, default=d.block_size)
    add("--num-gpu-blocks", type=int, default=d.num_gpu_blocks)
    add("--max-num-seqs", type=int, default=d.max_num_seqs)
    add("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens)
    add("--max-model-len", type=int, default=d.max_model_len)
    add("--itl-ms", type=float, default=d.itl_ms, help="decode step time at no load")
    add("--prefill-overhead-ms", type=float, default=d.prefill_overhead_ms)
    add("--prefill-ms-per-token", type=float, default=d.prefill_ms_per_token)
    add("--time-factor-under-load", type=float, default=d.time_factor_under_load)
    add("--prefill-mode", choices=list(PREFILL_MODES), default=d.prefill_mode,
        help="batched: prefills queue in shared steps (vLLM); independent: each prefill "
        "runs on its own, only scaled by the load factor (llm-d-inference-sim); serial: "
        "batched, but one prefill at a time")
    add("--kv-transfer-ms-per-token", type=float, default=d.kv_transfer_ms_per_token)
    add("--speed", type=float, default=d.speed, help="run this many times faster than real")
    add("--zero-latency", action="store_true", help="answer at once (gateway overhead runs)")
    add("--default-max-tokens", type=int, default=d.default_max_tokens)
    add("--seed", type=int, default=d.seed)
    add("--kv-events-port", type=int, default=None,
        help="publish KV events (ZMQ PUB) here; replica i uses this port + i")
    add("--kv-events-replay-port", type=int, default=None,
        help="answer KV event replay requests here (+ i per replica)")
    add("--kv-events-encoding", choices=["array", "map"], default=d.kv_events_encoding,
        help="vLLM's tagged arrays (older) or maps with a 'type' key (newer)")
    add("--bytes-per-token", type=float, default=None,
        help="characters of text per token (1-32; default: the word-based tokenizer, ~4)")
    add("--log-level", default=d.log_level, choices=["debug", "info", "warning", "error"])


def config_from_args(args: argparse.Namespace) -> SimConfig:
    """The ``SimConfig`` described by parsed flags."""
    names = getattr(args, "served_model_name", None) or ()
    return SimConfig(
        model=args.model,
        served_model_names=tuple(names),
        block_size=args.block_size,
        num_gpu_blocks=args.num_gpu_blocks,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        itl_ms=args.itl_ms,
        prefill_overhead_ms=args.prefill_overhead_ms,
        prefill_ms_per_token=args.prefill_ms_per_token,
        time_factor_under_load=args.time_factor_under_load,
        prefill_mode=getattr(args, "prefill_mode", "batched"),
        kv_transfer_ms_per_token=args.kv_transfer_ms_per_token,
        speed=args.speed,
        zero_latency=args.zero_latency,
        default_max_tokens=args.default_max_tokens,
        seed=args.seed,
        log_level=args.log_level,
        kv_events_port=getattr(args, "kv_events_port", None),
        kv_events_replay_port=getattr(args, "kv_events_replay_port", None),
        kv_events_encoding=getattr(args, "kv_events_encoding", "array"),
        bytes_per_token=getattr(args, "bytes_per_token", None),
    )


class _Server(uvicorn.Server):
    """A uvicorn server that leaves signal handling to its owner."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


@dataclass
class Replica:
    """One running replica."""

    host: str
    port: int
    sim: SimServer
    server: uvicorn.Server
    task: asyncio.Task[None]

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def engine(self) -> Engine:
        return self.sim.engine

    @property
    def kv_events_address(self) -> str | None:
        """``tcp://host:port`` of the replica's KV events publisher, if it has one."""
        publisher = self.sim.kv_publisher
        return publisher.address if publisher is not None else None

    @property
    def kv_events_replay_address(self) -> str | None:
        publisher = self.sim.kv_publisher
        return publisher.replay_address if publisher is not None else None


def _bind(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.setblocking(False)
    return sock


async def _serve(config: SimConfig, host: str, port: int, index: int) -> Replica:
    sock = _bind(host, port)
    bound = sock.getsockname()[1]
    # Fixed event ports are consecutive per replica; 0 stays ephemeral for every replica.
    kv_port = config.kv_events_port
    replay_port = config.kv_events_replay_port
    app = create_app(
        config,
        host=host,
        port=bound,
        engine_id=f"sim-{index}-{bound}",
        kv_events_port=kv_port + index if kv_port else kv_port,
        kv_events_replay_port=replay_port + index if replay_port else replay_port,
    )
    publisher = app.state.sim.kv_publisher
    if publisher is not None:
        publisher.start()
    uconfig = uvicorn.Config(
        app,
        lifespan="off",
        http="httptools",
        log_level=config.log_level,
        access_log=False,
        timeout_graceful_shutdown=1,
        timeout_keep_alive=30,
    )
    server = _Server(uconfig)
    task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
    return Replica(host, bound, app.state.sim, server, task)


async def _stop(replicas: list[Replica]) -> None:
    for replica in replicas:
        replica.server.should_exit = True
    # Aborting requests ends open streams, so uvicorn's graceful shutdown finishes quickly.
    await asyncio.gather(*(r.engine.stop() for r in replicas))
    for replica in replicas:
        if replica.sim.kv_publisher is not None:
            await replica.sim.kv_publisher.aclose()
    for replica in replicas:
        try:
            await asyncio.wait_for(asyncio.shield(replica.task), SHUTDOWN_TIMEOUT_S)
        except TimeoutError:
            replica.server.force_exit = True
            replica.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await replica.task


@contextlib.asynccontextmanager
async def start_replicas(
    n: int, config: SimConfig, host: str = "127.0.0.1", base_port: int = 0
) -> AsyncIterator[list[Replica]]:
    """Serve ``n`` replicas (ephemeral ports unless ``base_port``); stop them on exit."""
    replicas: list[Replica] = []
    try:
        for i in range(n):
            replicas.append(await _serve(config, host, base_port + i if base_port else 0, i))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + STARTUP_TIMEOUT_S
        while not all(r.server.started for r in replicas):
            failed = [r for r in replicas if r.task.done()]
            if failed or loop.time() > deadline:
                raise RuntimeError("simulated replicas failed to start")
            await asyncio.sleep(0.005)
        yield replicas
    finally:
        await _stop(replicas)


async def _run_async(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    base = args.base_port if args.base_port is not None else args.port
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with start_replicas(args.replicas, config, args.host, base) as replicas:
        for replica in replicas:
            logging.getLogger("benchmarks.sim").warning("replica serving on %s", replica.url)
        await stop.wait()
    return 0


def _loop_runner() -> Callable[[Coroutine[Any, Any, int]], int]:
    try:
        import uvloop
    except ImportError:
        return asyncio.run
    return uvloop.run


def run(args: argparse.Namespace) -> int:
    """Serve the replicas described by ``args`` until SIGINT/SIGTERM; the exit code."""
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(message)s")
    try:
        return _loop_runner()(_run_async(args))
    except OSError as exc:
        logging.getLogger("benchmarks.sim").error("cannot serve: %s", exc)
        return 1


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks.sim``."""
    parser = argparse.ArgumentParser(
        prog="benchmarks.sim",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))
