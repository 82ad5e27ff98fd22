"""Parsing and validating OpenAI request bodies, and rendering their prompt for the index.

The original bytes are forwarded upstream unchanged: the gateway only reads what routing needs
and rejects what no replica could serve, with an OpenAI-shaped 4xx naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import orjson

from router.errors import BadRequestError
from router.rendering import render_chat, render_prompt

Api = Literal["chat", "completions"]

MAX_N = 16


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    api: Api
    body: bytes
    payload: dict[str, Any]
    model: str
    stream: bool
    rendered: str


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


def _check_common(payload: dict[str, Any]) -> bool:
    stream = payload.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise BadRequestError("'stream' must be a boolean", param="stream")
    n = payload.get("n")
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_N):
        raise BadRequestError(f"'n' must be an integer from 1 to {MAX_N}", param="n")
    for key in ("max_tokens", "max_completion_tokens"):
        value = payload.get(key)
        if value is not None and (
            not isinstance(value, int) or isinstance(value, bool) or value < 1
        ):
            raise BadRequestError(f"'{key}' must be a positive integer", param=key)
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


def parse_request(api: Api, body: bytes) -> ParsedRequest:
    payload = decode_json(body)
    model = _require_model(payload)
    stream = _check_common(payload)
    if api == "chat":
        messages = _check_messages(payload)
        rendered = render_chat(messages, payload.get("tools"))
    else:
        rendered = render_prompt(_check_prompt(payload))
    return ParsedRequest(api, body, payload, model, stream, rendered)
