"""CPU time and context switches of a process and its descendants, from /proc (Linux).

Taken before and after a load run, the difference over the requests served is a router's CPU
per request: unlike throughput, it barely depends on what else the (shared) machine is doing.
User and kernel time are kept apart, with the context switches, because where two setups
differ tells why: the gateway's own Python shows in user time, the sockets and wake-ups in
kernel time and voluntary switches. Children that exited during the run are not counted (no
router here forks per request).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")


@dataclass(frozen=True)
class Usage:
    """CPU seconds in user and kernel mode, and context switches (voluntary: the process
    waited, e.g. in epoll; involuntary: it was preempted)."""

    user_s: float = 0.0
    system_s: float = 0.0
    voluntary: int = 0
    involuntary: int = 0

    @property
    def cpu_s(self) -> float:
        return self.user_s + self.system_s

    def __sub__(self, other: Usage) -> Usage:
        return Usage(
            self.user_s - other.user_s, self.system_s - other.system_s,
            self.voluntary - other.voluntary, self.involuntary - other.involuntary,
        )


def _stat_fields(pid: int) -> list[str] | None:
    try:
        text = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None  # exited meanwhile
    # The command name (field 2) may hold spaces: split after its closing parenthesis.
    return text[text.rindex(")") + 2 :].split()


def _parents() -> dict[int, int]:
    """pid -> parent pid of every live process."""
    parents: dict[int, int] = {}
    for entry in PROC.iterdir():
        if entry.name.isdigit():
            fields = _stat_fields(int(entry.name))
            if fields is not None:
                parents[int(entry.name)] = int(fields[1])
    return parents


def _tree(root: int) -> set[int]:
    parents = _parents()
    children: dict[int, list[int]] = {}
    for pid, parent in parents.items():
        children.setdefault(parent, []).append(pid)
    tree, todo = set(), [root]
    while todo:
        current = todo.pop()
        if current not in tree:
            tree.add(current)
            todo.extend(children.get(current, ()))
    return tree


def _switches(pid: int) -> tuple[int, int]:
    """(voluntary, involuntary) context switches summed over every live thread of ``pid``
    (a thread that ended between two readings takes its count with it: the gateway's threads
    live as long as it does)."""
    voluntary = involuntary = 0
    with contextlib.suppress(OSError):
        for task in (PROC / str(pid) / "task").iterdir():
            with contextlib.suppress(OSError):
                for line in (task / "status").read_text().splitlines():
                    if line.startswith("voluntary_ctxt_switches:"):
                        voluntary += int(line.split()[1])
                    elif line.startswith("nonvoluntary_ctxt_switches:"):
                        involuntary += int(line.split()[1])
    return voluntary, involuntary


def tree_usage(pid: int) -> Usage:
    """What ``pid`` and every live descendant have used so far."""
    ticks = float(os.sysconf("SC_CLK_TCK"))
    user = system = 0.0
    voluntary = involuntary = 0
    for current in _tree(pid):
        fields = _stat_fields(current)
        if fields is None:
            continue
        # After the name: state is field 3, so utime (14) and stime (15) are at 11 and 12.
        user += int(fields[11]) / ticks
        system += int(fields[12]) / ticks
        v, i = _switches(current)
        voluntary, involuntary = voluntary + v, involuntary + i
    return Usage(user, system, voluntary, involuntary)


def tree_cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` and every live descendant, in seconds."""
    return tree_usage(pid).cpu_s
