"""Why a request stalled: a kernel trace kept beside a run of (g), read per stall.

``--disk-trace`` has ``perf record`` (Debian's ``linux-perf``) trace the
whole machine while the schedule runs: the scheduler's switches and wake-ups
and the block layer's requests. It records in overwrite mode into a ring
buffer per CPU and writes it out only at the end, so the tracer itself takes
no CPU while the requests are measured. Afterwards every *stall* (requests of
``threshold_ms`` or more from their scheduled instant, grouped while they
overlap) is set against the trace:

- the slowest write and the slowest cache flush the disk had in flight during
  it, from issue to completion: the device's own latency;
- how long toko-api's loop thread was runnable but not running (waiting for a
  core), and what ran instead. While it waits it holds the GIL, so the
  writer thread waits too.

A stall is put down to the disk when a request in flight took at least half
as long as the stall's slowest request; to the CPU when one of toko-api's
threads (the loop's, the writer's, a reader's) waited for a core for at
least 30 % of the stall; to the load generator when it began one of the
requests late by at least half the slowest one's time (a stall of toko's
makes it late too, so this comes after those two); to toko-api's own work
("loop busy") when its loop thread ran on a core for at least 60 % of the
stall; and is unexplained otherwise: then the trace file is the place to
look.
"""

from __future__ import annotations

import bisect
import collections
import functools
import os
import re
import select
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.loadgen import Sample

# Ring buffer per CPU: a 60 s run at 2,000/s writes about 300 MB of events.
BUFFER = "512M"
EVENTS = (
    "sched:sched_switch",
    "sched:sched_wakeup",
    "block:block_rq_issue",
    "block:block_rq_complete",
)
THRESHOLD_MS = 10.0
SLOWEST_SHARE = 0.5  # of the stall's slowest request: the generator's lateness, the disk's
CPU_SHARE = 0.3  # of the stall's span
BUSY_SHARE = 0.6  # of the stall's span, the loop thread on a core
# Scheduler events kept before a stall, to know each thread's state as it begins.
LEAD_S = 0.5
# No request the disk completes has been in flight this long (SCSI's own timeout
# is 30 s): an older issue is one whose completion the trace missed.
STALE_S = 10.0


class TraceUnavailable(RuntimeError):
    """perf is missing or could not start: said in one line."""


class KernelTrace:
    """``perf record`` over the whole machine, enabled on ``__enter__`` once
    perf says so (its control FIFO's ack), written out on ``__exit__``."""

    def __init__(self, path: Path, buffer: str = BUFFER) -> None:
        self.path = path
        self.buffer = buffer
        self._proc: subprocess.Popen[bytes] | None = None
        self._dir: Path | None = None

    def __enter__(self) -> KernelTrace:
        perf = shutil.which("perf")
        if perf is None:
            raise TraceUnavailable("--disk-trace needs perf (apt install linux-perf)")
        self._dir = Path(tempfile.mkdtemp(prefix="toko-trace-"))
        ctl_path, ack_path = self._dir / "ctl", self._dir / "ack"
        os.mkfifo(ctl_path)
        os.mkfifo(ack_path)
        argv = [perf, "record", "-a", "-k", "CLOCK_MONOTONIC", "--overwrite", "-m", self.buffer]
        argv += ["-c", "1", "-D", "-1", "--control", f"fifo:{ctl_path},{ack_path}"]
        for event in EVENTS:
            argv += ["-e", event]
        argv += ["-o", str(self.path)]
        log = self.path.with_suffix(".log").open("wb")
        self._proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        # O_RDWR: opening a FIFO so never blocks, whether or not perf has it open yet.
        ctl = os.open(ctl_path, os.O_RDWR)
        ack = os.open(ack_path, os.O_RDWR)
        try:
            os.write(ctl, b"enable\n")
            if not self._acked(ack):
                self._end()
                said = self.path.with_suffix(".log").read_text(errors="replace").strip()
                first = said.splitlines()[0] if said else "no word from it"
                raise TraceUnavailable(f"perf record did not start: {first}")
        finally:
            os.close(ctl)
            os.close(ack)
        return self

    def __exit__(self, *exc: object) -> None:
        self._end()

    def _acked(self, ack: int, timeout_s: float = 30.0) -> bool:
        """Whether perf acks the enable within ``timeout_s``; False at once if it exits."""
        assert self._proc is not None
        for _ in range(int(timeout_s / 0.1)):
            ready, _, _ = select.select([ack], [], [], 0.1)
            if ready:
                return os.read(ack, 64).startswith(b"ack")
            if self._proc.poll() is not None:
                return False
        return False

    def _end(self) -> None:
        if self._proc is not None:
            self._proc.send_signal(signal.SIGINT)
            self._proc.wait(timeout=300)
            self._proc = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None


