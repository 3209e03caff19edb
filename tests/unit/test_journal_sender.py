"""service.logs.JournalSender against a real datagram socket standing in for journald's."""

from __future__ import annotations

import array
import os
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from service.logs import JournalSender


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
        sender.flush(timeout=0)
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
