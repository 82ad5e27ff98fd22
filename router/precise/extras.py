"""What a request's block keys depend on besides its tokens: its LoRA adapter and cache salt.

vLLM hashes a block with extra keys (router/precise/keys.py); the request side reproduces the
two it can know:

- ``cache_salt`` (an OpenAI-compatible body field vLLM accepts, non-empty text): the first
  block's, so every key of the chain differs from the unsalted one's;
- the adapter: vLLM runs a request whose ``model`` names a loaded LoRA adapter with it and keys
  every block by that name. With ``precisePrefix.baseModels`` a request for any model but those
  names an adapter; without, only names the KV events have shown as ``lora_name`` do.

Media parts (images, audio, video, embeddings) and completion ``prompt_embeds`` cannot be
reproduced: vLLM keys them by a hash of the processed input, and their placeholder tokens are
expanded by the engine's processor, so the gateway's tokens for them are not the engine's. Such
a request gets no precise keys at all and is scored from the approximate index.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

from router.precise.tokenizers import TokenizeInput
from router.protocol.parsing import salt_field

# Content parts vLLM renders as text; any other part is media (or unknown: not guessed at).
_TEXT_PARTS = frozenset({"text", "input_text", "output_text", "refusal", "thinking"})


@dataclass(frozen=True, slots=True)
class KeyExtras:
    """The request's adapter (None: the base model) and salt (None: unsalted)."""

    lora_name: str | None = None
    cache_salt: str | None = None


NO_EXTRAS = KeyExtras()


def key_extras(
    source: TokenizeInput,
    body: Mapping[str, Any],
    base_models: Collection[str],
    is_adapter: Callable[[str], bool],
    api: str,
) -> KeyExtras | None:
    """The extras of a request's keys, or None when its keys cannot be the engine's.

    ``source`` is what is tokenized (Messages and Responses as chat), ``body`` the request as
    sent to the route ``api``."""
    salt = salt_field(api, body)
    if salt is not None and (not isinstance(salt, str) or not salt):
        return None  # vLLM refuses the request
    if source.api == "completions":
        media = body.get("prompt_embeds") is not None
    else:
        media = has_media(source.payload.get("messages"))
    if media:
        return None
    model = source.model
    if base_models:
        lora = None if model in base_models else model
    else:
        lora = model if is_adapter(model) else None
    if lora is None and salt is None:
        return NO_EXTRAS
    return KeyExtras(lora, salt)


def has_media(messages: Any) -> bool:
    """Whether any chat message has a content part that is not text."""
    if not isinstance(messages, list):
        return False
    # dict, not the Mapping ABC: JSON decodes to dicts, and the ABC's check costs ten times
    # more, once per message of every request.
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            for part in content:
                if isinstance(part, str):
                    continue
                if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS:
                    return True
    return False
