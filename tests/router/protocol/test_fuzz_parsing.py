"""Property-based tests: no body crashes parsing, and rendering keeps its prefix structure."""

from __future__ import annotations

from typing import Any

import orjson
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from router.core.errors import BadRequestError
from router.core.hashing import block_hashes
from router.protocol.parsing import ParsedRequest, parse_request
from router.protocol.rendering import render_chat, render_prompt

SORTED = orjson.OPT_SORT_KEYS
# Derandomized: the same examples on every run, so CI is deterministic.
FUZZ = settings(
    max_examples=300,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)
KEYS = ["model", "messages", "prompt", "stream", "n", "max_tokens", "max_completion_tokens",
        "tools", "temperature", "top_p", "stream_options"]
# Bodies that look like requests, with every known field possibly of the wrong type.
request_like = st.dictionaries(st.sampled_from(KEYS), json_values, max_size=8)
token_ids = st.lists(st.integers(-(2**63), 2**64 - 1), max_size=5)
prompts = st.one_of(
    st.text(max_size=20), token_ids, st.lists(st.text(max_size=5), max_size=4),
    st.lists(token_ids, max_size=3), st.lists(json_scalars, max_size=4),
)
text = st.text(max_size=40)  # any code point, separators and lone surrogates included
# Text rich in the renderer's separators and escape character, to attack message boundaries.
tricky = st.text(alphabet=st.sampled_from("ab\x1e\x1f\\"), max_size=8)
content_part = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": text}),
    st.fixed_dictionaries({"type": st.just("image_url"), "image_url": st.fixed_dictionaries(
        {"url": text})}),
)
message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["system", "user", "assistant", "tool"]),
        "content": st.one_of(st.none(), text, tricky, st.lists(content_part, max_size=3)),
    },
    optional={"name": text, "tool_call_id": text},
)
trickier = st.text(alphabet=st.sampled_from("a\x1e\x1f\\x1ef"), max_size=10)
tricky_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant"]), "content": trickier},
    optional={"name": trickier, "tool_call_id": trickier},
)
messages = st.lists(message, min_size=1, max_size=6)


def parse_or_reject(api: str, body: bytes) -> ParsedRequest | None:
    try:
        return parse_request(api, body)  # type: ignore[arg-type]
    except BadRequestError as exc:
        error = orjson.loads(exc.body())["error"]
        assert exc.status_code == 400 and error["message"]
        return None


@FUZZ
@given(st.sampled_from(["chat", "completions"]), st.binary(max_size=200))
def test_arbitrary_bytes_are_parsed_or_rejected(api: str, body: bytes) -> None:
    parse_or_reject(api, body)


@FUZZ
@given(st.sampled_from(["chat", "completions"]), json_values | request_like)
def test_arbitrary_json_is_parsed_or_rejected(api: str, payload: Any) -> None:
    parsed = parse_or_reject(api, orjson.dumps(payload))
    if parsed is not None:
        # Whatever was accepted can be hashed for the index (surrogates included).
        block_hashes(parsed.rendered, 64, parsed.model, 100)


@FUZZ
@given(prompts, st.sampled_from(["m", "", None]))
def test_every_prompt_shape_is_parsed_or_rejected(prompt: Any, model: Any) -> None:
    parse_or_reject("completions", orjson.dumps({"model": model, "prompt": prompt}))


@FUZZ
@given(st.sampled_from(["chat", "completions"]), st.integers(1, 1200))
def test_deep_nesting_is_a_400(api: str, depth: int) -> None:
    nested = "[" * depth + "]" * depth
    field = '"tools"' if api == "chat" else '"prompt"'
    raw = f'{{"model":"m","messages":[{{"role":"u"}}],{field}:{nested}}}'.encode()
    parse_or_reject(api, raw)


@FUZZ
@given(messages, st.lists(st.dictionaries(st.text(max_size=5), text, max_size=3), max_size=2))
def test_valid_chat_is_accepted(msgs: list[dict[str, Any]], tools: list[Any]) -> None:
    body = {"model": "m", "messages": msgs, "stream": True, "n": 2, "max_tokens": 7}
    if tools:
        body["tools"] = tools
    parsed = parse_request("chat", orjson.dumps(body))
    assert parsed.stream is True and parsed.model == "m"


@FUZZ
@given(messages, messages)
def test_rendering_of_a_growing_conversation_extends_the_previous(
    first: list[dict[str, Any]], more: list[dict[str, Any]]
) -> None:
    # Appended turns must keep the cached prefix: that is what prefix routing relies on.
    assert render_chat(first + more).startswith(render_chat(first))


@FUZZ
@given(messages, messages)
def test_distinct_conversations_render_distinctly(
    a: list[dict[str, Any]], b: list[dict[str, Any]]
) -> None:
    # Content cannot forge a message boundary: equal renderings mean equal conversations.
    if render_chat(a) == render_chat(b):
        assert [_canon(m) for m in a] == [_canon(m) for m in b]


@FUZZ
@given(st.lists(tricky_message, min_size=1, max_size=3), st.lists(tricky_message, max_size=3))
@example(
    [{"role": "user", "content": "x", "name": "n\x1eassistant\x1fy"}],
    [{"role": "user", "content": "x", "name": "n"}, {"role": "assistant", "content": "y"}],
)
@example([{"role": "user", "content": "a\\x1e"}], [{"role": "user", "content": "a\x1e"}])
def test_names_cannot_forge_message_boundaries(
    a: list[dict[str, Any]], b: list[dict[str, Any]]
) -> None:
    if render_chat(a) == render_chat(b):
        assert [_canon(m) for m in a] == [_canon(m) for m in b]


def _canon(message: dict[str, Any]) -> Any:
    content = message.get("content")
    if isinstance(content, list):
        content = "".join(
            p["text"] if p["type"] == "text" else orjson.dumps(p, option=SORTED).decode()
            for p in content
        )
    return (message["role"], content or "", message.get("name"), message.get("tool_call_id"))


@FUZZ
@given(st.dictionaries(st.text(max_size=6), json_scalars, min_size=2, max_size=6), messages)
def test_tool_key_order_does_not_change_the_rendering(
    tool: dict[str, Any], msgs: list[dict[str, Any]]
) -> None:
    reordered = dict(reversed(list(tool.items())))
    assert render_chat(msgs, [tool]) == render_chat(msgs, [reordered])


@FUZZ
@given(st.one_of(text, st.lists(st.integers(-(2**40), 2**40), min_size=1, max_size=20)))
def test_prompt_rendering_is_total_and_batch_of_one_is_the_same(prompt: Any) -> None:
    assert render_prompt(prompt) == render_prompt([prompt])
