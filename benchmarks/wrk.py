"""Driving wrk (a C load generator) for the overhead benchmark, and reading its report.

A Python client spends more CPU per request than the routers it measures; on a 2-core machine
that would cap every router at the client's rate. wrk runs one thread here and builds each
request in Lua: OpenAI completions with prompts of about 600 bytes, 16 shared prefixes.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

_SCRIPT = """
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
local shared = string.rep("Summarise the design of a routing gateway for a fleet. ", 9)
local n = 0
request = function()
  n = n + 1
  local prompt = "prefix " .. (n %% 16) .. ": " .. shared .. " question " .. n
  local body = '{"model":"%(model)s","prompt":"' .. prompt ..
    '","max_tokens":%(tokens)d,"stream":%(stream)s}'
  return wrk.format("POST", "/v1/completions", nil, body)
end
"""

_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0}


@dataclass(frozen=True, slots=True)
class WrkResult:
    requests: int
    errors: int  # non-2xx answers and socket errors
    rps: float
    p50_s: float
    p99_s: float


def available() -> bool:
    return shutil.which("wrk") is not None


def script(model: str, tokens: int, stream: bool) -> str:
    return _SCRIPT % {"model": model, "tokens": tokens, "stream": str(stream).lower()}


def _seconds(text: str) -> float:
    match = re.fullmatch(r"([\d.]+)(us|ms|s|m)", text)
    if match is None:
        raise ValueError(f"unreadable wrk latency {text!r}")
    return float(match[1]) * _UNITS[match[2]]


def parse(report: str) -> WrkResult:
    """The figures of ``wrk --latency``'s report."""
    requests = re.search(r"(\d+) requests in", report)
    rps = re.search(r"Requests/sec:\s+([\d.]+)", report)
    p50 = re.search(r"^\s+50%\s+(\S+)", report, re.M)
    p99 = re.search(r"^\s+99%\s+(\S+)", report, re.M)
    if requests is None or rps is None or p50 is None or p99 is None:
        raise ValueError(f"unreadable wrk report:\n{report}")
    errors = 0
    non_2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", report)
    if non_2xx:
        errors += int(non_2xx[1])
    sockets = re.search(r"Socket errors: (.*)", report)
    if sockets:
        errors += sum(int(n) for n in re.findall(r"\d+", sockets[1]))
    return WrkResult(int(requests[1]), errors, float(rps[1]), _seconds(p50[1]),
                     _seconds(p99[1]))


def run(url: str, lua: str, connections: int, seconds: float) -> WrkResult:
    """One wrk run (one thread) against ``url``."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "load.lua"
        path.write_text(lua)
        args = ["wrk", "-t1", f"-c{connections}", f"-d{max(1, round(seconds))}s", "--latency",
                "-s", str(path), url]
        done = subprocess.run(args, capture_output=True, text=True, timeout=seconds + 60,
                              check=True)
    return parse(done.stdout)
