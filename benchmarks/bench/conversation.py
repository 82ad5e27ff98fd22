"""A conversation's messages and prompt token ids, kept incrementally, and the reuse ledger.

Prompts grow by appended messages, so re-encoding and re-hashing a 50K-token context for every
request would cost the load generator more than the router it measures. ``ConversationState``
encodes each message once (the chat template renders each message on its own between special
tokens, so per-message ids concatenate to the whole prompt's ids) and extends the chain of
block hashes only over the new tail.

``ReuseLedger`` counts, in arrival order, the prompt tokens an infinitely large prefix cache
would have served: the same rule and hashes as ``benchmarks.reuse.ReuseTracker``, but fed with
chains computed incrementally, a request's prompt recorded when it is sent and its answer when
it ends (as vLLM caches computed blocks while a request runs).

The chains must be cut at the replicas' block size: vLLM hits whole blocks only, so a ledger
of finer blocks counts reuse no replica can reach (up to 7x too much on a trace at 64-token
blocks), and one whose counted blocks are not the replicas' is no bound on their hits. At the
replicas' block size and tokenizer, the ledger's total is what one infinite cache would hit
in any admission order (a block is missed only by the first request that holds it), so the
replicas' hits, counted once per request as vLLM exports them, stay at or below it.
"""

from __future__ import annotations

import random
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

from benchmarks.sim.tokenizer import Tokenizer, render_chat
from benchmarks.workloads import Conversation, Message, Step, Workload

BLOCK_SIZE = 16


def extend_chain(chain: list[int], ids: Sequence[int], block_size: int = BLOCK_SIZE) -> None:
    """Append the hashes of the full ``block_size`` blocks of ``ids`` not yet in ``chain``."""
    h = chain[-1] if chain else 0
    pack = struct.Struct(f"<{block_size}I").pack
    for start in range(len(chain) * block_size, len(ids) - block_size + 1, block_size):
        h = xxhash.xxh64_intdigest(pack(*ids[start : start + block_size]), h)
        chain.append(h)


def chain_of(ids: Sequence[int], block_size: int = BLOCK_SIZE) -> list[int]:
    chain: list[int] = []
    extend_chain(chain, ids, block_size)
    return chain


class ReuseLedger:
    """Reusable prompt tokens of a workload as it runs ("one replica, infinite cache")."""

    def __init__(self, block_size: int = BLOCK_SIZE) -> None:
        self.block_size = block_size
        self._seen: set[int] = set()
        self.prompt_tokens = 0
        self.reusable_tokens = 0
        self.requests = 0
        self.max_prompt_tokens = 0

    def sent(self, prompt_len: int, chain: Sequence[int]) -> int:
        """Count a prompt being sent; returns its reusable tokens and remembers its blocks."""
        cap = (prompt_len - 1) // self.block_size  # vLLM always recomputes the last token
        run = 0
        for h in chain[:cap]:
            if h not in self._seen:
                break
            run += 1
        reusable = run * self.block_size
        self.requests += 1
        self.prompt_tokens += prompt_len
        self.reusable_tokens += reusable
        self.max_prompt_tokens = max(self.max_prompt_tokens, prompt_len)
        self._seen.update(chain)
        return reusable

    def answered(self, chain: Sequence[int]) -> None:
        """Remember the blocks of a prompt plus its answer (``ConversationState.answer_chain``)."""
        self._seen.update(chain)

    @property
    def distinct_tokens(self) -> int:
        """Tokens in the distinct full blocks seen (what an infinite cache would hold)."""
        return len(self._seen) * self.block_size

    @property
    def fraction(self) -> float:
        return self.reusable_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass(slots=True)
class Prompt:
    messages: list[Message]
    ids: list[int]
    chain: list[int]


