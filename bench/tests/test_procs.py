"""bench.procs.Managed.stop on a real process that ignores SIGTERM."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from bench.procs import cpu_probe, managed

HANGS = """
import signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
def stuck_in_shutdown():
    with open(sys.argv[1], "w") as ready:
        ready.write("ready")
    while True:
        time.sleep(0.05)
stuck_in_shutdown()
"""


def test_a_process_ignoring_sigterm_is_killed_with_its_stacks_saved(tmp_path: Path) -> None:
    log = tmp_path / "hangs.log"
    fifo = tmp_path / "ready"
    os.mkfifo(fifo)
    cmd = [sys.executable, "-c", HANGS, str(fifo)]
    with managed("hangs", cmd, log_path=log, stop_timeout=1) as p:
        # Blocks until the child has its handler in place and says so.
        assert fifo.read_text() == "ready"
    assert p.killed and p.proc.returncode == -signal.SIGKILL
    stacks = log.with_name("hangs.log.stacks").read_text()
    assert "stuck_in_shutdown" in stacks


def test_the_cpu_probe_gives_time_per_iteration() -> None:
    short = cpu_probe(rounds=3, iterations=200)
    assert 0 < short["min_us"] <= short["median_us"] <= short["max_us"]
    # Per iteration, so the count of iterations must not change the figure much;
    # a probe that timed the whole round instead would be 50 times larger here.
    longer = cpu_probe(rounds=3, iterations=10000)
    assert longer["median_us"] < 10 * short["median_us"]
