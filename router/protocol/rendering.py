"""Canonical prompt rendering for the prefix index.

The gateway cannot reproduce a replica's chat template or tokenizer, so it renders each request
into a canonical text whose *prefix structure* matches the replica's: tools first (chat templates
put tool definitions into the system header), then every message in order. A conversation that
grows by appended messages therefore renders to a text that extends the previous one, and its
block hashes form a growing chain of identical leading blocks.

Separators are ASCII control characters that do not occur in ordinary text, so that message
boundaries cannot be forged by content ("user: x" inside a message is not a new message).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import orjson

_MSG = "\x1e"  # record separator: between messages
_FIELD = "\x1f"  # unit separator: between fields of a message
_ESC = "\x1a"  # substitute: escapes the three inside text


def _canonical_json(value: Any) -> str:
    # Sorted keys: two clients sending the same tools in another key order share a prefix.
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS).decode()


def render_content(content: Any) -> str:
    """Render an OpenAI message ``content``: a string or a list of typed parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        pieces: list[str] = []
        for part in content:
            if isinstance(part, Mapping):
                pieces.append(_render_part(part))
            elif isinstance(part, str):
                pieces.append(part)
        return "".join(pieces)
    return _canonical_json(content)


def _render_part(part: Mapping[str, Any]) -> str:
    kind = part.get("type")
    if kind in ("text", "input_text", "output_text"):
        text = part.get("text")
        return text if isinstance(text, str) else ""
    # Images and other media: the canonical JSON of the part, so the same image yields the same
    # block and a different image breaks the chain, as the engine's multimodal hashes do. Less
    # a cache_control marker, which vLLM ignores and clients move every turn.
    if "cache_control" in part:
        part = {k: v for k, v in part.items() if k != "cache_control"}
    return _canonical_json(part)


def _escape(text: str) -> str:
    # Rare: text carrying our separators (or the escape character) is escaped, injectively, so
    # that no content, role or name can fake a message boundary.
    if _MSG in text or _FIELD in text or _ESC in text:
        return text.replace(_ESC, _ESC + _ESC).replace(_MSG, _ESC + "m").replace(_FIELD, _ESC + "f")
    return text


def render_message(message: Mapping[str, Any]) -> str:
    role = message.get("role")
    content = _escape(render_content(message.get("content")))
    fields = [_escape(role) if isinstance(role, str) else "", content]
    for key in ("name", "tool_call_id"):
        value = message.get(key)
        if isinstance(value, str):
            fields.append(f"{key}={_escape(value)}")
    tool_calls = message.get("tool_calls")
    if tool_calls:
        fields.append(_canonical_json(tool_calls))
    return _FIELD.join(fields)


def render_chat(messages: Sequence[Mapping[str, Any]], tools: Any = None) -> str:
    """Render a chat request's tools and messages; each message ends with a separator."""
    return render_conversation(messages, tools)[0]


def render_conversation(
    messages: Sequence[Mapping[str, Any]], tools: Any = None
) -> tuple[str, tuple[int, int] | None]:
    """:func:`render_chat`, and the UTF-8 byte span of the last answer in it.

    The last answer is the last assistant message that another message follows: what the
    endpoint that served the previous turn generated. vLLM caches the blocks of generated
    tokens as it decodes, so that endpoint holds the answer although no prompt the gateway
    indexed contained it. The span ends before the message's separator (the end-of-turn token,
    sampled last, is never computed).
    """
    parts: list[str] = []
    if tools:
        parts.append("tools" + _FIELD + _canonical_json(tools) + _MSG)
    answer = -1
    for message in messages:
        if message.get("role") == "assistant":
            answer = len(parts)
        parts.append(render_message(message) + _MSG)
    text = "".join(parts)
    if answer < 0 or answer == len(parts) - 1:
        return text, None
    start = len("".join(parts[:answer]).encode("utf-8", "surrogatepass"))
    end = start + len(parts[answer].encode("utf-8", "surrogatepass")) - len(_MSG)
    return text, (start, end)


def render_prompt(prompt: Any) -> str:
    """Render a completions ``prompt``: text, token ids, or a one-element batch of either."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        return _token_ids_text(prompt)
    return ""


def _token_ids_text(ids: list[Any]) -> str:
    """Token ids as text: five hex digits each, one fixed width for every prompt of a model
    (so a prompt's rendering is a prefix of its next turn's), wide enough that no id of a real
    vocabulary (Llama 3's and Qwen's reach past 16 bits; cut to 16 they collided) shares its
    text with another, and about a token of text's four bytes. Formatted in one C call: a
    Python call per id cost 100 ms on the event loop for a 128K-token prompt."""
    values = tuple(ids)
    if values and (min(values) < 0 or max(values) > _TOKEN_ID_MAX):
        values = tuple(int(t) & _TOKEN_ID_MAX for t in values)  # ids no replica accepts
    return ("%05x" * len(values)) % values


_TOKEN_ID_MAX = 0xFFFFF
