"""Request-side tokenizers for precise prefix routing: the prompt as the replica will see it.

:class:`Tokenizer` is the extension point: ``tokenize`` returns the prompt's token ids (chat
template applied, generation prompt included) or None when it cannot within its budget, in
which case the request is routed on the approximate index. Implementations:

- :class:`LocalTokenizer` over an encode function: the simulator's tokenizer
  (:func:`sim_tokenizer`), or a Hugging Face ``tokenizer.json`` from a local path plus the
  model's chat template rendered with jinja2 (:func:`huggingface_tokenizer`; the optional
  ``tokenizers`` extra). Nothing is downloaded. Large prompts are encoded on one worker thread
  owned by the tokenizer, so the event loop never runs them and at most one core is used.
- :class:`RemoteTokenizer`: asks a replica's ``POST /tokenize`` (vLLM and the simulator serve it).

:class:`CachingTokenizer` wraps either with a bounded LRU of recent prompts, shares one encoding
between identical concurrent prompts (a sub-agent burst), and enforces the time budget.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

import httpx
import orjson
import xxhash

from router.endpoints import EndpointSnapshot

Api = Literal["chat", "completions"]
EncodeChat = Callable[[Sequence[Mapping[str, Any]], Sequence[Any] | None], list[int]]
EncodeText = Callable[[str], list[int]]
log = logging.getLogger("prefixgate.tokenizers")


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
    ) -> list[int] | None:
        """Prompt token ids, or None when this request cannot be tokenized here."""
        ...

    async def aclose(self) -> None: ...


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


class LocalTokenizer:
    """Encodes in-process; prompts above ``thread_above_bytes`` go to its worker thread."""

    def __init__(
        self,
        encode_chat: EncodeChat,
        encode_text: EncodeText,
        thread_above_bytes: int = 16_384,
        max_pending: int = 8,
    ) -> None:
        self._encode_chat = encode_chat
        self._encode_text = encode_text
        self._thread_above = thread_above_bytes
        self._max_pending = max_pending
        self._pending = 0
        self._executor: ThreadPoolExecutor | None = None

    def encode(self, request: TokenizeInput) -> list[int] | None:
        payload = request.payload
        if request.api == "chat":
            messages = payload.get("messages")
            tools = payload.get("tools")
            if not isinstance(messages, list):
                return None
            return self._encode_chat(messages, tools if isinstance(tools, list) else None)
        prompt = completion_prompt(payload)
        if prompt is None or isinstance(prompt, list):
            return prompt
        return self._encode_text(prompt)

    async def tokenize(
        self, request: TokenizeInput, endpoints: Sequence[EndpointSnapshot]
    ) -> list[int] | None:
        try:
            if request.size < self._thread_above:
                return self.encode(request)
            if self._pending >= self._max_pending:
                return None  # the worker is behind: route this one approximately
            if self._executor is None:
                self._executor = ThreadPoolExecutor(1, thread_name_prefix="prefixgate-tokenize")
            self._pending += 1
            try:
                loop = asyncio.get_running_loop()
                return await loop.run_in_executor(self._executor, self.encode, request)
            finally:
                self._pending -= 1
        except (ValueError, TypeError, KeyError):
            return None  # a body the template cannot render; the replica will say why

    async def aclose(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None


def sim_tokenizer(thread_above_bytes: int = 16_384) -> LocalTokenizer:
    """The simulator's own tokenizer and ChatML template (benchmarks/sim/tokenizer.py)."""
    from benchmarks.sim.tokenizer import Tokenizer as SimTokenizer

    tok = SimTokenizer()
    return LocalTokenizer(tok.encode_chat, tok.encode, thread_above_bytes)


def _read_template(path: Path) -> str:
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json":
        template = json.loads(text).get("chat_template")
        if isinstance(template, list):  # named templates: take the default one
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        if not isinstance(template, str):
            raise ValueError(f"{path} has no chat_template string")
        return template
    return text


