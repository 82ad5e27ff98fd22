"""Seeded, deterministic workloads for tests, the demo and benchmarks.

Three scripted workloads for ``prefixgate bench`` (``build_workload``): agentic coding sessions,
shared-prefix synthetic, plain multi-turn chat, each with tiny..large presets.

Text is made of short words that the simulator's tokenizer counts as one token each (a word
of at most three letters with its leading space), so "N tokens" of text is N tokens there.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

_WORDS = [c1 + v + c2 for c1 in "bdfgklmnprstvz" for v in "aeiou" for c2 in "dgklmnprst"]


def words(rng: random.Random, tokens: int) -> str:
    """About ``tokens`` tokens of text."""
    return "".join(" " + rng.choice(_WORDS) for _ in range(tokens)).lstrip()


@dataclass(frozen=True, slots=True)
class ChatSession:
    """A multi-turn conversation: the user turns are fixed, the answers come from the model."""

    session_id: str
    system: str
    user_turns: tuple[str, ...]
    max_tokens: int
    think_seconds: float = 0.0


@dataclass(frozen=True, slots=True)
class MultiSessionWorkload:
    sessions: tuple[ChatSession, ...]
    concurrency: int
    extra: dict[str, float] = field(default_factory=dict)


def multi_session_chat(
    *,
    sessions: int = 16,
    turns: int = 6,
    agent_types: int = 2,
    system_tokens: int = 1500,
    user_tokens: int = 200,
    max_tokens: int = 32,
    concurrency: int | None = None,
    seed: int = 0,
) -> MultiSessionWorkload:
    """Sessions of a few agent types: each type shares a long system prompt, each session's
    context grows every turn by a user message and the model's answer."""
    rng = random.Random(seed)
    systems = [f"agent {t}: " + words(rng, system_tokens) for t in range(agent_types)]
    out = []
    for s in range(sessions):
        user = tuple(words(rng, user_tokens) for _ in range(turns))
        out.append(ChatSession(f"session-{seed}-{s}", systems[s % agent_types], user, max_tokens))
    return MultiSessionWorkload(tuple(out), concurrency or sessions)


# -- Generic scripted workloads (benchmarks.bench runs these) ------------------------------------
#
# A workload is a set of conversations. Each conversation is a script of steps: the content the
# client appends before a request (a user message or a tool result), the answer length, the think
# gap before it, an optional prefix reset, and an optional burst of sub-agents launched after the
# step's answer. Answers come from the model, so the context a step sends is only known at run
# time; the script fixes everything else. Times are simulated seconds (a real GPU's), which the
# runner divides by the simulator's --speed.

Message = dict[str, Any]


@dataclass(frozen=True, slots=True)
class SubAgent:
    """A sub-agent: starts from the parent's context (its prefix) and runs its own steps."""

    steps: tuple[Step, ...]


@dataclass(frozen=True, slots=True)
class Step:
    content: str
    max_tokens: int
    think_s: float = 0.0
    # A prefix reset (context compaction): before this step the conversation restarts from its
    # system prompt and this summary, so only the system prompt and tools are still shared.
    reset: str | None = None
    burst: tuple[SubAgent, ...] = ()


@dataclass(frozen=True, slots=True)
class Conversation:
    session_id: str
    system: str
    steps: tuple[Step, ...]
    tools: tuple[Message, ...] = ()
    kind: str = "main"

    @property
    def num_requests(self) -> int:
        return sum(1 + sum(len(a.steps) for a in s.burst) for s in self.steps)


@dataclass(frozen=True, slots=True)
class Workload:
    """Conversations plus how they arrive: at most ``concurrency`` live at once and, with
    ``rate``, started as a Poisson process of ``rate`` conversations per simulated second."""

    name: str
    conversations: tuple[Conversation, ...]
    concurrency: int
    rate: float | None = None
    send_session_id: bool = True
    seed: int = 0
    params: dict[str, Any] = field(default_factory=dict)
    # Start of each conversation in simulated seconds (a replayed trace); overrides ``rate``.
    arrivals: tuple[float, ...] | None = None

    @property
    def num_requests(self) -> int:
        return sum(c.num_requests for c in self.conversations)


