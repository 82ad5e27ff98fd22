"""Locust: agentic users against any OpenAI-compatible endpoint (prefixgate, a peer, vLLM).

Each user runs agentic coding sessions from ``benchmarks.workloads.agentic_sessions``: a long
system prompt and tools per agent type, a context that grows every turn by the answer and a
tool result, think gaps, sub-agent bursts sent in parallel from the parent's context, prefix
resets. Every request streams and carries ``x-session-id``. Besides Locust's own response
times (to the response headers), it reports ``TTFT`` (first content token) and ``E2E`` rows.

Headless, 32 users for 2 minutes, against a gateway on :8000 (run from the repo root)::

    locust -f benchmarks/locustfile.py --host http://127.0.0.1:8000 --headless \\
        -u 32 -r 4 -t 2m --model sim-model --preset small --time-scale 5

Web UI on http://127.0.0.1:8089 (bind it to loopback)::

    locust -f benchmarks/locustfile.py --host http://127.0.0.1:8000 --web-host 127.0.0.1

``--time-scale`` divides think gaps (use the simulator's ``--speed``; 1 for real servers).
"""

from __future__ import annotations

import itertools
import time
from typing import Any

import gevent
import orjson
from locust import HttpUser, constant, events, task

from benchmarks.workloads import AGENTIC_PRESETS, Conversation, Step, SubAgent, agentic_sessions

_user_ids = itertools.count()


def _arguments(parser: Any) -> None:
    parser.add_argument("--model", default="sim-model", help="model name to request")
    parser.add_argument("--preset", default="small", choices=sorted(AGENTIC_PRESETS))
    parser.add_argument("--time-scale", type=float, default=1.0, help="think gaps / this")
    parser.add_argument("--workload-seed", type=int, default=0)


# Locust reads its extra flags through this hook; a locustfile is only ever loaded by Locust.
# (Typed as Any: locust's hooks are untyped, and it is absent where only the tests are.)
_parser_hook: Any = events.init_command_line_parser
_parser_hook.add_listener(_arguments)


# The ignores are for CI, where locust (the bench extra) is absent and so typed as Any.
class AgenticUser(HttpUser):  # type: ignore[misc, unused-ignore]
    """One agent at a time: a session, then the next one (sessions differ per user)."""

    wait_time = constant(0)

    def on_start(self) -> None:
        opts = self.environment.parsed_options
        self.model = getattr(opts, "model", "sim-model")
        self.scale = max(getattr(opts, "time_scale", 1.0), 1e-6)
        preset = AGENTIC_PRESETS[getattr(opts, "preset", "small")]
        seed = getattr(opts, "workload_seed", 0) * 100_003 + next(_user_ids)
        self.sessions = itertools.cycle(agentic_sessions(**{**preset, "seed": seed}).conversations)

    @task  # type: ignore[untyped-decorator, unused-ignore]
    def session(self) -> None:
        conv = next(self.sessions)
        messages = [{"role": "system", "content": conv.system}]
        self._steps(conv, messages, conv.steps, "main")

    def _steps(
        self, conv: Conversation, messages: list[dict[str, Any]], steps: Any, kind: str
    ) -> bool:
        for step in steps:
            if step.think_s:
                time.sleep(step.think_s / self.scale)  # gevent-patched: yields to other users
            if step.reset is not None:
                del messages[1:]
                messages.append({"role": "user", "content": step.reset})
            messages.append({"role": "user", "content": step.content})
            answer = self._chat(conv, messages, step, kind)
            if answer is None:
                return False
            messages.append({"role": "assistant", "content": answer})
            if step.burst:
                gevent.joinall([
                    gevent.spawn(self._subagent, conv, list(messages), agent)
                    for agent in step.burst
                ])
        return True

    def _subagent(self, conv: Conversation, messages: list[dict[str, Any]], a: SubAgent) -> None:
        self._steps(conv, messages, a.steps, "subagent")

    def _chat(
        self, conv: Conversation, messages: list[dict[str, Any]], step: Step, kind: str
    ) -> str | None:
        body: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "max_tokens": step.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if conv.tools:
            body["tools"] = list(conv.tools)
        headers = {"content-type": "application/json", "x-session-id": conv.session_id}
        name = f"chat ({kind})"
        started = time.perf_counter()
        first: float | None = None
        parts: list[str] = []
        with self.client.post(
            "/v1/chat/completions", data=orjson.dumps(body), headers=headers, name=name,
            stream=True, catch_response=True,
        ) as resp:
            if resp.status_code != 200:
                resp.failure(f"HTTP {resp.status_code}: {resp.text[:200]}")
                return None
            for line in resp.iter_lines():
                if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
                    continue
                event = orjson.loads(line[5:])
                if "error" in event:
                    resp.failure(str(event["error"])[:200])
                    return None
                for choice in event.get("choices") or ():
                    text = (choice.get("delta") or {}).get("content") or ""
                    if text:
                        first = first if first is not None else time.perf_counter()
                        parts.append(text)
            resp.success()
        done = time.perf_counter()
        if first is not None:
            self._report("TTFT", name, first - started)
        self._report("E2E", name, done - started)
        return "".join(parts)

    def _report(self, kind: str, name: str, seconds: float) -> None:
        self.environment.events.request.fire(
            request_type=kind, name=name, response_time=seconds * 1000.0,
            response_length=0, exception=None, context={},
        )
