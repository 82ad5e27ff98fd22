"""The private Redis of ``prefixgate serve --workers N`` when the config names none.

Workers must share the prefix index, session affinity and in-flight counts, and the Redis-backed
stores already do that for gateway replicas; a Redis on a unix socket in the supervisor's run
directory (no TCP port, no persistence, mode 700) gives N workers that sharing with no setup.
It lives exactly as long as the supervisor: stopped when it exits and, on Linux, killed by the
kernel if the supervisor is killed first.
"""

from __future__ import annotations

import contextlib
import ctypes
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import redis

from router.core.errors import ConfigError

START_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 5.0
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)


def _answers(url: str) -> bool:
    client = redis.Redis.from_url(url, socket_timeout=0.5, socket_connect_timeout=0.5)
    try:
        return bool(client.ping())
    except (redis.RedisError, OSError):
        return False
    finally:
        client.close()


def missing_redis_message(workers: int) -> str:
    return (
        f"server.workers: {workers} workers share the prefix index, session affinity and "
        "in-flight counts through Redis, and there is none: set prefixIndex.backend: "
        "replicated (or redis) with prefixIndex.url (redis://host:port/db or unix:///path), "
        "or install redis-server on the PATH for a private one (docs/scale-out.md)"
    )


@dataclass(frozen=True)
class PrivateRedis:
    url: str  # unix://
    proc: subprocess.Popen[bytes]

    def alive(self) -> bool:
        """False once it has exited (it is reaped then)."""
        return self.proc.poll() is None


@contextlib.contextmanager
def private_redis(run_dir: Path, workers: int) -> Iterator[PrivateRedis]:
    """A fresh redis-server on a unix socket for as long as the context lasts."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise ConfigError(missing_redis_message(workers))
    path = run_dir / "redis.sock"
    args = [
        binary, "--port", "0", "--unixsocket", str(path), "--unixsocketperm", "700",
        "--save", "", "--appendonly", "no", "--dir", str(run_dir), "--loglevel", "warning",
    ]
    proc = subprocess.Popen(
        args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, preexec_fn=_die_with_parent
    )
    url = f"unix://{path}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not (path.exists() and _answers(url)):
            if proc.poll() is not None:
                raise ConfigError(f"the private redis-server exited at start ({proc.returncode})")
            if time.monotonic() > deadline:
                raise ConfigError(f"the private redis-server did not answer in {START_TIMEOUT_S}s")
            time.sleep(0.05)
        yield PrivateRedis(url, proc)
    finally:
        proc.terminate()
        try:
            proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(STOP_TIMEOUT_S)
