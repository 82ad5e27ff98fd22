"""What a simulated replica's Responses API answers: the response object, its stream of typed
events, and the store that keeps finished responses for ``previous_response_id``.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson
from starlette.types import Send

from . import protocol as p
from .engine import Engine
from .request import SimRequest, Status
from .responses import JSON, GenerationResponse, send_bytes, start_event_stream

MAX_STORED = 10_000


@dataclass
class Stored:
    """A stored response: the chat messages it ran on, its output as messages, its body."""

    messages: list[dict[str, Any]]
    output: list[dict[str, Any]]
    body: dict[str, Any]


@dataclass
class ResponseStore:
    """The replica's stored responses, oldest dropped first beyond ``limit``."""

    limit: int = MAX_STORED
    items: OrderedDict[str, Stored] = field(default_factory=OrderedDict)

    def get(self, response_id: str) -> Stored | None:
        return self.items.get(response_id)

    def put(self, response_id: str, stored: Stored) -> None:
        self.items[response_id] = stored
        while len(self.items) > self.limit:
            self.items.popitem(last=False)

    def delete(self, response_id: str) -> bool:
        return self.items.pop(response_id, None) is not None


def _event(kind: str, data: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


class ResponsesResponse(GenerationResponse):
    """One Responses request through the engine; stores the response once it finished."""

    def __init__(
        self,
        engine: Engine,
        req: SimRequest,
        params: p.GenerationParams,
        *,
        body: Mapping[str, Any],
        messages: list[dict[str, Any]],
        store: ResponseStore,
    ) -> None:
        super().__init__(engine, req, params, lambda r: {})
        self._body = body
        self._messages = messages
        self._store = store
        hexid = self._rid.rsplit("-", 1)[-1]
        self._id, self._item_id = "resp_" + hexid, ("fc_" if self._params.tool_name else "msg_")
        self._item_id += hexid
        self._call_id = "call_" + hexid
        self._seq = 0
        self._created_at = time.time()

    def _item(self, text: str, done: bool) -> dict[str, Any]:
        status = "completed" if done else "in_progress"
        if self._params.tool_name is not None:
            return {
                "type": "function_call",
                "id": self._item_id,
                "call_id": self._call_id,
                "name": self._params.tool_name,
                "arguments": text,
                "status": status,
            }
        content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
        return {
            "type": "message",
            "id": self._item_id,
            "status": status,
            "role": "assistant",
            "content": content if done else [],
        }

    def _response(self, output: list[dict[str, Any]], status: str) -> dict[str, Any]:
        req, body = self._req, self._body
        usage = None
        if status == "completed":
            usage = {
                "input_tokens": req.num_prompt_tokens,
                "input_tokens_details": {"cached_tokens": req.num_cached_tokens},
                "output_tokens": len(req.output),
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": req.num_prompt_tokens + len(req.output),
            }
        return {
            "id": self._id,
            "object": "response",
            "created_at": self._created_at,
            "status": status,
            "model": self._params.model,
            "output": output,
            "instructions": body.get("instructions"),
            "previous_response_id": body.get("previous_response_id"),
            "max_output_tokens": body.get("max_output_tokens"),
            "tools": body.get("tools") or [],
            "tool_choice": body.get("tool_choice", "auto"),
            "parallel_tool_calls": True,
            "temperature": body.get("temperature", 1.0),
            "top_p": body.get("top_p", 1.0),
            "store": body.get("store", True),
            "metadata": body.get("metadata") or {},
            "text": {"format": {"type": "text"}},
            "truncation": "disabled",
            "background": False,
            "reasoning": None,
            "error": None,
            "incomplete_details": None,
            "usage": usage,
        }

    def _finish(self) -> dict[str, Any]:
        """The completed response body; stored unless the request said ``store: false``."""
        text = self._engine.tokenizer.decode(self._req.output)
        if self._params.tool_name is not None:
            text = p.tool_arguments(text)
            reply: dict[str, Any] = {
                "role": "assistant",
                "content": None,
                "tool_calls": [p.tool_call(self._call_id, self._params.tool_name, text)],
            }
        else:
            reply = {"role": "assistant", "content": text}
        response = self._response([self._item(text, True)], "completed")
        if self._body.get("store", True) is not False:
            self._store.put(self._id, Stored(self._messages, [reply], response))
        return response

    async def _send_full(self, send: Send) -> None:
        if self._req.status is Status.ABORTED:
            err = p.ApiError("The engine is shutting down.", status=503)
            await send_bytes(send, err.status, orjson.dumps(err.body()), JSON)
            return
        await send_bytes(send, 200, orjson.dumps(self._finish()), JSON)

    def _ev(self, kind: str, **data: Any) -> bytes:
        event = _event(kind, {"type": kind, "sequence_number": self._seq, **data})
        self._seq += 1
        return event

    def _opening(self) -> bytes:
        item = {"item_id": self._item_id, "output_index": 0}
        events = [
            self._ev("response.created", response=self._response([], "in_progress")),
            self._ev("response.in_progress", response=self._response([], "in_progress")),
            self._ev("response.output_item.added", output_index=0, item=self._item("", False)),
        ]
        if self._params.tool_name is None:
            part = {"type": "output_text", "text": "", "annotations": []}
            events.append(
                self._ev("response.content_part.added", **item, content_index=0, part=part)
            )
        return b"".join(events)

    def _delta(self, text: str) -> bytes:
        item = {"item_id": self._item_id, "output_index": 0}
        if self._params.tool_name is not None:
            return self._ev("response.function_call_arguments.delta", **item, delta=text)
        return self._ev(
            "response.output_text.delta", **item, content_index=0, delta=text, logprobs=[]
        )

    def _closing(self) -> bytes:
        response = self._finish()
        final = response["output"][0]
        item = {"item_id": self._item_id, "output_index": 0}
        events = []
        if self._params.tool_name is not None:
            events.append(
                self._ev(
                    "response.function_call_arguments.done", **item, arguments=final["arguments"]
                )
            )
        else:
            text = final["content"][0]["text"]
            events.append(
                self._ev(
                    "response.output_text.done", **item, content_index=0, text=text, logprobs=[]
                )
            )
            events.append(
                self._ev(
                    "response.content_part.done", **item, content_index=0, part=final["content"][0]
                )
            )
        events.append(self._ev("response.output_item.done", output_index=0, item=final))
        events.append(self._ev("response.completed", response=response))
        return b"".join(events)

    async def _send_stream(self, send: Send) -> None:
        req, piece, tool = self._req, self._engine.tokenizer.piece, self._params.tool_name
        await start_event_stream(send)
        await send({"type": "http.response.body", "body": self._opening(), "more_body": True})
        sent = 0
        async for ids in self._deltas():
            text = "".join(piece(i) for i in ids)
            if tool is not None:
                text = (p.ARGS_OPEN if sent == 0 else "") + p.escape_piece(text)
                if req.status is Status.FINISHED:
                    text += p.ARGS_CLOSE
            sent += len(ids)
            await send({"type": "http.response.body", "body": self._delta(text), "more_body": True})
        if req.status is Status.ABORTED:
            tail = self._ev(
                "error", code="server_error", message="The engine is shutting down.", param=None
            )
        else:
            tail = self._closing()
        await send({"type": "http.response.body", "body": tail, "more_body": False})
