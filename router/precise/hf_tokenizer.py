"""A Hugging Face ``tokenizer.json`` from a local path plus the model's chat template.

Nothing is downloaded: the file (or a model directory holding it) must be on disk, with the
template in a .jinja file or the directory's ``tokenizer_config.json``. Chat prompts are
rendered as ``apply_chat_template`` renders them and encoded piece by piece between added
tokens (router/precise/segments.py) when that is exact for this tokenizer and template; whole
otherwise. Needs the optional ``tokenizers`` extra (and jinja2).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from router.precise.segments import SegmentMemo, probe_equivalence, split_pattern
from router.precise.tokenizers import EncodeText, LocalTokenizer, PiecewiseChat, RenderChat

log = logging.getLogger("prefixgate.tokenizers")


def _read_template(path: Path) -> str:
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json":
        template = json.loads(text).get("chat_template")
        if isinstance(template, list):  # named templates: take the default one
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        if not isinstance(template, str):
            raise ValueError(f"{path} has no chat_template string")
        return template
    return text


def huggingface_tokenizer(
    path: str | Path,
    chat_template: str | Path | None = None,
    add_special_tokens: bool = True,
    thread_above_bytes: int = 16_384,
) -> LocalTokenizer:
    """A local ``tokenizer.json`` (a file, or a model directory holding it) plus a template.

    The template is ``chat_template`` (a .jinja file, or a tokenizer_config.json), else the
    directory's tokenizer_config.json. Chat prompts are encoded without added special tokens
    (the template writes them, as ``apply_chat_template`` does); completion prompts with them.
    """
    try:
        from jinja2.sandbox import ImmutableSandboxedEnvironment
        from tokenizers import Tokenizer as HFTokenizer
    except ImportError as exc:  # pragma: no cover - depends on the installed extras
        raise ValueError("install prefixgate[tokenizers] for a Hugging Face tokenizer") from exc
    root = Path(path)
    file = root / "tokenizer.json" if root.is_dir() else root
    tok = HFTokenizer.from_file(str(file))
    config_path = file.parent / "tokenizer_config.json"
    config: dict[str, Any] = {}
    if config_path.is_file():
        config = json.loads(config_path.read_text(encoding="utf-8"))
    source = Path(chat_template) if chat_template is not None else config_path
    template_text = _read_template(source)
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

    def raise_exception(message: str) -> None:
        raise ValueError(message)

    env.globals["raise_exception"] = raise_exception
    env.filters["tojson"] = lambda v, indent=None: json.dumps(v, indent=indent, ensure_ascii=False)
    template = env.from_string(template_text)
    specials = {k: _token_text(config.get(k)) for k in ("bos_token", "eos_token")}

    def render(messages: Sequence[Mapping[str, Any]], tools: Sequence[Any] | None) -> str:
        return template.render(
            messages=messages, tools=tools, add_generation_prompt=True, **specials
        )

    def whole(text: str) -> list[int]:
        return list(tok.encode(text, add_special_tokens=False).ids)

    def encode_chat(
        messages: Sequence[Mapping[str, Any]], tools: Sequence[Any] | None
    ) -> list[int]:
        return whole(render(messages, tools))

    def encode_text(text: str) -> list[int]:
        return list(tok.encode(text, add_special_tokens=add_special_tokens).ids)

    memo = _hf_memo(tok, render, whole)
    piecewise = PiecewiseChat(render, memo) if memo is not None else None
    return LocalTokenizer(encode_chat, encode_text, thread_above_bytes, piecewise=piecewise)


# Renders of these, through the model's own template, must encode the same piece by piece as
# whole before the piecewise memo is used (odd whitespace on purpose: that is where it breaks).
_PROBE_CHATS: tuple[list[dict[str, str]], ...] = (
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hello  there,\n world"},
        {"role": "assistant", "content": " Sure. "},
        {"role": "user", "content": "next\n\nstep "},
    ],
    [{"role": "user", "content": "hi"}],
)


def _hf_memo(
    tok: Any, render: RenderChat, whole: EncodeText
) -> SegmentMemo | None:
    """A piecewise memo for this tokenizer and template, or None where it would not be exact
    (router/precise/segments.py)."""
    added = list(tok.get_added_tokens_decoder().values())
    if not added or any(t.lstrip or t.rstrip or t.single_word for t in added):
        return None  # stripping added tokens eat their neighbours' whitespace
    if tok.normalizer is not None and any(t.normalized for t in added):
        return None  # matched after normalization: the raw text's split may differ
    memo = SegmentMemo(whole, split_pattern(t.content for t in added))
    samples: list[str] = []
    for chat in _PROBE_CHATS:
        try:
            samples.append(render(chat, None))
        except Exception:  # a template may refuse a role order: try the next
            continue
    reason = probe_equivalence(whole, memo, samples) if samples else "no probe rendered"
    if reason is not None:
        log.info("tokenizer: encoding whole prompts (%s)", reason)
        return None
    return memo


def _token_text(value: Any) -> str:
    if isinstance(value, dict):  # AddedToken serialised as {"content": ...}
        value = value.get("content")
    return value if isinstance(value, str) else ""
