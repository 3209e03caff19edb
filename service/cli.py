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
from service.settings import ConfigError, Settings, check_for_api
from service.settings_checks import check_database_folder
from service.settings_doc import help_epilog
from service.store.base import StoreError
from service.store.lock import InstanceLock, InstanceLocked


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="toko-api",
        description="toko product API with a durable email job queue.",
        epilog=help_epilog(),
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
