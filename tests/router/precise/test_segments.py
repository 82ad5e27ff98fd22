"""Piecewise prompt encoding: the same ids as encoding the whole, from remembered pieces."""

from __future__ import annotations

import re
import threading
from typing import Any

import pytest

from benchmarks.sim.tokenizer import SPECIAL_RE, Tokenizer, image_placeholder, render_chat
from router.precise.segments import SegmentMemo, probe_equivalence, split_pattern

CHAT: list[dict[str, Any]] = [
    {"role": "system", "content": "You are terse.\n"},
    {"role": "user", "content": [
        {"type": "text", "text": "What is in  this picture?"},
        {"type": "image_url", "image_url": {"url": "https://example.test/cat.png"}},
    ]},
    {"role": "assistant", "content": " A cat, 3 of them. "},
    {"role": "user", "content": "And\n\nnow?"},
]
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "grep", "parameters": {"type": "object"}}}
]


def test_a_growing_conversation_encodes_as_a_whole_and_reuses_its_pieces() -> None:
    tok = Tokenizer()
    memo = SegmentMemo(tok.encode, SPECIAL_RE)
    text = render_chat(CHAT, TOOLS)
    assert image_placeholder("https://example.test/cat.png") in text
    assert list(memo.encode(text)) == tok.encode(text)
    misses = memo.misses
    longer = render_chat([*CHAT, {"role": "assistant", "content": "Done."}], TOOLS)
    assert list(memo.encode(longer)) == tok.encode(longer)
    # Only the new message's pieces (its role line and content) were encoded afresh.
    assert 0 < memo.misses - misses <= 2
    assert memo.hits > 0


def test_ids_come_as_32_bit_arrays_and_widen_for_a_larger_id() -> None:
    def encode(text: str) -> list[int]:
        return [2**40 if text == "big" else len(text)]

    memo = SegmentMemo(encode, split_pattern(["<s>"]))
    narrow = memo.encode("ab<s>cde")
    assert narrow.typecode == "I" and list(narrow) == [2, 3, 3]
    wide = memo.encode("ab<s>big<s>")  # a remembered 32-bit piece, then one past 2**32
    assert wide.typecode == "q" and list(wide) == [2, 3, 2**40, 3]


def test_the_memo_is_bounded_by_tokens_and_pieces() -> None:
    tok = Tokenizer()
    memo = SegmentMemo(tok.encode, SPECIAL_RE, max_tokens=60, max_pieces=3)
    for i in range(20):
        text = f"<|im_start|>user\nmessage number {i} " + "word " * i + "<|im_end|>"
        assert list(memo.encode(text)) == tok.encode(text)
        assert memo.tokens <= 60 and len(memo) <= 3
    # A piece larger than the whole budget is encoded, not kept.
    huge = "x" * 1000
    assert list(memo.encode(huge)) == tok.encode(huge)
    assert memo.tokens <= 60


def test_split_pattern_prefers_the_longest_special() -> None:
    pattern = split_pattern(["<|a|>", "<|a|>x", ""])
    assert pattern.split("1<|a|>x2<|a|>3") == ["1", "<|a|>x", "2", "<|a|>", "3"]
    with pytest.raises(ValueError, match="at least one"):
        split_pattern([""])
    with pytest.raises(ValueError, match="capturing group"):
        SegmentMemo(lambda t: [], re.compile("<s>"))


def test_probe_catches_an_encoder_that_is_not_piecewise() -> None:
    # A tokenizer that marks the start of its input (a "first piece only" prefix space, say).
    def marked(text: str) -> list[int]:
        return [0, *(ord(c) for c in text)]

    memo = SegmentMemo(marked, split_pattern(["<s>"]))
    assert probe_equivalence(marked, memo, ["<s>hello"]) is not None
    plain = SegmentMemo(lambda t: [ord(c) for c in t], split_pattern(["<s>"]))
    assert probe_equivalence(lambda t: [ord(c) for c in t], plain, ["<s>hello<s>"]) is None


def test_concurrent_encoding_from_threads_stays_exact() -> None:
    tok = Tokenizer()
    memo = SegmentMemo(tok.encode, SPECIAL_RE, max_pieces=8)
    texts = [render_chat([*CHAT, {"role": "user", "content": f"turn {i}"}]) for i in range(12)]
    expected = [tok.encode(t) for t in texts]
    failures: list[int] = []

    def work(offset: int) -> None:
        for n in range(60):
            i = (n + offset) % len(texts)
            if list(memo.encode(texts[i])) != expected[i]:
                failures.append(i)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not failures and len(memo) <= 8
