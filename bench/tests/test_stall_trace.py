"""Reading a kernel trace across a stall (bench.stall_trace).

The two excerpts under data/ are ``perf script -F comm,pid,tid,cpu,time,event,trace``
output of traced (g) runs at 1,000/s on this project's bench machine, 2026-12-07:
- stall-cpu: 18 requests up to 18.7 ms while toko-api's loop thread (tid 9314)
  waited for a core, behind the SMTP sink and the kernel's kdamond.0;
- stall-disk: 7 requests up to 16.0 ms while a 32 KiB write to the log sat
  13.8 ms in the virtual disk.
"""

from __future__ import annotations

import gzip
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from bench.loadgen import Sample
from bench.procs import REPO
from bench.stall_trace import (
    KernelTrace,
    Stall,
    Switch,
    Trace,
    TraceUnavailable,
    explain,
    find_stalls,
    merge_spans,
    parse,
    ran_on_core,
    read,
    stall_lines,
    waited_for_core,
)

DATA = Path(__file__).parent / "data"


def _explained(name: str, stall: Stall, pid: str, t0: float) -> tuple[Trace, dict[str, Any]]:
    """One of the recorded excerpts, parsed, and ``stall`` explained from it."""
    with gzip.open(DATA / name, "rt") as f:
        trace = parse(f.read().splitlines())
    return trace, explain(stall, trace, pid, t0=t0)


def test_a_stall_behind_other_processes_is_put_down_to_the_cpu() -> None:
    stall = Stall(start=47861.88145, end=47861.91011, max_ms=18.66, requests=18)
    trace, got = _explained("stall-cpu.perf.txt.gz", stall, "9314", t0=47845.80745)
    assert got["cause"] == "cpu"
    assert got["at_s"] == pytest.approx(16.074, abs=0.001)
    # The disk answered everything in flight within a millisecond.
    assert got["write_in_flight_max_ms"] < 1
    assert got["flush_in_flight_max_ms"] < 1
    # The loop thread waited for a core about 12 ms of the 28.7, much of it
    # behind the kernel's kdamond.0 (4.2 ms in one slice).
    assert 10 < got["loop_waited_for_core_ms"] < 15
    assert 12 < got["loop_ran_ms"] < 17  # on a core about half the time, waiting the rest
    assert got["ran_instead_ms"]["kdamond.0"] == pytest.approx(4.2, abs=0.3)
    # Its other threads (the writer among them) are told apart by process.
    assert set(trace.threads_of("9314")) >= {"9316", "9317"}


def test_a_stall_on_a_slow_write_is_put_down_to_the_disk() -> None:
    stall = Stall(start=48289.94668, end=48289.96360, max_ms=15.95, requests=7)
    _, got = _explained("stall-disk.perf.txt.gz", stall, "9695", t0=48267.70968)
    assert got["cause"] == "disk"
    # The log's 32 KiB write, issued 48289.947264, completed 48289.961047.
    assert got["write_in_flight_max_ms"] == pytest.approx(13.78, abs=0.01)
    assert got["loop_waited_for_core_ms"] < 5


def test_a_stall_the_loop_spent_at_work_is_its_own() -> None:
    trace = Trace(
        ios=[(1.0, 1.0001, False)],
        sched=[
            (0.999, "7"),
            Switch(0.999, 0, "0", "R", "7", "toko-api"),  # on a core throughout
            Switch(1.0115, 0, "7", "S", "0", "swapper/0"),
        ],
        process_of={"7": "7", "8": "7"},
    )
    got = explain(Stall(1.0, 1.012, 12.0, 9), trace, "7", t0=0.0)
    assert got["cause"] == "loop busy"
    assert got["loop_ran_ms"] == pytest.approx(11.5)
    assert got["loop_waited_for_core_ms"] == 0


