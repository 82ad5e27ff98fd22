"""llm-d's profile handlers and P/D deciders, as rules of router/config/llmd_plugins.py.

llm-d runs exactly one profile handler. ``single-profile-handler`` and
``data-parallel-profile-handler`` mean the one profile; ``disagg-profile-handler`` (and
``pd-profile-handler``, its deprecated name, still registered in llm-d) names the prefill and
decode profiles and the decider that turns disaggregation on. router/config/llmd.py turns the
handler's settings into the prefill and decode profiles and ``disaggregation``.
"""

from __future__ import annotations

from router.config.llmd_params import Params, Rule, State
from router.core.errors import ConfigError

PD_TYPES = ("prefix-based-pd-decider", "always-disagg-pd-decider")
DECODE_FIRST, PREFILL_FIRST = "decode-first", "prefill-first"
_NO_ENCODE = ("prefixgate has no encode stage; remove it (prefill/decode disaggregation is "
              "supported)")
# llm-d's deprecated flat parameters of the disagg handler (the nested form's equivalents).
_FLAT = ("decodeProfile", "prefillProfile", "prefillDeciderPluginName", "deciderPluginName",
         "encodeProfile", "encodeDeciderPluginName")


def _claim(state: State, name: str, p: Params, handler: str) -> None:
    """Record the profile handler; a second one fails, as in llm-d."""
    if state.handler_name is not None:
        raise ConfigError(f"{p.where.rsplit('.', 1)[0]}.type: a second profile handler "
                          f"({name!r}, after {state.handler_name!r}); llm-d runs exactly one")
    state.handler, state.handler_name = handler, name


def _primary_port(state: State, p: Params) -> None:
    """Checked as llm-d checks it, then ignored: ranks are endpoints of their own here."""
    if not p.has("primaryPort"):
        return
    port = p.get("primaryPort", int, 0)
    if port and not 1 <= port <= 65535:
        raise ConfigError(f"{p.at('primaryPort')}: must be between 1 and 65535, got {port}")
    state.notes.ignore(f"{p.at('primaryPort')} ({p.type})", "each endpoint is addressed on its "
                       "own port: list every data-parallel rank as an endpoint")


def _single_handler(state: State, name: str, p: Params) -> None:
    p.done()
    _claim(state, name, p, "single-profile-handler")


def _data_parallel_handler(state: State, name: str, p: Params) -> None:
    _primary_port(state, p)
    p.done()
    _claim(state, name, p, "single-profile-handler")


def _stage_order(p: Params) -> str:
    """llm-d's ``stageOrder``, spelled as loosely as llm-d accepts it."""
    raw = p.get("stageOrder", str, "")
    key = raw.lower().replace("-", "").replace("_", "")
    if key in ("", "decodefirst", "decode"):
        return DECODE_FIRST
    if key in ("prefillfirst", "prefill"):
        return PREFILL_FIRST
    raise ConfigError(f"{p.at('stageOrder')}: unknown stage order {raw!r} (decode-first or "
                      "prefill-first)")


def _flat(p: Params) -> tuple[dict[str, str], dict[str, str], str, str]:
    """The deprecated flat form: profile names and their paths, the decider and its path."""
    for key in ("encodeProfile", "encodeDeciderPluginName"):
        if p.has(key):
            raise ConfigError(f"{p.at(key)}: {_NO_ENCODE}")
    names = {role: p.get(f"{role}Profile", str, "") or role for role in ("decode", "prefill")}
    at = {role: p.at(f"{role}Profile") for role in ("decode", "prefill")}
    preferred = p.get("prefillDeciderPluginName", str, "")
    alias = p.get("deciderPluginName", str, "")  # pd-profile-handler's name, lower priority
    key = "prefillDeciderPluginName" if preferred else "deciderPluginName"
    return names, at, preferred or alias, p.at(key)


