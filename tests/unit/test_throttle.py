"""Throttle: a repeating failure is logged once per interval, with a count of the rest."""

from __future__ import annotations

import logging

import pytest

from service.logs import Throttle


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
