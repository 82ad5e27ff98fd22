from __future__ import annotations

from typing import Any

from router.protocol.rendering import (
    render_chat,
    render_content,
    render_conversation,
    render_prompt,
)


def test_appended_messages_extend_the_rendering() -> None:
    turn1: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": "fix the bug"},
    ]
    turn2 = [
        *turn1,
        {"role": "assistant", "content": "done", "tool_calls": [{"id": "1", "type": "function"}]},
        {"role": "tool", "tool_call_id": "1", "content": "ok"},
    ]
    assert render_chat(turn2).startswith(render_chat(turn1))


def test_tools_come_first_and_are_canonical() -> None:
    messages = [{"role": "user", "content": "hi"}]
    a = render_chat(messages, [{"type": "function", "function": {"name": "f", "parameters": {}}}])
    b = render_chat(messages, [{"function": {"parameters": {}, "name": "f"}, "type": "function"}])
    assert a == b
    assert a.startswith("tools")


def test_content_parts() -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert render_content(parts) == "ab"
    image = [{"type": "image_url", "image_url": {"url": "data:x"}}]
    assert render_content(image) != render_content(
        [{"type": "image_url", "image_url": {"url": "y"}}]
    )
    assert render_content(None) == ""


def test_message_boundaries_cannot_be_forged() -> None:
    one = render_chat([{"role": "user", "content": "a\x1euser\x1fb"}])
    two = render_chat([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    assert one != two
    assert render_chat([{"role": "user", "content": "x"}]) != render_chat(
        [{"role": "assistant", "content": "x"}]
    )


def test_prompt_forms() -> None:
    assert render_prompt("abc") == "abc"
    assert render_prompt(["abc"]) == "abc"
    assert render_prompt([1, 2, 3]) == render_prompt([[1, 2, 3]])
    assert len(render_prompt([1, 2, 3])) == 15
    assert render_prompt([1, 2]) != render_prompt([2, 1])
    # Ids past 16 bits (Llama 3's and Qwen's vocabularies) stay distinct from their low bits,
    # and no two lists render alike by running into each other.
    assert render_prompt([100_000, 7]) != render_prompt([100_000 - 65_536, 7])
    assert render_prompt([0x10000]) != render_prompt([0x0001, 0x0000])
    assert render_prompt([151_000]) == f"{151_000:05x}"
    assert render_prompt([5, 7]).startswith(render_prompt([5])), "a turn renders its prefix"


def test_the_last_answer_is_spanned_in_bytes() -> None:
    turn1: list[dict[str, Any]] = [
        {"role": "system", "content": "Vous êtes un agent."},  # multi-byte before the answer
        {"role": "user", "content": "répare"},
    ]
    answer = {"role": "assistant", "content": "fait", "tool_calls": [{"id": "1"}]}
    turn2 = [*turn1, answer, {"role": "tool", "tool_call_id": "1", "content": "ok"}]
    text, span = render_conversation(turn2)
    assert text == render_chat(turn2)
    assert span is not None
    data = text.encode()
    assert span[0] == len(render_chat(turn1).encode()), "where the previous prompt ended"
    assert data[span[0] : span[1]].decode() == render_chat([answer])[:-1], "no separator"
    assert render_conversation(turn1)[1] is None, "no answer yet"
    assert render_conversation([*turn1, answer])[1] is None, "a trailing assistant prefill"
    # Of several answers, the last one that another message follows.
    _, last = render_conversation([*turn2, answer, {"role": "user", "content": "and?"}])
    assert last is not None and last[0] > span[1]


def test_a_cache_control_marker_moved_off_an_image_part_does_not_break_the_chain() -> None:
    """Clients that speak Anthropic's prompt caching through chat (OpenRouter's convention)
    put a ``cache_control`` marker on the newest parts and move it every turn. vLLM ignores
    it, and the rendering does on text parts; on an image part it was hashed with the image,
    so the next turn's rendering no longer extended this one's at that image."""
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    marked = {**image, "cache_control": {"type": "ephemeral"}}
    turn1 = [{"role": "user", "content": [{"type": "text", "text": "look"}, marked]}]
    turn2 = [
        {"role": "user", "content": [{"type": "text", "text": "look"}, image]},
        {"role": "assistant", "content": "a cat"},
        {"role": "user", "content": [{"type": "text", "text": "and?", "cache_control": {}}]},
    ]
    assert render_chat(turn2).startswith(render_chat(turn1))
    # A different image still breaks it.
    other = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    assert render_content([other]) != render_content([image])