class ConversationState:
    """Messages so far, their token ids and block chain; ``fork`` for a sub-agent."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        system: str,
        tools: Sequence[Message] = (),
        block_size: int = BLOCK_SIZE,
    ) -> None:
        self._tok = tokenizer
        self.block_size = block_size
        self._gen_ids = tokenizer.encode(render_chat([], None, add_generation_prompt=True))
        self.tools: list[Message] = list(tools)
        self._system = system
        self.messages: list[Message] = []
        self.ids: list[int] = []
        self.chain: list[int] = []
        self.reset(None)

    def reset(self, summary: str | None) -> None:
        """Restart from the system prompt (and tools), plus ``summary`` as a user message."""
        self.messages = []
        self.ids = (
            self._tok.encode(render_chat([], self.tools, add_generation_prompt=False))
            if self.tools
            else []
        )
        self.chain = []
        self.add("system", self._system)
        if summary is not None:
            self.add("user", summary)

    def add(self, role: str, content: str) -> None:
        message = {"role": role, "content": content}
        self.messages.append(message)
        self.ids.extend(self._tok.encode(render_chat([message], None, False)))
        extend_chain(self.chain, self.ids, self.block_size)

    def prompt(self) -> Prompt:
        """What the next request sends: the messages and its prompt ids with their chain."""
        ids = self.ids + self._gen_ids
        chain = list(self.chain)
        extend_chain(chain, ids, self.block_size)
        return Prompt(list(self.messages), ids, chain)

    def answer_chain(self, prompt: Prompt, answer_ids: Sequence[int]) -> list[int]:
        """The blocks a replica caches of a prompt and its answer: all but the answer's last
        token, which it samples but never feeds back, so never computes (as vLLM)."""
        chain = list(prompt.chain)
        extend_chain(chain, [*prompt.ids, *answer_ids[:-1]], self.block_size)
        return chain

    def fork(self) -> ConversationState:
        child = ConversationState.__new__(ConversationState)
        child._tok, child._gen_ids, child.tools = self._tok, self._gen_ids, self.tools
        child.block_size = self.block_size
        child._system = self._system
        child.messages, child.ids, child.chain = (
            list(self.messages), list(self.ids), list(self.chain)
        )
        return child


def _walk(
    state: ConversationState,
    steps: Sequence[Step],
    ledger: ReuseLedger,
    tok: Tokenizer,
    rng: random.Random,
) -> None:
    for step in steps:
        if step.reset is not None:
            state.reset(step.reset)
        state.add("user", step.content)
        prompt = state.prompt()
        ledger.sent(len(prompt.ids), prompt.chain)
        # A stand-in answer as a replica gives it, ``max_tokens`` tokens at its density: only
        # its size matters for reuse.
        answer_ids = tok.generate(step.max_tokens, rng.randrange(1 << 32), chat=True)
        ledger.answered(state.answer_chain(prompt, answer_ids))
        state.add("assistant", tok.decode(answer_ids))
        for agent in step.burst:
            _walk(state.fork(), agent.steps, ledger, tok, rng)


def estimate_reuse(
    workload: Workload, block_size: int = BLOCK_SIZE, bytes_per_token: float | None = None
) -> ReuseLedger:
    """The workload's reusable tokens at ``block_size``, walking conversations one after the
    other.

    A live run interleaves conversations, which changes little: what one conversation reuses
    comes from its own earlier turns and from prefixes (system prompt, tools) that are seen
    once and then stay. The runner measures the live figure too.
    """
    tok = Tokenizer(bytes_per_token)
    ledger = ReuseLedger(block_size)
    rng = random.Random(workload.seed)
    for conv in workload.conversations:
        state = ConversationState(tok, conv.system, conv.tools, block_size)
        _walk(state, conv.steps, ledger, tok, rng)
    return ledger


def new_state(
    tokenizer: Tokenizer, conv: Conversation, block_size: int = BLOCK_SIZE
) -> ConversationState:
    return ConversationState(tokenizer, conv.system, conv.tools, block_size)
