"""Seeded, deterministic workloads for tests, the demo and benchmarks.

Text is made of short words that the simulator's tokenizer counts as one token each (a word
of at most three letters with its leading space), so "N tokens" of text is N tokens there.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

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