def test_parse_pairs_writes_by_sector_and_flushes_in_order() -> None:
    issue, complete = "block:block_rq_issue: 254,0", "block:block_rq_complete: 254,0"
    lines = [
        f"toko-api  10/12  [001] 100.000100:  {issue} WS 20480 () 500 + 40 0x2,0,4 [toko-api]",
        f"kworker/1:0H  26/26  [001] 100.000200:  {issue} FF 0 () 0 + 0 0x0,0,0 [kworker/1:0H]",
        f"swapper  0/0  [001] 100.000300:  {complete} FF () 18446744073709551615 + 0 0x0,0,0 [0]",
        f"swapper  0/0  [001] 100.000301:  {complete} WS () 0 + 0 0x2,0,4 [0]",
        f"swapper  0/0  [000] 100.009100:  {complete} WS () 500 + 40 0x2,0,4 [0]",
        "toko-api  10/10  [000] 100.010000:  sched:sched_wakeup: comm=toko-api pid=12 prio=120",
    ]
    trace = parse(lines)
    took_us = sorted((round((b - a) * 1e6), flush) for a, b, flush in trace.ios)
    assert took_us == [(100, True), (9000, False)]
    assert trace.sched == [(100.01, "12")]
    # A write the trace saw issued but never completed (as at its edges) does
    # not pair with the next completion on that sector, which the log rewrites.
    orphan = f"toko-api  10/12  [001] 99.000000:  {issue} WS 4096 () 500 + 8 0x2,0,4 [toko-api]"
    assert sorted(round((b - a) * 1e6) for a, b, _ in parse([orphan, *lines]).ios) == [100, 9000]
    stale = f"toko-api  10/12  [001] 50.0:  {issue} WS 4096 () 777 + 8 0x2,0,4 [toko-api]"
    done = f"swapper  0/0  [000] 70.0:  {complete} WS () 777 + 8 0x2,0,4 [0]"
    assert parse([stale, done]).ios == []  # 20 s in flight: a completion the trace missed
    # Scheduler events outside the spans kept are dropped; block requests never are.
    assert parse(lines, keep=[(0.0, 1.0)]).sched == []
    assert len(parse(lines, keep=[(0.0, 1.0)]).ios) == 2


def test_waited_for_core_counts_runnable_time_and_who_ran() -> None:
    events: list[Switch | tuple[float, str]] = [
        Switch(1.000, 0, "7", "R", "50", "generator"),  # the loop is preempted
        Switch(1.003, 0, "50", "S", "60", "kdamond.0"),
        Switch(1.005, 0, "60", "I", "7", "toko-api"),  # back after 5 ms
        Switch(1.006, 0, "7", "S", "0", "swapper/0"),  # asleep: not waiting
        (1.008, "7"),  # woken...
        Switch(1.009, 0, "0", "R", "7", "toko-api"),  # ...and on a core 1 ms later
    ]
    # Ran from 1.005 to 1.006 and from 1.009 on (to the span's end).
    assert ran_on_core(events, "7", 1.0, 1.010) == pytest.approx(2.0)
    waited, instead = waited_for_core(events, "7", 0.0, 2.0)
    assert waited == pytest.approx(6.0)
    assert instead["generator"] == pytest.approx(3.0)
    assert instead["kdamond.0"] == pytest.approx(2.0)
    # Only what falls within the span counts, a wait the span ends in too.
    assert waited_for_core(events, "7", 1.002, 1.004)[0] == pytest.approx(2.0)
    assert waited_for_core(events[:-1], "7", 1.0085, 1.0088)[0] == pytest.approx(0.3)


def test_find_stalls_groups_overlapping_slow_requests() -> None:
    def sample(i: int, scheduled: float, ms: float) -> Sample:
        return Sample(i, scheduled, scheduled, scheduled + ms / 1000, status=201, product_id=i)

    samples = [
        sample(0, 1.000, 2),
        sample(1, 1.001, 12),  # a stall begins
        sample(2, 1.002, 11),
        sample(3, 1.0125, 10),  # 1.5 ms after the last answer: the same stall
        sample(4, 3.000, 25),  # another
        Sample(5, 4.0),  # never answered: not a latency
        Sample(6, 5.0, 5.009, 5.012, status=201, product_id=6),  # sent 9 ms late
    ]
    stalls = find_stalls(samples, t0=100.0)
    assert [(round(s.start, 4), round(s.end, 4), s.requests) for s in stalls] == [
        (101.001, 101.0225, 3),
        (103.0, 103.025, 1),
        (105.0, 105.012, 1),
    ]
    assert stalls[1].max_ms == pytest.approx(25)
    assert stalls[1].late_max_ms == 0 and stalls[2].late_max_ms == pytest.approx(9)
    # Its own lateness is most of that one: the generator's, not toko-api's.
    assert explain(stalls[2], Trace(), "7", t0=100.0)["cause"] == "generator late"
    assert merge_spans([(3, 4), (1, 2), (1.5, 2.5)]) == [(1, 2.5), (3, 4)]


