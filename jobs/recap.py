"""``toko-recap``: record a period's product figures once and email them.

Started daily by toko-recap.timer. The recap row is keyed by period, so a
second run for the same period (a re-run, a catch-up, another host) changes
nothing and says so. Each run then prunes done jobs older than
TOKO_JOB_RETENTION (jobs.retention), so the daily timer bounds the database.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from datetime import date, datetime, timedelta

from jobs.common import JobFailed, require_database, run_job
from jobs.retention import prune_done_jobs
from service.settings import Settings
from service.store import open_store
from service.store.admin import QueueAdmin
from service.store.base import StoreError
from service.tasks import recap_email_job

log = logging.getLogger("toko.recap")


def parse_period(text: str) -> date:
    try:
        return date.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a date like 2026-11-28: {text!r}") from None


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


async def record(settings: Settings, day: date, now: float | None = None) -> int | None:
    """Record ``day``'s recap once, then prune done jobs older than the retention."""
    start, end = period_bounds(day)
    store = open_store(settings, application_name="toko-recap")
    await store.open()
    try:
        total, new = await store.product_counts(start, end)
        job = recap_email_job(day.isoformat(), total, new, settings.job_max_attempts)
        job_id = await store.record_recap(day.isoformat(), total, new, job)
        fields = {"PERIOD": day.isoformat(), "PRODUCTS_TOTAL": total, "PRODUCTS_NEW": new}
        if job_id is None:
            log.info("recap already recorded for this period; nothing to do", extra=fields)
        else:
            log.info("recap recorded", extra={**fields, "JOB_ID": job_id})
        # After the recap, so a pruning problem never costs the period its recap.
        if isinstance(store, QueueAdmin):
            await prune_done_jobs(store, settings.job_retention, now or time.time())
        else:
            log.warning("this store cannot prune done jobs; TOKO_JOB_RETENTION is ignored")
    finally:
        await store.close()
    return job_id


def _main(args: argparse.Namespace, settings: Settings) -> int:
    today = datetime.now().astimezone().date()
    day: date = args.period or (today - timedelta(days=1))
    require_ended(day, today)
    if not settings.is_postgres:
        require_database(settings.database)
    try:
        asyncio.run(record(settings, day))
    except StoreError as exc:
        raise JobFailed(str(exc)) from exc
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="toko-recap",
        description="Record the product recap for one day and queue its email to the admin.",
    )
    parser.add_argument(
        "--period",
        type=parse_period,
        metavar="YYYY-MM-DD",
        help="the day to recap, once it is over (default: yesterday, host time zone)",
    )
    return run_job("toko-recap", parser, _main)
