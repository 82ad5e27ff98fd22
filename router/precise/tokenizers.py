"""Request-side tokenizers for precise prefix routing: the prompt as the replica will see it.

:class:`Tokenizer` is the extension point: ``tokenize`` returns the prompt's token ids (chat
template applied, generation prompt included) or None when it cannot within its budget, in
which case the request is routed on the approximate index. Implementations:

- :class:`LocalTokenizer` over an encode function: the simulator's tokenizer
  (:func:`sim_tokenizer`), or a Hugging Face ``tokenizer.json`` from a local path plus the
  model's chat template (router/precise/hf_tokenizer.py). Nothing is downloaded. Chat prompts are
  encoded piece by piece from a memo where that is exact (router/precise/segments.py), so a turn
  costs
  what it added; large amounts of new text go to one worker thread owned by the tokenizer.
- :class:`RemoteTokenizer`: asks a replica's ``POST /tokenize`` (vLLM and the simulator serve it).

:class:`CachingTokenizer` wraps either with a bounded LRU of recent prompts, shares one encoding
between identical concurrent prompts (a sub-agent burst), and enforces the time budget.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal, Protocol, TypeVar, runtime_checkable

import orjson
import xxhash

from router.core.endpoints import EndpointSnapshot
from router.core.lru import SizedLRU
from router.precise.segments import SegmentMemo
from router.upstream.client import UPSTREAM_ERRORS, UpstreamClient

# A /tokenize answer is a few bytes per token; past this it is not read.
MAX_TOKENIZE_BYTES = 64 << 20
Api = Literal["chat", "completions"]
EncodeChat = Callable[[Sequence[Mapping[str, Any]], Sequence[Any] | None], list[int]]
RenderChat = Callable[[Sequence[Mapping[str, Any]], Sequence[Any] | None], str]
EncodeText = Callable[[str], list[int]]
# Prompt token ids: a list, or an array of 32-bit ids where a memo joined them (segments.py).
Tokens = Sequence[int]
log = logging.getLogger("prefixgate.tokenizers")
_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class TokenizeInput:
    """What a tokenizer needs of a request: its API, the parsed body, and its size in bytes."""

    api: Api
    model: str
    payload: Mapping[str, Any]
    size: int = 0


class Tokenizer(Protocol):
    async def tokenize(
        self, request: TokenizeInput, endpoints: Sequence[EndpointSnapshot]
    ) -> Tokens | None:
        """Prompt token ids, or None when this request cannot be tokenized here."""
        ...

    async def aclose(self) -> None: ...


@dataclass(frozen=True, slots=True)
class Deferred:
    """Encoding work too long for the event loop: ``fn(arg)`` in a worker thread."""

    fn: Callable[[Any], Tokens | None]
    arg: Any


@runtime_checkable
class EagerTokenizer(Tokenizer, Protocol):
    """A tokenizer that can tell, without suspending, whether a prompt is cheap to encode."""

    def encode_now(self, request: TokenizeInput) -> Tokens | Deferred | None:
        """The tokens now, or the deferred work when encoding would hold the event loop."""
        ...

    async def finish(self, work: Deferred) -> Tokens | None: ...


def completion_prompt(payload: Mapping[str, Any]) -> str | list[int] | None:
    """A completions ``prompt`` as one text or one id list; None for a batch of prompts."""
    prompt = payload.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return [int(t) for t in prompt]
    return None


@dataclass(frozen=True, slots=True)
class PiecewiseChat:
    """A chat template's renderer, and the memo its renders are encoded through
    (router/precise/segments.py)."""

    render: RenderChat
    memo: SegmentMemo


class LocalTokenizer:
    """Encodes in-process; what would take long goes to its worker thread.

    Long means a prompt above ``thread_above_bytes``, or with ``piecewise``, more than that
    many characters not already in the memo: a growing conversation's next turn is encoded on
    the event loop in about a millisecond, which is cheaper than a thread hand-off that waits
    for the interpreter lock behind the loop's own work."""

    def __init__(
        self,
        encode_chat: EncodeChat,
        encode_text: EncodeText,
        thread_above_bytes: int = 16_384,
        max_pending: int = 8,
        piecewise: PiecewiseChat | None = None,
    ) -> None:
        self._encode_chat = encode_chat
        self._encode_text = encode_text
        self._thread_above = thread_above_bytes
        self._max_pending = max_pending
        self._piecewise = piecewise
        self._pending = 0
        self._executor: ThreadPoolExecutor | None = None

    @property
    def memo(self) -> SegmentMemo | None:
        return self._piecewise.memo if self._piecewise is not None else None

    def encode(self, request: TokenizeInput) -> Tokens | None:
        payload = request.payload
        if request.api == "chat":
            chat = _chat_parts(payload)
            return None if chat is None else self._encode_chat(*chat)
        prompt = completion_prompt(payload)
        if prompt is None or isinstance(prompt, list):
            return prompt
        return self._encode_text(prompt)

    def encode_now(self, request: TokenizeInput) -> Tokens | Deferred | None:
        """The tokens when they are cheap enough to encode on the event loop, else the work
        for the worker thread."""
        try:
            if request.api == "chat" and self._piecewise is not None:
                chat = _chat_parts(request.payload)
                if chat is None:
                    return None
                memo = self._piecewise.memo
                pieces = memo.split(self._piecewise.render(*chat))
                if memo.unknown_chars(pieces) < self._thread_above:
                    return memo.encode_pieces(pieces)
                return Deferred(memo.encode_pieces, pieces)
            if request.size < self._thread_above:
                return self.encode(request)
            return Deferred(self.encode, request)
        except (ValueError, TypeError, KeyError):
            return None  # a body the template cannot render; the replica will say why

    async def tokenize(
        self, request: TokenizeInput, endpoints: Sequence[EndpointSnapshot]
    ) -> Tokens | None:
        now = self.encode_now(request)
        return await self.finish(now) if isinstance(now, Deferred) else now

    async def finish(self, work: Deferred) -> Tokens | None:
        """Runs deferred work in the worker thread (None when the worker is behind)."""
        try:
            return await self._in_thread(work.fn, work.arg)
        except (ValueError, TypeError, KeyError):
            return None

    async def _in_thread(self, fn: Callable[[_T], Tokens | None], arg: _T) -> Tokens | None:
        if self._pending >= self._max_pending:
            return None  # the worker is behind: route this one approximately
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="prefixgate-tokenize")
        self._pending += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, fn, arg)
        finally:
            self._pending -= 1

    async def aclose(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None


def _chat_parts(
    payload: Mapping[str, Any],
) -> tuple[Sequence[Mapping[str, Any]], Sequence[Any] | None] | None:
    messages = payload.get("messages")
    tools = payload.get("tools")
    if not isinstance(messages, list):
        return None
    return messages, tools if isinstance(tools, list) else None


def sim_tokenizer(thread_above_bytes: int = 16_384) -> LocalTokenizer:
    """The simulator's own tokenizer and ChatML template (benchmarks/sim/tokenizer.py); chat
    prompts are encoded piece by piece (router/precise/segments.py: exact by its construction)."""
    from benchmarks.sim.tokenizer import SPECIAL_RE, render_chat
    from benchmarks.sim.tokenizer import Tokenizer as SimTokenizer

    tok = SimTokenizer()
    memo = SegmentMemo(tok.encode, SPECIAL_RE)

    def render(messages: Sequence[Mapping[str, Any]], tools: Sequence[Any] | None) -> str:
        return render_chat(messages, tools, add_generation_prompt=True)

    return LocalTokenizer(
        tok.encode_chat, tok.encode, thread_above_bytes, piecewise=PiecewiseChat(render, memo)
    )


class RemoteTokenizer:
    """Asks a candidate replica's ``/tokenize``; the first that answers within budget wins."""

    def __init__(
        self,
        timeout_seconds: float = 0.5,
        max_attempts: int = 2,
        client: UpstreamClient | None = None,
    ) -> None:
        self._timeout = timeout_seconds
        self._attempts = max(1, max_attempts)
        # Its own connections unless given some: a tokenize call never waits behind traffic.
        self._owns_client = client is None
        self._client = client or UpstreamClient(32, timeout_seconds)

    def _body(self, request: TokenizeInput) -> dict[str, Any] | None:
        payload = request.payload
        if request.api == "chat":
            body: dict[str, Any] = {
                "model": request.model,
                "messages": payload.get("messages"),
                "add_generation_prompt": True,
            }
            if payload.get("tools"):
                body["tools"] = payload["tools"]
            return body
        prompt = completion_prompt(payload)
        if prompt is None:
            return None
        return {"model": request.model, "prompt": prompt}

    async def tokenize(
        self, request: TokenizeInput, endpoints: Sequence[EndpointSnapshot]
    ) -> Tokens | None:
        body = self._body(request)
        if body is None:
            return None
        # The least busy candidates first: tokenizing is not free for the replica either.
        ordered = sorted(endpoints, key=lambda e: e.in_flight)[: self._attempts]
        content = orjson.dumps(body)
        headers = [("content-type", "application/json")]
        for endpoint in ordered:
            try:
                reply = await self._client.fetch(
                    "POST", endpoint.url + "/tokenize", headers, content, seconds=self._timeout,
                    limit=MAX_TOKENIZE_BYTES,
                )
            except UPSTREAM_ERRORS:
                continue
            if reply.status != 200:
                continue
            try:
                tokens = orjson.loads(reply.body).get("tokens")
            except (orjson.JSONDecodeError, AttributeError):
                continue
            if isinstance(tokens, list) and all(isinstance(t, int) for t in tokens):
                return tokens
        return None

    async def aclose(self) -> None:
        if self._owns_client:
            await self._client.aclose()


def prompt_fingerprint(request: TokenizeInput) -> int:
    """A cache key for the parts of a request that decide its prompt tokens."""
    payload = request.payload
    parts = (
        request.api,
        request.model,
        payload.get("messages") if request.api == "chat" else payload.get("prompt"),
        payload.get("tools"),
    )
    return xxhash.xxh64_intdigest(orjson.dumps(parts, option=orjson.OPT_SORT_KEYS))


class CachingTokenizer:
    """Bounded LRU of recent prompts, shared in-flight encodings, and a time budget."""

    def __init__(
        self,
        inner: Tokenizer,
        budget_seconds: float,
        max_entries: int = 1024,
        max_tokens: int = 4_000_000,
    ) -> None:
        self.inner = inner
        self._eager = inner if isinstance(inner, EagerTokenizer) else None
        self._budget = budget_seconds
        self._cache: SizedLRU[int, Tokens] = SizedLRU(max_entries, max_tokens)
        self._inflight: dict[int, asyncio.Future[Tokens | None]] = {}
        self.hits = 0
        self.misses = 0
        self.timeouts = 0

    async def tokenize(
        self, request: TokenizeInput, endpoints: Sequence[EndpointSnapshot]
    ) -> Tokens | None:
        key = prompt_fingerprint(request)
        cached = self._cache.get(key)
        if cached is not None:
            self.hits += 1
            return cached
        shared = self._inflight.get(key)
        if shared is None:
            self.misses += 1
            if self._eager is None:
                work: Awaitable[Tokens | None] = self.inner.tokenize(request, endpoints)
            else:
                # Encoded right here when that is cheap: a task would send the request through
                # the event loop's ready queue twice, behind every stream being relayed.
                now = self._encode_now(self._eager, request)
                if not isinstance(now, Deferred):
                    if now is not None:
                        self._cache.put(key, now)
                    return now
                work = self._eager.finish(now)
            shared = asyncio.ensure_future(self._encode(key, work))
            self._inflight[key] = shared
            shared.add_done_callback(lambda _: self._inflight.pop(key, None))
        try:
            async with asyncio.timeout(self._budget):
                return await asyncio.shield(shared)
        except TimeoutError:
            self.timeouts += 1
            return None

    def _encode_now(
        self, eager: EagerTokenizer, request: TokenizeInput
    ) -> Tokens | Deferred | None:
        try:
            return eager.encode_now(request)
        except Exception:  # a tokenizer bug must cost precision, never the request
            log.exception("tokenizer %r failed", self.inner)
            return None

    async def _encode(self, key: int, work: Awaitable[Tokens | None]) -> Tokens | None:
        try:
            tokens = await work
        except Exception:  # a tokenizer bug must cost precision, never the request
            log.exception("tokenizer %r failed", self.inner)
            return None
        if tokens is not None:
            self._cache.put(key, tokens)
        return tokens

    async def aclose(self) -> None:
        for future in list(self._inflight.values()):
            future.cancel()
        await self.inner.aclose()
