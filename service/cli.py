"""``toko-api``: the command-line entry point."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from types import FrameType

from service import __version__
from service.logs import setup_logging
from service.settings import ConfigError, Settings, check_database_folder, check_for_api
from service.store.base import StoreError
from service.store.lock import InstanceLock, InstanceLocked

EPILOG = """\
configuration comes from the environment (under systemd: /etc/toko/toko.env):
  TOKO_LISTEN            host:port to listen on (default 127.0.0.1:8080)
  TOKO_DATABASE          SQLite file (default $STATE_DIRECTORY/toko.db or ./var/toko.db)
                         or a postgresql://user@host:port/db URL
  TOKO_SMTP_URL          smtp://[user@]host[:port]; unset: emails go to the log
  TOKO_ADMIN_EMAIL       who gets the emails, several separated by commas
                         (default admin@toko.com)
  TOKO_MAIL_FROM         sender address (default toko@localhost)
  TOKO_WORKERS           concurrent job workers (default 3)
  TOKO_JOB_MAX_ATTEMPTS  attempts before a job is kept as failed (default 20)
  TOKO_JOB_BACKOFF       base seconds of the exponential retry backoff (default 2;
                         with 20 attempts, 4.6 to 9 hours of retries)
  TOKO_JOB_TIMEOUT       seconds one attempt may take (default 30)
  TOKO_DRAIN_TIMEOUT     seconds running jobs get to finish on stop (default 10)
  TOKO_CLIENT_TIMEOUT    seconds a client has to send a request, then its body (default 75)
  TOKO_JOB_RETENTION     age after which toko-recap prunes done jobs (default 7d)
  TOKO_LOG_LEVEL         debug, info, warning or error (default info)
Secrets come from systemd credentials or files, never from the environment:
  smtp-password  or TOKO_SMTP_PASSWORD_FILE      the SMTP password
  db-password    or TOKO_DATABASE_PASSWORD_FILE  the PostgreSQL password
  api-token      or TOKO_API_TOKEN_FILE          the token writes must carry
"""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="toko-api",
        description="toko product API with a durable email job queue.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument(
        "--check-config",
        action="store_true",
        help="validate the configuration and exit",
    )
    return parser.parse_args(argv)


class StopSignals:
    """SIGTERM and SIGINT noted, rather than ending the process, from now until
    the event loop takes them over (``asked`` tells the runner).

    Loading the server (aiohttp and the rest) takes a few hundred milliseconds,
    most of a start-up on SQLite: a `systemctl stop` then killed toko-api by
    the signal, with no word in the journal, and a Ctrl-C printed a
    KeyboardInterrupt traceback. Noted, either ends the start-up as one that
    comes while the store opens does. A SIGHUP is ignored, as it is later:
    its default would end the process in a way systemd counts as clean, so
    Restart=on-failure would leave the API down.
    """

    def __init__(self) -> None:
        self.asked = False
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._note)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)

    def _note(self, signum: int, frame: FrameType | None) -> None:
        self.asked = True


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        settings = Settings.from_env(os.environ)
        check_for_api(settings)
        check_database_folder(settings)
    except ConfigError as exc:
        print(f"toko-api: {exc}", file=sys.stderr)
        return 2
    unknown = settings.unknown_variables_line()
    if args.check_config:
        if unknown:
            print(f"toko-api: warning: {unknown}", file=sys.stderr)
        print("toko-api: configuration is valid")
        return 0
    stop_signals = StopSignals()
    # Imported here, not at the top: --version, --help and --check-config
    # answer without loading aiohttp and the rest of the server.
    from service.runner import run
    from service.systemd import SocketActivationError

    setup_logging(settings.log_level, journal=settings.journal, identifier="toko-api")
    log = logging.getLogger("toko")
    if unknown:
        log.warning("%s", unknown, extra={"UNKNOWN_SETTINGS": " ".join(settings.unknown_variables)})
    # The lock guards a SQLite file; a shared database has many instances by design.
    lock = InstanceLock(settings.database) if not settings.is_postgres else None
    try:
        if lock is not None:
            lock.acquire()
    except InstanceLocked as exc:
        print(f"toko-api: another toko-api uses this database: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"toko-api: cannot use {settings.database}: {exc}", file=sys.stderr)
        return 1
    try:
        return run(settings, lambda: stop_signals.asked)
    except StoreError as exc:
        log.critical("cannot start: %s", exc)
        print(f"toko-api: {exc}", file=sys.stderr)
        return 1
    except SocketActivationError as exc:
        log.critical("cannot start: %s", exc)
        print(f"toko-api: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        log.critical("cannot start: %s", exc)
        print(
            f"toko-api: cannot listen on {settings.listen_host}:{settings.listen_port} "
            f"(TOKO_LISTEN): {exc}",
            file=sys.stderr,
        )
        return 1
    finally:
        if lock is not None:
            lock.release()


if __name__ == "__main__":
    sys.exit(main())
