"""A deterministic stand-in tokenizer and chat template (ChatML) for the simulator.

Nothing is downloaded and nothing depends on Python's salted ``hash()``, so two processes (the
simulator and a gateway test, say) always agree on token ids. Special tokens are split out
first, as real tokenizers do, and generated text is drawn from one-pre-token words, so a reply
embedded in the next turn's template tokenizes to exactly the generated ids and its full blocks
hit the prefix cache, as in vLLM. The encoding rules: docs/simulator.md.

With ``bytes_per_token`` set, text is cut on a fixed grid at that density instead (real
tokenizers range from 2 to 10 bytes a token); the rules: docs/simulator.md.
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import orjson
import xxhash

PINNED_BASE = 140000
IM_START_ID = 151644
IM_END_ID = 151645
ENDOFTEXT_ID = 151643
VOCAB_SIZE = 151936

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
ENDOFTEXT = "<|endoftext|>"
_FIXED_SPECIALS = {IM_START: IM_START_ID, IM_END: IM_END_ID, ENDOFTEXT: ENDOFTEXT_ID}

SPECIAL_RE = re.compile(r"(<\|im_start\|>|<\|im_end\|>|<\|endoftext\|>|<\|image:[0-9a-f]{16}\|>)")
_PRETOKEN_RE = re.compile(r"[ ]?[^\W\d_]+|[ ]?\d+|[ ]?(?:[^\w\s]|_)+|\s+(?!\S)|\s+")
_MAX_PIECE = 4
_HASH_SEED = 0x5EED
_MEMO_LIMIT = 1 << 20
# Density mode's range: 32 characters a token keeps the pinned ids below the special tokens'.
MIN_DENSITY = 1.0
MAX_DENSITY = 32.0

_CONSONANTS = "bcdfghjklmnprstvwz"
_VOWELS = "aeiou"
_COMMON = (
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "it",
    "you",
    "he",
    "was",
    "for",
    "on",
    "are",
    "as",
    "his",
    "at",
    "be",
    "or",
    "one",
    "had",
    "by",
    "but",
    "not",
    "all",
    "we",
    "can",
    "use",
    "an",
    "she",
    "do",
    "how",
    "if",
    "up",
    "out",
    "so",
    "her",
    "him",
    "has",
    "two",
    "go",
    "see",
    "way",
    "who",
    "oil",
    "its",
    "now",
    "day",
    "did",
    "get",
    "may",
)
_PUNCT = (",", ".")


def _density_pieces(length: int, count: int = 96) -> list[str]:
    """Up to ``count`` distinct generated pieces of ``length`` characters: lowercase letters
    and single inner spaces, never a space at either end (strip-safe, one run)."""
    rng = random.Random(0x5EED + length)
    letters = "abcdefghijklmnopqrstuvwxyz"
    found: dict[str, None] = {}
    for _ in range(count * 8):
        chars = [rng.choice(letters)]
        for i in range(1, length):
            space = i < length - 1 and chars[-1] != " " and rng.random() < 0.2
            chars.append(" " if space else rng.choice(letters))
        found["".join(chars)] = None
        if len(found) >= count:
            break
    return list(found)


def _piece_id(piece: str) -> int:
    return xxhash.xxh64_intdigest(piece.encode("utf-8"), _HASH_SEED) % PINNED_BASE


def image_placeholder(url: str) -> str:
    """The special token an image part renders to (stable across processes)."""
    return f"<|image:{xxhash.xxh64_hexdigest(url.encode('utf-8'), _HASH_SEED)}|>"


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out: list[str] = []
        for part in content:
            if not isinstance(part, Mapping):
                raise ValueError("content parts must be objects")
            kind = part.get("type")
            if kind == "text":
                out.append(str(part.get("text", "")))
            elif kind == "image_url":
                image = part.get("image_url")
                url = image.get("url", "") if isinstance(image, Mapping) else str(image)
                out.append(image_placeholder(str(url)))
            else:
                raise ValueError(f"unsupported content part type: {kind!r}")
        return "".join(out)
    raise ValueError("message content must be a string, a list of parts or null")


def render_chat(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Any] | None = None,
    add_generation_prompt: bool = True,
) -> str:
    """Render messages (and tools) with the ChatML template described in the module doc."""
    parts: list[str] = []
    if tools:
        tools_json = orjson.dumps(list(tools), option=orjson.OPT_SORT_KEYS).decode()
        parts.append(f"{IM_START}system\n{tools_json}{IM_END}\n")
    for message in messages:
        if not isinstance(message, Mapping):
            raise ValueError("each message must be an object")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise ValueError("each message needs a string 'role'")
        parts.append(f"{IM_START}{role}\n{_content_text(message.get('content'))}{IM_END}\n")
    if add_generation_prompt:
        parts.append(f"{IM_START}assistant\n")
    return "".join(parts)


class Tokenizer:
    """Deterministic tokenizer; one instance per replica (it keeps a bounded decode memo)."""

    def __init__(self, bytes_per_token: float | None = None) -> None:
        if bytes_per_token is not None and not MIN_DENSITY <= bytes_per_token <= MAX_DENSITY:
            raise ValueError(f"bytes_per_token must be in [{MIN_DENSITY}, {MAX_DENSITY}]")
        self.bytes_per_token = bytes_per_token
        words = list(_COMMON)
        words += [c1 + v + c2 for c1 in _CONSONANTS for v in _VOWELS for c2 in _CONSONANTS]
        # " " + word must stay one piece of at most four characters.
        words = [w for w in dict.fromkeys(words) if len(w) < _MAX_PIECE]
        pinned: dict[str, int] = {}
        for piece in [*_PUNCT, *(w for word in words for w in (word, " " + word))]:
            # Generated pieces get their own id range so they can never collide with text.
            pinned[piece] = PINNED_BASE + len(pinned)
        self._pinned = pinned
        self._first_ids = [pinned[w] for w in words if w in pinned]
        self._word_ids = [pinned[" " + w] for w in words if w in pinned]
        self._punct_ids = [pinned[p] for p in _PUNCT]
        self._punct_set = frozenset(self._punct_ids)
        # Density mode: generated pieces by length, in their own id range after the words'.
        self._by_length: dict[int, list[int]] = {}
        if bytes_per_token is not None:
            for length in range(1, math.ceil(bytes_per_token) + 1):
                ids = self._by_length[length] = []
                for piece in _density_pieces(length):
                    pinned.setdefault(piece, PINNED_BASE + len(pinned))
                    ids.append(pinned[piece])
        self._piece_to_id: dict[str, int] = {}
        self._id_to_piece: dict[int, str] = {}
        self._reset_memo()

    def _reset_memo(self) -> None:
        self._piece_to_id = dict(self._pinned)
        self._id_to_piece = {i: p for p, i in self._pinned.items()}
        self._id_to_piece.update({i: p for p, i in _FIXED_SPECIALS.items()})

    def _remember(self, piece: str) -> int:
        token_id = _piece_id(piece)
        if len(self._piece_to_id) >= _MEMO_LIMIT:
            # Bounded memory: forget learned pieces, keep the generation vocabulary.
            self._reset_memo()
        self._piece_to_id[piece] = token_id
        self._id_to_piece.setdefault(token_id, piece)
        return token_id

    def _encode_text(self, text: str, out: list[int]) -> None:
        memo = self._piece_to_id
        for pre in _PRETOKEN_RE.findall(text):
            if len(pre) <= _MAX_PIECE:
                token_id = memo.get(pre)
                out.append(token_id if token_id is not None else self._remember(pre))
                continue
            for start in range(0, len(pre), _MAX_PIECE):
                piece = pre[start : start + _MAX_PIECE]
                token_id = memo.get(piece)
                out.append(token_id if token_id is not None else self._remember(piece))

    def _encode_runs(self, segment: str, after_special: bool, out: list[int]) -> None:
        """Density mode: the role line after a special token, then the rest, each cut on the
        grid (see the module doc)."""
        if after_special:
            cut = segment.find("\n") + 1
            if cut:
                self._encode_run(segment[:cut], out)
                segment = segment[cut:]
        if segment:
            self._encode_run(segment, out)

    def _encode_run(self, run: str, out: list[int]) -> None:
        memo = self._piece_to_id
        b = self.bytes_per_token
        assert b is not None
        start, k, n = 0, 1, len(run)
        while start < n:
            end = min(n, int(k * b + 0.5))
            piece = run[start:end]
            token_id = memo.get(piece)
            out.append(token_id if token_id is not None else self._remember(piece))
            start, k = end, k + 1

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; special tokens in the text are recognised."""
        out: list[int] = []
        dense = self.bytes_per_token is not None
        for i, segment in enumerate(SPECIAL_RE.split(text)):
            if i % 2 == 1:
                fixed = _FIXED_SPECIALS.get(segment)
                out.append(fixed if fixed is not None else self._remember(segment))
            elif segment and dense:
                self._encode_runs(segment, i > 0, out)
            elif segment:
                self._encode_text(segment, out)
        return out

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``; ids this instance never produced decode as ``<|tok:N|>``."""
        table = self._id_to_piece
        return "".join(table.get(i) or f"<|tok:{i}|>" for i in ids)

    def encode_chat(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Any] | None = None
    ) -> list[int]:
        """Prompt ids of a chat request, generation prompt included."""
        return self.encode(render_chat(messages, tools, add_generation_prompt=True))

    def encode_prompt(self, prompt: str | Sequence[int]) -> list[int]:
        """Prompt ids of a completions request (text, or ids passed through)."""
        if isinstance(prompt, str):
            return self.encode(prompt)
        return [int(t) for t in prompt]

    def generate(self, n: int, seed: int, chat: bool) -> list[int]:
        """``n`` deterministic output ids for ``seed``; see the module doc for their shape.

        ``chat`` replies start without a leading space (strip-safe); completions continue the
        prompt text, so their first word carries one.
        """
        if n <= 0:
            return []
        rng = random.Random(seed)
        b = self.bytes_per_token
        if b is not None:
            # Lengths follow the grid from 0, so the text re-encodes to the same ids.
            by_length = self._by_length
            return [
                rng.choice(by_length[int((k + 1) * b + 0.5) - int(k * b + 0.5)])
                for k in range(n)
            ]
        ids = [rng.choice(self._word_ids) for _ in range(n)]
        if chat:
            ids[0] = rng.choice(self._first_ids)
        # A punctuation mark only after a word: two in a row would merge into one pre-token.
        for i in range(1, n):
            if rng.random() < 0.08 and ids[i - 1] not in self._punct_set:
                ids[i] = rng.choice(self._punct_ids)
        return ids

    def piece(self, token_id: int) -> str:
        """Text of one token (used for streaming deltas)."""
        return self._id_to_piece.get(token_id) or f"<|tok:{token_id}|>"
