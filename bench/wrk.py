"""Run wrk (Debian's ``wrk`` 4.x) with a POST /produk Lua script and parse its output.

The Lua ``done()`` hook prints one ``WRK_JSON {...}`` line with exact counts
and percentiles in microseconds; the human-readable report is parsed too, as
a fallback and so a changed script cannot silently lose figures.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# One Lua state per wrk thread: `tid` (set from setup()) and the run token
# passed after `--` make every nama unique within a run, so the service does
# not get a body it has already seen (no accidental caching anywhere).
POST_PRODUK_LUA = r"""
local threads = {}
local counter = 0
local prefix = "bench"

function setup(thread)
   table.insert(threads, thread)
   thread:set("tid", #threads)
end

function init(args)
   prefix = string.format("bench-%s-t%d", args[1] or "run", tid or 0)
   wrk.method = "POST"
   wrk.headers["Content-Type"] = "application/json"
end

function request()
   counter = counter + 1
   local body = string.format('{"nama": "%s-%d", "harga": %d}',
                              prefix, counter, 1000 + counter % 100000)
   return wrk.format(nil, nil, nil, body)
end

function done(summary, latency, requests)
   local e = summary.errors
   io.write(string.format(
      'WRK_JSON {"requests": %d, "duration_us": %d, "bytes": %d, ' ..
      '"errors": {"connect": %d, "read": %d, "write": %d, "status": %d, "timeout": %d}, ' ..
      '"latency_us": {"min": %d, "max": %d, "mean": %.3f, "stdev": %.3f, ' ..
      '"p50": %d, "p75": %d, "p90": %d, "p99": %d, "p999": %d}}\n',
      summary.requests, summary.duration, summary.bytes,
      e.connect, e.read, e.write, e.status, e.timeout,
      latency.min, latency.max, latency.mean, latency.stdev,
      latency:percentile(50), latency:percentile(75), latency:percentile(90),
      latency:percentile(99), latency:percentile(99.9)))
end
"""

_UNITS_MS = {"us": 0.001, "ms": 1.0, "s": 1000.0, "m": 60_000.0, "h": 3_600_000.0}
_DURATION = re.compile(r"^([0-9.]+)(us|ms|s|m|h)$")
_PCT_LINE = re.compile(r"^\s*([0-9.]+)%\s+([0-9.]+(?:us|ms|s|m|h))\s*$")
_REQS_LINE = re.compile(r"^\s*(\d+) requests in ([0-9.]+(?:us|ms|s|m|h)),")
_RPS_LINE = re.compile(r"^Requests/sec:\s+([0-9.]+)")
_SOCKET_ERRORS = re.compile(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)")
_NON_2XX = re.compile(r"Non-2xx or 3xx responses: (\d+)")


class WrkParseError(ValueError):
    pass


@dataclass(frozen=True)
class WrkResult:
    requests: int
    duration_s: float
    rps: float
    latency_ms: dict[str, float]  # keys p50, p75, p90, p99 (+ p999, mean, max when known)
    errors: dict[str, int] = field(default_factory=dict)  # connect/read/write/timeout/status

    @property
    def error_count(self) -> int:
        return sum(self.errors.values())

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["error_count"] = self.error_count
        return d


def duration_to_ms(text: str) -> float:
    """wrk's ``Latency`` strings (``812.00us``, ``3.21ms``, ``1.02s``, ``2m``) in ms."""
    m = _DURATION.match(text.strip())
    if not m:
        raise WrkParseError(f"not a wrk duration: {text!r}")
    return float(m.group(1)) * _UNITS_MS[m.group(2)]


def _pct_key(pct: float) -> str:
    """50.0 -> ``p50``, 99.9 -> ``p999`` (the keys the Lua hook uses)."""
    text = f"{pct:g}"
    return "p" + text.replace(".", "")


def parse_wrk_output(text: str) -> WrkResult:
    """Parse wrk's stdout: the ``WRK_JSON`` line if present, else the text report."""
    for line in text.splitlines():
        if line.startswith("WRK_JSON "):
            return _from_json(json.loads(line[len("WRK_JSON ") :]))
    return _from_text(text)


def _from_json(d: dict[str, Any]) -> WrkResult:
    duration_s = d["duration_us"] / 1e6
    if duration_s <= 0:
        raise WrkParseError("wrk reported a zero duration")
    lat = {k: float(v) / 1000.0 for k, v in d["latency_us"].items()}
    errors = {k: int(v) for k, v in d["errors"].items()}
    return WrkResult(
        requests=int(d["requests"]),
        duration_s=duration_s,
        rps=d["requests"] / duration_s,
        latency_ms=lat,
        errors=errors,
    )


def _from_text(text: str) -> WrkResult:
    lat: dict[str, float] = {}
    requests: int | None = None
    duration_s: float | None = None
    rps: float | None = None
    errors = {"connect": 0, "read": 0, "write": 0, "timeout": 0, "status": 0}
    in_dist = False
    for line in text.splitlines():
        if "Latency Distribution" in line:
            in_dist = True
            continue
        if in_dist:
            m = _PCT_LINE.match(line)
            if m:
                lat[_pct_key(float(m.group(1)))] = duration_to_ms(m.group(2))
                continue
            in_dist = False
        if m := _REQS_LINE.match(line):
            requests = int(m.group(1))
            duration_s = duration_to_ms(m.group(2)) / 1000.0
        elif m := _RPS_LINE.match(line):
            rps = float(m.group(1))
        elif m := _SOCKET_ERRORS.search(line):
            for key, value in zip(("connect", "read", "write", "timeout"), m.groups(), strict=True):
                errors[key] = int(value)
        elif m := _NON_2XX.search(line):
            errors["status"] = int(m.group(1))
    if requests is None or duration_s is None or rps is None:
        raise WrkParseError("no request summary in wrk output (was it run at all?)")
    if "p50" not in lat or "p99" not in lat:
        raise WrkParseError("no latency distribution in wrk output (run wrk with --latency)")
    return WrkResult(
        requests=requests, duration_s=duration_s, rps=rps, latency_ms=lat, errors=errors
    )


def wrk_binary() -> str:
    path = shutil.which("wrk")
    if path is None:
        raise RuntimeError("wrk not found: install Debian's wrk (make bench does it)")
    return path


def run_wrk(
    url: str,
    *,
    script: Path,
    duration_s: float,
    connections: int,
    threads: int,
    token: str,
    log: Path | None = None,
) -> WrkResult:
    """Run wrk once (bounded by its -d plus a grace period) and parse the result."""
    secs = max(1, round(duration_s))
    cmd = [
        wrk_binary(),
        f"-t{threads}",
        f"-c{connections}",
        f"-d{secs}s",
        "--timeout",
        "5s",
        "--latency",
        "-s",
        str(script),
        url,
        "--",
        token,
    ]
    # subprocess.run kills wrk if we are interrupted or it overruns.
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=secs + 30, check=False)
    if log is not None:
        with log.open("a") as f:
            f.write(f"$ {' '.join(cmd)}\n{proc.stdout}{proc.stderr}\n")
    if proc.returncode != 0:
        raise RuntimeError(f"wrk exited {proc.returncode}: {proc.stderr.strip()[:500]}")
    return parse_wrk_output(proc.stdout)
