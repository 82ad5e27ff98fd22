"""Request-side tokenizers: the same ids the replica computes, within a budget."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import Any, TypeVar, cast

import httpx
import pytest

from benchmarks.sim.cli import start_replicas
from benchmarks.sim.config import SimConfig
from router.core.endpoints import EndpointSnapshot, endpoint_id_from_url
from router.precise.hf_tokenizer import huggingface_tokenizer
from router.precise.tokenizers import (
    CachingTokenizer,
    LocalTokenizer,
    RemoteTokenizer,
    TokenizeInput,
    sim_tokenizer,
)

MODEL = "sim-model"
_R = TypeVar("_R")
CHAT: dict[str, Any] = {
    "model": MODEL,
    "messages": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": [{"type": "text", "text": "Count to 3, please."}]},
    ],
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
}
COMPLETION: dict[str, Any] = {"model": MODEL, "prompt": "Once upon a time 123"}


def snapshot(url: str, in_flight: int = 0) -> EndpointSnapshot:
    return EndpointSnapshot(
        id=endpoint_id_from_url(url),
        url=url,
        role="both",
        in_flight=in_flight,
        pending_prefill_tokens=0,
        waiting=0,
        running=0,
        kv_usage=0,
        metrics_age=0,
    )


def chat_input(payload: dict[str, Any] = CHAT, size: int = 10) -> TokenizeInput:
    return TokenizeInput("chat", MODEL, payload, size)


async def test_sim_and_remote_tokenizers_agree_with_the_replica() -> None:
    async with start_replicas(1, SimConfig(zero_latency=True)) as replicas:
        url = replicas[0].url
        async with httpx.AsyncClient(base_url=url) as client:
            chat_ids = (await client.post("/tokenize", json=CHAT)).json()["tokens"]
            text_ids = (await client.post("/tokenize", json=COMPLETION)).json()["tokens"]
        local = sim_tokenizer()
        remote = RemoteTokenizer(timeout_seconds=2.0)
        endpoints = [snapshot(url)]
        try:
            for tok in (local, remote):
                assert list(await tok.tokenize(chat_input(), endpoints) or ()) == chat_ids
                completion = TokenizeInput("completions", MODEL, COMPLETION)
                assert list(await tok.tokenize(completion, endpoints) or ()) == text_ids
            ids = TokenizeInput("completions", MODEL, {"prompt": [[5, 6, 7]]})
            assert list(await local.tokenize(ids, endpoints) or ()) == [5, 6, 7]
            batch = TokenizeInput("completions", MODEL, {"prompt": ["a", "b"]})
            assert await local.tokenize(batch, endpoints) is None
            assert await remote.tokenize(batch, endpoints) is None
        finally:
            await local.aclose()
            await remote.aclose()


async def test_remote_tokenizer_skips_a_dead_replica_and_gives_up_cleanly() -> None:
    async with start_replicas(1, SimConfig(zero_latency=True)) as replicas:
        remote = RemoteTokenizer(timeout_seconds=1.0)
        try:
            dead = snapshot("http://127.0.0.1:9", in_flight=0)
            live = snapshot(replicas[0].url, in_flight=1)
            assert await remote.tokenize(chat_input(), [dead, live])
            assert await remote.tokenize(chat_input(), [dead]) is None
        finally:
            await remote.aclose()


async def test_large_prompts_are_encoded_on_the_worker_thread() -> None:
    tok = sim_tokenizer(thread_above_bytes=100)
    big = {"model": MODEL, "messages": [{"role": "user", "content": "word " * 5000}]}
    try:
        small = await tok.tokenize(chat_input(big, size=10), [])
        threaded = await tok.tokenize(chat_input(big, size=10_000), [])
        assert small == threaded and small
    finally:
        await tok.aclose()


def _tiny_tokenizer(tmp_path: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=["<unk>", "<s>", "<|im_start|>"])
    tok.train_from_iterator(["hello there user assistant system count to three"], trainer)
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    template = (
        "{{ bos_token }}{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} "
        "{% endfor %}{% if add_generation_prompt %}<|im_start|> assistant{% endif %}"
    )
    config = {"chat_template": template, "bos_token": {"content": "<s>"}}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


async def test_huggingface_tokenizer_applies_the_chat_template(tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    path = _tiny_tokenizer(tmp_path)
    raw = Tokenizer.from_file(str(path))
    tok = huggingface_tokenizer(tmp_path)  # a model directory works as well as the file
    payload = {"model": MODEL, "messages": [{"role": "user", "content": "hello there"}]}
    try:
        ids = await tok.tokenize(chat_input(payload), [])
        expected = "<s><|im_start|> user hello there <|im_start|> assistant"
        assert list(ids or ()) == raw.encode(expected, add_special_tokens=False).ids
        template = tmp_path / "other.jinja"
        template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
        other = huggingface_tokenizer(path, template)
        plain = await other.tokenize(chat_input(payload), [])
        assert list(plain or ()) == raw.encode("hello there").ids
        failing = tmp_path / "fail.jinja"
        failing.write_text("{{ raise_exception('no system role') }}")
        assert await huggingface_tokenizer(path, failing).tokenize(chat_input(payload), []) is None
    finally:
        await tok.aclose()


async def test_huggingface_tokenizer_prepares_messages_as_vllm_does(tmp_path: Path) -> None:
    """vLLM hands the template its own form of the messages: text parts joined by newlines for
    a template that reads ``content`` as a string (a string as one text part for one that loops
    over it), and tool call arguments as objects, not the JSON text the client sent."""
    from tokenizers import Tokenizer

    path = _tiny_tokenizer(tmp_path)
    raw = Tokenizer.from_file(str(path))

    def ids(text: str) -> list[int]:
        return list(raw.encode(text, add_special_tokens=False).ids)

    tok = huggingface_tokenizer(path)  # reads m['content'] as a string
    parts = [{"type": "text", "text": "hello"}, {"type": "text", "text": "there"}]
    payload = {"model": MODEL, "messages": [{"role": "user", "content": parts}]}
    got = await tok.tokenize(chat_input(payload), [])
    assert list(got or ()) == ids("<s><|im_start|> user hello\nthere <|im_start|> assistant")
    looping = tmp_path / "looping.jinja"
    looping.write_text(
        "{% for m in messages %}{% for p in m['content'] %}{{ p['text'] }} {% endfor %}"
        "{% endfor %}"
    )
    payload = {"model": MODEL, "messages": [{"role": "user", "content": "hello there"}]}
    got = await huggingface_tokenizer(path, looping).tokenize(chat_input(payload), [])
    assert list(got or ()) == ids("hello there ")
    calls = tmp_path / "calls.jinja"
    calls.write_text(
        "{% for m in messages %}{% for c in m.tool_calls or [] %}"
        "{{ c.function.arguments | tojson }} {% endfor %}{% endfor %}"
    )
    call = {"id": "1", "type": "function", "function": {"name": "f", "arguments": '{"a":1}'}}
    payload = {"model": MODEL, "messages": [{"role": "assistant", "tool_calls": [call]}]}
    got = await huggingface_tokenizer(path, calls).tokenize(chat_input(payload), [])
    assert list(got or ()) == ids('{"a": 1} ')
    assert call["function"]["arguments"] == '{"a":1}'  # the request body is left as it was


def test_huggingface_tokenizer_needs_a_template(tmp_path: Path) -> None:
    path = _tiny_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ValueError, match="chat_template"):
        huggingface_tokenizer(path)


class SlowTokenizer:
    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.calls = 0

    async def tokenize(
        self, request: TokenizeInput, endpoints: Sequence[EndpointSnapshot]
    ) -> list[int] | None:
        self.calls += 1
        await asyncio.sleep(self.delay)
        return [1, 2, 3]

    async def aclose(self) -> None:
        return None


async def test_cache_shares_concurrent_encodings_and_enforces_the_budget() -> None:
    inner = SlowTokenizer(0.05)
    tok = CachingTokenizer(inner, budget_seconds=2.0)
    results = await asyncio.gather(*(tok.tokenize(chat_input(), []) for _ in range(5)))
    assert results == [[1, 2, 3]] * 5 and inner.calls == 1
    assert await tok.tokenize(chat_input(), []) == [1, 2, 3]
    assert tok.hits == 1 and inner.calls == 1
    slow = CachingTokenizer(SlowTokenizer(5.0), budget_seconds=0.05)
    assert await slow.tokenize(chat_input(), []) is None
    assert slow.timeouts == 1
    await slow.aclose()


async def test_cache_is_bounded() -> None:
    tok = CachingTokenizer(
        LocalTokenizer(lambda m, t: [1] * 10, lambda s: [2] * 10), 1.0, max_entries=3, max_tokens=25
    )
    for i in range(6):
        payload = {"model": MODEL, "messages": [{"role": "user", "content": str(i)}]}
        await tok.tokenize(chat_input(payload), [])
    assert len(tok._cache) <= 2


async def test_huggingface_tokenizer_remembers_pieces_only_where_that_is_exact(
    tmp_path: Path,
) -> None:
    from tokenizers import AddedToken, Tokenizer

    path = _tiny_tokenizer(tmp_path)
    raw = Tokenizer.from_file(str(path))
    turns = [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "count"}]
    tok = huggingface_tokenizer(path)
    assert tok.memo is not None
    for n in (1, 2):
        payload = {"model": MODEL, "messages": turns[:n]}
        text = "<s>" + "".join(f"<|im_start|> {m['role']} {m['content']} " for m in turns[:n])
        expected = raw.encode(text + "<|im_start|> assistant", add_special_tokens=False).ids
        assert list(await tok.tokenize(chat_input(payload), []) or ()) == expected
    assert tok.memo.hits > 0
    # An added token that strips the whitespace around it: pieces would not add up.
    raw.add_special_tokens([AddedToken("<sep>", lstrip=True, rstrip=True)])
    stripping = tmp_path / "stripping.json"
    raw.save(str(stripping))
    template = tmp_path / "sep.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }} <sep> {% endfor %}")
    careful = huggingface_tokenizer(stripping, template)
    assert careful.memo is None
    payload = {"model": MODEL, "messages": turns}
    expected = raw.encode("hello there <sep> count <sep> ", add_special_tokens=False).ids
    assert list(await careful.tokenize(chat_input(payload), []) or ()) == expected


async def test_a_next_turn_is_encoded_inline_from_the_memo() -> None:
    tok = sim_tokenizer(thread_above_bytes=1000)
    turns: list[dict[str, Any]] = [{"role": "user", "content": "word " * 2000}]
    try:
        first = await tok.tokenize(chat_input({"model": MODEL, "messages": turns}), [])
        assert first and tok._executor is not None  # 10 KB of new text: the worker thread
        tok._max_pending = 0  # from here on, a trip to the thread would come back empty
        turns += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "next"}]
        payload = {"model": MODEL, "messages": turns}
        second = await tok.tokenize(chat_input(payload, size=10_000), [])
        assert second is not None and list(second) == list(tok.encode(chat_input(payload)) or ())
        # the same prefix, minus the generation prompt
        assert list(second[: len(first) - 3]) == list(first[:-3])
        turns.append({"role": "user", "content": "fresh " * 1000})
        assert await tok.tokenize(chat_input({"model": MODEL, "messages": turns}), []) is None
    finally:
        await tok.aclose()


def _run_without_suspending(coro: Coroutine[Any, Any, _R]) -> _R:
    """The coroutine's result if it finishes without ever yielding to the event loop."""
    try:
        coro.send(None)
    except StopIteration as done:
        return cast(_R, done.value)
    coro.close()
    raise AssertionError("the coroutine suspended")


async def test_a_cheap_prompt_is_encoded_without_a_trip_through_the_event_loop() -> None:
    # Under load the ready queue is long (every relayed stream's chunks): a task per miss
    # put each routing decision behind it twice.
    inner = sim_tokenizer(thread_above_bytes=1000)
    tok = CachingTokenizer(inner, budget_seconds=1.0)
    payload = {"model": MODEL, "messages": [{"role": "user", "content": "short words"}]}
    tokens = _run_without_suspending(tok.tokenize(chat_input(payload), []))
    assert list(tokens or ()) == list(inner.encode(chat_input(payload)) or ())
    assert tok.misses == 1 and _run_without_suspending(tok.tokenize(chat_input(payload), []))
    assert tok.hits == 1
    # Long new text still goes to the worker thread, shared by identical concurrent prompts.
    long = {"model": MODEL, "messages": [{"role": "user", "content": "word " * 2000}]}
    both = await asyncio.gather(*(tok.tokenize(chat_input(long), []) for _ in range(2)))
    assert list(both[0] or ()) == list(both[1] or ()) == list(inner.encode(chat_input(long)) or ())
    assert tok.misses == 2
    assert inner._executor is not None
    await tok.aclose()
