"""Trace replay: prompts share exactly the leading blocks their rows share; times scale."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.sim.tokenizer import Tokenizer
from benchmarks.trace_replay import TraceParams, TraceRow, load_trace, trace_workload, window

ROWS = [
    {"timestamp": 1000, "input_length": 1300, "output_length": 512, "hash_ids": [0, 1, 2]},
    {"timestamp": 1500, "input_length": 1100, "output_length": 64, "hash_ids": [0, 1, 3]},
    {"timestamp": 3000, "input_length": 700, "output_length": 3, "hash_ids": [4, 5]},
    {"timestamp": 4000, "input_length": 1024, "output_length": 10, "hash_ids": [0, 1]},
]


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return path


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_prompts_follow_the_block_ids(trace: Path) -> None:
    wl = trace_workload(load_trace(trace), TraceParams(requests=4, block_tokens=16, seed=1))
    tok = Tokenizer()
    ids = [tok.encode(c.steps[0].content) for c in wl.conversations]
    # 16 one-token words per 512-token block; the last block cut in proportion.
    assert [len(i) for i in ids] == [16 + 16 + 9, 16 + 16 + 2, 16 + 6, 32]
    assert _common_prefix(ids[0], ids[1]) == 32  # blocks 0 and 1
    assert _common_prefix(ids[0], ids[2]) == 0
    assert ids[3] == ids[0][:32]  # the same two blocks, nothing more
    assert [c.steps[0].max_tokens for c in wl.conversations] == [16, 2, 1, 1]
    assert wl.rate is None and wl.concurrency == 4 and not wl.send_session_id


def test_window_and_time_scale(trace: Path) -> None:
    rows = load_trace(trace)
    wl = trace_workload(rows, TraceParams(start=1, requests=2, time_scale=0.5))
    assert wl.arrivals == (0.0, 0.75)
    assert [c.session_id for c in wl.conversations] == ["trace-1", "trace-2"]
    # A window past the end moves back to fit.
    late = trace_workload(rows, TraceParams(start=3, requests=3))
    assert [c.session_id for c in late.conversations] == ["trace-1", "trace-2", "trace-3"]
    assert late.params["start"] == 1


def test_bad_rows_name_their_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n" + '{"timestamp": 1}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2"):
        load_trace(path)


def test_keep_thins_whole_conversations(tmp_path: Path) -> None:
    rows = [TraceRow(i * 100.0, 1024, 8, (0, 1000 + i % 7, 5000 + i)) for i in range(700)]
    picked = window(rows, 0, 50, keep=3)
    assert len(picked) == 50
    kept = {rows[i].hash_ids[1] for i in picked}
    assert 1 <= len(kept) < 7  # some conversations, each with every one of its rows
    assert [i for i in range(picked[-1] + 1) if rows[i].hash_ids[1] in kept] == picked
    # Near the end, the start moves back until enough rows are found.
    assert len(window(rows, 690, 50, keep=3)) == 50
