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

from jinja2 import nodes

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
    openai_format = _loops_over_content(env.parse(template_text))

    def render(messages: Sequence[Mapping[str, Any]], tools: Sequence[Any] | None) -> str:
        prepared = [_as_vllm_message(m, openai_format) for m in messages]
        return template.render(
            messages=prepared, tools=tools, add_generation_prompt=True, **specials
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


# vLLM's chat preprocessing (vllm/entrypoints/chat_utils.py): the template sees the messages as
# vLLM rebuilds them, not as the client sent them, and a different render is other tokens.


def _loops_over_content(ast: nodes.Template) -> bool:
    """Whether the template iterates over a message's ``content`` (vLLM's "openai" content
    format) rather than reading it as a string (its "string" format): vLLM's detection."""
    messages = [name for _, name in _assigned_from(ast, "messages")]
    message_names = []
    for loop in ast.find_all(nodes.For):
        if any(_reads(loop.iter, name) for name in messages) and isinstance(
            loop.target, nodes.Name
        ):
            message_names.append(loop.target.name)
    return any(
        _reads(loop.iter, name, "content")
        for loop in ast.find_all(nodes.For)
        for name in message_names
    )


def _assigned_from(ast: nodes.Template, varname: str) -> list[tuple[nodes.Node, str]]:
    found: list[tuple[nodes.Node, str]] = [(ast, varname)]
    pending = [varname]
    while pending:
        name = pending.pop(0)
        for assign in ast.find_all(nodes.Assign):
            if _reads(assign.node, name) and isinstance(assign.target, nodes.Name):
                found.append((assign, assign.target.name))
                if assign.target.name != name and len(found) < 64:
                    pending.append(assign.target.name)
    return found


def _reads(node: nodes.Node, varname: str, key: str | None = None) -> bool:
    """``varname`` (or its ``key``), possibly filtered, tested or sliced."""
    if isinstance(node, nodes.Filter):
        return node.node is not None and _reads(node.node, varname, key)
    if isinstance(node, nodes.Test):
        return _reads(node.node, varname, key)
    if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice):
        return _reads(node.node, varname, key)
    if key is None:
        return isinstance(node, nodes.Name) and node.ctx == "load" and node.name == varname
    if isinstance(node, nodes.Getitem):
        return (
            _reads(node.node, varname)
            and isinstance(node.arg, nodes.Const)
            and node.arg.value == key
        )
    if isinstance(node, nodes.Getattr):
        return _reads(node.node, varname) and node.attr == key
    return False


def _part_text(part: Any) -> str | None:
    if isinstance(part, str):
        return part
    if not isinstance(part, Mapping):
        return None
    kind = part.get("type")
    text = part.get("text")
    if not isinstance(text, str) and isinstance(kind, str):
        text = part.get(kind)  # {"type": "refusal", "refusal": ...}
    return text if isinstance(text, str) else None


def _as_vllm_message(message: Mapping[str, Any], openai_format: bool) -> Mapping[str, Any]:
    """The message as vLLM hands it to the template: text parts joined by newlines (or a string
    made one text part, for a template that loops over content), tool call arguments parsed
    into objects; the request's own message is not modified."""
    if not isinstance(message, Mapping):
        return message
    content = message.get("content")
    parts = [] if content is None else [content] if isinstance(content, str) else content
    if not isinstance(parts, list):
        return message
    texts = [t for t in map(_part_text, parts) if t is not None]
    role = message.get("role")
    out: dict[str, Any] = {
        "role": role,
        "content": [{"type": "text", "text": t} for t in texts] if openai_format
        else "\n".join(texts),
    }
    if role == "assistant":
        calls = message.get("tool_calls")
        if isinstance(calls, list) and calls:
            out["tool_calls"] = [_as_vllm_call(c) for c in calls]
        elif calls is not None and not isinstance(calls, list):
            out["tool_calls"] = calls
        reasoning = message.get("reasoning") or message.get("reasoning_content")
        if reasoning is not None:
            out["reasoning"] = out["reasoning_content"] = reasoning
    elif role == "tool" and "tool_call_id" in message:
        out["tool_call_id"] = message["tool_call_id"]
    if isinstance(message.get("name"), str):
        out["name"] = message["name"]
    if role == "developer":
        out["tools"] = message.get("tools")
    return out


def _as_vllm_call(call: Any) -> Any:
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping):
        return call
    arguments = function.get("arguments")
    parsed: Any = arguments
    if not arguments:
        parsed = {}
    elif isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except ValueError:
            parsed = {}
    if not isinstance(parsed, Mapping):
        parsed = {}
    return {**call, "function": {**function, "arguments": parsed}}
