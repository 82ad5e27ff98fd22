"""The relay-cost benchmark runs end to end on a real replica and gateway (tiny sizes)."""

from __future__ import annotations

import pytest

from benchmarks.relay_cost import main


def test_relay_cost_reports_cpu_per_chunk(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--rounds", "1", "--requests", "4", "--concurrency", "2", "--speed", "50"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 1 |")]
    assert len(rows) == 1
    cells = [cell.strip() for cell in rows[0].strip("|").split("|")]
    chunks, cpu, per_chunk = int(cells[1].replace(",", "")), float(cells[3]), float(cells[4])
    # How many reads the client's 4 streams took is the machine's business: a loaded one
    # coalesces tokens (79 reads were seen, against 1,200 tokens). Every stream was counted,
    # and the figure reported is the CPU time divided by them.
    assert chunks >= 4
    assert per_chunk > 0
    assert per_chunk == pytest.approx(cpu / chunks * 1e6, abs=0.05 + 0.005 * 1e6 / chunks)