# -- reading a trace -------------------------------------------------------------------

_LINE = re.compile(r"^\s*(.+?)\s+(-?\d+)/(-?\d+)\s+\[(\d+)\]\s+([\d.]+):\s+(\S+):\s*(.*)$")
_ISSUE = re.compile(r"^(\S+) (\S+) (\d+) \(.*?\) (\d+) \+ (\d+)")
_COMPLETE = re.compile(r"^(\S+) (\S+) \(.*?\) (\d+) \+ (\d+)")
_KV = re.compile(r"(\w+)=(\S+)")
SCRIPT_FIELDS = "comm,pid,tid,cpu,time,event,trace"


@dataclass(frozen=True)
class Switch:
    at: float
    cpu: int
    prev_tid: str
    prev_state: str
    next_tid: str
    next_comm: str


@dataclass
class Trace:
    # (issued, completed, flush?)
    ios: list[tuple[float, float, bool]] = field(default_factory=list)
    # scheduler events in time order: a Switch, or (at, tid) for a wake-up
    sched: list[Switch | tuple[float, str]] = field(default_factory=list)
    # thread -> its process, for every thread seen running
    process_of: dict[str, str] = field(default_factory=dict)

    def sched_between(self, start: float, end: float) -> list[Switch | tuple[float, str]]:
        times = self._sched_times
        return self.sched[bisect.bisect_left(times, start) : bisect.bisect_right(times, end)]

    @functools.cached_property
    def _sched_times(self) -> list[float]:
        # Once per trace, not once per stall: read only after parse() has filled it.
        return [e.at if isinstance(e, Switch) else e[0] for e in self.sched]

    def threads_of(self, pid: str) -> list[str]:
        return sorted(t for t, p in self.process_of.items() if p == pid and t != pid)


class _Pairing:
    """Block requests paired issue to completion: writes by device and sector,
    cache flushes (no data) by device. Each completion goes with the latest
    issue still open: a request the trace saw issued but never completed (as
    at its edges) must not shift every later pairing on a sector the log
    writes over and over. An issue older than ``STALE_S`` goes with nothing."""

    def __init__(self, trace: Trace) -> None:
        self.trace = trace
        self.open: dict[tuple[str, str], list[float]] = collections.defaultdict(list)

    def issued(self, at: float, rest: str) -> None:
        b = _ISSUE.match(rest)
        if b is None:
            return
        flush = "F" in b[2] and b[3] == "0"
        self.open[(b[1], "flush" if flush else b[4])].append(at)

    def completed(self, at: float, rest: str) -> None:
        c = _COMPLETE.match(rest)
        if c is None:
            return
        flush = c[2].startswith("F")
        issues = self.open.get((c[1], "flush" if flush else c[3]))
        if not issues:
            return
        issued = issues.pop()
        if at - issued > STALE_S:
            issues.clear()
            return
        self.trace.ios.append((issued, at, flush))


def _sched_event(at: float, cpu: int, event: str, rest: str) -> Switch | tuple[float, str] | None:
    kv = dict(_KV.findall(rest))
    if event == "sched:sched_switch":
        return Switch(at, cpu, kv["prev_pid"], kv["prev_state"], kv["next_pid"], kv["next_comm"])
    if event == "sched:sched_wakeup":
        return (at, kv["pid"])
    return None


def parse(lines: Iterable[str], keep: Sequence[tuple[float, float]] = ()) -> Trace:
    """``perf script -F comm,pid,tid,cpu,time,event,trace`` output. Block requests
    are kept whole; scheduler events only within ``keep`` (all when empty)."""
    trace = Trace()
    pairing = _Pairing(trace)
    starts = [a for a, _ in keep]
    for line in lines:
        m = _LINE.match(line)
        if m is None:
            continue
        at, event, rest = float(m[5]), m[6], m[7]
        trace.process_of[m[3]] = m[2]
        if event == "block:block_rq_issue":
            pairing.issued(at, rest)
        elif event == "block:block_rq_complete":
            pairing.completed(at, rest)
        elif event.startswith("sched:"):
            i = bisect.bisect_right(starts, at) - 1
            if keep and (i < 0 or at > keep[i][1]):
                continue
            e = _sched_event(at, int(m[4]), event, rest)
            if e is not None:
                trace.sched.append(e)
    return trace


