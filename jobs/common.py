"""What every timer job shares: settings, logging, and one-line failures."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from types import FrameType

from service import __version__
from service.logs import setup_logging, stop_waiting_for_journald
from service.settings import ConfigError, LogSettings, ToolSettings, output_is_journal
from service.settings_checks import check_database_folder, user_name

# How long a job's exit waits for a journald that does not read (stopped,
# restarting) to take its last lines. toko-api waits 2 s, inside its stop
# timeout; a job has nothing else to do, and its last lines say how it ended.
LOG_FLUSH_SECONDS = 30.0


def add_version(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")


class JobFailed(Exception):
    """A timer job could not do its work; the message is the one line printed."""


class Stopped(BaseException):
    """SIGTERM arrived (systemctl stop, the unit's TimeoutStartSec=, a shutdown).

    A BaseException, like KeyboardInterrupt: it passes ``except Exception``
    and runs the cleanups (``finally``, ``except BaseException``) on its way out.
    Its message, if any, says what the job did before it stopped.
    """


def stop_on_sigterm() -> None:
    """From now on SIGTERM raises Stopped in the main thread, so cleanups run.

    SIGTERM's default action ends the process on the spot: a backup stopped
    that way left its partial copy behind. Python runs the handler between
    bytecodes, so a long C call (SQLite's backup step) finishes first.
    """

    def stop(signum: int, frame: FrameType | None) -> None:
        # A second SIGTERM must not cut the cleanup short (SIGKILL still ends it).
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise Stopped

    signal.signal(signal.SIGTERM, stop)


def anothers_database(database: Path) -> str | None:
    """The user root must run as on ``database``, another's; None if root may.

    A file root creates beside a database the service user owns is one that
    user cannot open or replace: a -wal/-shm left by a crash stops toko-api
    from starting; a backup folder, or its lock file, fails every nightly
    backup after it. Where the database is not there yet (a restore), the
    folder it goes in counts.
    """
    if os.geteuid() != 0:
        return None
    try:
        owner = (database if database.exists() else database.parent).stat().st_uid
    except OSError:
        return None  # nothing there: the command itself will say so
    return None if owner == 0 else user_name(owner)


def require_database(database: str) -> None:
    """Fail unless the SQLite file exists: opening it would create an empty one.

    A job pointed at the wrong path would otherwise report on, or back up, a
    database that toko-api never uses, and say all went well.
    """
    if not Path(database).exists():
        raise JobFailed(
            f"no database at {database} (has toko-api ever started? TOKO_DATABASE names the file)"
        )


def run_job(
    name: str,
    parser: argparse.ArgumentParser,
    body: Callable[[argparse.Namespace, ToolSettings], int],
    *,
    without_settings: Callable[[argparse.Namespace, ConfigError], str] | None = None,
) -> int:
    """Parse arguments, load settings, run ``body``; failures end as one line and exit 1.

    Bad settings end as one line and exit 2, logged at error priority too.
    ``without_settings`` is what a job still does then; it returns the line.
    """
    try:
        return _run_job(name, parser, body, without_settings)
    finally:
        # Only the exit's wait for journald is left (up to LOG_FLUSH_SECONDS): a
        # SIGTERM now ends it, and stderr still counts what is lost. Stopped,
        # raised inside that wait, was a traceback on stderr and no count.
        signal.signal(signal.SIGTERM, _stop_waiting_for_journald)


def _stop_waiting_for_journald(signum: int, frame: FrameType | None) -> None:
    stop_waiting_for_journald()


def _run_job(
    name: str,
    parser: argparse.ArgumentParser,
    body: Callable[[argparse.Namespace, ToolSettings], int],
    without_settings: Callable[[argparse.Namespace, ConfigError], str] | None,
) -> int:
    args = parser.parse_args()
    try:
        settings = ToolSettings.from_env(os.environ)
        check_database_folder(settings)
    except ConfigError as exc:
        # Logged with the default settings: under systemd the stderr line alone
        # is an info-priority entry that `journalctl -p err` never shows.
        defaults = LogSettings(journal=output_is_journal(os.environ.get("JOURNAL_STREAM")))
        setup_logging(
            defaults.level,
            journal=defaults.journal,
            identifier=name,
            flush_timeout=LOG_FLUSH_SECONDS,
        )
        message = str(exc) if without_settings is None else without_settings(args, exc)
        logging.getLogger(f"toko.{name}").error("%s failed: %s", name, message)
        print(f"{name}: {message}", file=sys.stderr)
        return 2
    setup_logging(
        settings.log.level,
        journal=settings.log.journal,
        identifier=name,
        flush_timeout=LOG_FLUSH_SECONDS,
    )
    unknown = settings.unknown_variables_line()
    if unknown:
        logging.getLogger(f"toko.{name}").warning("%s", unknown)
    try:
        owner = (
            None if settings.store.is_postgres else anothers_database(Path(settings.store.database))
        )
        if owner:
            # Not "sudo -u": a job reads no toko.env itself, so it would run
            # without the service's settings (another database, even).
            raise JobFailed(
                f"run as the database's owner ({owner}) with the service's settings,"
                " not as root: through systemd-run, as the toko helper of"
                " /usr/share/doc/toko/docs/how-to/run-commands.md does"
            )
        return body(args, settings)
    except JobFailed as exc:
        logging.getLogger(f"toko.{name}").error("%s failed: %s", name, exc)
        print(f"{name}: {exc}", file=sys.stderr)
        return 1
    except Stopped as exc:
        # Non-zero, so systemd counts the run as failed (and OnFailure= alerts).
        line = "stopped by SIGTERM before it finished" + (f"; {exc}" if str(exc) else "")
        logging.getLogger(f"toko.{name}").error("%s %s", name, line)
        print(f"{name}: {line}", file=sys.stderr)
        return 128 + signal.SIGTERM
