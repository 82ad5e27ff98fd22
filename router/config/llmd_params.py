"""Reading an llm-d config's values: plugin parameters, durations and quantities.

llm-d's parameters are JSON decoded into Go structs: a key a plugin does not know fails there,
and does here too, naming the plugin. Keys that are known but mean nothing to prefixgate are
*accepted and ignored*: each is recorded once, by name, with the reason, and the gateway logs
the list at start-up (router/config/llmd.py).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeAlias, TypeVar

from router.core.errors import ConfigError

T = TypeVar("T")
_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)")
_DURATION_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_QUANTITY = re.compile(r"(\d+(?:\.\d+)?)([KMGTPE]i?|k)?")
_QUANTITY_UNITS = {
    None: 1, "k": 10**3, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15,
    "E": 10**18, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
}


@dataclass(slots=True)
class Notes:
    """What was accepted but ignored, in config order, each once."""

    ignored: list[str] = field(default_factory=list)

    def ignore(self, where: str, why: str) -> None:
        line = f"{where}: {why}"
        if line not in self.ignored:
            self.ignored.append(line)


def check(ok: bool, where: str, rule: str, value: Any) -> None:
    """A value llm-d refuses fails here too, at the key as written (``rule``: what it must be)."""
    if not ok:
        raise ConfigError(f"{where}: {rule}, got {value!r}")


def duration_seconds(value: Any, where: str) -> float:
    """A Go/Kubernetes duration ("1m30s", "200ms") or a number of seconds."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        text = value.strip()
        parts = _DURATION.findall(text)
        if parts and "".join(n + u for n, u in parts) == text:
            return sum(float(n) * _DURATION_UNITS[u] for n, u in parts)
    raise ConfigError(f"{where}: not a duration: {value!r} (e.g. 30s, 1m, 200ms)")


def quantity(value: Any, where: str) -> int:
    """A Kubernetes quantity ("1Gi", "500M", 1000) as a whole number."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        match = _QUANTITY.fullmatch(value.strip())
        if match:
            return int(float(match.group(1)) * _QUANTITY_UNITS[match.group(2)])
    raise ConfigError(f"{where}: not a quantity: {value!r} (e.g. 1000, 512Mi, 1Gi)")


# What an ignored key must be: a type (as Params.get checks it), or a check of the value at
# its path that raises ConfigError (duration_seconds, a nested mapping's own ``mapping``).
Kind: TypeAlias = type | Callable[[Any, str], object]


def typed(value: Any, kind: type[T], where: str) -> T:
    """``value`` as ``kind``, as Go's JSON decoding takes it: no bool for a number, no quoted
    number or bool; an int fills a float."""
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        name = "mapping" if kind is dict else kind.__name__
        raise ConfigError(f"{where}: expected {name}, got {value!r}")
    return value


def check_kind(value: Any, kind: Kind, where: str) -> None:
    if value is None:
        return  # Go's JSON decoding leaves the field unset for a null, with no error
    if isinstance(kind, type):
        typed(value, kind, where)
    else:
        kind(value, where)


def unknown(value: Any, where: str) -> None:
    """A key whose llm-d type is not known here: accepted as it is."""


def duration(value: Any, where: str) -> float:
    """A Go duration string ("2m", "500ms"), as llm-d's plugins parse theirs."""
    return duration_seconds(typed(value, str, where), where)


def mapping(**kinds: Kind) -> Callable[[Any, str], None]:
    """A check of a nested mapping (a Go struct) whose listed keys have the given kinds;
    other keys are left to llm-d's own struct, not known here."""

    def check_mapping(value: Any, where: str) -> None:
        typed(value, dict, where)
        for key, kind in kinds.items():
            if key in value:
                check_kind(value[key], kind, f"{where}.{key}")

    return check_mapping


class Params:
    """One plugin's ``parameters`` (or a mapping inside them): take what maps, ignore what does
    not, refuse the unknown. ``where`` is the mapping's path (``plugins[2].parameters``)."""

    def __init__(self, raw: Any, where: str, plugin_type: str, notes: Notes) -> None:
        if raw is None:
            raw = {}
        if not isinstance(raw, Mapping):
            raise ConfigError(f"{where}: must be a mapping")
        self._raw = dict(raw)
        self.where = where
        self.type = plugin_type
        self._notes = notes

    def at(self, key: str) -> str:
        return f"{self.where}.{key}"

    def get(self, key: str, kind: type[T], default: T) -> T:
        value = self._raw.pop(key, None)
        if value is None:  # absent, or a null: unset, as Go's JSON decoding leaves it
            return default
        return typed(value, kind, self.at(key))

    def sub(self, key: str) -> Params:
        """A nested mapping, read the same way (its keys are checked by its own ``done``)."""
        return Params(self._raw.pop(key, None), self.at(key), self.type, self._notes)

    def has(self, key: str) -> bool:
        return key in self._raw

    def ignore(self, why: str, **kinds: Kind) -> None:
        """Accept the keys of ``kinds`` and record that they change nothing here, and why.

        Each is still checked against the type llm-d decodes it into (``kinds``), as the
        keys that are used are: llm-d would refuse ``insecureSkipVerify: "true"``."""
        for key, kind in kinds.items():
            if key in self._raw:
                check_kind(self._raw.pop(key), kind, self.at(key))
                self._notes.ignore(f"{self.at(key)} ({self.type})", why)

    def ignore_all(self, why: str) -> None:
        """Accept every key left, unchecked: for plugins whose parameters prefixgate does not
        read at all."""
        for key in list(self._raw):
            del self._raw[key]
            self._notes.ignore(f"{self.at(key)} ({self.type})", why)

    def done(self) -> None:
        """Fail on whatever no rule took (a key llm-d does not know either)."""
        if self._raw:
            key = sorted(self._raw)[0]
            raise ConfigError(f"{self.at(key)}: unknown parameter of {self.type}")


@dataclass(slots=True)
class State:
    """What the rules build: native plugins by name, config sections, and the cross-plugin
    facts (profile handler, deciders, producers, fairness policies, saturation detectors)."""

    notes: Notes
    types: dict[str, str] = field(default_factory=dict)  # every plugin name -> llm-d type
    native: dict[str, dict[str, Any]] = field(default_factory=dict)  # filters, scorers, pickers
    sections: dict[str, dict[str, Any]] = field(default_factory=dict)
    handler: str | None = None  # the llm-d handler type it acts as
    handler_name: str | None = None  # the plugin's name (llm-d runs one)
    handler_params: dict[str, Any] = field(default_factory=dict)
    deciders: dict[str, int] = field(default_factory=dict)  # name -> nonCachedTokens
    producers: dict[str, str] = field(default_factory=dict)  # name -> llm-d type
    fairness: dict[str, dict[str, Any]] = field(default_factory=dict)
    detectors: dict[str, dict[str, Any]] = field(default_factory=dict)
    orderings: set[str] = field(default_factory=set)

    def section(self, *path: str) -> dict[str, Any]:
        node = self.sections.setdefault(path[0], {})
        for key in path[1:]:
            node = node.setdefault(key, {})
        return node

    def add(self, name: str, native_type: str, parameters: dict[str, Any] | None = None) -> None:
        self.native[name] = {"type": native_type, "name": name, "parameters": parameters or {}}


# A rule builds what one llm-d plugin becomes: (state, the plugin's name, its parameters).
Rule = Callable[[State, str, Params], None]
