"""Parsing and validating OpenAI request bodies, and rendering their prompt for the index.

The original bytes are forwarded upstream unchanged: the gateway only reads what routing needs
and rejects what no replica could serve, with an OpenAI-shaped 4xx naming the field. No input
may get further than that: whatever the body, the result is a ParsedRequest or a
BadRequestError (tests/router/protocol/test_fuzz_parsing.py holds hypothesis to that).

The OpenAPI description of the two bodies (:func:`openapi_extra`) documents the same checks
without FastAPI validating anything per request: the routes read the raw body.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

import orjson

from router.core.errors import BadRequestError
from router.core.hashing import hash_blocks
from router.protocol import anthropic, responses_api
from router.protocol.rendering import render_conversation, render_prompt

Api = Literal["chat", "completions", "messages", "responses"]
# Where each API is served on a replica (vLLM serves all four).
UPSTREAM_PATHS: dict[str, str] = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "messages": "/v1/messages",
    "responses": "/v1/responses",
}

MAX_N = 16


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    api: Api
    body: bytes
    # The decoded body and its rendered prompt (see the properties): None for a body parsed
    # in another process (:func:`digest_body`), which hands back only what routing reads
    # (the payload is decoded on demand, the prompt never rendered again).
    decoded: dict[str, Any] | None
    model: str
    stream: bool
    prompt: str | None
    # The body's own session key when it has one (Messages: metadata.user_id, Responses:
    # prompt_cache_key); the x-session-id header wins over it.
    session_hint: str | None = None
    # Responses: the stored response the request continues, which pins it to one endpoint.
    previous_response_id: str | None = None
    # UTF-8 byte span of ``rendered``'s last answer (router.protocol.rendering.render_conversation).
    answer_span: tuple[int, int] | None = None
    # Responses: the replica keeps the answer (``store``, true unless the client says false),
    # so where it went is worth remembering.
    stored: bool = False
    # vLLM's ``cache_salt``: its blocks are cached apart from every other salt's and the
    # unsalted ones', so its prompt hashes are too (:func:`prompt_hashes`).
    cache_salt: str | None = None

    @property
    def payload(self) -> dict[str, Any]:
        """The decoded body (decoded here on first use when it was parsed elsewhere)."""
        if self.decoded is None:
            object.__setattr__(self, "decoded", decode_json(self.body))
        assert self.decoded is not None
        return self.decoded

    @property
    def rendered(self) -> str:
        """The prompt rendered for the index. Not for a body parsed in another process: its
        size and block hashes came back in its ``Prepared``, and rendering it here would parse
        the whole (large) body again, on the event loop."""
        if self.prompt is None:
            raise RuntimeError(
                "the prompt of a body parsed in the body parser's process is not kept: "
                "pass its Prepared (prompt_bytes, block_hashes) to routing_request"
            )
        return self.prompt


@dataclass(frozen=True, slots=True)
class Digest:
    """What routing reads of a body, small enough to hand back from another process: the
    body itself, its decoded payload and rendered prompt stay there (30 MB of them would cost
    the gateway about as much to unpickle as to parse)."""

    model: str
    stream: bool
    session_hint: str | None
    previous_response_id: str | None
    answer_span: tuple[int, int] | None
    prompt_bytes: int
    block_hashes: list[int]
    # The body as the gateway forwards it, when parsing rewrote it (None: unchanged).
    rewritten: bytes | None = None
    stored: bool = False

    def parsed(self, api: Api, body: bytes) -> ParsedRequest:
        return ParsedRequest(
            api, body if self.rewritten is None else self.rewritten, None, self.model,
            self.stream, None, self.session_hint, self.previous_response_id, self.answer_span,
            self.stored,
        )


def prompt_hashes(
    parsed: ParsedRequest, block_bytes: int, max_blocks: int
) -> tuple[int, list[int]]:
    """The rendered prompt's size in UTF-8 bytes and its block hashes (router/core/hashing.py):
    chained from the model's seed, or from the model's and the salt's for a salted request."""
    data = parsed.rendered.encode("utf-8", "surrogatepass")
    space = parsed.model if parsed.cache_salt is None else f"{parsed.model}\0{parsed.cache_salt}"
    return len(data), hash_blocks(data, block_bytes, space, max_blocks)


def digest_body(api: Api, body: bytes, block_bytes: int, max_blocks: int) -> Digest:
    """Parse, render and hash ``body``: run in a process of its own for a large body, since
    orjson holds the GIL for the whole decode and a thread would stall the event loop too."""
    parsed = parse_request(api, body)
    size, hashes = prompt_hashes(parsed, block_bytes, max_blocks)
    return Digest(
        parsed.model, parsed.stream, parsed.session_hint, parsed.previous_response_id,
        parsed.answer_span, size, hashes, None if parsed.body is body else parsed.body,
        parsed.stored,
    )


def digest_file(api: Api, path: str, block_bytes: int, max_blocks: int) -> Digest:
    """:func:`digest_body` of a body spilled to a file, which it removes once read: handing 30
    MB over through a pipe would be pickled, and pickling holds the sender's GIL."""
    try:
        with open(path, "rb") as f:
            body = f.read()
    finally:
        os.unlink(path)
    return digest_body(api, body, block_bytes, max_blocks)


def _encode(payload: dict[str, Any]) -> bytes:
    try:
        return orjson.dumps(payload)
    except TypeError:  # orjson refuses to serialise past 254 levels
        raise BadRequestError("request body is nested too deeply") from None


