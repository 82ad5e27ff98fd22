"""CPU time of a process and its descendants, from /proc (Linux).

Taken before and after a load run, the difference over the requests served is a router's CPU
per request: unlike throughput, it barely depends on what else the (shared) machine is doing.
Children that exited during the run are not counted (no router here forks per request).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

PROC = Path("/proc")


def _stat_fields(pid: int) -> list[str] | None:
    try:
        text = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None  # exited meanwhile
    # The command name (field 2) may hold spaces: split after its closing parenthesis.
    return text[text.rindex(")") + 2 :].split()


def _children(pid: int) -> Iterator[int]:
    for entry in PROC.iterdir():
        if entry.name.isdigit():
            fields = _stat_fields(int(entry.name))
            if fields is not None and int(fields[1]) == pid:
                yield int(entry.name)


def tree_cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` and every live descendant, in seconds."""
    ticks = float(os.sysconf("SC_CLK_TCK"))
    total, todo, seen = 0.0, [pid], set()
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        fields = _stat_fields(current)
        if fields is None:
            continue
        # After the name: state is field 3, so utime (14) and stime (15) are at 11 and 12.
        total += (int(fields[11]) + int(fields[12])) / ticks
        todo.extend(_children(current))
    return total
