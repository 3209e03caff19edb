"""service.systemd.Notifier when systemd does not read: a real datagram socket
standing in for NOTIFY_SOCKET, its queue full as PID 1's is while it is away."""

from __future__ import annotations

import asyncio
import logging
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from service.systemd import Notifier
from tests.support.journald import fill


@pytest.fixture
def systemd() -> Iterator[socket.socket]:
    """A bound socket that reads only when the test says: systemd away until then."""
    # AF_UNIX paths are limited to ~107 bytes; pytest's tmp_path can be longer.
    with tempfile.TemporaryDirectory(prefix="toko-notify-", dir="/tmp") as tmp:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.bind(str(Path(tmp) / "notify"))
        sock.settimeout(5)
        with sock:
            yield sock


@pytest.fixture
def notifier(systemd: socket.socket, monkeypatch: pytest.MonkeyPatch) -> Notifier:
    path = systemd.getsockname()
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    return Notifier(path)


def read_fillers(systemd: socket.socket, count: int) -> None:
    """systemd reads again: first what other programs queued while it was away."""
    for _ in range(count):
        assert systemd.recv(4096) == b"MESSAGE=other"


async def receive(systemd: socket.socket, count: int) -> list[str]:
    """The next ``count`` messages, read off the loop: the notifier's own sends
    run on the loop, which this must leave free."""
    return [(await asyncio.to_thread(systemd.recv, 4096)).decode() for _ in range(count)]


def systemd_lines(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "toko.systemd"]


async def test_while_systemd_is_away_nothing_blocks_and_it_then_reads_what_matters_in_order(
    systemd: socket.socket, notifier: Notifier
) -> None:
    others = fill(systemd)
    # Each call returns at once: on a blocking socket the first one never returns.
    notifier.ready("starting")
    notifier.status("b")
    notifier.watchdog()
    notifier.watchdog()
    notifier.status("c")
    notifier.extend_timeout(3, "d")
    notifier.status("e")
    notifier.watchdog()
    notifier.status("f")
    # READY=1, the first ping and EXTEND_TIMEOUT_USEC= wait in order; "d"
    # replaced "b" and "c", "f" replaced "e"; the later pings were skipped.
    assert notifier.waiting == 4
    assert (notifier.replaced_statuses, notifier.skipped_pings) == (3, 2)

    read_fillers(systemd, others)
    # Sent by the loop as the socket has room again, with no further call.
    assert await receive(systemd, 4) == [
        "READY=1\nSTATUS=starting",
        "WATCHDOG=1",
        "EXTEND_TIMEOUT_USEC=3000000\nSTATUS=d",
        "STATUS=f",
    ]
    assert notifier.waiting == 0
    notifier.status("g")  # and straight through again
    assert await receive(systemd, 1) == ["STATUS=g"]
    await notifier.aclose()


async def test_one_line_when_systemd_stops_reading_and_one_with_the_counts_when_it_reads_again(
    systemd: socket.socket, notifier: Notifier, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="toko.systemd")
    others = fill(systemd)
    notifier.ready("starting")
    for n in range(200):
        notifier.status(f"pending={n}")
        notifier.watchdog()
    away = systemd_lines(caplog)
    assert [r.levelno for r in away] == [logging.WARNING]
    assert "systemd is not reading notifications" in away[0].getMessage()

    read_fillers(systemd, others)
    assert await receive(systemd, 3) == [
        "READY=1\nSTATUS=starting",
        "WATCHDOG=1",
        "STATUS=pending=199",
    ]
    (back,) = systemd_lines(caplog)[1:]
    assert back.levelno == logging.INFO
    assert "199 status updates were replaced by later ones and 199 watchdog pings skipped" in (
        back.getMessage()
    )
    assert (back.REPLACED, back.SKIPPED_PINGS) == (199, 199)  # type: ignore[attr-defined]
    assert (notifier.replaced_statuses, notifier.skipped_pings) == (0, 0)
    await notifier.aclose()


async def test_a_stopping_sent_while_systemd_is_away_goes_out_when_it_reads_again_before_exit(
    systemd: socket.socket, notifier: Notifier, caplog: pytest.LogCaptureFixture
) -> None:
    others = fill(systemd)
    notifier.stopping("finishing requests and running jobs")
    closing = asyncio.create_task(notifier.aclose())
    await asyncio.sleep(0)  # aclose() is waiting for systemd now
    assert not closing.done()
    read_fillers(systemd, others)
    await closing
    assert systemd.recv(4096) == b"STOPPING=1\nSTATUS=finishing requests and running jobs"
    assert not any("not sent" in r.getMessage() for r in systemd_lines(caplog))
    assert not notifier.enabled


async def test_the_exit_waits_its_default_two_seconds_for_systemd_then_says_what_was_not_sent(
    systemd: socket.socket, notifier: Notifier, caplog: pytest.LogCaptureFixture
) -> None:
    fill(systemd)
    notifier.stopping("bye")
    notifier.extend_timeout(3, "closing the store")
    started = time.monotonic()
    await notifier.aclose()  # at its default, as toko-api runs it
    waited = time.monotonic() - started
    assert Notifier.FLUSH_TIMEOUT_S == 2.0
    assert 2.0 <= waited < 4.0
    (line,) = [r for r in systemd_lines(caplog) if "not sent" in r.getMessage()]
    assert line.getMessage() == (
        "systemd did not read notifications within 2 s of exit;"
        " not sent: STOPPING=1, EXTEND_TIMEOUT_USEC=3000000"
    )
    assert not notifier.enabled
    notifier.status("after close")  # a no-op, as outside systemd


def test_without_an_event_loop_what_waits_goes_out_with_the_next_message(
    systemd: socket.socket, notifier: Notifier
) -> None:
    others = fill(systemd)
    notifier.ready("starting")
    assert notifier.waiting == 1
    read_fillers(systemd, others)
    notifier.status("next")
    assert [systemd.recv(4096) for _ in range(2)] == [b"READY=1\nSTATUS=starting", b"STATUS=next"]
    assert notifier.waiting == 0
    asyncio.run(notifier.aclose())
