"""toko-api while systemd does not read its notifications (PID 1 busy in a
long daemon-reload, stuck, or behind a container manager): it must go on
serving and running jobs, and systemd must then read what matters.

A real toko-api with NOTIFY_SOCKET on a real AF_UNIX datagram socket that
stops reading the moment READY=1 arrives, its queue full from then on
(tests.support.notify: away_after_ready).
"""

from __future__ import annotations

import asyncio
import re
import time

import aiohttp
import pytest

from tests.conftest import ServiceFactory
from tests.support.api import create_products
from tests.support.notify import Notification, away_after_ready
from tests.support.service import ServiceProcess
from tests.support.smtp import SmtpServer

STATUS_RE = re.compile(r"pending=\d+ running=\d+ failed=\d+ workers=3/3")
AWAY_SECONDS = 120.0
# Between two requests of each kind while systemd is away.
PACE_SECONDS = 0.25
# Well above an answer's few milliseconds here, far below the client's 5 s:
# an event loop blocked on the notify socket misses it by seconds.
PROMPT_SECONDS = 1.0
WATCHDOG_USEC = 2_000_000  # a ping every second, each one finding no room


def away_at_ready(svc: ServiceProcess) -> None:
    assert svc.notify is not None
    svc.notify.hooks.append(away_after_ready(svc.notify))


async def timed(session: aiohttp.ClientSession, method: str, url: str, **kw: object) -> float:
    started = time.monotonic()
    async with session.request(method, url, **kw) as resp:  # type: ignore[arg-type]
        await resp.read()
        assert resp.status in (200, 201), (method, url, resp.status)
    return time.monotonic() - started


async def serve_while_away(svc: ServiceProcess, seconds: float) -> tuple[list[float], int]:
    """POST /produk and GET /healthz every PACE_SECONDS for ``seconds``; their
    latencies and how many products were made."""
    latencies: list[float] = []
    made = 0
    timeout = aiohttp.ClientTimeout(total=5)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            body = {"nama": f"Barang {made}", "harga": 1000 + made}
            latencies.append(await timed(session, "POST", svc.url("/produk"), json=body))
            made += 1
            latencies.append(await timed(session, "GET", svc.url("/healthz")))
            await asyncio.sleep(PACE_SECONDS)  # pacing, not waiting for anything
    return latencies, made


def sent_after(notes: list[Notification], since: float) -> list[Notification]:
    return [n for n in notes if n.at >= since]


@pytest.mark.waits
@pytest.mark.timeout(AWAY_SECONDS + 120)
async def test_two_minutes_without_systemd_reading_serve_and_run_jobs_then_it_reads_the_latest(
    service_factory: ServiceFactory, smtp: SmtpServer
) -> None:
    svc = service_factory({"TOKO_SMTP_URL": smtp.url}, watchdog_usec=WATCHDOG_USEC)
    away_at_ready(svc)
    svc.start()
    ready = await svc.async_wait_ready(timeout=20)
    assert svc.notify is not None

    latencies, made = await serve_while_away(svc, AWAY_SECONDS)
    slowest = max(latencies)
    assert slowest < PROMPT_SECONDS, f"an answer took {slowest:.2f} s while systemd was away"
    # Jobs kept running: every product's email arrives while systemd is still away.
    await smtp.async_wait_delivered(made, timeout=30)
    assert svc.notify.service_messages(since=ready.at + 0.001) == []
    assert svc.find_logs(
        "systemd is not reading notifications; they wait (the latest status, one"
        " watchdog ping) and go out when it reads again"
    )

    back = svc.notify.back()
    back_line = await svc.logs.async_wait_for(
        lambda xs: next((r for r in xs if "REPLACED" in r), None),
        timeout=10,
        what="the line that says systemd reads again",
    )
    # Nothing must-keep was pending; the latest STATUS= and one ping were, so
    # the first two of toko-api's messages are those two, sent the moment
    # there was room.
    first = await svc.notify.log.async_wait_for(
        lambda xs: (s := svc.notify.service_messages(since=back)) and len(s) >= 2 and s,
        timeout=10,
        what="two messages after systemd reads again",
    )
    assert sorted(next(iter(n.fields)) for n in first[:2]) == ["STATUS", "WATCHDOG"], first
    (status,) = [n for n in first[:2] if "STATUS" in n.fields]
    assert STATUS_RE.fullmatch(status.fields["STATUS"]), status
    # About one status every 5 s and one ping a second were replaced or skipped.
    assert back_line["REPLACED"] >= AWAY_SECONDS / 5 - 3, back_line
    assert back_line["SKIPPED_PINGS"] >= AWAY_SECONDS - 10, back_line

    svc.terminate()
    assert await svc.async_wait_exit(timeout=20) == 0


async def test_a_stop_while_systemd_is_away_is_read_when_it_comes_back_and_the_exit_is_clean(
    service_factory: ServiceFactory, smtp: SmtpServer
) -> None:
    smtp.set_delay(3.0)  # one email in flight keeps the drain going
    svc = service_factory(
        {"TOKO_SMTP_URL": smtp.url, "TOKO_WORKERS": "1", "TOKO_DRAIN_TIMEOUT": "10"},
        watchdog_usec=WATCHDOG_USEC,
    )
    away_at_ready(svc)
    svc.start()
    await svc.async_wait_ready(timeout=20)
    assert svc.notify is not None
    async with aiohttp.ClientSession() as session:
        await create_products(session, svc.base_url, ["Satu"])
    await smtp.arrivals.async_wait_for(lambda xs: xs, timeout=10, what="an email in flight")

    term_at = time.monotonic()
    svc.terminate()
    await svc.async_wait_log("stopping", timeout=5)  # STOPPING=1 is waiting now
    back = svc.notify.back()
    stopping = await svc.notify.async_wait_for_field("STOPPING", "1", timeout=5, since=back)
    extend = await svc.notify.async_wait_for_field(
        "EXTEND_TIMEOUT_USEC", timeout=10, since=stopping.at
    )
    assert await svc.async_wait_exit(timeout=15) == 0
    assert time.monotonic() - term_at < 10, "the exit took longer than the drain timeout"
    assert len(smtp.delivered()) == 1  # the email in flight was finished first
    # In order: a ping and a status may have waited before the stop; nothing after
    # STOPPING=1 is older than it, and nothing was left unsent at exit.
    sent = svc.notify.service_messages(since=back)
    keys = [next(iter(n.fields)) for n in sent]
    assert keys.index("STOPPING") < keys.index("EXTEND_TIMEOUT_USEC"), keys
    assert extend.at >= stopping.at
    assert not any("not sent" in str(r.get("message")) for r in svc.logs.snapshot())
