"""The relay-cost benchmark runs end to end on a real replica and gateway (tiny sizes)."""

from __future__ import annotations

import pytest

from benchmarks.relay_cost import main


def test_relay_cost_reports_cpu_per_chunk(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--rounds", "1", "--requests", "4", "--concurrency", "2", "--speed", "50"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 1 |")]
    assert len(rows) == 1
    cells = [cell.strip() for cell in rows[0].strip("|").split("|")]
    chunks, per_chunk = int(cells[1].replace(",", "")), float(cells[4])
    assert chunks >= 4 * 50  # four streams of up to 300 tokens, a chunk per token or a few
    assert per_chunk > 0
