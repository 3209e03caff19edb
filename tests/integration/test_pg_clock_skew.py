"""A host whose clock strays from the database server's is told so.

Leases and retry times are each host's wall clock, compared on every host: a
host far behind writes leases the others see as already expired.
"""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from service.store.postgres import PostgresStore, notifications
from tests.support.postgres import PostgresCluster


class OffsetClock:
    """This host's clock, ``offset`` seconds off (the one thing mocked here)."""

    def __init__(self, offset: float) -> None:
        self.offset = offset

    def __call__(self) -> float:
        return time.time() + self.offset


class SkewRighted(logging.Handler):
    """Sets ``event`` at the line saying the clock is right again (logged on the loop)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.event = asyncio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if hasattr(record, "CLOCK_SKEW_SECONDS") and record.levelno == logging.INFO:
            self.event.set()


def skew_lines(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if hasattr(r, "CLOCK_SKEW_SECONDS")]


@pytest.mark.parametrize("offset", [-60.0, 0.0, 60.0])
async def test_a_clock_off_by_a_minute_is_named_at_open(
    pg_cluster: PostgresCluster, pg_url: str, caplog: pytest.LogCaptureFixture, offset: float
) -> None:
    store = PostgresStore(pg_url, password=pg_cluster.password, clock=OffsetClock(offset))
    with caplog.at_level(logging.INFO, "toko.store"):
        await store.open()
    await store.close()
    if offset == 0.0:
        assert skew_lines(caplog) == []  # a clock in sync says nothing
        return
    (line,) = skew_lines(caplog)
    assert line.levelno == logging.WARNING
    assert abs(line.CLOCK_SKEW_SECONDS - offset) < 2, line.CLOCK_SKEW_SECONDS
    assert "keep them in sync (NTP)" in line.getMessage()


async def test_the_listen_probe_notices_a_clock_put_right(
    pg_cluster: PostgresCluster,
    pg_url: str,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(notifications, "LISTEN_PROBE_SECONDS", 0.05)
    clock = OffsetClock(-60.0)
    store = PostgresStore(pg_url, password=pg_cluster.password, clock=clock)
    righted_seen = SkewRighted()
    logging.getLogger("toko.store").addHandler(righted_seen)
    try:
        with caplog.at_level(logging.INFO, "toko.store"):
            await store.open()
            try:
                clock.offset = 0.0  # NTP stepped it
                store.add_wakeup_listener(lambda: None)  # starts the LISTEN task and its probe
                async with asyncio.timeout(10):
                    await righted_seen.event.wait()
            finally:
                await store.close()
    finally:
        logging.getLogger("toko.store").removeHandler(righted_seen)
    warned, righted = skew_lines(caplog)[:2]
    assert warned.levelno == logging.WARNING
    assert righted.levelno == logging.INFO, righted.getMessage()
    assert "agrees with the database server's again" in righted.getMessage()
