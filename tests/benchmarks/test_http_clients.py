"""The HTTP client benchmark runs end to end on a real replica (tiny sizes)."""

from __future__ import annotations

import pytest

from benchmarks.http_clients import CLIENTS, PATHS, main, padded_page
from router.pool.engine_pages import parse_vllm_metrics


def test_the_padded_page_is_a_vllm_page_of_the_size_asked() -> None:
    page = b'vllm:num_requests_waiting{model_name="m"} 3.0\n'
    padded = padded_page(page, 48 * 1024)
    assert padded.startswith(page) and 48 * 1024 <= len(padded) < 50 * 1024
    assert parse_vllm_metrics(padded.decode(), 0.0).waiting == 3.0, "padding adds no series"


def test_every_client_is_measured_on_every_path(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--calls", "5", "--rounds", "1", "--page-kb", "16"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| `")]
    assert len(rows) == len(CLIENTS) * len(PATHS)
    for row in rows:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        assert cells[1] in CLIENTS
        assert float(cells[2].split()[0]) > 0 and float(cells[3]) > 0
    sizes = {float(r.split("(")[1].split()[0]) for r in rows if r.startswith("| `/metrics-vllm`")}
    assert len(sizes) == 1 and 16.0 <= sizes.pop() < 18.0, "the page asked for, one family over"
