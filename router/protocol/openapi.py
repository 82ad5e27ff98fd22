"""OpenAPI description of the inference bodies: what ``/openapi.json`` documents and the
schema-driven tests send. Never run per request; the request path validates in
router/protocol/parsing.py, with the bounds these mirror."""

from __future__ import annotations

from typing import Any

from router.protocol.parsing import MAX_N, Api

_NULLABLE_BOOL = {"type": ["boolean", "null"]}
_POSITIVE = {"type": ["integer", "null"], "minimum": 1}
_COMMON: dict[str, Any] = {
    "model": {"type": "string", "minLength": 1, "examples": ["sim-model"]},
    "stream": _NULLABLE_BOOL,
    "n": {"type": ["integer", "null"], "minimum": 1, "maximum": MAX_N},
    "max_tokens": _POSITIVE,
    "max_completion_tokens": _POSITIVE,
    "temperature": {"type": ["number", "null"], "minimum": 0, "maximum": 2},
    "top_p": {"type": ["number", "null"], "minimum": 0, "maximum": 1},
    "stream_options": {"type": ["object", "null"]},
}
_TOKEN_IDS = {"type": "array", "minItems": 1, "items": {"type": "integer"}}
_MESSAGE = {
    "type": "object",
    "required": ["role"],
    "properties": {
        "role": {"type": "string", "minLength": 1},
        "content": {"type": ["string", "array", "null"]},
        "name": {"type": "string"},
        "tool_call_id": {"type": "string"},
    },
}
_BODIES: dict[str, dict[str, Any]] = {
    "chat": {
        "type": "object",
        "required": ["model", "messages"],
        "properties": {
            **_COMMON,
            "messages": {"type": "array", "minItems": 1, "items": _MESSAGE},
            "tools": {"type": ["array", "null"]},
        },
    },
    "completions": {
        "type": "object",
        "required": ["model", "prompt"],
        "properties": {
            **_COMMON,
            "prompt": {
                "anyOf": [
                    {"type": "string"},
                    _TOKEN_IDS,
                    {"type": "array", "minItems": 1, "items": {"type": "string"}},
                    {"type": "array", "minItems": 1, "items": _TOKEN_IDS},
                ]
            },
        },
    },
}
_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "integer", "null"]},
            },
        }
    },
}
_ERRORS = {
    "400": "Malformed body: not JSON, wrong types, missing fields",
    "401": "Missing or wrong API key (when auth is on)",
    "404": "Unknown model",
    "408": "The body did not arrive within the body timeout",
    "413": "Body over server.maxBodyBytes",
    "429": "Shed by flow control",
    "502": "No endpoint could be reached",
    "503": "No healthy endpoint, or shutting down",
    "504": "No endpoint answered within the first-byte timeout",
}


def openapi_extra(api: Api) -> dict[str, Any]:
    """``requestBody`` and ``responses`` for the route of ``api`` (FastAPI's openapi_extra)."""
    responses: dict[str, Any] = {
        "200": {
            "description": "The replica's answer: JSON, or text/event-stream when streaming",
            "content": {"application/json": {}, "text/event-stream": {}},
        },
        "default": {
            "description": "The replica's own error, passed through",
            "content": {"application/json": {}},
        },
    }
    for status, text in _ERRORS.items():
        responses[status] = {
            "description": text,
            "content": {"application/json": {"schema": _ERROR}},
        }
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": _BODIES[api]}},
        },
        "responses": responses,
    }
