"""Replay of a Mooncake-style trace as a scripted workload.

A trace row is one request: ``timestamp`` (ms from the trace's start), ``input_length`` and
``output_length`` (tokens), and ``hash_ids``, one id per 512-token block of the prompt, equal
ids being equal blocks. The replay gives each id a fixed text of ``block_tokens`` one-token
words (drawn from the id alone), so two prompts share exactly the leading blocks their rows
share; the last block is cut in proportion to the row's partial last block. Lengths shrink by
``block_tokens / 512`` and arrival times are multiplied by ``time_scale``, so a window of a
production hour fits a short simulated run with the same sharing structure.

A conversation's turns lie minutes apart in such a trace, so a short run of consecutive rows
shares little. ``keep`` thins a longer stretch instead: a row is kept when its conversation (its
second block id, the first being a prompt every row shares) hashes into one of ``keep``
buckets, so kept conversations keep all their turns.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.workloads import _WORDS, Conversation, Step, Workload

TRACE_BLOCK_TOKENS = 512


@dataclass(frozen=True, slots=True)
class TraceRow:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def load_trace(path: Path) -> list[TraceRow]:
    """Rows of a JSONL trace, in file order; a bad row fails with its line number."""
    rows = []
    with path.open() as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                rows.append(TraceRow(float(d["timestamp"]), int(d["input_length"]),
                                     int(d["output_length"]), tuple(int(h) for h in d["hash_ids"])))
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{n}: not a trace row ({exc})") from None
    if not rows:
        raise ValueError(f"{path}: no rows")
    return rows


@dataclass(frozen=True, slots=True)
class TraceParams:
    start: int = 0  # first row of the window
    requests: int = 40  # rows in the window
    block_tokens: int = 32  # tokens standing for one 512-token block
    time_scale: float = 1.0  # simulated seconds per trace second
    keep: int = 1  # keep one conversation in ``keep`` (all of their rows)
    max_output: int = 128
    seed: int = 0


def _block_words(block_id: int, n: int) -> list[str]:
    rng = random.Random(block_id * 1_000_003 + 17)
    return [rng.choice(_WORDS) for _ in range(n)]


def _prompt(row: TraceRow, block_tokens: int) -> str:
    """One-token words (each with its leading space) following the row's block ids."""
    ids = row.hash_ids
    last = row.input_length - TRACE_BLOCK_TOKENS * (len(ids) - 1)
    last_words = max(1, round(block_tokens * min(max(last, 1), TRACE_BLOCK_TOKENS)
                              / TRACE_BLOCK_TOKENS))
    parts: list[str] = []
    for i, block in enumerate(ids):
        n = last_words if i == len(ids) - 1 else block_tokens
        parts.extend(_block_words(block, block_tokens)[:n])
    return "".join(" " + w for w in parts)


def _kept(row: TraceRow, position: int, keep: int) -> bool:
    key = row.hash_ids[1] if len(row.hash_ids) > 1 else position
    return (key * 2654435761) % 2**32 % keep == 0


def window(rows: Sequence[TraceRow], start: int, requests: int, keep: int = 1) -> list[int]:
    """Positions of the first ``requests`` kept rows from ``start`` on (the start moved back
    when the trace ends first, as far as it goes)."""
    if keep == 1:
        first = max(0, min(start, len(rows) - requests))
        return list(range(first, min(first + requests, len(rows))))
    out: list[int] = []
    for first in [*range(min(start, len(rows) - 1), 0, -requests * keep), 0]:
        out = [i for i in range(first, len(rows)) if _kept(rows[i], i, keep)][:requests]
        if len(out) >= requests:
            break
    return out


def trace_workload(rows: Sequence[TraceRow], params: TraceParams | None = None) -> Workload:
    """Rows from ``start`` on (see ``window``) as an open-loop workload: one single-turn
    conversation per row, started at its scaled timestamp."""
    p = params or TraceParams()
    if p.requests < 1 or p.block_tokens < 1 or p.time_scale <= 0 or p.keep < 1:
        raise ValueError("trace replay: requests, block_tokens, keep >= 1, time_scale > 0")
    picked = window(rows, p.start, p.requests, p.keep)
    if not picked:
        raise ValueError("trace replay: no rows in the window")
    start = picked[0]
    window_rows = [rows[i] for i in picked]
    t0 = window_rows[0].timestamp_ms
    scale = p.block_tokens / TRACE_BLOCK_TOKENS
    convs, arrivals = [], []
    for i, row in zip(picked, window_rows, strict=True):
        out = max(1, min(p.max_output, round(row.output_length * scale)))
        step = Step(_prompt(row, p.block_tokens), out)
        convs.append(Conversation(f"trace-{i}", "", (step,)))
        arrivals.append(max(row.timestamp_ms - t0, 0.0) / 1000.0 * p.time_scale)
    return Workload("trace", tuple(convs), len(convs), None, False, p.seed,
                    {**asdict(p), "start": start}, tuple(arrivals))