def _nested(p: Params) -> tuple[dict[str, str], dict[str, str], str, str]:
    profiles = p.sub("profiles")
    names = {role: profiles.get(role, str, "") or role for role in ("decode", "prefill")}
    if profiles.has("encode"):
        raise ConfigError(f"{profiles.at('encode')}: {_NO_ENCODE}")
    profiles.done()
    deciders = p.sub("deciders")
    decider = deciders.get("prefill", str, "")
    if deciders.has("encode"):
        raise ConfigError(f"{deciders.at('encode')}: {_NO_ENCODE}")
    deciders.done()
    at = {role: profiles.at(role) for role in ("decode", "prefill")}
    return names, at, decider, deciders.at("prefill")


def _disagg_handler(state: State, name: str, p: Params) -> None:
    _claim(state, name, p, "disagg-profile-handler")
    order = _stage_order(p)
    flat = [key for key in _FLAT if p.has(key)]
    nested = [key for key in ("profiles", "deciders") if p.has(key)]
    if flat and nested:
        raise ConfigError(f"{p.at(flat[0])}: llm-d's deprecated flat parameters and the nested "
                          f"{nested[0]!r} cannot be mixed; use one form")
    names, at, decider, decider_at = _flat(p) if flat else _nested(p)
    p.done()
    if order == PREFILL_FIRST and decider:
        raise ConfigError(f"{decider_at}: llm-d takes no prefill decider in prefill-first stage "
                          "order (every request is prefilled); remove one of them")
    state.handler_params = {"profiles": names, "profile_at": at, "decider": decider,
                            "decider_at": decider_at, "order": order, "where": p.where}


def _pd_handler(state: State, name: str, p: Params) -> None:
    """llm-d's deprecated name of the disagg handler: flat parameters only, and the decider
    defaults to a plugin named ``prefix-based-pd-decider``."""
    _claim(state, name, p, "disagg-profile-handler")
    _primary_port(state, p)
    p.ignore("the prefix match is read off the gateway's own prefix index",
             prefixPluginType=str, prefixPluginName=str, prefixMatchInfoProducerName=str)
    # llm-d's default decider name, spelled out, so that the flat form reads it.
    raw = {"deciderPluginName": "prefix-based-pd-decider"}
    for key in ("decodeProfile", "prefillProfile", "deciderPluginName"):
        if p.has(key):
            raw[key] = p.get(key, str, "")
    p.done()
    if not raw["deciderPluginName"]:
        raise ConfigError(f"{p.at('deciderPluginName')}: required (a prefix-based-pd-decider "
                          "or always-disagg-pd-decider plugin)")
    names, at, decider, decider_at = _flat(Params(raw, p.where, p.type, state.notes))
    state.handler_params = {"profiles": names, "profile_at": at, "decider": decider,
                            "decider_at": decider_at, "order": DECODE_FIRST, "where": p.where}


def _prefix_decider(state: State, name: str, p: Params) -> None:
    state.deciders[name] = p.get("nonCachedTokens", int, 0)
    if p.get("promptTokens", int, 0) > 0:
        state.notes.ignore(f"{p.at('promptTokens')} (prefix-based-pd-decider)",
                           "the decision is on the uncached tokens alone (nonCachedTokens)")
    p.done()
    if state.deciders[name] < 0:
        raise ConfigError(f"{p.at('nonCachedTokens')}: cannot be negative")


def _always_decider(state: State, name: str, p: Params) -> None:
    p.done()
    state.deciders[name] = -1  # always: prefill runs on the prefill pool for every request


HANDLER_RULES: dict[str, Rule] = {
    "single-profile-handler": _single_handler,
    "data-parallel-profile-handler": _data_parallel_handler,
    "disagg-profile-handler": _disagg_handler,
    "pd-profile-handler": _pd_handler,
    "prefix-based-pd-decider": _prefix_decider,
    "always-disagg-pd-decider": _always_decider,
}
