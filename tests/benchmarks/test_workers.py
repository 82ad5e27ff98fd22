"""The workers benchmark's measuring parts: wrk's report and a process tree's CPU and
context switches."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import pytest

from benchmarks.proc_cpu import Usage, tree_cpu_seconds, tree_usage
from benchmarks.workers import Run, paired_ratio, parse_wrk

REPORT = """Running 8s test @ http://127.0.0.1:1/v1/chat/completions
  2 threads and 32 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency    43.10ms    9.02ms 120.00ms   80.00%
  5866 requests in 8.06s, 4.10MB read
  Socket errors: connect 0, read 2, write 0, timeout 1
  Non-2xx or 3xx responses: 4
Requests/sec:    727.95
Transfer/sec:    521.00KB
"""


def test_parse_wrk_counts_requests_rate_and_every_kind_of_error() -> None:
    assert parse_wrk(REPORT) == (5866, 727.95, 7)
    clean = REPORT.replace("  Socket errors: connect 0, read 2, write 0, timeout 1\n", "")
    assert parse_wrk(clean.replace("  Non-2xx or 3xx responses: 4\n", "")) == (5866, 727.95, 0)
    with pytest.raises(ValueError, match="not a wrk report"):
        parse_wrk("wrk: command failed")


def test_tree_cpu_counts_the_children() -> None:
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\n"
    # Our own CPU is read first: the tree's walk of /proc costs this process CPU too (tens of
    # ms on a loaded machine), which a later reading of our own would subtract.
    with _child(burn) as child:
        assert _poll(child, _childrens_cpu, 0.25)


def test_tree_usage_counts_a_childs_waits_as_voluntary_switches() -> None:
    # 200 sleeps, each a wait: a voluntary context switch of the child. Only the child's tree
    # is read: this test's own polling sleeps would count in ours.
    waits = "import time\nfor _ in range(200): time.sleep(0.0005)\n"
    with _child(waits) as child:
        assert _poll(child, lambda: tree_usage(child.pid).voluntary, 200)


@contextlib.contextmanager
def _child(code: str) -> Iterator[subprocess.Popen[bytes]]:
    """A Python child running ``code``, then alive (waiting on stdin) until the test ends."""
    child = subprocess.Popen([sys.executable, "-c", code + "input()"], stdin=subprocess.PIPE)
    try:
        yield child
    finally:
        child.kill()
        child.wait(5)


def _poll(child: subprocess.Popen[bytes], read: Callable[[], float], least: float) -> bool:
    """Whether ``read()`` reaches ``least`` while the child lives (30 s bound, a loaded
    machine)."""
    for _ in range(600):
        if read() >= least:
            return True
        assert child.poll() is None
        time.sleep(0.05)
    return False


def test_run_reports_cpu_per_request_from_user_and_kernel_time() -> None:
    run = Run(2, 1000.0, 4000, 0, Usage(user_s=1.0, system_s=0.6, voluntary=8000))
    assert run.cpu_ms_per_request == pytest.approx(0.4)
    assert run.per_request(run.usage.voluntary) == 2.0
    assert (Usage(2.0, 1.0, 5, 3) - Usage(0.5, 0.25, 1, 1)) == Usage(1.5, 0.75, 4, 2)


def _childrens_cpu() -> float:
    own = _own()  # first: the walk of /proc that follows costs this process CPU too
    return tree_cpu_seconds(os.getpid()) - own


def _own() -> float:
    times = os.times()
    return times.user + times.system


def _run(workers: int, cpu_s: float, requests: int = 1000) -> Run:
    return Run(workers, 100.0, requests, 0, Usage(cpu_s, 0.0, 0, 0))


def test_paired_ratio_pairs_each_round_with_its_own_base() -> None:
    # The base's CPU a request drifts by half between rounds; each round's pair moves with it.
    runs = [_run(1, 0.2), _run(2, 0.22), _run(1, 0.3), _run(2, 0.33), _run(1, 0.25),
            _run(2, 0.275)]
    ratio = paired_ratio(runs, 2, 1)
    assert ratio is not None
    mean, low, high, rounds = ratio
    assert rounds == 3
    assert mean == pytest.approx(1.1)
    assert low == pytest.approx(1.1) and high == pytest.approx(1.1)  # no spread between pairs


def test_paired_ratio_interval_covers_the_rounds_spread() -> None:
    runs = [_run(1, 0.3), _run(2, 0.27), _run(1, 0.3), _run(2, 0.33), _run(1, 0.3),
            _run(2, 0.3)]
    ratio = paired_ratio(runs, 2, 1)
    assert ratio is not None
    mean, low, high, _ = ratio
    assert low < 1.0 < high
    assert mean == pytest.approx((0.9 * 1.1 * 1.0) ** (1 / 3))


def test_paired_ratio_needs_two_rounds() -> None:
    assert paired_ratio([_run(1, 0.3), _run(2, 0.3)], 2, 1) is None
