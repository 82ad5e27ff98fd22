"""/metrics with several worker processes: every worker answers a scrape with all workers'
series, each labelled ``worker="<slot>"``.

A scrape reaches whichever worker the kernel hands the connection to, so a worker alone would
show a random share of the traffic. Instead each worker serves its own registry on a unix
socket in the supervisor's run directory, and the one scraped reads its siblings' there and
merges the families (one HELP/TYPE block each, as the text format requires). Counters restart
from zero when a worker is replaced, which ``rate()`` reads as an ordinary counter reset;
``sum without (worker) (...)`` gives the gateway's totals. ``prefixgate_worker_up`` says which
workers answered this scrape, so a missing one shows as 0 rather than as a silent dip.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample
from starlette.types import Receive, Scope, Send

ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
Render = Callable[[], bytes]
CONTENT_TYPE = b"text/plain; version=0.0.4; charset=utf-8"
WORKER_LABEL = "worker"
# A sibling busy with a long request still answers between two of its callbacks; one that has
# not within this long is reported down for this scrape rather than holding the scrape.
SIBLING_TIMEOUT_S = 2.0
# Ends a sibling's answer: one cut short (the sibling killed while writing) is otherwise a valid
# exposition with series missing, or a line cut in two that fails the whole scrape.
END_MARK = b"# end of worker registry\n"


def metrics_socket(run_dir: Path, slot: int) -> Path:
    return run_dir / f"metrics-{slot}.sock"


class _Families:
    """A collector over already-merged families, so ``generate_latest`` renders them."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self._families = list(families)

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)


def merge(texts: dict[int, str | None]) -> bytes:
    """Each worker's exposition text (None: it did not answer) as one, labelled by worker."""
    merged: dict[str, Metric] = {}
    up = Metric("prefixgate_worker_up", "1 if the worker answered this scrape.", "gauge")
    for slot, text in sorted(texts.items()):
        up.add_sample("prefixgate_worker_up", {WORKER_LABEL: str(slot)}, 1.0 if text else 0.0)
        for family in text_string_to_metric_families(text or ""):
            into = merged.get(family.name)
            if into is None:
                into = merged[family.name] = Metric(
                    family.name, family.documentation, family.type, family.unit
                )
            into.samples.extend(
                Sample(s.name, {**s.labels, WORKER_LABEL: str(slot)}, s.value, s.timestamp,
                       s.exemplar)
                for s in family.samples
            )
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families([up, *merged.values()]))
    return generate_latest(registry)


async def _read_sibling(path: Path) -> str | None:
    try:
        async with asyncio.timeout(SIBLING_TIMEOUT_S):
            reader, writer = await asyncio.open_unix_connection(str(path))
            try:
                data = await reader.read()
            finally:
                writer.close()
        if not data.endswith(END_MARK):
            return None  # cut short: killed while answering
        return data[: -len(END_MARK)].decode()
    except (OSError, TimeoutError, UnicodeDecodeError):
        return None  # being replaced, or stuck: reported through prefixgate_worker_up


class FleetMetrics:
    """ASGI layer of one worker: ``GET /metrics`` answers for every worker; the rest passes."""

    def __init__(self, app: ASGIApp, render: Render, run_dir: Path, slot: int, count: int) -> None:
        self.app = app
        self._render = render
        self._run_dir = run_dir
        self._slot = slot
        self._count = count

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] == "/metrics" and scope["method"] == "GET":
            body = await self.scrape()
            headers = [(b"content-type", CONTENT_TYPE), (b"content-length", b"%d" % len(body))]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await send({"type": "http.response.body", "body": body})
            return
        await self.app(scope, receive, send)

    async def scrape(self) -> bytes:
        others = [s for s in range(self._count) if s != self._slot]
        answers = await asyncio.gather(
            *(_read_sibling(metrics_socket(self._run_dir, s)) for s in others)
        )
        texts: dict[int, str | None] = dict(zip(others, answers, strict=True))
        # Rendered on the loop: collectors read (and some expire) state only the loop touches.
        texts[self._slot] = self._render().decode()
        # Parsing and relabelling every worker's text takes milliseconds a worker (a tenth of a
        # second for 16 workers and 50 endpoints): in a thread, which yields the interpreter to
        # the event loop every switch interval, rather than a stall of every stream it relays.
        return await asyncio.to_thread(merge, texts)

    @contextlib.asynccontextmanager
    async def serving(self) -> AsyncIterator[None]:
        """This worker's own registry on its unix socket while the context lasts."""
        path = metrics_socket(self._run_dir, self._slot)
        path.unlink(missing_ok=True)  # left by the worker this one replaces

        async def answer(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                writer.writelines((self._render(), END_MARK))
                await writer.drain()
            except OSError:
                pass  # the scraping sibling gave up
            finally:
                writer.close()

        server = await asyncio.start_unix_server(answer, path=str(path))
        try:
            yield
        finally:
            server.close()
            await server.wait_closed()
