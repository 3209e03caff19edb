"""service.journal.JournalSender against a real datagram socket standing in for journald's."""

from __future__ import annotations

import array
import gc
import logging
import os
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from service.journal import JournalSender
from service.logs import StructuredJournalHandler
from tests.support.journald import fill


@pytest.fixture
def journald() -> Iterator[socket.socket]:
    """A bound socket that reads only when the test says: journald stopped until then."""
    # AF_UNIX paths are limited to ~107 bytes; pytest's tmp_path can be longer.
    with tempfile.TemporaryDirectory(prefix="toko-journal-", dir="/tmp") as tmp:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.bind(str(Path(tmp) / "socket"))
        with sock:
            yield sock


def read_waiting(sock: socket.socket) -> list[bytes]:
    entries = []
    while True:
        try:
            entries.append(sock.recv(1 << 20, socket.MSG_DONTWAIT))
        except BlockingIOError:
            return entries


def message(entry: bytes) -> str:
    return entry.decode().split("\n", 1)[0].removeprefix("MESSAGE=")


def test_lines_beyond_the_backlog_are_dropped_counted_and_reported(
    journald: socket.socket,
) -> None:
    sender = JournalSender(journald.getsockname(), max_backlog=5)
    for n in range(50):  # never blocks, whatever journald does
        sender(f"line {n}", SYSLOG_IDENTIFIER="toko-api")
    assert sender.backlog == 5
    received = read_waiting(journald)
    while sender.backlog:  # journald reads again
        sender.send_backlog()
        received += read_waiting(journald)
    sender("after", SYSLOG_IDENTIFIER="toko-api")
    received += read_waiting(journald)
    sender.close()

    kept = len(received) - 2
    assert [message(e) for e in received[:kept]] == [f"line {n}" for n in range(kept)]
    notice, after = received[kept:]
    assert message(notice) == f"{50 - kept} log lines were dropped: the journal did not take them"
    assert f"\nDROPPED={50 - kept}\n".encode() in notice
    assert b"\nPRIORITY=4\n" in notice and b"\nSYSLOG_IDENTIFIER=toko-api\n" in notice
    assert message(after) == "after"


def test_the_exit_waits_for_journald_then_says_on_stderr_what_it_lost(
    journald: socket.socket, capfd: pytest.CaptureFixture[str]
) -> None:
    sender = JournalSender(journald.getsockname(), flush_timeout=0.5)
    others = fill(journald)
    sender("last words")

    def journald_reads_again() -> None:
        for _ in range(others):
            journald.recv(1 << 20)

    reader = threading.Timer(0.1, journald_reads_again)
    reader.start()
    sender.flush()
    reader.join()
    assert [message(e) for e in read_waiting(journald)] == ["last words"]
    assert capfd.readouterr().err == ""

    fill(journald)  # and stops reading for good
    sender("lost 1")
    sender("lost 2")
    started = time.monotonic()
    sender.flush()
    assert time.monotonic() - started >= 0.5
    assert capfd.readouterr().err == (
        "2 log lines were lost: the journal did not take them within 0.5 s of exit\n"
    )
    assert sender.backlog == 0
    sender.close()


def test_stop_waiting_ends_the_exit_wait_at_once_and_the_loss_is_still_counted(
    journald: socket.socket, capfd: pytest.CaptureFixture[str]
) -> None:
    sender = JournalSender(journald.getsockname(), flush_timeout=30)
    fill(journald)  # journald stopped reading, and does not read again
    sender("lost")
    stopper = threading.Timer(0.1, sender.stop_waiting)  # a SIGTERM's handler, say
    started = time.monotonic()
    stopper.start()
    sender.flush()
    stopper.join()
    assert time.monotonic() - started < 5
    assert capfd.readouterr().err == (
        "1 log lines were lost: the journal did not take them before the program was stopped"
        " at exit\n"
    )
    assert sender.backlog == 0
    sender.close()


def test_a_journald_that_is_not_there_costs_the_line_not_an_exception(tmp_path: Path) -> None:
    sender = JournalSender(str(tmp_path / "no-socket"))
    sender("lost")
    assert sender.backlog == 1
    sender.close()


def test_values_with_line_breaks_and_entries_too_large_for_a_datagram(
    journald: socket.socket,
) -> None:
    sender = JournalSender(journald.getsockname())
    sender("job failed", EXCEPTION_TEXT="Traceback\n  boom")
    assert journald.recv(1 << 20) == (
        b"MESSAGE=job failed\nEXCEPTION_TEXT\n"
        + (16).to_bytes(8, "little")
        + b"Traceback\n  boom\n"
    )
    # Larger than any datagram: sent as a sealed memfd, as libsystemd does.
    sender._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    sender("big", BODY="x" * 100_000)
    data, ancdata, _, _ = journald.recvmsg(16, socket.CMSG_SPACE(4))
    assert data == b""
    ((_, _, raw_fd),) = ancdata
    fd = array.array("i", raw_fd)[0]
    try:
        assert os.pread(fd, 20, 0) == b"MESSAGE=big\nBODY=xxx"
        assert os.fstat(fd).st_size == len(b"MESSAGE=big\nBODY=\n") + 100_000
    finally:
        os.close(fd)
    sender.close()


