"""``prefixgate serve --workers N``: a pre-fork supervisor of N gateway worker processes.

One Python process serves on one core; N workers (router/serve/worker_process.py) serve the same
port
through SO_REUSEPORT, and share the prefix index, session affinity and in-flight counts through
Redis: the configured one, or a private redis-server when the config names none
(router/serve/private_redis.py), on which each worker keeps the index and affinity in memory and
replicates its writes to the others (``backend: replicated``, router/index/replicated.py). The
supervisor itself serves nothing and runs no event loop or thread, so forking from it is safe
at any time. It:

- restarts a worker that exits on its own, after a backoff that doubles per crash of its slot,
  and gives up (stops the others, exits 1) when one slot crashed ``MAX_RESTARTS`` times within
  ``RESTART_WINDOW_S``: a crash loop is a broken deployment, better restarted by its
  orchestrator than hidden; a worker that exits 2 (a config error) stops everything at once;
- forwards the first SIGTERM or SIGINT to the workers as SIGTERM (each drains as the
  single-process gateway does) and a second as SIGQUIT (exit at once), then waits for them, for
  at most the shutdown delay plus the drain timeout plus ``STOP_GRACE_S``, before SIGKILL;
- exits 0 when every worker drained cleanly.

Design notes and the Redis choice: docs/scale-out.md.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

from router.api.logs import LogFormat, make_formatter
from router.config.model import GatewayConfig, parse_config
from router.core.errors import ConfigError
from router.serve.private_redis import private_redis
from router.serve.server import bind_socket
from router.serve.worker_process import WorkerSlot, run_worker

log = logging.getLogger("prefixgate.supervisor")
Clock = Callable[[], float]

MAX_RESTARTS = 5
RESTART_WINDOW_S = 60.0
FIRST_BACKOFF_S = 0.1
MAX_BACKOFF_S = 5.0
STOP_GRACE_S = 10.0
CONFIG_ERROR_EXIT = 2
# Budget of a private Redis call unless prefixIndex.timeoutMs says otherwise. The 5 ms default
# guards against a slow network Redis; a local one answers in microseconds, so its timeouts only
# measure how late the worker's own loop ran, and with a 5 ms budget a busy host turned up to
# half of the lookups into local-only guesses (docs/benchmarks/workers.md).
PRIVATE_REDIS_TIMEOUT_MS = 50.0


@dataclass
class RestartPolicy:
    """When a crashed slot may start again, and whether it may at all (bounded restarts)."""

    clock: Clock = time.monotonic
    max_restarts: int = MAX_RESTARTS
    window: float = RESTART_WINDOW_S
    _crashes: dict[int, list[float]] = field(default_factory=dict)

    def crashed(self, slot: int) -> float | None:
        """The delay before restarting ``slot``, or None once it has crashed too often."""
        now = self.clock()
        recent = [t for t in self._crashes.get(slot, []) if now - t < self.window]
        recent.append(now)
        self._crashes[slot] = recent
        if len(recent) > self.max_restarts:
            return None
        return min(MAX_BACKOFF_S, FIRST_BACKOFF_S * 2.0 ** (len(recent) - 1))


def shared_config(config: GatewayConfig, redis_url: str | None, port: int) -> GatewayConfig:
    """The workers' config: the bound port, and the private Redis when there is one."""
    data = config.model_dump(by_alias=True, exclude_unset=True)
    data.setdefault("server", {})["port"] = port
    if redis_url is not None:
        index = data.setdefault("prefixIndex", {})
        index.update(backend="replicated", url=redis_url)
        index.setdefault("timeoutMs", PRIVATE_REDIS_TIMEOUT_MS)
    return parse_config(data)


def needs_private_redis(config: GatewayConfig) -> bool:
    index = config.prefix_index
    return config.server.workers > 1 and (index.backend == "memory" or index.url is None)


