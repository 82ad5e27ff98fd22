"""OpenAI/vLLM request parsing and response shapes for the simulated server.

Bodies and chunks follow vLLM's (field names, ``logprobs: null``, ``stop_reason``, usage with
``prompt_tokens_details.cached_tokens``). Invalid input raises ``ApiError``, which the server
turns into ``{"error": {"message", "type", "param", "code"}}`` with vLLM's status codes.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from .config import SimConfig
from .tokenizer import VOCAB_SIZE, Tokenizer


class ApiError(Exception):
    """An error answered to the client as an OpenAI error body."""

    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param

    @property
    def error_type(self) -> str:
        return {
            400: "BadRequestError",
            404: "NotFoundError",
            429: "RateLimitError",
            503: "ServiceUnavailableError",
        }.get(self.status, "BadRequestError" if self.status < 500 else "InternalServerError")

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.status,
            }
        }


@dataclass
class GenerationParams:
    """What a completions or chat request asks of the engine."""

    chat: bool
    model: str
    prompt_ids: list[int]
    max_tokens: int
    stream: bool
    include_usage: bool
    seed: int | None
    cache_salt: str | None
    kv_transfer_params: dict[str, Any] | None
    # A tool the request forces (tool_choice "required" or named): the reply is one call to it.
    tool_name: str | None = None


def parse_json(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object, or a 400."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ApiError(f"Invalid JSON body: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError("The request body must be a JSON object.")
    return body


def resolve_model(body: Mapping[str, Any], config: SimConfig) -> str:
    """The served model name a request addresses (404 for an unknown one, as vLLM)."""
    model = body.get("model")
    if model is None:
        return config.model_names[0]
    if not isinstance(model, str):
        raise ApiError("'model' must be a string.", param="model")
    if model not in config.model_names:
        raise ApiError(f"The model `{model}` does not exist.", status=404, param="model")
    # vLLM answers with its primary served name whichever alias was asked for.
    return config.model_names[0]


def _opt_int(body: Mapping[str, Any], key: str, minimum: int | None = None) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(f"'{key}' must be an integer.", param=key)
    if minimum is not None and value < minimum:
        raise ApiError(f"'{key}' must be at least {minimum}, got {value}.", param=key)
    return value


def _validate_ids(ids: list[Any]) -> list[int]:
    for token in ids:
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < VOCAB_SIZE:
            raise ApiError(f"Token id {token!r} is out of vocabulary.", param="prompt")
    return ids


def completion_prompt_ids(body: Mapping[str, Any], tokenizer: Tokenizer) -> list[int]:
    """Prompt ids of a completions body: a string, ids, or a one-element list of either."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise ApiError("The simulator accepts a single prompt per request.", param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt)
    elif isinstance(prompt, list):
        ids = _validate_ids(prompt)
    elif prompt is None:
        raise ApiError("'prompt' is required.", param="prompt")
    else:
        raise ApiError("'prompt' must be a string or a list of token ids.", param="prompt")
    if not ids:
        raise ApiError("The prompt cannot be empty.", param="prompt")
    return ids


