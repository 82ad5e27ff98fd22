"""Which agent session a request belongs to, from the headers coding agents send.

Claude Code, OpenCode and Codex do not send ``x-session-id``; each names its session in a
header of its own. Read in order (the first non-empty value wins): the explicit
``x-session-id``, then the operator's headers (``sessionAffinity.headers``), then the agents'
(``AGENT_SESSION_HEADERS``), so a client that sends both keeps the id it chose on purpose.
The agent's id also keys flow control's fairness when the request names no fairness id, so
one agent flooding the gateway queues behind its own requests, not everyone's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from flow_control.resolve import MAX_ID_CHARS, SESSION_HEADER, header_value

# Claude Code; OpenCode; Codex (both spellings: some proxies rewrite '-' to '_' or back).
AGENT_SESSION_HEADERS = (
    "x-claude-code-session-id",
    "x-session-affinity",
    "session-id",
    "session_id",
)


@dataclass(frozen=True, slots=True)
class Identity:
    """``session``: what affinity keys on; ``agent``: the agent's own id, for fairness."""

    session: str | None
    agent: str | None


class AgentIdentity:
    def __init__(self, extra_headers: Sequence[str] = (), agent_headers: bool = True) -> None:
        names = [h.lower() for h in extra_headers]
        if agent_headers:
            names += [h for h in AGENT_SESSION_HEADERS if h not in names]
        self.headers = tuple(names)

    def identify(self, headers: Mapping[str, str], hint: str | None = None) -> Identity:
        """``hint``: a session id the body carries (Anthropic metadata, Responses API)."""
        agent = header_value(headers, self.headers)
        explicit = header_value(headers, (SESSION_HEADER,))
        if hint:  # cut as the headers are: it keys an LRU entry and a Redis key
            hint = hint.strip()[:MAX_ID_CHARS]
        return Identity(explicit or agent or hint or None, agent)