class Abandoned:
    """Stands for an asyncio task destroyed pending: its finalizer logs."""

    def __init__(self, log: logging.Logger) -> None:
        self.log = log
        self.cycle = self  # freed by the garbage collector only

    def __del__(self) -> None:
        self.log.error("abandoned")


def journal_logger(sender: JournalSender, name: str) -> logging.Logger:
    handler = StructuredJournalHandler(sender_function=sender, SYSLOG_IDENTIFIER="toko-api")
    handler.setFormatter(logging.Formatter("%(message)s"))
    log = logging.getLogger(name)
    log.addHandler(handler)
    log.propagate = False
    log.setLevel(logging.INFO)
    return log


def run_briefly(target: Callable[[], None]) -> None:
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    # A deadlocked thread never ends: the limit only has to stay below the
    # test's own (120 s), far from what a loaded machine takes.
    thread.join(timeout=60)
    assert not thread.is_alive(), "logging deadlocked"


def everything_sent(sender: JournalSender, journald: socket.socket) -> list[str]:
    """The messages of all entries, journald reading again."""
    received = read_waiting(journald)
    while sender.backlog:
        sender.send_backlog()
        received += read_waiting(journald)
    sender.close()
    return [message(e) for e in received]


def test_a_line_a_finalizer_logs_during_a_send_is_queued_not_a_deadlock(
    journald: socket.socket,
) -> None:
    """asyncio logs from finalizers ("Task was destroyed but it is pending!"), and
    the garbage collector runs them at whatever allocation it is at: also inside a
    send, such as the error a busy journald returns. That froze the thread for good,
    and every thread that logged after it (the event loop: the watchdog's abort)."""
    sender = JournalSender(journald.getsockname())
    log = journal_logger(sender, "toko.test.finalizer")

    def collect_at_every_point_of_a_send() -> None:
        threshold = gc.get_threshold()
        gc.set_threshold(100)
        # Out of the collections below: what the test session holds already.
        # 100 full collections walked its whole heap, over 10 s on a busy machine.
        gc.freeze()
        try:
            for allocations in range(100):
                gc.collect()  # the next collection: after 100 allocations
                Abandoned(log)
                _ = [[] for _ in range(allocations)]
                log.info("line %d", allocations)
        finally:
            gc.unfreeze()
            gc.set_threshold(*threshold)

    for n in range(20):  # journald busy: its queue fills, sends fail until it reads
        log.info("before %d", n)
    run_briefly(collect_at_every_point_of_a_send)

    messages = everything_sent(sender, journald)
    assert messages.count("abandoned") == 100
    lines = [m for m in messages if m != "abandoned"]
    assert lines == [f"before {n}" for n in range(20)] + [f"line {n}" for n in range(100)]


GARBAGE_MAX = JournalSender.MAX_BACKLOG // 2


def test_a_finalizer_the_retry_thread_runs_does_not_deadlock_the_thread_logging(
    journald: socket.socket,
) -> None:
    """The retry thread holds the sender's lock while it sends; a finalizer it runs
    then logs, waiting for the handler's lock, which a thread that logs holds while
    it waits for the sender's."""
    sender = JournalSender(journald.getsockname())
    sender.RETRY_S = 0  # the retry thread sends as often as it can
    log = journal_logger(sender, "toko.test.retry-finalizer")
    for n in range(20):  # journald busy: the retry thread keeps trying
        log.info("before %d", n)
    leaving_garbage = True

    def leave_garbage() -> None:  # a thread that logs nothing itself
        # Each object logs once; capped so that with the 3,020 lines below the
        # backlog never reaches its limit, however fast this thread runs.
        for _ in range(GARBAGE_MAX):
            if not leaving_garbage:
                return
            Abandoned(log)
            time.sleep(0)

    def log_lines() -> None:
        for n in range(3000):
            log.info("line %d", n)

    threshold = gc.get_threshold()
    gc.set_threshold(5)  # collections in every thread, the retry thread too
    garbage_thread = threading.Thread(target=leave_garbage, daemon=True)
    garbage_thread.start()
    try:
        run_briefly(log_lines)
    finally:
        leaving_garbage = False
        garbage_thread.join()
        gc.set_threshold(*threshold)

    gc.collect()
    messages = everything_sent(sender, journald)
    lines = [m for m in messages if m != "abandoned"]
    assert lines == [f"before {n}" for n in range(20)] + [f"line {n}" for n in range(3000)]
