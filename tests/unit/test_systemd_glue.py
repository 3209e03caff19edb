from __future__ import annotations

import json
import logging
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from service.logs import JsonLineFormatter
from service.systemd import Notifier


@pytest.fixture
def notify_socket(tmp_path: Path) -> Iterator[tuple[str, socket.socket]]:
    path = str(tmp_path / "notify")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(5)
    yield path, sock
    sock.close()


@pytest.fixture
def notified(
    notify_socket: tuple[str, socket.socket], monkeypatch: pytest.MonkeyPatch
) -> tuple[Notifier, socket.socket]:
    """A Notifier for NOTIFY_SOCKET, and the socket its messages arrive on."""
    path, sock = notify_socket
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    return Notifier(path), sock


async def test_notifier_sends_ready_watchdog_stopping(
    notified: tuple[Notifier, socket.socket],
) -> None:
    notifier, sock = notified
    notifier.ready("pending=0")
    notifier.watchdog()
    notifier.extend_timeout(3, "draining")
    notifier.stopping("bye")
    await notifier.aclose()
    received = [sock.recv(4096).decode() for _ in range(4)]
    assert received == [
        "READY=1\nSTATUS=pending=0",
        "WATCHDOG=1",
        "EXTEND_TIMEOUT_USEC=3000000\nSTATUS=draining",
        "STOPPING=1\nSTATUS=bye",
    ]


async def test_a_status_in_any_script_arrives_as_utf8_with_its_ready(
    notified: tuple[Notifier, socket.socket],
) -> None:
    # sdnotify's own notify() encodes Latin-1: Cyrillic lost the whole
    # message, READY=1 with it, and "é" arrived as a byte systemd refuses.
    notifier, sock = notified
    for status in ("cannot write: /srv/данные/toko.db", "cannot write: /srv/café/toko.db"):
        notifier.ready(status)
        assert sock.recv(4096) == f"READY=1\nSTATUS={status}".encode()
    await notifier.aclose()


async def test_a_status_with_line_breaks_is_one_assignment(
    notified: tuple[Notifier, socket.socket],
) -> None:
    # A store error's text goes into STATUS=; a line break in it started
    # another assignment of the notify message.
    notifier, sock = notified
    notifier.status("store unavailable: failed\nWATCHDOG=1\r\ndetail")
    await notifier.aclose()
    assert sock.recv(4096) == b"STATUS=store unavailable: failed WATCHDOG=1 detail"


async def test_notifier_is_a_no_op_outside_systemd() -> None:
    notifier = Notifier(None)
    assert not notifier.enabled
    notifier.ready("x")  # must not raise
    await notifier.aclose()


def test_json_lines_carry_structured_fields() -> None:
    record = logging.LogRecord("toko.worker", logging.INFO, __file__, 1, "job %s", ("ok",), None)
    record.JOB_ID = 7
    record.WORKER = "worker-1"
    line = json.loads(JsonLineFormatter().format(record))
    assert line["message"] == "job ok"
    assert line["level"] == "INFO"
    assert (line["JOB_ID"], line["WORKER"]) == (7, "worker-1")
    assert line["ts"].endswith("Z")


def _journal_entry(record: logging.LogRecord) -> tuple[str, dict[str, object]]:
    """(MESSAGE, fields) that toko's journal handler sends for ``record``."""
    from service.logs import StructuredJournalHandler

    sent: list[tuple[str, dict[str, object]]] = []

    def send(message: str, **fields: object) -> None:  # stands in for sd_journal_send
        sent.append((message, fields))

    handler = StructuredJournalHandler(sender_function=send, SYSLOG_IDENTIFIER="toko-api")
    handler.setFormatter(logging.Formatter("%(message)s"))
    handler.emit(record)
    ((message, fields),) = sent
    return message, fields


def test_journal_entries_carry_only_our_fields() -> None:
    record = logging.LogRecord("toko.worker", logging.ERROR, __file__, 1, "job %s", ("x",), None)
    record.JOB_ID = 7
    record.lower = "dropped"
    message, fields = _journal_entry(record)
    assert message == "job x"
    assert fields["SYSLOG_IDENTIFIER"] == "toko-api"
    assert fields["JOB_ID"] == 7
    assert fields["PRIORITY"] == "3"
    assert all(key.isupper() for key in fields)


def test_journal_messages_say_why_a_job_failed() -> None:
    # journalctl shows MESSAGE alone: the reason must be in it, not only in ERROR.
    record = logging.LogRecord(
        "toko.worker", logging.WARNING, __file__, 1, "job failed, will retry", (), None
    )
    record.ERROR = "SMTPRecipientsRefused: 450 mailbox busy"
    message, fields = _journal_entry(record)
    assert message == "job failed, will retry: SMTPRecipientsRefused: 450 mailbox busy"
    assert fields["ERROR"] == "SMTPRecipientsRefused: 450 mailbox busy"
