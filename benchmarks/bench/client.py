"""Runs a scripted workload against OpenAI-compatible endpoints, streaming every request.

Client-side figures per request: time to the first content token, time per output token after
it, end-to-end time, and the usage the server reports (prompt, completion, cached tokens).
Think gaps are simulated seconds divided by ``speed``; recorded times are wall seconds (the
report converts them). Several target URLs (gateway replicas behind a load balancer) take
requests in turn.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from benchmarks.bench.conversation import (
    BLOCK_SIZE,
    ConversationState,
    Prompt,
    ReuseLedger,
    new_state,
)
from benchmarks.sim.tokenizer import Tokenizer
from benchmarks.workloads import Conversation, Step, SubAgent, Workload

DESTINATION_HEADER = "x-gateway-destination-endpoint"
REQUEST_ID_HEADER = "x-request-id"


@dataclass(slots=True)
class RequestRecord:
    kind: str
    sent_at: float
    status: int
    ok: bool
    ttft: float | None = None
    e2e: float | None = None
    tpot: float | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    reusable_tokens: int = 0
    destination: str | None = None
    error: str | None = None
    session: str = ""
    request_id: str | None = None
    # Sub-agents launched together with this request's sub-agent, itself included (0 for a
    # main conversation), and the request's place in its script: a burst's first turns are
    # ``group > 0, turn == 0``. ``benchmarks.ttft_tail`` classes the TTFT tail by them.
    group: int = 0
    turn: int = 0


@dataclass(slots=True)
class ClientRun:
    planned: int
    records: list[RequestRecord] = field(default_factory=list)
    ledger: ReuseLedger = field(default_factory=ReuseLedger)
    wall_s: float = 0.0
    timed_out: bool = False

    @property
    def errors(self) -> int:
        return sum(1 for r in self.records if not r.ok)

    @property
    def incomplete(self) -> int:
        """Requests never answered: cut by the deadline or skipped after an earlier error."""
        return self.planned - len(self.records)


@dataclass(slots=True)
class _Stream:
    answer: list[str] = field(default_factory=list)
    first: float | None = None
    last: float | None = None
    chunks: int = 0
    usage: dict[str, Any] | None = None
    error: str | None = None


def _consume(stream: _Stream, line: bytes, now: float) -> None:
    if not line.startswith(b"data:"):
        return
    data = line[5:].strip()
    if not data or data == b"[DONE]":
        return
    event = orjson.loads(data)
    if "error" in event:
        stream.error = str(event["error"].get("message", event["error"]))[:200]
        return
    if event.get("usage"):
        stream.usage = event["usage"]
    for choice in event.get("choices") or ():
        delta = choice.get("delta") or {}
        text = delta.get("content") or choice.get("text") or ""
        if text:
            stream.answer.append(text)
            stream.chunks += 1
            stream.first = stream.first if stream.first is not None else now
            stream.last = now


class WorkloadClient:
    def __init__(
        self,
        targets: Sequence[str],
        workload: Workload,
        *,
        model: str = "sim-model",
        speed: float = 1.0,
        deadline_s: float = 300.0,
        bytes_per_token: float | None = None,
        block_size: int = BLOCK_SIZE,
        on_record: Callable[[RequestRecord], None] | None = None,
    ) -> None:
        if not targets:
            raise ValueError("at least one target URL is needed")
        self.targets = [t.rstrip("/") for t in targets]
        self.workload = workload
        self.model = model
        self.speed = speed
        self.deadline_s = deadline_s
        self.on_record = on_record
        # The reuse ledger tokenizes and cuts blocks as the replicas do, or it bounds nothing.
        self._tok = Tokenizer(bytes_per_token)
        self._block_size = block_size
        self._sent = 0
        self._t0 = 0.0
        self._run = ClientRun(workload.num_requests, ledger=ReuseLedger(block_size))
        self._http: aiohttp.ClientSession | None = None

    async def run(self) -> ClientRun:
        wl = self.workload
        gate = asyncio.Semaphore(max(1, wl.concurrency))
        starts = self._arrivals()
        connector = aiohttp.TCPConnector(limit=0, force_close=False)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
        self._t0 = time.perf_counter()

        async def one(conv: Conversation, start: float) -> None:
            if start > 0:
                await asyncio.sleep(start)
            async with gate:
                await self._conversation(conv)

        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
            self._http = http
            pairs = zip(wl.conversations, starts, strict=True)
            tasks = [asyncio.create_task(one(c, s)) for c, s in pairs]
            try:
                async with asyncio.timeout(self.deadline_s):
                    await asyncio.gather(*tasks)
            except TimeoutError:
                self._run.timed_out = True
            finally:
                for task in tasks:
                    task.cancel()
                for task in tasks:
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
        self._run.wall_s = time.perf_counter() - self._t0
        return self._run

    def _arrivals(self) -> list[float]:
        wl = self.workload
        if wl.arrivals is not None:
            return [t / self.speed for t in wl.arrivals]
        if not wl.rate:
            return [0.0] * len(wl.conversations)
        rng = random.Random(wl.seed + 7919)
        t, out = 0.0, []
        for _ in wl.conversations:
            out.append(t / self.speed)
            t += rng.expovariate(wl.rate)
        return out

    async def _conversation(self, conv: Conversation) -> None:
        state = new_state(self._tok, conv, self._block_size)
        await self._steps(state, conv, conv.steps, conv.kind)

    async def _steps(
        self,
        state: ConversationState,
        conv: Conversation,
        steps: Sequence[Step],
        kind: str,
        group: int = 0,
    ) -> bool:
        for turn, step in enumerate(steps):
            if step.think_s > 0:
                await asyncio.sleep(step.think_s / self.speed)
            if step.reset is not None:
                state.reset(step.reset)
            state.add("user", step.content)
            answer = await self._request(state, conv, step.max_tokens, kind, group, turn)
            if answer is None:
                return False  # no answer to build on: the rest of this script cannot run
            state.add("assistant", answer)
            if step.burst:
                size = len(step.burst)
                await asyncio.gather(
                    *(self._subagent(state, conv, a, size) for a in step.burst)
                )
        return True

    async def _subagent(
        self, parent: ConversationState, conv: Conversation, a: SubAgent, group: int
    ) -> None:
        await self._steps(parent.fork(), conv, a.steps, "subagent", group)

    def _body(self, prompt: Prompt, conv: Conversation, max_tokens: int) -> bytes:
        body: dict[str, Any] = {
            "model": self.model,
            "messages": prompt.messages,
            "max_tokens": max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if conv.tools:
            body["tools"] = list(conv.tools)
        return orjson.dumps(body)

    async def _request(
        self,
        state: ConversationState,
        conv: Conversation,
        max_tokens: int,
        kind: str,
        group: int,
        turn: int,
    ) -> str | None:
        assert self._http is not None
        prompt = state.prompt()
        url = self.targets[self._sent % len(self.targets)] + "/v1/chat/completions"
        self._sent += 1
        headers = {"content-type": "application/json"}
        if self.workload.send_session_id:
            headers["x-session-id"] = conv.session_id
        payload = self._body(prompt, conv, max_tokens)
        reusable = self._run.ledger.sent(len(prompt.ids), prompt.chain)
        started = time.perf_counter()
        record = RequestRecord(
            kind, started - self._t0, 0, False, reusable_tokens=reusable,
            session=conv.session_id, group=group, turn=turn,
        )
        stream = _Stream()
        try:
            async with self._http.post(url, data=payload, headers=headers) as resp:
                record.status = resp.status
                record.destination = resp.headers.get(DESTINATION_HEADER)
                record.request_id = resp.headers.get(REQUEST_ID_HEADER)
                if resp.status != 200:
                    record.error = (await resp.text())[:200]
                else:
                    async for line in resp.content:
                        _consume(stream, line, time.perf_counter())
        except (aiohttp.ClientError, OSError, ValueError) as exc:
            record.error = f"{type(exc).__name__}: {exc}"[:200]
        record.e2e = time.perf_counter() - started
        return self._finish(record, stream, state, prompt, started)

    def _finish(
        self,
        record: RequestRecord,
        stream: _Stream,
        state: ConversationState,
        prompt: Prompt,
        started: float,
    ) -> str | None:
        answer: str | None = None
        # A transport or parse error after the first token (a stream cut mid-answer) fails
        # the request too: its answer never completed.
        answered = record.error is None and stream.error is None
        if record.status == 200 and answered and stream.first is not None:
            record.ok = True
            record.ttft = stream.first - started
            usage = stream.usage or {}
            record.completion_tokens = int(usage.get("completion_tokens") or stream.chunks)
            record.prompt_tokens = int(usage.get("prompt_tokens") or len(prompt.ids))
            details = usage.get("prompt_tokens_details") or {}
            record.cached_tokens = int(details.get("cached_tokens") or 0)
            if record.completion_tokens > 1 and stream.last is not None:
                record.tpot = (stream.last - stream.first) / (record.completion_tokens - 1)
            answer = "".join(stream.answer)
            answer_ids = self._tok.encode(answer)
            self._run.ledger.answered(state.answer_chain(prompt, answer_ids))
        elif record.error is None:
            record.error = stream.error or "empty stream"
        self._run.records.append(record)
        if self.on_record is not None:
            self.on_record(record)
        return answer
