"""``toko-queue``: look at and repair the job queue of an installed toko.

Talks to the store directly (not over HTTP), with the service's own
environment: /etc/toko/toko.env when it exists and TOKO_DATABASE is not set
(``--env-file`` names another). Run it as the service user, e.g.
``sudo -u toko toko-queue stats``; on PostgreSQL it also needs the database
password, which only root can read: run it with the credential, as the
README's "Running on several hosts" shows. A retried job runs at the running
toko-api's next sweep (within a second).

Exit status: 0 done, 1 failed (unknown job, job neither failed nor waiting,
store error, or the reader of its output stopped early, as ``| head`` does:
no traceback then), 2 bad usage or configuration.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from jobs import queue_tables
from jobs.common import anothers_database
from jobs.stale_settings import stale_settings_warning
from service import __version__
from service.durations import parse_duration
from service.env_file import DEFAULT_ENV_FILE, EnvFileError, cli_environment
from service.models import JOB_STATES, iso_utc
from service.settings import ConfigError, ToolSettings
from service.store import open_store
from service.store.admin import Retryable
from service.store.base import LoginRefused, StoreError, schema_log
from service.store.roles import QueueAdmin, Store
from service.validation import ID_MAX, ascii_int

PROG = "toko-queue"
LIST_LIMIT_MAX = 10_000
IDS_SHOWN = 20  # ids a retry of every failed or waiting job prints, beyond: a count
# The password file is root's (0600): `sudo -u toko` cannot read it, so the
# README hands it over as the services get it, as the credential db-password.
# --collect: a command that fails (an unknown job id, say) must not leave a
# failed run-u….service behind, which marks the whole system degraded.
PG_HINT = (
    "no database password: run it as root with the credential, e.g. sudo systemd-run "
    "--pipe --wait --quiet --collect --uid=toko "
    f"-p LoadCredential=db-password:/etc/toko/db-password /usr/bin/{PROG} stats"
)


class CommandFailed(Exception):
    """The command could not do what was asked; the message is printed, exit 1."""


Output = tuple[Any, str]  # (JSON value, human text)


def _duration(text: str) -> float:
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r} {exc}") from None


def _job_id(text: str) -> int:
    # Checked here: an id past SQLite's 64-bit integers would fail deep in the driver.
    value = ascii_int(text, 1, ID_MAX)
    if value is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a job id (1 to {ID_MAX})")
    return value


def _limit(text: str) -> int:
    value = ascii_int(text, 1, LIST_LIMIT_MAX)
    if value is None:
        raise argparse.ArgumentTypeError(f"must be an integer from 1 to {LIST_LIMIT_MAX}")
    return value


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    # SUPPRESS: a subcommand's default must not undo a --json given before it.
    common.add_argument(
        "--json", action="store_true", default=argparse.SUPPRESS, help="output JSON for scripts"
    )
    parser = argparse.ArgumentParser(
        prog=PROG,
        description=(
            "Inspect and repair the toko job queue, in the database directly, with the "
            "service's settings: the jobs by state, one job in full, failed jobs run again, "
            "old done ones deleted. A retried job goes to the running toko-api's workers "
            "within a second."
        ),
        epilog=(
            f"environment: as toko-api's; {DEFAULT_ENV_FILE} is read when it exists and "
            "TOKO_DATABASE is not set. Run as the service user: sudo -u toko toko-queue stats "
            "(on PostgreSQL with the password credential: see "
            "/usr/share/doc/toko/docs/how-to/several-hosts.md)"
        ),
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("--json", action="store_true", help="output JSON for scripts")
    parser.add_argument(
        "--env-file",
        metavar="PATH",
        help=f"read settings from PATH (default: {DEFAULT_ENV_FILE} if TOKO_DATABASE is unset)",
    )
    parser.add_argument(
        "--no-env-file", action="store_true", help="use only the current environment"
    )
    sub = parser.add_subparsers(title="commands", dest="command", required=True, metavar="COMMAND")
    sub.add_parser("stats", parents=[common], help="jobs by state and kind")
    listing = sub.add_parser("list", parents=[common], help="jobs in one state, newest first")
    listing.add_argument(
        "--state", choices=JOB_STATES, required=True, help="the jobs in this state"
    )
    listing.add_argument(
        "--limit", type=_limit, default=50, metavar="N", help="at most N jobs (default 50)"
    )
    show = sub.add_parser("show", parents=[common], help="one job in full")
    show.add_argument("id", type=_job_id, metavar="ID", help="the job's id, as list shows it")
    retry = sub.add_parser(
        "retry",
        parents=[common],
        help="run failed jobs, or jobs waiting to retry, now with a fresh attempt budget",
    )
    which = retry.add_mutually_exclusive_group(required=True)
    which.add_argument(
        "ids", type=_job_id, nargs="*", default=[], metavar="ID", help="the jobs with these ids"
    )
    which.add_argument("--all-failed", action="store_true", help="every failed job")
    which.add_argument(
        "--all-waiting",
        action="store_true",
        help="every pending job that failed before and waits for its next attempt",
    )
    purge = sub.add_parser("purge", parents=[common], help="delete old done jobs")
    purge.add_argument(
        "--done-older-than",
        type=_duration,
        required=True,
        metavar="AGE",
        help="a duration like 90s, 15m, 12h or 7d",
    )
    return parser


# commands ------------------------------------------------------------------------


async def stats(admin: QueueAdmin, args: argparse.Namespace, now: float) -> Output:
    result = await admin.queue_stats()
    return result.to_json(now), queue_tables.stats_text(result, now)


async def list_jobs(admin: QueueAdmin, args: argparse.Namespace, now: float) -> Output:
    jobs = await admin.list_jobs(args.state, args.limit)
    return [d.to_json() for d in jobs], queue_tables.jobs_text(jobs)


async def show(admin: QueueAdmin, args: argparse.Namespace, now: float) -> Output:
    details = await admin.job_details(args.id)
    if details is None:
        raise CommandFailed(f"no job with id {args.id}")
    return details.to_json(), queue_tables.job_text(details)


async def retry(admin: QueueAdmin, args: argparse.Namespace, now: float) -> Output:
    if args.all_failed or args.all_waiting:
        which: Retryable = "failed" if args.all_failed else "waiting"
        retried = await admin.retry_now(None, which)
        return {"retried": retried}, f"retried {len(retried)} {which} job(s){_some_ids(retried)}"
    wanted = sorted(set(args.ids))
    retried = await admin.retry_now(wanted, "failed")
    retried = sorted(retried + await admin.retry_now(sorted(set(wanted) - set(retried)), "waiting"))
    refused = []
    for job_id in sorted(set(wanted) - set(retried)):
        details = await admin.job_details(job_id)
        refused.append({"id": job_id, "state": details.job.state if details else None})
    if refused:
        why = "; ".join(
            f"job {r['id']} "
            + (f"is {r['state']}, not failed or waiting" if r["state"] else "does not exist")
            for r in refused
        )
        done = f" (retried: {', '.join(map(str, retried))})" if retried else ""
        raise CommandFailed(f"not retried: {why}{done}")
    return {"retried": retried}, f"retried job(s) {', '.join(map(str, retried))}"


def _some_ids(ids: list[int]) -> str:
    # After an outage --all-* may retry hundreds of thousands: every id on the
    # terminal is megabytes nobody reads. Scripts take them all from --json.
    if not ids:
        return ""
    shown = ", ".join(map(str, ids[:IDS_SHOWN]))
    more = len(ids) - IDS_SHOWN
    return f": {shown}" + (f" and {more} more (--json lists every id)" if more > 0 else "")


async def purge(admin: QueueAdmin, args: argparse.Namespace, now: float) -> Output:
    cutoff = now - args.done_older_than
    purged = await admin.purge_done(cutoff)
    text = f"purged {purged} done job(s) last updated before {iso_utc(cutoff)}"
    return {"purged": purged, "older_than": iso_utc(cutoff)}, text


COMMANDS: dict[str, Callable[[QueueAdmin, argparse.Namespace, float], Any]] = {
    "stats": stats,
    "list": list_jobs,
    "show": show,
    "retry": retry,
    "purge": purge,
}


# plumbing ------------------------------------------------------------------------


async def run_command(settings: ToolSettings, args: argparse.Namespace) -> Output:
    store: Store = open_store(settings, application_name=PROG)
    await store.open()
    try:
        result: Output = await COMMANDS[args.command](store, args, time.time())
        return result
    finally:
        await store.close()


def _sqlite_file_problem(database: Path) -> str | None:
    if not database.exists():
        # Opening would create an empty database: say where we looked instead.
        return f"no database at {database} (set TOKO_DATABASE, or --env-file)"
    owner = anothers_database(database)
    # toko-queue reads toko.env itself: as the owner, it has the service's settings.
    return owner and f"run as the database's owner, not root: sudo -u {owner} {PROG} ..."


def _store_hint(settings: ToolSettings, exc: StoreError) -> str | None:
    if not settings.store.is_postgres:
        return f"run as the service user: sudo -u toko {PROG} ..."
    if settings.store.database_password is None and isinstance(exc, LoginRefused):
        return PG_HINT
    # Which local user asks makes no difference to a password login, and a
    # password does not bring a server up: the error itself says what went
    # wrong (a wrong password, no server).
    return None


@contextlib.contextmanager
def store_lines_on_stderr() -> Iterator[None]:
    """Show what the store logs while toko-queue uses it, as toko-queue's lines.

    toko-queue sets up no logging (its output is its answer). Without a
    handler Python printed the store's warnings bare ("database not
    reachable yet, retrying" while the server is down), unlike every other
    line of toko-queue's. The schema line is shown too: a toko-api started
    afterwards finds nothing left to migrate, so without it an upgrade that
    toko-queue happened to apply would be told nowhere.
    """
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"{PROG}: %(message)s"))
    root = logging.getLogger()
    level = schema_log.level
    root.addHandler(handler)
    schema_log.setLevel(logging.INFO)
    try:
        yield
    finally:
        root.removeHandler(handler)
        schema_log.setLevel(level)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        environ = cli_environment(os.environ, args.env_file, use_default=not args.no_env_file)
        settings = ToolSettings.from_env(environ)
    except (EnvFileError, ConfigError) as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    unknown = settings.unknown_variables_line()
    if unknown:
        print(f"{PROG}: warning: {unknown}", file=sys.stderr)
    stale = None if args.env_file or args.no_env_file else stale_settings_warning(DEFAULT_ENV_FILE)
    if stale:
        print(f"{PROG}: warning: {stale}", file=sys.stderr)
    if not settings.store.is_postgres:
        problem = _sqlite_file_problem(Path(settings.store.database))
        if problem:
            print(f"{PROG}: {problem}", file=sys.stderr)
            return 1
    try:
        with store_lines_on_stderr():
            data, text = asyncio.run(run_command(settings, args))
    except CommandFailed as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 1
    except StoreError as exc:
        hint = _store_hint(settings, exc)
        suffix = f" ({hint})" if hint else ""
        print(f"{PROG}: {exc}{suffix}", file=sys.stderr)
        return 1
    try:
        print(json.dumps(data, ensure_ascii=False, indent=2) if args.json else text)
        # Flushed here: at exit, a failed flush is a message and exit 120.
        sys.stdout.flush()
    except BrokenPipeError:
        # The reader stopped early (| head): as the Python docs advise for
        # SIGPIPE, point stdout at devnull so the flush at exit fails no more.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