def model_of(body: bytes) -> str:
    """The body's ``model`` (a 400 when there is none), all that some routes read of it."""
    return _require_model(decode_json(body))


def model_of_file(path: str) -> str:
    """:func:`model_of` a body spilled to a file, which it removes once read."""
    try:
        with open(path, "rb") as f:
            body = f.read()
    finally:
        os.unlink(path)
    return model_of(body)


def decode_json(body: bytes) -> dict[str, Any]:
    if not body:
        raise BadRequestError("request body is empty; expected a JSON object")
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise BadRequestError(f"request body is not valid JSON: {exc}") from None
    if not isinstance(payload, dict):
        raise BadRequestError("request body must be a JSON object")
    return payload


def _require_model(payload: dict[str, Any]) -> str:
    model = payload.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequestError("'model' is required and must be a non-empty string", param="model")
    return model


def _is_integer(value: Any) -> bool:
    # 5.0 is an integer to JSON Schema and to vLLM's pydantic models alike.
    if isinstance(value, float):
        return value.is_integer()
    return isinstance(value, int) and not isinstance(value, bool)


def _check_number(payload: dict[str, Any], key: str, low: float, high: float) -> None:
    value = payload.get(key)
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise BadRequestError(f"'{key}' must be a number from {low:g} to {high:g}", param=key)


def _check_common(payload: dict[str, Any]) -> bool:
    stream = payload.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise BadRequestError("'stream' must be a boolean", param="stream")
    n = payload.get("n")
    if n is not None and (not _is_integer(n) or not 1 <= n <= MAX_N):
        raise BadRequestError(f"'n' must be an integer from 1 to {MAX_N}", param="n")
    for key in ("max_tokens", "max_completion_tokens"):
        value = payload.get(key)
        if value is not None and (not _is_integer(value) or value < 1):
            raise BadRequestError(f"'{key}' must be a positive integer", param=key)
    _check_number(payload, "temperature", 0.0, 2.0)
    _check_number(payload, "top_p", 0.0, 1.0)
    options = payload.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise BadRequestError("'stream_options' must be an object", param="stream_options")
    return stream


def _check_messages(payload: dict[str, Any]) -> list[dict[str, Any]]:
    messages = payload.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequestError("'messages' must be a non-empty array", param="messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise BadRequestError(
                f"messages[{i}] must be an object with a string 'role'", param=f"messages[{i}]"
            )
        if not message["role"]:
            raise BadRequestError(
                f"messages[{i}].role must not be empty", param=f"messages[{i}].role"
            )
        content = message.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise BadRequestError(
                f"messages[{i}].content must be a string or an array of parts",
                param=f"messages[{i}].content",
            )
    return messages


def _check_prompt(payload: dict[str, Any]) -> Any:
    prompt = payload.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return prompt
        if all(isinstance(p, str) for p in prompt) or all(
            isinstance(p, list) and all(isinstance(t, int) for t in p) for p in prompt
        ):
            return prompt
    raise BadRequestError(
        "'prompt' must be a string, an array of token ids, or an array of those",
        param="prompt",
    )


def _check_tools(payload: dict[str, Any]) -> Any:
    tools = payload.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise BadRequestError("'tools' must be an array", param="tools")
    return tools


# Body fields only the gateway sets: a client's would steer a replica (vLLM's NixlConnector
# pulls KV from the remote_host it names), so they are dropped like routing headers.
GATEWAY_FIELDS = ("kv_transfer_params",)


def parse_request(api: Api, body: bytes) -> ParsedRequest:
    parsed = _parse_request(api, body)
    salt = salt_field(api, parsed.payload)
    if isinstance(salt, str) and salt:
        return replace(parsed, cache_salt=salt)
    return parsed


def salt_field(api: str, payload: Mapping[str, Any]) -> Any:
    """The body's ``cache_salt`` as vLLM takes it on route ``api`` (None: none): its Messages
    route has no such field, drops it and caches unsalted. vLLM refuses a salt that is not
    non-empty text."""
    return payload.get("cache_salt") if api != "messages" else None


def _parse_request(api: Api, body: bytes) -> ParsedRequest:
    payload = decode_json(body)
    if any(key in payload for key in GATEWAY_FIELDS):
        for key in GATEWAY_FIELDS:
            payload.pop(key, None)
        body = _encode(payload)
    model = _require_model(payload)
    stream = _check_common(payload)
    try:
        if api == "messages":
            rendered, answer = anthropic.render_messages(payload)
            hint = anthropic.session_hint(payload)
            return ParsedRequest(
                api, body, payload, model, stream, rendered, hint, answer_span=answer
            )
        if api == "responses":
            rendered, answer = responses_api.render_responses(payload)
            hint = responses_api.session_hint(payload)
            previous = payload.get("previous_response_id")
            stored = payload.get("store") is not False
            return ParsedRequest(
                api, body, payload, model, stream, rendered, hint, previous, answer, stored
            )
        if api == "chat":
            messages = _check_messages(payload)
            rendered, answer = render_conversation(messages, _check_tools(payload))
            return ParsedRequest(api, body, payload, model, stream, rendered, answer_span=answer)
        prompt = _check_prompt(payload)
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            # A batch goes to one endpoint as a whole: route on its first prompt.
            prompt = prompt[0]
        rendered = render_prompt(prompt)
    except TypeError:
        # orjson refuses to serialise past 254 levels (tools or media parts nested that deep).
        raise BadRequestError("request body is nested too deeply") from None
    return ParsedRequest(api, body, payload, model, stream, rendered)