class Supervisor:
    """Forks, watches and stops the workers; :meth:`run` returns the process's exit code."""

    def __init__(
        self, config: GatewayConfig, run_dir: Path, log_level: str, log_format: LogFormat | None,
        policy: RestartPolicy | None = None,
        companion: Callable[[], bool] | None = None,
    ) -> None:
        self.config = config
        # Whether what the workers share (the private redis-server) still runs: without it
        # they would go on as separate gateways, degraded and unnoticed, so its end stops
        # them all with a failure, for the orchestrator to restart the whole.
        self._companion = companion
        self._run_dir = run_dir
        self._log = (log_level, log_format)
        self._policy = policy or RestartPolicy()
        self._workers: dict[int, int] = {}  # pid -> slot
        self._due: dict[int, float] = {}  # slot -> when to start it again
        self._signals: list[int] = []
        self._stop_at: float | None = None  # the kill deadline, once stopping
        self._code = 0
        self._wake_r, self._wake_w = socket.socketpair()

    def run(self) -> int:
        previous = self._install_signals()
        try:
            for slot in range(self.config.server.workers):
                self._start(slot)
            while self._workers or (self._stop_at is None and self._due):
                self._wait()
                self._handle_signals()
                self._reap()
                self._check_companion()
                self._restart_due()
                self._kill_overdue()
        finally:
            self._restore_signals(previous)
        return self._code

    # -- signals ---------------------------------------------------------------------------

    def _install_signals(self) -> dict[int, object]:
        for sock in (self._wake_r, self._wake_w):
            sock.setblocking(False)
        signal.set_wakeup_fd(self._wake_w.fileno())
        previous: dict[int, object] = {}
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD):
            previous[sig] = signal.signal(sig, self._on_signal)
        return previous

    def _restore_signals(self, previous: dict[int, object]) -> None:
        signal.set_wakeup_fd(-1)
        for sig, handler in previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._wake_r.close()
        self._wake_w.close()

    def _on_signal(self, signum: int, _: FrameType | None) -> None:
        if signum != signal.SIGCHLD:
            self._signals.append(signum)

    def _wait(self) -> None:
        now = time.monotonic()
        deadlines = [*self._due.values(), *([self._stop_at] if self._stop_at else [])]
        timeout = min([1.0, *(max(0.0, d - now) for d in deadlines)])
        with contextlib.suppress(InterruptedError):
            select.select([self._wake_r], [], [], timeout)
        with contextlib.suppress(BlockingIOError):
            while self._wake_r.recv(512):
                pass

    def _handle_signals(self) -> None:
        while self._signals:
            self._signals.pop(0)
            if self._stop_at is None:
                self.stop("signal")
            else:
                log.warning("second signal: workers exit without waiting for their requests")
                self._send(signal.SIGQUIT)

    def stop(self, why: str) -> None:
        """Drain every worker (SIGTERM) and start no more."""
        if self._stop_at is not None:
            return
        server = self.config.server
        budget = server.shutdown_delay_seconds + server.drain_timeout_seconds + STOP_GRACE_S
        log.info("stopping %d worker(s) (%s); killing any left in %.0fs",
                 len(self._workers), why, budget)
        self._stop_at = time.monotonic() + budget
        self._due.clear()
        self._send(signal.SIGTERM)

    def _send(self, sig: int) -> None:
        for pid in list(self._workers):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    def _kill_overdue(self) -> None:
        if self._stop_at is not None and self._workers and time.monotonic() > self._stop_at:
            log.error("%d worker(s) still running past the drain deadline: killed",
                      len(self._workers))
            self._code = self._code or 1
            self._send(signal.SIGKILL)
            self._stop_at = time.monotonic() + STOP_GRACE_S

    def _check_companion(self) -> None:
        if self._companion is None or self._stop_at is not None or self._companion():
            return
        log.error("the private redis-server the workers share exited: stopping")
        self._code = 1
        self.stop("private redis-server exited")

    # -- workers ---------------------------------------------------------------------------

    def _reap(self) -> None:
        # Each worker by its pid, never waitpid(-1): the private redis-server is a child too.
        for pid in list(self._workers):
            try:
                done, status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                done, status = pid, 0
            if done:
                slot = self._workers.pop(pid)
                self._exited(slot, pid, os.waitstatus_to_exitcode(status))

    def _exited(self, slot: int, pid: int, code: int) -> None:
        if self._stop_at is not None:
            # -SIGTERM: the stop's own signal met SIGTERM's default action, in a worker still
            # starting or past its drain; nothing was in flight there.
            if code not in (0, -signal.SIGTERM):
                log.warning("worker %d (pid %d) exited %d while stopping", slot, pid, code)
                self._code = self._code or 1
            return
        if code == CONFIG_ERROR_EXIT:
            log.error("worker %d exited on a configuration error: stopping", slot)
            self._code = CONFIG_ERROR_EXIT
            self.stop("config error")
            return
        delay = self._policy.crashed(slot)
        if delay is None:
            log.error("worker %d crashed more than %d times in %.0fs: giving up", slot,
                      self._policy.max_restarts, self._policy.window)
            self._code = 1
            self.stop("crash loop")
            return
        log.warning("worker %d (pid %d) exited %d: restarting in %.1fs", slot, pid, code, delay)
        self._due[slot] = time.monotonic() + delay

    def _restart_due(self) -> None:
        now = time.monotonic()
        for slot, at in list(self._due.items()):
            if at <= now and self._stop_at is None:
                del self._due[slot]
                self._start(slot)

    def _start(self, slot: int) -> None:
        if threading.active_count() > 1:  # a forked child would inherit their locks, not them
            log.warning("forking with %d threads running", threading.active_count())
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:
            self._child(slot, parent)  # never returns
        self._workers[pid] = slot

    def _child(self, slot: int, parent: int) -> None:
        code = 1
        try:
            signal.set_wakeup_fd(-1)
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD):
                signal.signal(sig, signal.SIG_DFL)  # until the worker's loop handles them
            self._wake_r.close()
            self._wake_w.close()
            ws = WorkerSlot(slot, self.config.server.workers, self._run_dir)
            run_worker(self.config, ws, parent, *self._log)
            code = 0
        except ConfigError as exc:
            print(f"prefixgate: {exc}", file=sys.stderr)
            code = CONFIG_ERROR_EXIT
        except BaseException:  # the child must reach os._exit whatever happened
            traceback.print_exc()
        finally:
            with contextlib.suppress(Exception):
                sys.stdout.flush()
                sys.stderr.flush()
            os._exit(code)


