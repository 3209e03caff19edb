"""Throttle: a repeating failure is logged once per interval, with a count of the rest."""

from __future__ import annotations

import asyncio
import errno
import logging
import os
from collections.abc import Iterator

import pytest

from service.logs import LoopErrorThrottle, Throttle


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


LOG = logging.getLogger("toko.test.throttle")


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def throttle(clock: Clock) -> Throttle:
    return Throttle(10.0, clock)


def test_first_line_at_once_then_one_per_interval_with_the_count(
    caplog: pytest.LogCaptureFixture, clock: Clock, throttle: Throttle
) -> None:
    log = LOG
    with caplog.at_level(logging.ERROR, logger=log.name):
        for _ in range(500):
            throttle.log(log, logging.ERROR, "storage failure: %s", "disk full", PATH="/produk")
        clock.now += 9.9
        throttle.log(log, logging.ERROR, "storage failure: %s", "disk full", PATH="/produk")
        assert len(caplog.records) == 1
        clock.now += 0.1
        throttle.log(log, logging.ERROR, "storage failure: %s", "disk full", PATH="/produk")

    first, second = caplog.records
    assert first.getMessage() == "storage failure: disk full"
    assert first.__dict__["PATH"] == "/produk"
    assert "SUPPRESSED" not in first.__dict__
    assert second.getMessage() == (
        "storage failure: disk full (500 more like this in the 10 s before were not logged)"
    )
    assert second.__dict__["SUPPRESSED"] == 500
    assert second.levelno == logging.ERROR


def test_after_a_quiet_interval_the_next_failure_is_logged_plainly(
    caplog: pytest.LogCaptureFixture, clock: Clock, throttle: Throttle
) -> None:
    log = LOG
    with caplog.at_level(logging.WARNING, logger=log.name):
        throttle.log(log, logging.WARNING, "connection lost")
        clock.now += 60
        throttle.log(log, logging.WARNING, "connection lost")
    assert [r.getMessage() for r in caplog.records] == ["connection lost", "connection lost"]
    assert all("SUPPRESSED" not in r.__dict__ for r in caplog.records)


@pytest.fixture
def loop(clock: Clock) -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    loop.set_exception_handler(LoopErrorThrottle(10.0, clock))
    yield loop
    loop.close()


def _accept_failed() -> dict[str, object]:
    # What Python's accept loop reports at the open-files limit.
    return {
        "message": "socket.accept() out of system resource",
        "exception": OSError(errno.EMFILE, os.strerror(errno.EMFILE)),
    }


def test_event_loop_errors_that_repeat_are_logged_once_per_interval(
    caplog: pytest.LogCaptureFixture, clock: Clock, loop: asyncio.AbstractEventLoop
) -> None:
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        for _ in range(1000):
            loop.call_exception_handler(_accept_failed())
        # Another error is not held back by the first one's flood.
        loop.call_exception_handler(
            {"message": "Exception in callback", "exception": ValueError("Invalid fd: -1")}
        )
        loop.call_exception_handler({"message": "Task was destroyed but it is pending!"})
        loop.call_exception_handler({"message": "Task was destroyed but it is pending!"})
        clock.now += 10
        loop.call_exception_handler(_accept_failed())

    messages = [r.getMessage() for r in caplog.records]
    assert messages == [
        "socket.accept() out of system resource",
        "Exception in callback",
        "Task was destroyed but it is pending!",
        "socket.accept() out of system resource"
        " (999 more like this in the 10 s before were not logged)",
    ]
    # Logged as asyncio's own handler logs them: with the exception's traceback.
    first = caplog.records[0]
    assert first.exc_info is not None and first.exc_info[1] is not None
    assert first.exc_info[1].errno == errno.EMFILE
