"""What a request's path tells the endpoint picker before any body arrives: the API whose body
it carries, or the stored response it names."""

from __future__ import annotations

import re

from router.protocol.parsing import Api

# GET/DELETE /v1/responses/{id} and POST /v1/responses/{id}/cancel: the endpoint holding it.
_STORED_RESPONSE = re.compile(r".*/responses/([^/]+)(?:/cancel)?")


def api_for(path: str) -> Api | None:
    """The API whose body a path carries; None for paths routed without reading the body."""
    path = path.split("?", 1)[0].rstrip("/")
    if path.endswith("/chat/completions"):
        return "chat"
    if path.endswith("/completions"):
        return "completions"
    if path.endswith("/messages"):
        return "messages"
    if path.endswith("/responses"):
        return "responses"
    return None


def stored_response_id(path: str) -> str | None:
    """The response a ``/v1/responses/{id}`` path names (None for any other path)."""
    found = _STORED_RESPONSE.fullmatch(path.split("?", 1)[0].rstrip("/"))
    return found.group(1) if found else None