def _supervisor_logging(log_format: LogFormat | None, config: GatewayConfig) -> None:
    # The CLI's handler, in the configured format; no writer thread here: this process forks.
    for handler in logging.getLogger().handlers:
        handler.setFormatter(make_formatter(log_format or config.server.log_format))


def supervise(
    config: GatewayConfig, log_level: str = "info", log_format: LogFormat | None = None
) -> int:
    """Run ``config.server.workers`` workers until stopped; the process's exit code."""
    _supervisor_logging(log_format, config)
    server = config.server
    with contextlib.ExitStack() as stack:
        run_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="prefixgate-")))
        os.chmod(run_dir, 0o700)
        redis_url, companion = None, None
        if needs_private_redis(config):
            redis = stack.enter_context(private_redis(run_dir, server.workers))
            redis_url, companion = redis.url, redis.alive
            log.info("workers share a private redis-server at %s", redis_url)
        # Held, never listening, for the supervisor's lifetime: it resolves port 0 and keeps
        # the port while workers come and go (SO_REUSEPORT lets theirs join it).
        reserved = stack.enter_context(bind_socket(server.host, server.port, reuse_port=True))
        port = reserved.getsockname()[1]
        workers_config = shared_config(config, redis_url, port)
        log.info("serving on %s:%d with %d workers", server.host, port, server.workers)
        return Supervisor(
            workers_config, run_dir, log_level, log_format, companion=companion
        ).run()
    raise AssertionError("unreachable")  # pragma: no cover  (mypy: ExitStack may swallow)