def read(path: Path, keep: Sequence[tuple[float, float]]) -> Trace:
    """The trace at ``path``, scheduler events only within ``keep`` (sorted spans)."""
    with subprocess.Popen(
        ["perf", "script", "-i", str(path), "-F", SCRIPT_FIELDS],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    ) as proc:
        assert proc.stdout is not None
        return parse(proc.stdout, keep)


# -- stalls ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Stall:
    start: float  # monotonic: the first slow request's scheduled instant
    end: float  # the last one's answer
    max_ms: float
    requests: int
    # The most the load generator itself began one of them late.
    late_max_ms: float = 0.0


def find_stalls(
    samples: Sequence[Sample], t0: float, threshold_ms: float = THRESHOLD_MS
) -> list[Stall]:
    """Requests of ``threshold_ms`` or more, grouped while they overlap (2 ms apart at most)."""
    slow = sorted(
        (t0 + s.scheduled, t0 + s.finished, s.latency_ms, (s.started - s.scheduled) * 1000)
        for s in samples
        if s.finished > 0 and s.latency_ms >= threshold_ms
    )
    groups: list[list[float]] = []
    for start, end, ms, late in slow:
        if groups and start <= groups[-1][1] + 0.002:
            g = groups[-1]
            g[1], g[2], g[3], g[4] = max(g[1], end), max(g[2], ms), g[3] + 1, max(g[4], late)
        else:
            groups.append([start, end, ms, 1, late])
    return [Stall(a, b, ms, int(n), max(0.0, late)) for a, b, ms, n, late in groups]


def waited_for_core(
    events: Sequence[Switch | tuple[float, str]], tid: str, start: float, end: float
) -> tuple[float, dict[str, float]]:
    """ms ``tid`` was runnable but not running within [start, end], and who ran
    on each CPU meanwhile (ms by command name)."""
    since: float | None = None
    waited = 0.0
    instead: dict[str, float] = collections.defaultdict(float)
    running: dict[int, tuple[float, str]] = {}
    for e in events:
        if not isinstance(e, Switch):
            if e[1] == tid and since is None:
                since = e[0]
            continue
        if since is not None and e.cpu in running:
            ran_from, comm = running[e.cpu]
            lo, hi = max(ran_from, since, start), min(e.at, end)
            if hi > lo:
                instead[comm] += (hi - lo) * 1000
        running[e.cpu] = (e.at, e.next_comm)
        if e.prev_tid == tid and e.prev_state.startswith("R"):
            since = e.at  # preempted: still runnable
        elif e.prev_tid == tid:
            since = None  # asleep until a wake-up
        if e.next_tid == tid:
            if since is not None:
                lo, hi = max(since, start), min(e.at, end)
                if hi > lo:
                    waited += (hi - lo) * 1000
            since = None
            running[e.cpu] = (e.at, "")  # the thread itself
    if since is not None:  # still waiting as the span ends
        waited += max(0.0, end - max(since, start)) * 1000
    instead.pop("", None)
    return waited, instead


def ran_on_core(
    events: Sequence[Switch | tuple[float, str]], tid: str, start: float, end: float
) -> float:
    """ms ``tid`` ran on a core within [start, end]."""
    since: float | None = None
    ran = 0.0
    for e in events:
        if not isinstance(e, Switch):
            continue
        if e.next_tid == tid:
            since = e.at
        elif e.prev_tid == tid and since is not None:
            ran += max(0.0, min(e.at, end) - max(since, start)) * 1000
            since = None
    if since is not None:
        ran += max(0.0, end - max(since, start)) * 1000
    return ran


def _top(ms_by_name: dict[str, float], n: int = 3) -> dict[str, float]:
    return {k: round(v, 2) for k, v in sorted(ms_by_name.items(), key=lambda kv: -kv[1])[:n]}


