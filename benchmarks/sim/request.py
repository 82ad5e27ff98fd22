"""One request's state inside the simulated engine."""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass, field


class Status(enum.Enum):
    """Where a request is in its life."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"


@dataclass(eq=False)
class SimRequest:
    """A request as the engine sees it; times are on the engine's simulated clock (seconds).

    ``output_plan`` holds the ids the request will "sample" (decided up front so output is a
    pure function of the request); ``output`` grows by one id per generated token.
    """

    request_id: str
    prompt_ids: list[int]
    max_tokens: int
    output_plan: list[int]
    cache_salt: str | None = None
    remote_prefill: bool = False
    remote_decode: bool = False
    arrival: float = 0.0

    status: Status = Status.WAITING
    all_tokens: list[int] = field(default_factory=list)
    output: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0
    num_registered: int = 0
    prefilling: bool = True
    prefill_started: bool = False
    ready_at: float | None = None
    cached_tokens: int = -1
    admitted_at: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    finished_at: float | None = None
    token_times: list[float] = field(default_factory=list)
    transfer_block_ids: list[int] = field(default_factory=list)
    event: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        if not self.all_tokens:
            self.all_tokens = list(self.prompt_ids)

    @property
    def done(self) -> bool:
        """Finished or aborted: no more tokens will come."""
        return self.status in (Status.FINISHED, Status.ABORTED)

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt length in tokens."""
        return len(self.prompt_ids)

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens served from the prefix cache at first admission (0 before it)."""
        return max(self.cached_tokens, 0)