def chat_prompt_ids(body: Mapping[str, Any], tokenizer: Tokenizer) -> list[int]:
    """Prompt ids of a chat body rendered through the chat template."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError("'messages' must be a non-empty list.", param="messages")
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise ApiError("'tools' must be a list.", param="tools")
    try:
        return tokenizer.encode_chat(messages, tools)
    except ValueError as exc:
        raise ApiError(str(exc), param="messages") from None


def forced_tool(body: Mapping[str, Any]) -> str | None:
    """The tool a chat body's ``tool_choice`` forces (``"required"``: the first one), if any.

    The simulator cannot decide when to call a tool, so it calls one only when told to; its
    arguments are ``{"input": <generated text>}`` (:func:`tool_arguments`).
    """
    choice = body.get("tool_choice")
    if choice is None or choice in ("auto", "none"):
        return None
    tools = body.get("tools")
    if not isinstance(tools, list) or not tools:
        raise ApiError("'tool_choice' needs 'tools'.", param="tool_choice")
    if choice == "required":
        function = tools[0].get("function") if isinstance(tools[0], Mapping) else None
        name = function.get("name") if isinstance(function, Mapping) else None
    elif isinstance(choice, Mapping) and isinstance(choice.get("function"), Mapping):
        name = choice["function"].get("name")
    else:
        name = None
    if not isinstance(name, str) or not name:
        raise ApiError("'tool_choice' must name a function of 'tools'.", param="tool_choice")
    return name


def parse_generation(
    body: Mapping[str, Any], config: SimConfig, tokenizer: Tokenizer, chat: bool
) -> GenerationParams:
    """Validate a completions/chat body; raises ApiError for anything vLLM would reject."""
    model = resolve_model(body, config)
    n = _opt_int(body, "n", 1)
    if n not in (None, 1):
        raise ApiError("The simulator supports n=1 only.", param="n")
    stream = body.get("stream", False)
    options = body.get("stream_options")
    if not isinstance(stream, bool) or not (options is None or isinstance(options, dict)):
        raise ApiError("'stream' must be a boolean and 'stream_options' an object.")
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise ApiError("'cache_salt' must be a non-empty string.", param="cache_salt")
    kv_params = body.get("kv_transfer_params")
    if kv_params is not None and not isinstance(kv_params, dict):
        raise ApiError("'kv_transfer_params' must be an object.", param="kv_transfer_params")
    seed = _opt_int(body, "seed")
    max_tokens = _opt_int(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = _opt_int(body, "max_tokens", 1)
    ids = chat_prompt_ids(body, tokenizer) if chat else completion_prompt_ids(body, tokenizer)
    limit = config.max_model_len
    if len(ids) >= limit:
        raise ApiError(
            f"This model's maximum context length is {limit} tokens. However, your request has "
            f"{len(ids)} input tokens. Please reduce the length of the input messages.",
            param="messages" if chat else "prompt",
        )
    if max_tokens is None:
        max_tokens = min(config.default_max_tokens, limit - len(ids))
    elif len(ids) + max_tokens > limit:
        raise ApiError(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{len(ids) + max_tokens} tokens ({len(ids)} in the messages, {max_tokens} in the "
            "completion). Please reduce the length of the messages or completion.",
            param="max_tokens",
        )
    if kv_params and kv_params.get("do_remote_decode"):
        max_tokens = 1  # a prefill server answers after its first token
    return GenerationParams(
        chat=chat,
        model=model,
        prompt_ids=ids,
        max_tokens=max_tokens,
        stream=stream,
        include_usage=bool(options and options.get("include_usage")),
        seed=seed,
        cache_salt=salt,
        kv_transfer_params=kv_params,
        tool_name=forced_tool(body) if chat else None,
    )


# -- responses -------------------------------------------------------------------------------


def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex


def new_tool_call_id() -> str:
    return "chatcmpl-tool-" + uuid.uuid4().hex


# A forced tool call's arguments are {"input": <generated text>}, streamed piece by piece:
# ARGS_OPEN, then each piece JSON-escaped, then ARGS_CLOSE (orjson's compact form, so the
# concatenation equals tool_arguments(text)).
ARGS_OPEN = '{"input":"'
ARGS_CLOSE = '"}'


def tool_arguments(text: str) -> str:
    return orjson.dumps({"input": text}).decode()


def escape_piece(piece: str) -> str:
    """A piece of text as it appears inside a JSON string."""
    return orjson.dumps(piece).decode()[1:-1]


def tool_call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def now_s() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def full_response(
    params: GenerationParams,
    rid: str,
    created: int,
    text: str,
    usage_body: dict[str, Any],
    kv_transfer_params: dict[str, Any] | None,
) -> dict[str, Any]:
    """A non-streaming chat.completion or text_completion body."""
    if params.chat:
        calls: list[dict[str, Any]] = []
        if params.tool_name is not None:
            calls.append(tool_call(new_tool_call_id(), params.tool_name, tool_arguments(text)))
        choice: dict[str, Any] = {
            "index": 0,
            "message": {
                "role": "assistant",
                "content": None if calls else text,
                "refusal": None,
                "annotations": None,
                "audio": None,
                "function_call": None,
                "tool_calls": calls,
                "reasoning_content": None,
            },
            "logprobs": None,
            "finish_reason": "tool_calls" if calls else "length",
            "stop_reason": None,
        }
        obj = "chat.completion"
    else:
        choice = {
            "index": 0,
            "text": text,
            "logprobs": None,
            "finish_reason": "length",
            "stop_reason": None,
            "prompt_logprobs": None,
        }
        obj = "text_completion"
    return {
        "id": rid,
        "object": obj,
        "created": created,
        "model": params.model,
        "choices": [choice],
        "service_tier": None,
        "system_fingerprint": None,
        "usage": usage_body,
        "prompt_logprobs": None,
        "kv_transfer_params": kv_transfer_params,
    }


def chunk_header(params: GenerationParams, rid: str, created: int) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "chat.completion.chunk" if params.chat else "text_completion",
        "created": created,
        "model": params.model,
    }


def sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def token_chunk(
    header: dict[str, Any], chat: bool, text: str, finish: str | None, role: bool = False
) -> bytes:
    """One SSE event for one token (``role`` adds the assistant role, as vLLM's first chunk)."""
    if chat:
        delta: dict[str, Any] = (
            {"role": "assistant", "content": text} if role else {"content": text}
        )
        choice: dict[str, Any] = {
            "index": 0,
            "delta": delta,
            "logprobs": None,
            "finish_reason": finish,
        }
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    if finish is not None:
        choice["stop_reason"] = None
    return sse({**header, "choices": [choice]})


def tool_call_chunk(
    header: dict[str, Any], call: dict[str, Any], finish: str | None = None
) -> bytes:
    """One chat chunk carrying a piece of a tool call (the first one has its id and name)."""
    choice: dict[str, Any] = {
        "index": 0,
        "delta": {"tool_calls": [{"index": 0, **call}]},
        "logprobs": None,
        "finish_reason": finish,
    }
    if finish is not None:
        choice["stop_reason"] = None
    return sse({**header, "choices": [choice]})


DONE = b"data: [DONE]\n\n"
