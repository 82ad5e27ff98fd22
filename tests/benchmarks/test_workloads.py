"""Scripted workloads: seeded determinism, agentic shape, reusable fraction."""

from __future__ import annotations

import random

import pytest

from benchmarks.bench.conversation import (
    ConversationState,
    ReuseLedger,
    chain_of,
    estimate_reuse,
)
from benchmarks.reuse import ReuseTracker
from benchmarks.sim.tokenizer import Tokenizer
from benchmarks.workloads import (
    AGENTIC_PRESETS,
    WORKLOADS,
    Conversation,
    Step,
    agentic_sessions,
    build_workload,
    shared_prefix,
    words,
)


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_same_seed_same_workload_other_seed_other(name: str) -> None:
    a = build_workload(name, "tiny", seed=5)
    assert a == build_workload(name, "tiny", seed=5)
    assert a.conversations != build_workload(name, "tiny", seed=6).conversations


@pytest.mark.parametrize("name", sorted(WORKLOADS))
@pytest.mark.parametrize("preset", ["tiny", "small", "medium"])
def test_presets_build_and_grow(name: str, preset: str) -> None:
    w = build_workload(name, preset)
    assert w.num_requests == sum(c.num_requests for c in w.conversations) > 0
    assert w.concurrency >= 1
    if preset != "tiny":
        assert w.num_requests > build_workload(name, "tiny").num_requests


def test_unknown_names_fail_with_the_known_ones() -> None:
    with pytest.raises(ValueError, match="known: agentic"):
        build_workload("nope")
    with pytest.raises(ValueError, match="unknown preset 'huge'"):
        build_workload("agentic", "huge")
    with pytest.raises(ValueError, match="bogus"):
        build_workload("agentic", "tiny", bogus=1)


def _prompt_lengths(conv: Conversation, tok: Tokenizer) -> list[int]:
    state = ConversationState(tok, conv.system, conv.tools)
    lengths = []
    for step in conv.steps:
        if step.reset is not None:
            state.reset(step.reset)
        state.add("user", step.content)
        lengths.append(len(state.prompt().ids))
        state.add("assistant", words(random.Random(0), step.max_tokens))
    return lengths


def test_agentic_context_grows_each_turn_by_answer_and_tool_result() -> None:
    w = agentic_sessions(**AGENTIC_PRESETS["small"], reset_prob=0.0)
    tok = Tokenizer()
    for conv in w.conversations[:4]:
        lengths = _prompt_lengths(conv, tok)
        for prev, cur, step, before in zip(
            lengths, lengths[1:], conv.steps[1:], conv.steps, strict=False
        ):
            # Template tokens aside, the growth is the last answer plus this tool result.
            growth = before.max_tokens + len(tok.encode(step.content))
            assert growth <= cur - prev <= growth + 12


def test_agentic_has_long_shared_system_prompts_tools_bursts_and_resets() -> None:
    w = agentic_sessions(sessions=40, turns=12, reset_prob=0.1, burst_prob=0.2, seed=1)
    systems = {c.system for c in w.conversations}
    assert 1 < len(systems) <= 3  # a few agent types, each shared by many sessions
    assert all(c.tools for c in w.conversations)
    steps = [s for c in w.conversations for s in c.steps]
    assert any(s.reset for s in steps)
    bursts = [s.burst for s in steps if s.burst]
    assert bursts and all(len(b) >= 2 for b in bursts)
    sub_requests = sum(len(a.steps) for b in bursts for a in b)
    assert 0.2 < sub_requests / w.num_requests < 0.8  # a large share comes in bursts


def test_subagents_start_from_the_parents_prefix() -> None:
    tok = Tokenizer()
    conv = Conversation("s", "sys " + words(random.Random(1), 100),
                        (Step("first task", 8),))
    parent = ConversationState(tok, conv.system)
    parent.add("user", "first task")
    parent.add("assistant", "an answer")
    parent_ids = list(parent.ids)
    kids = [parent.fork() for _ in range(3)]
    for i, kid in enumerate(kids):
        kid.add("user", f"subtask {i}")
        prompt = kid.prompt()
        assert prompt.ids[: len(parent_ids)] == parent_ids
        assert prompt.chain[: len(parent.chain)] == parent.chain
    assert parent.ids == parent_ids  # forks never touch the parent


def test_incremental_prompt_ids_and_chain_match_a_full_encode() -> None:
    tok = Tokenizer()
    conv = agentic_sessions(**AGENTIC_PRESETS["tiny"]).conversations[0]
    state = ConversationState(tok, conv.system, conv.tools)
    state.add("user", "hello, world. 42 times")
    state.add("assistant", "fine")
    state.reset("summary of it all")
    state.add("user", "next")
    prompt = state.prompt()
    full = tok.encode_chat(prompt.messages, list(conv.tools))
    assert prompt.ids == full
    assert prompt.chain == chain_of(full)


def test_ledger_counts_like_reuse_tracker() -> None:
    tok = Tokenizer()
    tracker, ledger = ReuseTracker(), ReuseLedger()
    for conv in build_workload("chat", "tiny").conversations:
        state = ConversationState(tok, conv.system)
        for step in conv.steps:
            state.add("user", step.content)
            prompt = state.prompt()
            answer = tok.encode("an answer of a few words")
            expected = tracker.observe(prompt.ids, answer)
            assert ledger.sent(len(prompt.ids), prompt.chain) == expected
            ledger.answered(state.answer_chain(prompt, answer))
            state.add("assistant", "an answer of a few words")
    assert (ledger.prompt_tokens, ledger.reusable_tokens) == (
        tracker.prompt_tokens,
        tracker.reusable_tokens,
    )


def test_reusable_fraction_is_sane_per_workload() -> None:
    agentic = estimate_reuse(build_workload("agentic", "small")).fraction
    chat = estimate_reuse(build_workload("chat", "small")).fraction
    assert 0.75 < agentic < 0.99
    assert 0.6 < chat < 0.99
    # Shared prefix: in each group all but the first prompt reuse the system prompt's blocks.
    groups, per, system, question = 4, 10, 960, 40
    w = shared_prefix(groups=groups, prompts_per_group=per, system_tokens=system,
                      question_tokens=question, output_tokens=4)
    ledger = estimate_reuse(w)
    expected = (per - 1) / per * system / (system + question)
    assert ledger.fraction == pytest.approx(expected, rel=0.05)
    # No reuse at all when every prompt is its own group.
    alone = estimate_reuse(shared_prefix(groups=6, prompts_per_group=1, system_tokens=200))
    assert alone.reusable_tokens == 0
