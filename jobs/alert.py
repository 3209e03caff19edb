"""``toko-alert UNIT``: a timer job failed; say so in the journal and to the admin.

Started by ``toko-alert@.service`` through ``OnFailure=toko-alert@%n.service``
on toko-recap and toko-backup. It logs at error priority with the failed
unit's name in the field ``UNIT=`` (``journalctl -p err UNIT=toko-backup.service``)
and queues an ``alert_email`` job; toko-api's workers send it to
TOKO_ADMIN_EMAIL like any other email, with retries. The journal entry comes
first, so even a store that cannot take the job leaves a trace, and so do
settings that cannot be read (exit 2); a SQLite file that does not exist is
not created (exit 1, like toko-recap).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import socket
import time

from jobs.common import JobFailed, add_version, require_database, run_job
from service.models import iso_utc
from service.settings import ConfigError, ToolSettings
from service.store import open_store
from service.store.base import StoreError
from service.tasks import UnitFailure, alert_email_job

log = logging.getLogger("toko.alert")


async def enqueue_alert(settings: ToolSettings, failure: UnitFailure) -> int:
    store = open_store(settings, application_name="toko-alert")
    await store.open()
    try:
        return await store.enqueue(alert_email_job(failure, settings.jobs.max_attempts))
    finally:
        await store.close()


def _log_failure(args: argparse.Namespace) -> UnitFailure:
    """The journal entry, at error priority: written before anything can fail."""
    failure = UnitFailure(
        unit=args.unit,
        host=socket.gethostname(),
        failed_at=iso_utc(time.time()),
        result=args.result,
        exit_code=args.exit_code,
        exit_status=args.exit_status,
    )
    fields = {
        "UNIT": failure.unit,
        "SERVICE_RESULT": failure.result,
        "EXIT_CODE": failure.exit_code,
        "EXIT_STATUS": failure.exit_status,
    }
    log.error("%s failed", failure.unit, extra=fields)
    return failure


def _without_settings(args: argparse.Namespace, exc: ConfigError) -> str:
    # The failed job often failed on the very same setting (one bad line in
    # toko.env fails every unit that reads it): its entry must still be written.
    failure = _log_failure(args)
    return f"could not queue the alert email for {failure.unit}: {exc}"


def _main(args: argparse.Namespace, settings: ToolSettings) -> int:
    failure = _log_failure(args)
    try:
        if not settings.store.is_postgres:
            # As toko-recap does: an email queued into a new, empty database
            # would never be sent, yet the run would say it was queued.
            require_database(settings.store.database)
        job_id = asyncio.run(enqueue_alert(settings, failure))
    except (JobFailed, StoreError) as exc:
        raise JobFailed(f"could not queue the alert email for {failure.unit}: {exc}") from exc
    log.info("alert email queued", extra={"UNIT": failure.unit, "JOB_ID": job_id})
    return 0


def build_parser() -> argparse.ArgumentParser:
    """toko-alert's options, the one source of its --help and its man page."""
    parser = argparse.ArgumentParser(
        prog="toko-alert",
        description=(
            "Report a failed systemd unit: an error entry in the journal, with the unit in "
            "the field UNIT= (journalctl -p err UNIT=toko-backup.service), and an email to "
            "TOKO_ADMIN_EMAIL (sent by toko-api). systemd starts it as toko-alert@UNIT.service "
            "when toko-recap or toko-backup fails (their OnFailure=); try it with: systemctl "
            "start toko-alert@test.service"
        ),
    )
    add_version(parser)
    parser.add_argument(
        "unit", metavar="UNIT", help="the unit that failed, e.g. toko-backup.service"
    )
    # systemd passes these to OnFailure= units as MONITOR_SERVICE_RESULT etc.;
    # the unit file hands them over as arguments (empty when unknown).
    parser.add_argument(
        "--result",
        default="",
        metavar="RESULT",
        help="how the unit failed: exit-code, timeout, watchdog, ... ($MONITOR_SERVICE_RESULT)",
    )
    parser.add_argument(
        "--exit-code",
        default="",
        metavar="CODE",
        help="how its process ended: exited, killed or dumped ($MONITOR_EXIT_CODE)",
    )
    parser.add_argument(
        "--exit-status",
        default="",
        metavar="STATUS",
        help="its exit status, or the signal that ended it ($MONITOR_EXIT_STATUS)",
    )
    return parser


def main() -> int:
    return run_job("toko-alert", build_parser(), _main, without_settings=_without_settings)
