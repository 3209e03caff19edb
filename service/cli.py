"""``toko-api``: the command-line entry point."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import textwrap
from collections.abc import Iterable, Mapping
from types import FrameType

from service import __version__
from service.check_config import (
    API_CREDENTIALS,
    DEFAULT_CREDENTIALS_DIR,
    UNIT_CREDENTIALS,
    unit_environment,
)
from service.logs import setup_logging
from service.server_imports import import_environment
from service.settings import ConfigError, Settings, check_for_api
from service.settings_checks import check_database_folder
from service.settings_doc import help_epilog
from service.store.base import StoreError
from service.store.lock import InstanceLock, InstanceLocked

DESCRIPTION = textwrap.fill(
    "toko product API with a durable email job queue: POST /produk stores a product "
    "and its email job in one transaction, and this process's workers send the emails, "
    "with retries. Under systemd, toko-api.service runs it (Type=notify, with a "
    "watchdog) on the socket of toko-api.socket, with the settings of /etc/toko/toko.env: "
    "systemctl status toko-api, journalctl -u toko-api.",
    79,
    break_on_hyphens=False,
)


def _names(names: Iterable[str]) -> str:
    *rest, last = names
    return f"{', '.join(rest)} and {last}" if rest else last


def build_parser() -> argparse.ArgumentParser:
    """toko-api's options, the one source of its --help and its man page."""
    parser = argparse.ArgumentParser(
        prog="toko-api",
        description=DESCRIPTION,
        epilog=help_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument(
        "--check-config",
        action="store_true",
        help="check the settings as start-up does, print one line and exit: 0 when they are "
        "valid, 2 naming the first bad variable",
    )
    parser.add_argument(
        "--env-file",
        metavar="PATH",
        help="with --check-config: check the settings of PATH (/etc/toko/toko.env) as "
        "toko-api.service's EnvironmentFile= reads them (the shell's TOKO_ variables do not "
        "count), and the credentials the unit loads",
    )
    parser.add_argument(
        "--credentials-dir",
        metavar="DIR",
        help=f"with --env-file: the folder of the files the units' LoadCredential= lines "
        f"load, each named as its credential (default {DEFAULT_CREDENTIALS_DIR}): "
        f"{_names(UNIT_CREDENTIALS)}, which toko-api.service loads, must be there; "
        f"{_names(c for c in API_CREDENTIALS if c not in UNIT_CREDENTIALS)} are read where "
        "they are (loaded by a drop-in); none may be readable by every user",
    )
    return parser


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    # Only a check: the service itself gets its environment from systemd.
    if args.env_file is not None and not args.check_config:
        parser.error("--env-file goes with --check-config")
    if args.credentials_dir is not None and args.env_file is None:
        parser.error("--credentials-dir goes with --env-file")
    return args


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
    checked = ""
    try:
        environ: Mapping[str, str] = os.environ
        if args.env_file is not None:
            unit = unit_environment(os.environ, args.env_file, args.credentials_dir)
            environ, checked = unit.environ, f": {unit.checked()}"
        settings = Settings.from_env(environ)
        check_for_api(settings)
        check_database_folder(settings)
    except ConfigError as exc:
        print(f"toko-api: {exc}", file=sys.stderr)
        return 2
    unknown = settings.unknown_variables_line()
    if args.check_config:
        if unknown:
            print(f"toko-api: warning: {unknown}", file=sys.stderr)
        print(f"toko-api: configuration is valid{checked}")
        return 0
    stop_signals = StopSignals()
    # Imported here, not at the top: --version, --help and --check-config
    # answer without loading aiohttp and the rest of the server.
    with import_environment():
        from service.runner import run
        from service.systemd import SocketActivationError

    setup_logging(settings.log.level, journal=settings.log.journal, identifier="toko-api")
    log = logging.getLogger("toko")
    if unknown:
        log.warning("%s", unknown, extra={"UNKNOWN_SETTINGS": " ".join(settings.unknown_variables)})
    # The lock guards a SQLite file; a shared database has many instances by design.
    lock = InstanceLock(settings.store.database) if not settings.store.is_postgres else None
    try:
        if lock is not None:
            lock.acquire()
    except InstanceLocked as exc:
        print(f"toko-api: another toko-api uses this database: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"toko-api: cannot use {settings.store.database}: {exc}", file=sys.stderr)
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
            f"toko-api: cannot listen on {settings.http.host}:{settings.http.port} "
            f"(TOKO_LISTEN): {exc}",
            file=sys.stderr,
        )
        return 1
    finally:
        if lock is not None:
            lock.release()


if __name__ == "__main__":
    sys.exit(main())
