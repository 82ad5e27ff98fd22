"""The OpenAI Responses API of a simulated replica (``/v1/responses``), as vLLM serves it.

A request becomes chat messages as in vLLM: ``instructions`` first as a system message, then
(with ``previous_response_id``) the stored conversation of that response without its system
message and that response's output, then ``input`` (a string is one user message; items map
``message`` -> a message, ``function_call`` -> the assistant's ``tool_calls``,
``function_call_output`` -> a ``tool`` message). The chat template renders those, so the same
conversation through chat completions, Messages or Responses yields the same prompt tokens.

Responses are stored (unless ``store: false``) in a bounded store of this replica only, which
is why a follow-up naming ``previous_response_id`` must reach the replica that produced it; any
other answers 404, as vLLM does. ``GET`` and ``DELETE /v1/responses/{id}`` read and drop them.
Streams carry the typed events (``response.created`` first, with the id, then output item,
content part and text or function-call argument deltas, and ``response.completed``), each with
its ``sequence_number``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response

from . import protocol as p
from .responses import error_response, json_response
from .responses_output import ResponsesResponse, ResponseStore, Stored

if TYPE_CHECKING:
    from .host import SimHost

_TEXT_PARTS = ("input_text", "output_text", "text")


def not_found(response_id: str, param: str | None = None) -> p.ApiError:
    return p.ApiError(f"Response with id '{response_id}' not found.", status=404, param=param)


def _parts(content: list[Any]) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = []
    for part in content:
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind in _TEXT_PARTS:
            parts.append({"type": "text", "text": str(part.get("text", ""))})
        elif kind == "input_image":
            url = part.get("image_url") or part.get("file_id") or ""
            parts.append({"type": "image_url", "image_url": {"url": str(url)}})
        else:
            raise p.ApiError(f"Unsupported content part type: {kind!r}.", param="input")
    return parts


def _assistant(out: list[dict[str, Any]]) -> dict[str, Any] | None:
    last = out[-1] if out else None
    return last if last is not None and last.get("role") == "assistant" else None


def _item(item: Any, out: list[dict[str, Any]]) -> None:
    if not isinstance(item, Mapping):
        raise p.ApiError("Each input item must be an object.", param="input")
    kind = item.get("type", "message")
    prev = _assistant(out)
    if kind == "message":
        role, content = item.get("role"), item.get("content")
        if not isinstance(role, str) or not isinstance(content, (str, list)):
            raise p.ApiError("A message item needs a role and content.", param="input")
        value: Any = content if isinstance(content, str) else _parts(content)
        if role == "assistant" and prev is not None and prev.get("content") is None:
            prev["content"] = value
        else:
            out.append({"role": role, "content": value})
    elif kind == "function_call":
        call = p.tool_call(
            str(item.get("call_id", "")), str(item.get("name", "")), str(item.get("arguments", ""))
        )
        if prev is not None:
            prev.setdefault("tool_calls", []).append(call)
        else:
            out.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "function_call_output":
        output = item.get("output")
        content = output if isinstance(output, str) else _parts(output or [])
        out.append(
            {"role": "tool", "tool_call_id": str(item.get("call_id", "")), "content": content}
        )
    elif kind == "reasoning":
        if prev is None:
            out.append({"role": "assistant", "content": None})
    else:
        raise p.ApiError(f"Unsupported input item type: {kind!r}.", param="input")


def to_chat_messages(body: Mapping[str, Any], previous: Stored | None) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions:
        out.append({"role": "system", "content": str(instructions)})
    if previous is not None:
        # Instructions do not carry over from one response to the next.
        out += [dict(m) for m in previous.messages if m.get("role") != "system"]
        out += [dict(m) for m in previous.output]
    items = body.get("input")
    if isinstance(items, str):
        out.append({"role": "user", "content": items})
    elif isinstance(items, list):
        for item in items:
            _item(item, out)
    else:
        raise p.ApiError("'input' must be a string or a list of items.", param="input")
    if not out:
        raise p.ApiError("'input' must not be empty.", param="input")
    return out


def to_chat_tools(tools: Any) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise p.ApiError("'tools' must be a list.", param="tools")
    out = []
    for tool in tools:
        if not isinstance(tool, Mapping) or tool.get("type") != "function":
            raise p.ApiError("The simulator supports function tools only.", param="tools")
        function = {k: tool.get(k) for k in ("name", "description", "parameters")}
        out.append({"type": "function", "function": {k: v for k, v in function.items() if v}})
    return out or None


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, Mapping) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice if choice in ("auto", "none", "required") else None


def to_chat_body(body: Mapping[str, Any], store: ResponseStore) -> dict[str, Any]:
    """The chat completions body this request runs as (raises ApiError)."""
    previous = None
    previous_id = body.get("previous_response_id")
    if previous_id is not None:
        if not isinstance(previous_id, str):
            raise p.ApiError("'previous_response_id' must be a string.")
        previous = store.get(previous_id)
        if previous is None:
            raise not_found(previous_id, "previous_response_id")
    if body.get("background"):
        raise p.ApiError("The simulator does not run responses in the background.")
    chat: dict[str, Any] = {
        "model": body.get("model"),
        "messages": to_chat_messages(body, previous),
        "stream": body.get("stream", False),
    }
    tools = to_chat_tools(body.get("tools"))
    if tools:
        chat["tools"] = tools
        chat["tool_choice"] = _tool_choice(body.get("tool_choice", "auto"))
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    return chat


async def create(sim: SimHost, request: Request) -> Response:
    """``POST /v1/responses``."""
    fault = await sim.injected_fault()
    if fault is not None:
        return fault if isinstance(fault, Response) else error_response(fault)
    try:
        body = p.parse_json(await request.body())
        chat = to_chat_body(body, sim.responses)
        params = p.parse_generation(chat, sim.config, sim.engine.tokenizer, chat=True)
    except p.ApiError as err:
        return error_response(err)
    too_big = sim.capacity_error(params)
    if too_big is not None:
        return error_response(too_big)
    return ResponsesResponse(
        sim.engine,
        sim.new_request(params),
        params,
        body=body,
        messages=chat["messages"],
        store=sim.responses,
    )


def retrieve(sim: SimHost, response_id: str) -> Response:
    """``GET /v1/responses/{id}``."""
    stored = sim.responses.get(response_id)
    if stored is None:
        return error_response(not_found(response_id))
    return json_response(stored.body)


def delete(sim: SimHost, response_id: str) -> Response:
    """``DELETE /v1/responses/{id}``."""
    if not sim.responses.delete(response_id):
        return error_response(not_found(response_id))
    return json_response({"id": response_id, "object": "response", "deleted": True})
