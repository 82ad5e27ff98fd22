from __future__ import annotations

import orjson
import pytest

from router.core.errors import BadRequestError
from router.protocol.parsing import digest_body, parse_request, prompt_hashes


def body(**kw: object) -> bytes:
    return orjson.dumps(kw)


def test_chat_ok() -> None:
    parsed = parse_request("chat", body(model="m", messages=[{"role": "user", "content": "hi"}]))
    assert parsed.model == "m"
    assert parsed.stream is False
    assert "hi" in parsed.rendered


def test_completions_ok() -> None:
    parsed = parse_request("completions", body(model="m", prompt=[1, 2, 3], stream=True))
    assert parsed.stream is True
    assert parsed.rendered


@pytest.mark.parametrize(
    ("api", "raw", "param"),
    [
        ("chat", b"", None),
        ("chat", b"{not json", None),
        ("chat", b"[1, 2]", None),
        ("chat", body(messages=[{"role": "user", "content": "x"}]), "model"),
        ("chat", body(model=3, messages=[]), "model"),
        ("chat", body(model="m"), "messages"),
        ("chat", body(model="m", messages=[]), "messages"),
        ("chat", body(model="m", messages=["x"]), "messages[0]"),
        ("chat", body(model="m", messages=[{"role": "user", "content": 5}]), "messages[0].content"),
        ("chat", body(model="m", messages=[{"role": "u"}], stream="yes"), "stream"),
        ("chat", body(model="m", messages=[{"role": "u"}], n=1000), "n"),
        ("chat", body(model="m", messages=[{"role": "u"}], max_tokens=-1), "max_tokens"),
        ("chat", body(model="m", messages=[{"role": "u"}], max_tokens=True), "max_tokens"),
        ("completions", body(model="m"), "prompt"),
        ("completions", body(model="m", prompt=[]), "prompt"),
        ("completions", body(model="m", prompt=[1, "a"]), "prompt"),
        ("completions", body(model="m", prompt={"a": 1}), "prompt"),
    ],
)
def test_bad_requests_are_400_with_param(api: str, raw: bytes, param: str | None) -> None:
    with pytest.raises(BadRequestError) as info:
        parse_request(api, raw)  # type: ignore[arg-type]
    assert info.value.status_code == 400
    assert info.value.param == param
    error = orjson.loads(info.value.body())["error"]
    assert error["type"] == "invalid_request_error"
    assert error["message"]


def test_invalid_utf8_is_a_400() -> None:
    with pytest.raises(BadRequestError):
        parse_request("chat", b'{"model": "\xff\xfe"}')


def test_fields_only_the_gateway_sets_are_dropped_from_the_forwarded_body() -> None:
    raw = body(model="m", prompt="hi", kv_transfer_params={"do_remote_prefill": True})
    parsed = parse_request("completions", raw)
    assert orjson.loads(parsed.body) == {"model": "m", "prompt": "hi"}
    assert "kv_transfer_params" not in parsed.payload
    digest = digest_body("completions", raw, 64, 100)
    assert digest.parsed("completions", raw).body == parsed.body
    plain = body(model="m", prompt="hi")
    assert parse_request("completions", plain).body is plain  # nothing to drop: not re-encoded
    assert digest_body("completions", plain, 64, 100).rewritten is None


def test_a_salted_prompt_hashes_apart_from_other_salts_and_the_unsalted() -> None:
    # vLLM caches a cache_salt request's blocks apart: the index must not credit it with
    # another salt's (or the unsalted) blocks of the same text.
    text = [{"role": "user", "content": "x" * 2000}]

    def hashes(api: str, **kw: object) -> list[int]:
        payload = {"model": "m", **kw}
        if api == "chat":
            payload["messages"] = text
        else:
            payload["prompt"] = "x" * 2000
        size, hs = prompt_hashes(parse_request(api, orjson.dumps(payload)), 256, 100)
        assert size >= 2000
        return hs

    for api in ("chat", "completions"):
        plain, a, b = hashes(api), hashes(api, cache_salt="a"), hashes(api, cache_salt="b")
        assert len(plain) == len(a) == len(b) > 1
        assert not set(plain) & set(a) and not set(a) & set(b)
        assert hashes(api, cache_salt="a") == a
        assert hashes(api, cache_salt="") == plain  # vLLM refuses it; not a salt
    parsed = parse_request("chat", body(model="m", messages=text, cache_salt="a"))
    assert parsed.cache_salt == "a"
    assert digest_body("chat", parsed.body, 256, 100).block_hashes == hashes("chat", cache_salt="a")


def test_a_messages_requests_salt_is_ignored_as_vllm_ignores_it() -> None:
    # vLLM's Messages route has no cache_salt: it caches such a request's blocks unsalted.
    text = [{"role": "user", "content": "x" * 2000}]
    messages = {"model": "m", "max_tokens": 8, "messages": text}
    plain = parse_request("messages", orjson.dumps(messages))
    salted = parse_request("messages", orjson.dumps({**messages, "cache_salt": "t"}))
    assert salted.cache_salt is None
    assert prompt_hashes(salted, 256, 100) == prompt_hashes(plain, 256, 100)