def test_stall_lines_count_by_cause_slowest_first() -> None:
    base = {
        "requests": 3,
        "span_ms": 20.0,
        "generator_late_max_ms": 0.5,
        "write_in_flight_max_ms": 0.1,
        "flush_in_flight_max_ms": 0.1,
        "loop_ran_ms": 8.0,
        "loop_waited_for_core_ms": 9.0,
        "ran_instead_ms": {"kdamond.0": 4.0},
        "thread_waited_for_core_ms": 0.0,
        "thread_ran_instead_ms": {},
    }
    lines = stall_lines(
        [
            {**base, "at_s": 1.0, "max_ms": 12.0, "cause": "cpu"},
            {**base, "at_s": 2.0, "max_ms": 40.0, "cause": "disk"},
        ]
    )
    assert lines[0] == "stalls of 10 ms or more: 2 (1 cpu, 1 disk)"
    assert lines[1].startswith("  at 2.00 s: 40.0 ms (3 requests over 20.0 ms); sent late up")
    assert lines[1].endswith("=> disk")
    assert "loop ran 8.0 ms; waited for a core: loop 9.0 ms (kdamond.0 4.0)," in lines[2]
    assert stall_lines([]) == ["no request took 10 ms or more"]


def test_tracing_without_perf_says_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # a PATH with no perf on it
    with (
        pytest.raises(TraceUnavailable, match="apt install linux-perf"),
        KernelTrace(tmp_path / "run.perf.data"),
    ):
        pass
    assert not (tmp_path / "run.perf.data").exists()
    assert os.listdir(tmp_path) == []


@pytest.mark.root
def test_perf_refusing_to_start_is_said_in_one_line_at_once(tmp_path: Path) -> None:
    started = time.monotonic()
    with (
        pytest.raises(TraceUnavailable, match="did not start: Invalid argument for --mmap_pages"),
        KernelTrace(tmp_path / "run.perf.data", buffer="lots"),  # perf's own check says no
    ):
        pass
    assert time.monotonic() - started < 10  # not the 30 s allowed for an ack


@pytest.mark.root
def test_a_real_trace_holds_our_own_syncs_and_switches() -> None:
    """perf for real (linux-perf, from make test's apt step): enabled once it
    acks, written out at the end, and read back with this thread's writes to
    the disk (a file under build/, on the disk as the bench's databases are)."""
    work = REPO / "build" / "stall-trace-test"
    work.mkdir(parents=True, exist_ok=True)
    path, target = work / "run.perf.data", work / "synced"
    try:
        with KernelTrace(path, buffer="8M"):
            start = time.monotonic()
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            try:
                for _ in range(5):
                    os.write(fd, b"x" * 4096)
                    os.fdatasync(fd)  # blocks in D state: a switch away, a wake-up back
            finally:
                os.close(fd)
            end = time.monotonic()
        trace = read(path, [(start, end)])
    finally:
        for leftover in (path, path.with_suffix(".log"), target):
            leftover.unlink(missing_ok=True)
    me = str(threading.get_native_id())
    assert trace.process_of[me] == str(os.getpid())
    ours = [e for e in trace.sched if isinstance(e, Switch) and e.prev_tid == me]
    assert ours and all(start <= e.at <= end for e in ours)
    written = [(a, b) for a, b, flush in trace.ios if not flush and start <= a <= end]
    assert len(written) >= 5
