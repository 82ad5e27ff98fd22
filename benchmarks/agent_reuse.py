"""Prefix reuse captured for the same agentic sessions through each client API.

Every session is a coding agent's loop: a system prompt and tools shared by its agent type, a
first user message, then turns that alternate a forced tool call (answered with a tool result)
and a text answer (followed by a new user message). The same sessions run through chat
completions (openai SDK), the Anthropic Messages API (anthropic SDK, with Claude Code's habits:
system blocks led by a per-request billing header, a ``cache_control`` marker that moves to the
newest block every turn) and the OpenAI Responses API (openai SDK, the whole history every
turn with ``store: false``, as Codex sends it). By default no session key is sent, so only the
prefix index keeps a session's turns together.

The captured share is the replicas' cached prompt tokens over the reuse the sessions offer
(:mod:`benchmarks.reuse`, computed on the prompts the simulator really ran)::

    python -m benchmarks.agent_reuse --sessions 24 --turns 8
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import random
import uuid
from dataclasses import dataclass
from typing import Any

import anthropic
import openai

from benchmarks.driver import cache_stats
from benchmarks.reuse import ReuseTracker
from benchmarks.sim import anthropic_api as sim_anthropic
from benchmarks.sim import responses_api as sim_responses
from benchmarks.sim.cli import start_replicas
from benchmarks.sim.config import SimConfig
from benchmarks.sim.tokenizer import Tokenizer
from benchmarks.workloads import words

APIS = ("chat", "messages", "responses")
MODEL = "sim-model"
TOOL = "run"


@dataclass(frozen=True, slots=True)
class AgentSession:
    session_id: str
    system: str
    tool_description: str
    # The text appended before each request: a user message, or the result of the tool call
    # the previous answer made.
    turns: tuple[str, ...]
    max_tokens: int


def agentic_sessions(
    sessions: int = 12,
    turns: int = 8,
    agent_types: int = 2,
    system_tokens: int = 600,
    turn_tokens: int = 250,
    max_tokens: int = 40,
    seed: int = 0,
) -> list[AgentSession]:
    rng = random.Random(seed)
    systems = [f"agent {t}: " + words(rng, system_tokens) for t in range(agent_types)]
    tools = [words(rng, 60) for _ in range(agent_types)]
    return [
        AgentSession(
            f"agent-{seed}-{s}",
            systems[s % agent_types],
            tools[s % agent_types],
            tuple(words(rng, turn_tokens) for _ in range(turns)),
            max_tokens,
        )
        for s in range(sessions)
    ]


def _schema() -> dict[str, Any]:
    return {"type": "object", "properties": {"input": {"type": "string"}}}


@dataclass(slots=True)
class Outcome:
    requests: int = 0
    errors: int = 0


# The chat messages and tools a request ran as on the replica (for the reuse it offers).
Prompt = tuple[list[dict[str, Any]], list[Any] | None]


class _Chat:
    def __init__(self, client: openai.AsyncOpenAI, s: AgentSession, keyed: bool) -> None:
        self.client, self.s = client, s
        self.tools = [
            {
                "type": "function",
                "function": {
                    "name": TOOL,
                    "description": s.tool_description,
                    "parameters": _schema(),
                },
            }
        ]
        self.messages: list[dict[str, Any]] = [{"role": "system", "content": s.system}]
        self.headers = {"x-session-id": s.session_id} if keyed else {}
        self.call_id: str | None = None
        self.sent: Prompt = ([], None)

    async def step(self, k: int, text: str) -> str:
        if self.call_id is None:
            self.messages.append({"role": "user", "content": text})
        else:
            self.messages.append({"role": "tool", "tool_call_id": self.call_id, "content": text})
        self.sent = (list(self.messages), self.tools)
        body: dict[str, Any] = {
            "model": MODEL,
            "messages": self.messages,
            "tools": self.tools,
            "tool_choice": "required" if k % 2 == 0 else "auto",
            "max_tokens": self.s.max_tokens,
            "extra_headers": self.headers,
        }
        reply = await self.client.chat.completions.create(**body)
        message = reply.choices[0].message
        calls = message.tool_calls or []
        self.call_id = calls[0].id if calls else None
        if calls:
            self.messages.append(
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [c.model_dump(include={"id", "type", "function"}) for c in calls],
                }
            )
            return str(calls[0].model_dump()["function"]["arguments"])
        self.messages.append({"role": "assistant", "content": message.content})
        return message.content or ""


class _Messages:
    def __init__(self, client: anthropic.AsyncAnthropic, s: AgentSession, keyed: bool) -> None:
        self.client, self.s, self.keyed = client, s, keyed
        self.tools = [{"name": TOOL, "description": s.tool_description, "input_schema": _schema()}]
        self.messages: list[dict[str, Any]] = []
        self.tool_use_id: str | None = None
        self.body: dict[str, Any] = {}
        self.sent: Prompt = ([], None)

    async def step(self, k: int, text: str) -> str:
        if self.tool_use_id is None:
            block = {"type": "text", "text": text}
        else:
            block = {"type": "tool_result", "tool_use_id": self.tool_use_id, "content": text}
        self.messages.append({"role": "user", "content": [block]})
        messages = copy.deepcopy(self.messages)
        messages[-1]["content"][-1]["cache_control"] = {"type": "ephemeral"}
        billing = f"x-anthropic-billing-header: cc_version=2.0; cch={uuid.uuid4().hex[:5]};"
        self.body = {
            "model": MODEL,
            "max_tokens": self.s.max_tokens,
            "messages": messages,
            "system": [
                {"type": "text", "text": billing},
                {"type": "text", "text": self.s.system, "cache_control": {"type": "ephemeral"}},
            ],
            "tools": self.tools,
            "tool_choice": {"type": "any"} if k % 2 == 0 else {"type": "auto"},
        }
        if self.keyed:
            self.body["metadata"] = {"user_id": f"user_x_session_{self.s.session_id}"}
        chat = sim_anthropic.to_chat_body(self.body)
        self.sent = (chat["messages"], chat.get("tools"))
        reply = await self.client.messages.create(**self.body)
        content = [b.model_dump(exclude_none=True) for b in reply.content]
        self.messages.append({"role": "assistant", "content": content})
        uses = [b for b in reply.content if b.type == "tool_use"]
        self.tool_use_id = uses[0].id if uses else None
        if uses:
            return str(uses[0].input.get("input", ""))
        return "".join(b.text for b in reply.content if b.type == "text")


class _Responses:
    def __init__(self, client: openai.AsyncOpenAI, s: AgentSession, keyed: bool) -> None:
        self.client, self.s, self.keyed = client, s, keyed
        self.tools = [
            {
                "type": "function",
                "name": TOOL,
                "description": s.tool_description,
                "parameters": _schema(),
            }
        ]
        self.items: list[dict[str, Any]] = []
        self.call_id: str | None = None
        self.sent: Prompt = ([], None)

    async def step(self, k: int, text: str) -> str:
        if self.call_id is None:
            self.items.append({"role": "user", "content": text})
        else:
            self.items.append(
                {"type": "function_call_output", "call_id": self.call_id, "output": text}
            )
        body = {"instructions": self.s.system, "input": self.items}
        messages = sim_responses.to_chat_messages(body, None)
        self.sent = (messages, sim_responses.to_chat_tools(self.tools))
        request: dict[str, Any] = {
            "model": MODEL,
            "instructions": self.s.system,
            "input": self.items,
            "tools": self.tools,
            "tool_choice": "required" if k % 2 == 0 else "auto",
            "max_output_tokens": self.s.max_tokens,
            "store": False,
        }
        if self.keyed:
            request["prompt_cache_key"] = self.s.session_id
        reply = await self.client.responses.create(**request)
        calls = [o for o in reply.output if o.type == "function_call"]
        self.call_id = calls[0].call_id if calls else None
        if calls:
            call = calls[0]
            self.items.append(
                {
                    "type": "function_call",
                    "call_id": call.call_id,
                    "name": call.name,
                    "arguments": call.arguments,
                }
            )
            return str(call.arguments)
        self.items.append({"role": "assistant", "content": reply.output_text})
        return str(reply.output_text)


async def drive_agents(
    url: str,
    api: str,
    sessions: list[AgentSession],
    concurrency: int = 6,
    keyed: bool = False,
    deadline: float = 120.0,
) -> tuple[Outcome, ReuseTracker]:
    """Run every session through ``api`` against ``url`` (a gateway or a replica)."""
    outcome, reuse, tokenizer = Outcome(), ReuseTracker(), Tokenizer()
    gate = asyncio.Semaphore(concurrency)
    async with (
        openai.AsyncOpenAI(base_url=url + "/v1", api_key="prefixgate", max_retries=0) as oai,
        anthropic.AsyncAnthropic(base_url=url, api_key="prefixgate", max_retries=0) as claude,
    ):

        async def run(s: AgentSession) -> None:
            conv: _Chat | _Messages | _Responses
            if api == "chat":
                conv = _Chat(oai, s, keyed)
            elif api == "messages":
                conv = _Messages(claude, s, keyed)
            else:
                conv = _Responses(oai, s, keyed)
            async with gate:
                for k, text in enumerate(s.turns):
                    outcome.requests += 1
                    try:
                        answer = await conv.step(k, text)
                    except (openai.APIError, anthropic.APIError):
                        outcome.errors += 1
                        return
                    messages, tools = conv.sent
                    reuse.observe(tokenizer.encode_chat(messages, tools), tokenizer.encode(answer))

        async with asyncio.timeout(deadline):
            await asyncio.gather(*(run(s) for s in sessions))
    return outcome, reuse


async def captured_share(
    api: str,
    sessions: list[AgentSession],
    replicas: int = 4,
    sim: SimConfig | None = None,
    gateway: dict[str, Any] | None = None,
    keyed: bool = False,
) -> tuple[float, Outcome, ReuseTracker]:
    """(cached tokens / reusable tokens, outcome, reuse) of one run on fresh replicas."""
    from router.config.model import parse_config
    from router.serve.server import running_gateway

    sim = sim or SimConfig(num_gpu_blocks=768, speed=50.0)
    async with start_replicas(replicas, sim) as reps:
        urls = [r.url for r in reps]
        config = parse_config(
            {
                "server": {"port": 0, "accessLog": False},
                "pool": {
                    "endpoints": [{"url": u} for u in urls],
                    "metricsScrape": {"intervalSeconds": 0.05},
                },
                "seed": 1,
                **(gateway or {}),
            }
        )
        async with running_gateway(config) as gw:
            outcome, reuse = await drive_agents(gw.url, api, sessions, keyed=keyed)
        stats = await cache_stats(urls)
    hits = sum(s.hits for s in stats.values())
    return hits / max(1, reuse.reusable_tokens), outcome, reuse


async def _main(args: argparse.Namespace) -> None:
    sessions = agentic_sessions(args.sessions, args.turns, seed=args.seed)
    print(
        f"{args.sessions} sessions x {args.turns} turns, 4 replicas, "
        f"strategy {args.strategy}, session keys {'on' if args.keyed else 'off'}"
    )
    print(f"{'api':<10} {'requests':>8} {'errors':>6} {'reusable':>10} {'captured':>9}")
    for api in APIS:
        share, outcome, reuse = await captured_share(
            api, sessions, gateway={"strategy": args.strategy}, keyed=args.keyed
        )
        print(
            f"{api:<10} {outcome.requests:>8} {outcome.errors:>6} "
            f"{reuse.reusable_tokens:>10} {share:>9.3f}"
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="benchmarks.agent_reuse",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--sessions", type=int, default=24)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--strategy", default="default")
    parser.add_argument("--keyed", action="store_true", help="send each API's session key")
    asyncio.run(_main(parser.parse_args(argv)))


if __name__ == "__main__":
    main()