def huggingface_tokenizer(
    path: str | Path,
    chat_template: str | Path | None = None,
    add_special_tokens: bool = True,
    thread_above_bytes: int = 16_384,
) -> LocalTokenizer:
    """A local ``tokenizer.json`` (a file, or a model directory holding it) plus a template.

    The template is ``chat_template`` (a .jinja file, or a tokenizer_config.json), else the
    directory's tokenizer_config.json. Chat prompts are encoded without added special tokens
    (the template writes them, as ``apply_chat_template`` does); completion prompts with them.
    """
    try:
        from jinja2.sandbox import ImmutableSandboxedEnvironment
        from tokenizers import Tokenizer as HFTokenizer
    except ImportError as exc:  # pragma: no cover - depends on the installed extras
        raise ValueError("install prefixgate[tokenizers] for a Hugging Face tokenizer") from exc
    root = Path(path)
    file = root / "tokenizer.json" if root.is_dir() else root
    tok = HFTokenizer.from_file(str(file))
    config_path = file.parent / "tokenizer_config.json"
    config: dict[str, Any] = {}
    if config_path.is_file():
        config = json.loads(config_path.read_text(encoding="utf-8"))
    source = Path(chat_template) if chat_template is not None else config_path
    template_text = _read_template(source)
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

    def raise_exception(message: str) -> None:
        raise ValueError(message)

    env.globals["raise_exception"] = raise_exception
    env.filters["tojson"] = lambda v, indent=None: json.dumps(v, indent=indent, ensure_ascii=False)
    template = env.from_string(template_text)
    specials = {k: _token_text(config.get(k)) for k in ("bos_token", "eos_token")}

    def encode_chat(
        messages: Sequence[Mapping[str, Any]], tools: Sequence[Any] | None
    ) -> list[int]:
        text = template.render(
            messages=messages, tools=tools, add_generation_prompt=True, **specials
        )
        return list(tok.encode(text, add_special_tokens=False).ids)

    def encode_text(text: str) -> list[int]:
        return list(tok.encode(text, add_special_tokens=add_special_tokens).ids)

    return LocalTokenizer(encode_chat, encode_text, thread_above_bytes)


def _token_text(value: Any) -> str:
    if isinstance(value, dict):  # AddedToken serialised as {"content": ...}
        value = value.get("content")
    return value if isinstance(value, str) else ""


class RemoteTokenizer:
    """Asks a candidate replica's ``/tokenize``; the first that answers within budget wins."""

    def __init__(self, timeout_seconds: float = 0.5, max_attempts: int = 2) -> None:
        self._timeout = timeout_seconds
        self._attempts = max(1, max_attempts)
        self._client: httpx.AsyncClient | None = None

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
    ) -> list[int] | None:
        body = self._body(request)
        if body is None:
            return None
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=self._timeout)
        # The least busy candidates first: tokenizing is not free for the replica either.
        ordered = sorted(endpoints, key=lambda e: e.in_flight)[: self._attempts]
        content = orjson.dumps(body)
        headers = {"content-type": "application/json"}
        for endpoint in ordered:
            try:
                reply = await self._client.post(
                    endpoint.url + "/tokenize", content=content, headers=headers
                )
            except httpx.HTTPError:
                continue
            if reply.status_code != 200:
                continue
            try:
                tokens = orjson.loads(reply.content).get("tokens")
            except (orjson.JSONDecodeError, AttributeError):
                continue
            if isinstance(tokens, list) and all(isinstance(t, int) for t in tokens):
                return tokens
        return None

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None


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
        self, inner: Tokenizer, budget_seconds: float, max_entries: int = 1024,
        max_tokens: int = 4_000_000,
    ) -> None:
        self.inner = inner
        self._budget = budget_seconds
        self._max_entries = max(1, max_entries)
        self._max_tokens = max(1, max_tokens)
        self._cache: OrderedDict[int, list[int]] = OrderedDict()
        self._cached_tokens = 0
        self._inflight: dict[int, asyncio.Future[list[int] | None]] = {}
        self.hits = 0
        self.misses = 0
        self.timeouts = 0

    async def tokenize(
        self, request: TokenizeInput, endpoints: Sequence[EndpointSnapshot]
    ) -> list[int] | None:
        key = prompt_fingerprint(request)
        cached = self._cache.get(key)
        if cached is not None:
            self._cache.move_to_end(key)
            self.hits += 1
            return cached
        shared = self._inflight.get(key)
        if shared is None:
            self.misses += 1
            shared = asyncio.ensure_future(self._encode(key, request, endpoints))
            self._inflight[key] = shared
            shared.add_done_callback(lambda _: self._inflight.pop(key, None))
        try:
            async with asyncio.timeout(self._budget):
                return await asyncio.shield(shared)
        except TimeoutError:
            self.timeouts += 1
            return None

    async def _encode(
        self, key: int, request: TokenizeInput, endpoints: Sequence[EndpointSnapshot]
    ) -> list[int] | None:
        try:
            tokens = await self.inner.tokenize(request, endpoints)
        except Exception:  # a tokenizer bug must cost precision, never the request
            log.exception("tokenizer %r failed", self.inner)
            return None
        if tokens is not None and len(tokens) <= self._max_tokens:
            self._cache[key] = tokens
            self._cached_tokens += len(tokens)
            while self._cached_tokens > self._max_tokens or len(self._cache) > self._max_entries:
                _, old = self._cache.popitem(last=False)
                self._cached_tokens -= len(old)
        return tokens

    async def aclose(self) -> None:
        for future in list(self._inflight.values()):
            future.cancel()
        await self.inner.aclose()