def explain(stall: Stall, trace: Trace, toko_pid: str, t0: float) -> dict[str, Any]:
    """What the trace shows across one stall (see the module docstring). The
    loop thread is the process's first; of its other threads (the writer, the
    checkpoints', readers') the one that waited longest for a core is named."""
    during = [(b - a, f) for a, b, f in trace.ios if a < stall.end and b > stall.start]
    writes = [took * 1000 for took, flush in during if not flush]
    flushes = [took * 1000 for took, flush in during if flush]
    events = trace.sched_between(stall.start - LEAD_S, stall.end)
    waited, instead = waited_for_core(events, toko_pid, stall.start, stall.end)
    thread_waits = [
        waited_for_core(events, tid, stall.start, stall.end) for tid in trace.threads_of(toko_pid)
    ]
    t_waited, t_instead = max(thread_waits, key=lambda w: w[0], default=(0.0, {}))
    loop_ran = ran_on_core(events, toko_pid, stall.start, stall.end)
    span_ms = (stall.end - stall.start) * 1000
    if max(writes + flushes, default=0.0) >= SLOWEST_SHARE * stall.max_ms:
        cause = "disk"
    elif max(waited, t_waited) >= CPU_SHARE * span_ms:
        cause = "cpu"
    elif stall.late_max_ms >= SLOWEST_SHARE * stall.max_ms:
        cause = "generator late"  # the client's own wait, not toko-api's
    elif loop_ran >= BUSY_SHARE * span_ms:
        cause = "loop busy"
    else:
        cause = "unexplained"
    return {
        "at_s": round(stall.start - t0, 3),
        # Where to look in the trace kept beside the run: perf script --time A,B
        "at_monotonic": [round(stall.start, 6), round(stall.end, 6)],
        "max_ms": round(stall.max_ms, 2),
        "requests": stall.requests,
        "span_ms": round(span_ms, 2),
        "generator_late_max_ms": round(stall.late_max_ms, 2),
        "write_in_flight_max_ms": round(max(writes, default=0.0), 2),
        "flush_in_flight_max_ms": round(max(flushes, default=0.0), 2),
        "loop_ran_ms": round(loop_ran, 2),
        "loop_waited_for_core_ms": round(waited, 2),
        "ran_instead_ms": _top(instead),
        "thread_waited_for_core_ms": round(t_waited, 2),
        "thread_ran_instead_ms": _top(t_instead),
        "cause": cause,
    }


def explain_run(
    path: Path,
    samples: Sequence[Sample],
    t0: float,
    toko_pid: int,
    threshold_ms: float = THRESHOLD_MS,
) -> list[dict[str, Any]]:
    """Every stall of one run, explained from the trace at ``path``."""
    stalls = find_stalls(samples, t0, threshold_ms)
    if not stalls:
        return []
    keep = merge_spans([(s.start - LEAD_S, s.end) for s in stalls])
    trace = read(path, keep)
    return [explain(s, trace, str(toko_pid), t0) for s in stalls]


def merge_spans(spans: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _waited(ms: float, instead: dict[str, float]) -> str:
    who = ", ".join(f"{k} {v:.1f}" for k, v in instead.items())
    return f"{ms:.1f} ms" + (f" ({who})" if who else "")


def stall_lines(stalls: Sequence[dict[str, Any]], limit: int = 12) -> list[str]:
    """The count by cause, then one line per stall, the slowest first."""
    if not stalls:
        return [f"no request took {THRESHOLD_MS:g} ms or more"]
    counts = collections.Counter(s["cause"] for s in stalls)
    lines = [
        f"stalls of {THRESHOLD_MS:g} ms or more: {len(stalls)} ("
        + ", ".join(f"{n} {cause}" for cause, n in counts.most_common())
        + ")"
    ]
    for s in sorted(stalls, key=lambda s: -s["max_ms"])[:limit]:
        lines.append(
            f"  at {s['at_s']:.2f} s: {s['max_ms']:.1f} ms ({s['requests']} requests over"
            f" {s['span_ms']:.1f} ms); sent late up to {s['generator_late_max_ms']:.1f} ms;"
            f" disk in flight: write {s['write_in_flight_max_ms']:.1f},"
            f" flush {s['flush_in_flight_max_ms']:.1f} ms; loop ran {s['loop_ran_ms']:.1f} ms;"
            f" waited for a core: loop"
            f" {_waited(s['loop_waited_for_core_ms'], s['ran_instead_ms'])}, another thread"
            f" {_waited(s['thread_waited_for_core_ms'], s['thread_ran_instead_ms'])}"
            f" => {s['cause']}"
        )
    return lines
