"""``toko-recap``: record a period's product figures once and email them.

Started daily by toko-recap.timer. Without --period a run recaps every day
since the last recorded one up to yesterday (at most CATCH_UP_DAYS): the
timer's Persistent=true starts one run however many days the host was off,
and a run whose random delay pushes it past midnight must not skip a day.
The recap row is keyed by period, so a second run for the same period (a
re-run, a catch-up, another host) changes nothing and says so. Each run then
prunes done jobs older than TOKO_JOB_RETENTION (jobs.retention), so the daily
timer bounds the database. A stop (SIGTERM) ends a run between days: the
day under way commits, the next run records the rest.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Iterator
from datetime import date, datetime, timedelta

from jobs.common import (
    JobFailed,
    Stopped,
    add_version,
    require_database,
    run_job,
    stop_on_sigterm,
)
from jobs.retention import prune_done_jobs
from jobs.textfile import reported
from service.settings import ToolSettings
from service.store import open_store
from service.store.base import StoreError
from service.store.roles import Store
from service.tasks import recap_email_job

log = logging.getLogger("toko.recap")
# How far back a late run catches up, one recap email per day. A week covers
# a host off over a long holiday without a month of emails arriving at once;
# an older day can still be recorded by hand with --period.
CATCH_UP_DAYS = 7


def parse_period(text: str) -> date:
    try:
        day = date.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a date like 2026-11-28: {text!r}") from None
    try:
        # The first and last days datetime can name have no day after them
        # or no local midnight before them: refused here, not a traceback later.
        period_bounds(day)
    except (ValueError, OverflowError):
        raise argparse.ArgumentTypeError(f"out of range: {text!r}") from None
    return day


def require_ended(day: date, today: date) -> None:
    """Refuse a day that is not over: its recap would lock in partial figures for good."""
    if day >= today:
        after = day + timedelta(days=1)
        raise JobFailed(
            f"{day} has not ended yet (today is {today} here); recap it from {after} on"
        )


def period_bounds(day: date) -> tuple[float, float]:
    """[start, end) of a calendar day in the host's time zone, as epoch seconds."""
    start = datetime.combine(day, datetime.min.time()).astimezone()
    end = datetime.combine(day + timedelta(days=1), datetime.min.time()).astimezone()
    return start.timestamp(), end.timestamp()


def days_to_recap(last: date | None, today: date) -> list[date]:
    """The days a run on ``today`` recaps, oldest first, given the ``last`` one recorded.

    Every day after ``last`` up to yesterday, at most CATCH_UP_DAYS of them;
    always yesterday (if it is recorded already, the run says so). Nothing recorded
    yet: yesterday only, not the days before toko was installed.
    """
    yesterday = today - timedelta(days=1)
    if last is None:
        return [yesterday]
    first = min(max(last + timedelta(days=1), today - timedelta(days=CATCH_UP_DAYS)), yesterday)
    return [first + timedelta(days=n) for n in range((yesterday - first).days + 1)]


async def _days_due(store: Store, today: date) -> list[date]:
    # Before today: a row for today or later (a host whose clock ran ahead)
    # must not hide the days in between.
    last = await store.last_recap_before(today.isoformat())
    last_day = None if last is None else date.fromisoformat(last)
    days = days_to_recap(last_day, today)
    if last_day is not None and days[0] > last_day + timedelta(days=1):
        skipped = (last_day + timedelta(days=1), days[0] - timedelta(days=1))
        log.warning(
            "no recap for %s to %s: more than %d days ago, too late to catch up;"
            " toko-recap --period DAY records one",
            *skipped,
            CATCH_UP_DAYS,
            extra={"PERIOD_FIRST": skipped[0].isoformat(), "PERIOD_LAST": skipped[1].isoformat()},
        )
    return days


async def _shared_today(store: Store, today: date) -> date:
    """``today``, or the database server's today where that is earlier.

    A host whose clock runs ahead (its timer firing "at 00:10" at 23:55, or
    before NTP steps the clock back) would recap a day that is not over for
    the other hosts: its partial figures kept for good, since the real run
    finds the day recorded. On SQLite toko-api stamps products with this
    host's clock too, so this host's day is the one to go by.
    """
    shared_time = await store.database_time()
    if shared_time is None:
        return today
    shared = datetime.fromtimestamp(shared_time).astimezone().date()
    if shared >= today:
        return today
    log.warning(
        "this host's date is %s but the database server's is %s: recapping only days"
        " over there; keep the clocks in sync (NTP)",
        today,
        shared,
        extra={"HOST_DATE": today.isoformat(), "DATABASE_DATE": shared.isoformat()},
    )
    return shared


async def _record_day(store: Store, settings: ToolSettings, day: date) -> tuple[int | None, int]:
    """The day's email job id (None: recorded already) and its new products."""
    start, end = period_bounds(day)
    total, new = await store.product_counts(start, end)
    job = recap_email_job(day.isoformat(), total, new, settings.jobs.max_attempts)
    job_id = await store.record_recap(day.isoformat(), total, new, job)
    fields = {"PERIOD": day.isoformat(), "PRODUCTS_TOTAL": total, "PRODUCTS_NEW": new}
    if job_id is None:
        log.info("recap already recorded for this period; nothing to do", extra=fields)
    else:
        log.info("recap recorded", extra={**fields, "JOB_ID": job_id})
    return job_id, new