def _lognormal(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    return max(lo, min(hi, round(median * math.exp(rng.gauss(0.0, sigma)))))


def _think(rng: random.Random, median: float) -> float:
    # Exponential with the given median: many short gaps, a few long ones.
    return rng.expovariate(math.log(2) / median) if median > 0 else 0.0


def _tools(rng: random.Random, agent: int, n: int, tokens: int) -> tuple[Message, ...]:
    per = max(1, tokens // max(n, 1))
    return tuple(
        {
            "type": "function",
            "function": {
                "name": f"tool_{agent}_{i}",
                "description": words(rng, per),
                "parameters": {"type": "object", "properties": {"arg": {"type": "string"}}},
            },
        }
        for i in range(n)
    )


@dataclass(frozen=True, slots=True)
class AgenticParams:
    """Shape of agentic coding sessions as field traces show them, scaled to fit a laptop."""

    sessions: int = 16
    turns: int = 8
    agent_types: int = 3
    system_tokens: int = 1500
    tool_count: int = 8
    tool_tokens: int = 800
    first_user_tokens: int = 300
    answer_tokens: int = 120
    tool_result_tokens: int = 450
    think_s: float = 2.0
    burst_prob: float = 0.12
    burst_size: int = 4
    burst_max: int = 8
    subagent_turns: int = 2
    subagent_task_tokens: int = 150
    reset_prob: float = 0.028
    reset_tokens: int = 400
    concurrency: int = 12
    rate: float | None = None
    seed: int = 0


AGENTIC_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(sessions=4, turns=3, agent_types=2, system_tokens=200, tool_count=2,
                 tool_tokens=80, first_user_tokens=40, answer_tokens=12, tool_result_tokens=40,
                 think_s=0.2, burst_prob=0.5, burst_size=2, burst_max=3, subagent_turns=1,
                 subagent_task_tokens=20, reset_prob=0.0, reset_tokens=40, concurrency=4),
    "small": {},
    "medium": dict(sessions=48, turns=10, agent_types=4, system_tokens=2000, tool_tokens=1000,
                   answer_tokens=100, tool_result_tokens=500, concurrency=32),
    "large": dict(sessions=128, turns=20, agent_types=6, system_tokens=6000, tool_count=16,
                  tool_tokens=3000, first_user_tokens=600, answer_tokens=250,
                  tool_result_tokens=650, burst_max=16, subagent_turns=3, concurrency=64),
}


def _subagents(rng: random.Random, p: AgenticParams) -> tuple[SubAgent, ...]:
    # Burst sizes are skewed (median ~burst_size, long tail up to burst_max).
    n = _lognormal(rng, p.burst_size, 0.6, 2, max(2, p.burst_max))
    out = []
    for k in range(n):
        steps = [Step(f"subtask {k}: " + words(rng, p.subagent_task_tokens),
                      _lognormal(rng, p.answer_tokens, 0.5, 4, 4 * p.answer_tokens))]
        for _ in range(p.subagent_turns - 1):
            steps.append(Step(words(rng, _lognormal(rng, p.tool_result_tokens, 0.5, 8, 10**6)),
                              _lognormal(rng, p.answer_tokens, 0.5, 4, 4 * p.answer_tokens),
                              _think(rng, p.think_s / 2)))
        out.append(SubAgent(tuple(steps)))
    return tuple(out)


def agentic_sessions(params: AgenticParams | None = None, **overrides: Any) -> Workload:
    """Agentic coding sessions: agent types with a long system prompt and tool definitions;
    each turn appends the answer and a tool result; think gaps; sub-agent bursts from the
    parent's context; occasional prefix resets."""
    p = replace(params or AgenticParams(), **overrides)
    rng = random.Random(p.seed)
    agents = [
        (f"agent {t}: " + words(rng, p.system_tokens), _tools(rng, t, p.tool_count, p.tool_tokens))
        for t in range(p.agent_types)
    ]
    conversations = []
    for s in range(p.sessions):
        system, tools = agents[rng.randrange(p.agent_types)]
        steps = []
        for turn in range(p.turns):
            answer = _lognormal(rng, p.answer_tokens, 0.5, 4, 4 * p.answer_tokens)
            if turn == 0:
                steps.append(Step("task: " + words(rng, p.first_user_tokens), answer))
                continue
            result = words(rng, _lognormal(rng, p.tool_result_tokens, 0.6, 8, 10**6))
            reset = None
            if rng.random() < p.reset_prob:
                reset = "summary: " + words(rng, p.reset_tokens)
            burst = _subagents(rng, p) if rng.random() < p.burst_prob else ()
            steps.append(Step(result, answer, _think(rng, p.think_s), reset, burst))
        conversations.append(Conversation(f"agent-{p.seed}-{s}", system, tuple(steps), tools))
    return Workload("agentic", tuple(conversations), p.concurrency, p.rate, True, p.seed,
                    asdict(p))


@dataclass(frozen=True, slots=True)
class SharedPrefixParams:
    """inference-perf's shared-prefix synthetic data: groups of users behind one long system
    prompt, each sending one question (single turn)."""

    groups: int = 8
    prompts_per_group: int = 16
    system_tokens: int = 2000
    question_tokens: int = 100
    output_tokens: int = 100
    concurrency: int = 16
    rate: float | None = None
    seed: int = 0


SHARED_PREFIX_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(groups=2, prompts_per_group=3, system_tokens=200, question_tokens=20,
                 output_tokens=8, concurrency=4),
    "small": {},
    "medium": dict(groups=32, prompts_per_group=16, system_tokens=4000, concurrency=48),
    "large": dict(groups=150, prompts_per_group=20, system_tokens=6000, question_tokens=200,
                  output_tokens=200, concurrency=96),
}


