"""Tokenizer: determinism, round trip of generated text, multi-turn prefix extension."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.sim.tokenizer import IM_END_ID, IM_START_ID, Tokenizer, render_chat

TEXT = "Hello, world! The quick brown fox jumps over the lazy dog.\n\n  def f(x): return x**2"


def test_encode_is_deterministic_across_instances_and_processes() -> None:
    ids = Tokenizer().encode(TEXT)
    assert ids == Tokenizer().encode(TEXT)
    code = f"from benchmarks.sim.tokenizer import Tokenizer;print(Tokenizer().encode({TEXT!r}))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=30, check=True
    )
    assert out.stdout.strip() == str(ids)


def test_text_round_trip_and_rough_density() -> None:
    tok = Tokenizer()
    ids = tok.encode(TEXT)
    assert tok.decode(ids) == TEXT
    english = "the cat sat on the mat and looked at the other animals in the garden " * 50
    assert 2.5 <= len(english) / len(tok.encode(english)) <= 5.0


def test_special_tokens_are_split_out() -> None:
    tok = Tokenizer()
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>\n")
    assert ids[0] == IM_START_ID and IM_END_ID in ids
    assert tok.decode(ids) == "<|im_start|>user\nhi<|im_end|>\n"


def test_200k_tokens_tokenize_fast() -> None:
    text = "Some fairly ordinary English prose, with numbers 12345 and code_like(tokens). " * 9000
    # CPU time of this process, not wall time: other processes on a loaded machine do not
    # count, and a tokenizer gone quadratic still takes minutes.
    start = time.process_time()
    ids = Tokenizer().encode(text)
    assert len(ids) >= 200_000
    assert time.process_time() - start < 1.0


def test_render_chat_template_tools_and_images() -> None:
    text = render_chat(
        [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "look"},
                    {"type": "image_url", "image_url": {"url": "http://x/a.png"}},
                ],
            }
        ],
        tools=[{"type": "function", "function": {"name": "f"}}],
    )
    assert text.startswith('<|im_start|>system\n[{"function":{"name":"f"},"type":"function"}]')
    assert "<|im_start|>user\nlook<|image:" in text
    assert text.endswith("<|im_start|>assistant\n")
    no_gen = render_chat([{"role": "user", "content": "hi"}], add_generation_prompt=False)
    assert no_gen == "<|im_start|>user\nhi<|im_end|>\n"


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 300), seed=st.integers(0, 2**63), chat=st.booleans())
def test_generated_ids_round_trip(n: int, seed: int, chat: bool) -> None:
    tok = Tokenizer()
    ids = tok.generate(n, seed, chat)
    assert len(ids) == n
    assert ids == tok.generate(n, seed, chat)
    # A fresh instance (another process, in effect) decodes and re-encodes them exactly.
    assert Tokenizer().encode(Tokenizer().decode(ids)) == ids


@settings(max_examples=60, deadline=None)
@given(
    user=st.text(max_size=200),
    follow=st.text(max_size=50),
    n=st.integers(1, 80),
    seed=st.integers(0, 2**32),
)
def test_next_turn_prompt_extends_previous_and_holds_generated_ids(
    user: str, follow: str, n: int, seed: int
) -> None:
    tok = Tokenizer()
    turn1 = [{"role": "user", "content": user}]
    prompt1 = tok.encode_chat(turn1)
    reply_ids = tok.generate(n, seed, chat=True)
    turn2 = [
        *turn1,
        {"role": "assistant", "content": tok.decode(reply_ids)},
        {"role": "user", "content": follow},
    ]
    prompt2 = tok.encode_chat(turn2)
    assert prompt2[: len(prompt1)] == prompt1
    assert prompt2[len(prompt1) : len(prompt1) + n] == reply_ids
    assert prompt2[len(prompt1) + n] == IM_END_ID


def test_completion_continuation_holds_generated_ids() -> None:
    tok = Tokenizer()
    prompt = "Once upon a time"
    out = tok.generate(40, 7, chat=False)
    assert tok.encode(prompt + tok.decode(out)) == tok.encode(prompt) + out


DENSITIES = st.sampled_from([1.0, 2.5, 3.0, 4.0, 6.3, 9.0, 10.0, 32.0])


@settings(max_examples=40, deadline=None)
@given(text=st.text(min_size=200, max_size=2000), b=DENSITIES)
def test_density_sets_characters_per_token(text: str, b: float) -> None:
    ids = Tokenizer(bytes_per_token=b).encode(text)
    assert ids == Tokenizer(bytes_per_token=b).encode(text)
    if "<|" not in text:  # no special token: one run, cut on the grid
        assert abs(len(ids) - len(text) / b) <= 1


def test_density_changes_only_the_token_count_of_the_same_text() -> None:
    english = "the cat sat on the mat and looked at the other animals in the garden " * 50
    for b in (3.0, 9.0):
        assert len(english) / len(Tokenizer(bytes_per_token=b).encode(english)) == pytest.approx(
            b, rel=0.01
        )
    # Few distinct pieces, so no two share an id (see the module doc): an exact round trip.
    tok = Tokenizer(bytes_per_token=2.5)
    assert tok.decode(tok.encode(TEXT)) == TEXT
    with pytest.raises(ValueError, match="bytes_per_token"):
        Tokenizer(bytes_per_token=0.5)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 300), seed=st.integers(0, 2**63), chat=st.booleans(), b=DENSITIES)
def test_generated_ids_round_trip_at_any_density(n: int, seed: int, chat: bool, b: float) -> None:
    ids = Tokenizer(bytes_per_token=b).generate(n, seed, chat)
    assert len(ids) == n
    text = Tokenizer(bytes_per_token=b).decode(ids)
    assert text == text.strip() and "\n" not in text
    assert Tokenizer(bytes_per_token=b).encode(text) == ids


@settings(max_examples=40, deadline=None)
@given(
    user=st.text(max_size=200),
    follow=st.text(max_size=50),
    n=st.integers(1, 80),
    seed=st.integers(0, 2**32),
    b=DENSITIES,
)
def test_next_turn_holds_generated_ids_at_any_density(
    user: str, follow: str, n: int, seed: int, b: float
) -> None:
    tok = Tokenizer(bytes_per_token=b)
    turn1 = [{"role": "user", "content": user}]
    prompt1 = tok.encode_chat(turn1)
    reply_ids = tok.generate(n, seed, chat=True)
    turn2 = [
        *turn1,
        {"role": "assistant", "content": tok.decode(reply_ids)},
        {"role": "user", "content": follow},
    ]
    prompt2 = tok.encode_chat(turn2)
    assert prompt2[: len(prompt1)] == prompt1
    assert prompt2[len(prompt1) : len(prompt1) + n] == reply_ids
    assert prompt2[len(prompt1) + n] == IM_END_ID
