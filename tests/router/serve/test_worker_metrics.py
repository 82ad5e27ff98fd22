"""Merging the workers' registries into one scrape, over their real unix sockets."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from starlette.types import Receive, Scope, Send

from router.serve import worker_metrics
from router.serve.worker_metrics import FleetMetrics, merge


def _registry(requests: float, in_flight: float) -> CollectorRegistry:
    r = CollectorRegistry()
    Counter("prefixgate_requests", "Requests.", ["status"], registry=r).labels("200").inc(requests)
    Gauge("prefixgate_endpoint_in_flight", "In flight.", registry=r).set(in_flight)
    Histogram("prefixgate_lag_seconds", "Lag.", buckets=(0.1,), registry=r).observe(0.05)
    return r


def _samples(text: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text.decode())
        for s in family.samples
        if not s.name.endswith("_created")
    }


def test_merge_labels_every_series_by_worker_and_reports_who_answered() -> None:
    texts = {
        0: generate_latest(_registry(3, 1)).decode(),
        1: generate_latest(_registry(5, 2)).decode(),
        2: None,
    }
    text = merge(texts)
    samples = _samples(text)
    assert samples[("prefixgate_requests_total", (("status", "200"), ("worker", "0")))] == 3
    assert samples[("prefixgate_requests_total", (("status", "200"), ("worker", "1")))] == 5
    assert samples[("prefixgate_endpoint_in_flight", (("worker", "1"),))] == 2
    assert samples[("prefixgate_lag_seconds_bucket", (("le", "0.1"), ("worker", "0")))] == 1
    assert [samples[("prefixgate_worker_up", (("worker", str(w)),))] for w in range(3)] == [
        1, 1, 0
    ]
    # One HELP/TYPE block per family, as the text format requires.
    assert text.count(b"# TYPE prefixgate_requests_total counter") == 1


async def _not_found(scope: Scope, receive: Receive, send: Send) -> None:
    await send({"type": "http.response.start", "status": 404, "headers": []})
    await send({"type": "http.response.body", "body": b"inner"})


async def test_a_scrape_of_one_worker_reads_its_siblings_sockets(tmp_path: Path) -> None:
    workers = [
        FleetMetrics(_not_found, lambda n=n: generate_latest(_registry(n + 1, 0)), tmp_path, n, 3)
        for n in range(3)
    ]
    transport = httpx.ASGITransport(app=workers[0])
    async with httpx.AsyncClient(transport=transport, base_url="http://w") as http:
        async with workers[1].serving(), workers[2].serving():
            scraped = await http.get("/metrics")
            other = await http.get("/v1/models")
        gone = _samples((await http.get("/metrics")).content)
    assert scraped.status_code == 200
    assert scraped.headers["content-type"].startswith("text/plain; version=0.0.4")
    samples = _samples(scraped.content)
    assert [
        samples[("prefixgate_requests_total", (("status", "200"), ("worker", str(n))))]
        for n in range(3)
    ] == [1, 2, 3]
    assert other.status_code == 404 and other.text == "inner", "the rest goes to the app"
    assert [gone[("prefixgate_worker_up", (("worker", str(n)),))] for n in range(3)] == [1, 0, 0]


async def test_merging_runs_off_the_event_loop_and_rendering_on_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Merging takes tens of milliseconds a scrape with many workers and endpoints: on the
    loop, every stream the worker relays would stall that long. Rendering stays on the loop:
    collectors read state only the loop may touch."""
    loop_thread = threading.current_thread()
    rendered: list[threading.Thread] = []
    merged: list[threading.Thread] = []

    def render(n: int) -> bytes:
        rendered.append(threading.current_thread())
        return generate_latest(_registry(n, 0))

    def merging(texts: dict[int, str | None]) -> bytes:
        merged.append(threading.current_thread())
        return merge(texts)

    monkeypatch.setattr(worker_metrics, "merge", merging)
    workers = [FleetMetrics(_not_found, lambda n=n: render(n), tmp_path, n, 2) for n in range(2)]
    async with workers[1].serving():
        await workers[0].scrape()
    assert rendered == [loop_thread, loop_thread]
    assert len(merged) == 1 and merged[0] is not loop_thread


@pytest.mark.parametrize("cut", ["mid-line", "at-a-line-end"])
async def test_a_sibling_cut_off_mid_answer_is_reported_down_not_half_merged(
    tmp_path: Path, cut: str
) -> None:
    """A sibling killed while writing its registry (OOM) leaves part of it: merged as it is, a
    line cut in two would fail the whole scrape, and a cut at a line end would pass for a whole
    answer with series (histogram buckets) missing. It is down for this scrape instead."""
    whole = generate_latest(_registry(7, 0))
    end = whole.index(b'prefixgate_requests_total{status="200"}')
    part = whole[: end + 20] if cut == "mid-line" else whole[:end]

    async def answer(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(part)
        await writer.drain()
        writer.close()

    server = await asyncio.start_unix_server(
        answer, path=str(worker_metrics.metrics_socket(tmp_path, 1))
    )
    try:
        scraper = FleetMetrics(_not_found, lambda: generate_latest(_registry(1, 0)), tmp_path, 0, 2)
        samples = _samples(await scraper.scrape())
    finally:
        server.close()
        await server.wait_closed()
    assert samples[("prefixgate_worker_up", (("worker", "1"),))] == 0
    assert samples[("prefixgate_worker_up", (("worker", "0"),))] == 1
    assert not [key for key in samples if ("worker", "1") in key[1]
                and key[0] != "prefixgate_worker_up"]