class _StopBetweenDays:
    """SIGTERM during a run (systemctl stop, the unit's TimeoutStartSec=, a shutdown).

    Its default action ended the run on the spot, and nothing said which days
    were recorded. A day's recap is one transaction: the one under way
    commits, then the run ends. Anything else (waiting for the database,
    reading, pruning in chunks that each commit) is cut short at once.
    """

    def __init__(self) -> None:
        self.requested = False
        self._recording = False
        self._task = asyncio.current_task()

    @contextlib.contextmanager
    def handling_sigterm(self) -> Iterator[None]:
        loop = asyncio.get_running_loop()
        previous = signal.getsignal(signal.SIGTERM)
        loop.add_signal_handler(signal.SIGTERM, self._on_sigterm)
        try:
            yield
        finally:
            # remove_signal_handler() leaves SIGTERM's default: ending on the spot.
            loop.remove_signal_handler(signal.SIGTERM)
            signal.signal(signal.SIGTERM, previous)

    def _on_sigterm(self) -> None:
        if self.requested:
            return  # a second SIGTERM must not cut the store's close short
        self.requested = True
        if not self._recording and self._task is not None:
            self._task.cancel()

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        self._recording = True
        try:
            yield
        finally:
            self._recording = False


def _what_was_done(days: list[date] | None, recorded: dict[date, int | None]) -> str:
    """The end of the line a stopped run logs: which days it recorded, which not."""
    if days is None:
        return "nothing recorded"
    done = ", ".join(day.isoformat() for day in recorded) or "nothing"
    left = [day.isoformat() for day in days if day not in recorded]
    if left:
        return f"recorded: {done}; not recorded: {', '.join(left)}"
    return f"recorded: {done}; pruning of done jobs left to the next run"


async def record(
    settings: ToolSettings,
    period: date | None,
    today: date,
    now: float | None = None,
    new_products: dict[date, int] | None = None,
) -> dict[date, int | None]:
    """Record ``period``'s recap, or else each day due (days_to_recap), once each.

    Then prune done jobs older than the retention. Returns each day's email
    job id, None where the day was recorded already; ``new_products`` gets
    the new products of each day this run recorded. A SIGTERM raises
    Stopped, saying which days were recorded (see _StopBetweenDays).
    """
    stop = _StopBetweenDays()
    days: list[date] | None = None
    recorded: dict[date, int | None] = {}
    with stop.handling_sigterm():
        try:
            store = open_store(settings, application_name="toko-recap")
            await store.open()
            try:
                today = await _shared_today(store, today)
                if period:
                    require_ended(period, today)
                days = [period] if period else await _days_due(store, today)
                for day in days:
                    with stop.recording():
                        recorded[day], new = await _record_day(store, settings, day)
                    if recorded[day] is not None and new_products is not None:
                        new_products[day] = new
                    if stop.requested:
                        raise Stopped(_what_was_done(days, recorded))
                # After the recaps, so a pruning problem never costs a period its recap.
                await prune_done_jobs(store, settings.jobs.retention, now or time.time())
            finally:
                await store.close()
        except asyncio.CancelledError:
            if not stop.requested:
                raise
            raise Stopped(_what_was_done(days, recorded)) from None
    return recorded


# The run's own figures in its report to node_exporter (jobs.textfile).
REPORT_FIGURES = {
    "days_recorded": "Days the last successful run recorded; 0: every day due was recorded"
    " already, by this host or another.",
    "products_new": "Products created in the days the last successful run recorded.",
}


def _main(args: argparse.Namespace, settings: ToolSettings, figures: dict[str, float]) -> int:
    stop_on_sigterm()  # until record() handles SIGTERM on its event loop
    today = datetime.now().astimezone().date()
    if args.period:
        require_ended(args.period, today)
    if not settings.store.is_postgres:
        require_database(settings.store.database)
    new_products: dict[date, int] = {}
    try:
        asyncio.run(record(settings, args.period, today, new_products=new_products))
    except StoreError as exc:
        raise JobFailed(str(exc)) from exc
    figures["days_recorded"] = len(new_products)
    figures["products_new"] = sum(new_products.values())
    return 0


def build_parser() -> argparse.ArgumentParser:
    """toko-recap's options, the one source of its --help and its man page."""
    parser = argparse.ArgumentParser(
        prog="toko-recap",
        description=(
            "Record the product recap for each day not yet recorded (at most the last"
            f" {CATCH_UP_DAYS}; the first run: yesterday) and queue its email to the admin,"
            " then prune done jobs older than TOKO_JOB_RETENTION. toko-recap.timer starts it"
            " every day, and after a boot when the host was off at that time"
            " (systemctl list-timers); a day already recorded, by this host or another, is"
            " not recorded or emailed again."
        ),
    )
    add_version(parser)
    parser.add_argument(
        "--period",
        type=parse_period,
        metavar="YYYY-MM-DD",
        help="the one day to recap, once it is over (default: the days since the last"
        " recorded one up to yesterday, host time zone)",
    )
    return parser


def main() -> int:
    return run_job("toko-recap", build_parser(), reported("toko-recap", REPORT_FIGURES, _main))