def shared_prefix(params: SharedPrefixParams | None = None, **overrides: Any) -> Workload:
    p = replace(params or SharedPrefixParams(), **overrides)
    rng = random.Random(p.seed)
    systems = [f"group {g}: " + words(rng, p.system_tokens) for g in range(p.groups)]
    convs = [
        Conversation(f"user-{p.seed}-{g}-{i}", systems[g],
                     (Step(words(rng, p.question_tokens), p.output_tokens),))
        for g in range(p.groups)
        for i in range(p.prompts_per_group)
    ]
    rng.shuffle(convs)
    return Workload("shared-prefix", tuple(convs), p.concurrency, p.rate, False, p.seed, asdict(p))


@dataclass(frozen=True, slots=True)
class ChatParams:
    sessions: int = 16
    turns: int = 6
    agent_types: int = 2
    system_tokens: int = 1500
    user_tokens: int = 200
    max_tokens: int = 64
    think_s: float = 1.0
    concurrency: int = 8
    rate: float | None = None
    seed: int = 0


CHAT_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(sessions=4, turns=3, system_tokens=200, user_tokens=30, max_tokens=8,
                 think_s=0.1, concurrency=4),
    "small": {},
    "medium": dict(sessions=48, turns=10, concurrency=32),
    "large": dict(sessions=128, turns=16, system_tokens=3000, user_tokens=300, concurrency=64),
}


def multi_turn_chat(params: ChatParams | None = None, **overrides: Any) -> Workload:
    """Plain multi-turn chat (``multi_session_chat``'s sessions) as a scripted workload."""
    p = replace(params or ChatParams(), **overrides)
    base = multi_session_chat(
        sessions=p.sessions, turns=p.turns, agent_types=p.agent_types,
        system_tokens=p.system_tokens, user_tokens=p.user_tokens, max_tokens=p.max_tokens,
        seed=p.seed,
    )
    rng = random.Random(p.seed + 1)
    convs = tuple(
        Conversation(s.session_id, s.system, tuple(
            Step(u, s.max_tokens, _think(rng, p.think_s) if i else 0.0)
            for i, u in enumerate(s.user_turns)
        ))
        for s in base.sessions
    )
    return Workload("chat", convs, p.concurrency, p.rate, True, p.seed, asdict(p))


WORKLOADS: dict[str, tuple[Callable[..., Workload], type, dict[str, dict[str, Any]]]] = {
    "agentic": (agentic_sessions, AgenticParams, AGENTIC_PRESETS),
    "shared-prefix": (shared_prefix, SharedPrefixParams, SHARED_PREFIX_PRESETS),
    "chat": (multi_turn_chat, ChatParams, CHAT_PRESETS),
}


def build_workload(name: str, preset: str = "small", **overrides: Any) -> Workload:
    """A named workload at a preset size, with parameter overrides (unknown names fail)."""
    try:
        factory, params_type, presets = WORKLOADS[name]
    except KeyError:
        raise ValueError(f"unknown workload {name!r} (known: {', '.join(WORKLOADS)})") from None
    if preset not in presets:
        raise ValueError(f"unknown preset {preset!r} (known: {', '.join(presets)})")
    known = {f.name for f in fields(params_type)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(f"unknown {name} parameters: {', '.join(unknown)} "
                         f"(known: {', '.join(sorted(known))})")
    return factory(**{**presets[preset], **overrides})
