"""Configuration: built once from the environment, then passed around frozen,
one group per concern (``settings.http``, ``.store``, ``.mail``, ``.jobs``,
``.pool``, ``.backup``, ``.textfile``, ``.log``, ``.systemd``, ``.faults``);
the timer jobs and admin commands get ``ToolSettings``, without toko-api's
groups.

Nothing else in the service reads ``os.environ``; a bad value stops start-up
with one line that names the variable. Each TOKO_ variable is declared once,
in service.settings_spec, which also gives the fields below their defaults;
the values are parsed by service.settings_parsers, secrets read by
service.secret_files, and the checks that look at the filesystem are in
service.settings_checks.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from service.settings_parsers import ConfigError, SmtpTarget, is_postgres_url
from service.settings_spec import (
    DEFAULTS,
    KNOWN_VARIABLES,
    closest_known,
    read_variables,
    unknown_variables,
)
from service.validation import ascii_int

__all__ = [
    "KNOWN_VARIABLES",
    "BackupSettings",
    "ConfigError",
    "FaultSettings",
    "HttpSettings",
    "JobSettings",
    "LogSettings",
    "MailSettings",
    "PoolSettings",
    "Settings",
    "SmtpTarget",
    "StoreSettings",
    "SystemdSettings",
    "TextfileSettings",
    "ToolSettings",
    "check_for_api",
    "output_is_journal",
]


@dataclass(frozen=True)
class HttpSettings:
    host: str = DEFAULTS["http.host"]
    port: int = DEFAULTS["http.port"]
    # Whether TOKO_LISTEN was set: socket activation then overrides it (listener).
    listen_given: bool = False
    # How long an HTTP client may take to send a request (from connecting, or
    # from the last answer on a kept-alive connection) and then its body.
    client_timeout: float = DEFAULTS["http.client_timeout"]
    # Not configurable.
    max_body_bytes: int = 64 * 1024
    # Bearer token for writes (systemd credential api-token or TOKO_API_TOKEN_FILE).
    # None: writes are open (development). Kept out of repr so it never reaches a log.
    api_token: str | None = field(default=DEFAULTS["http.api_token"], repr=False)


@dataclass(frozen=True)
class StoreSettings:
    database: str = DEFAULTS["store.database"]
    # PostgreSQL password when not in the URL: systemd credential or file, never env.
    database_password: str | None = field(default=DEFAULTS["store.database_password"], repr=False)

    @property
    def is_postgres(self) -> bool:
        return is_postgres_url(self.database)


@dataclass(frozen=True)
class MailSettings:
    smtp: SmtpTarget | None = DEFAULTS["mail.smtp"]
    # Everyone told about new products, recaps and alerts: one email to all.
    admin_emails: tuple[str, ...] = DEFAULTS["mail.admin_emails"]
    sender: str = DEFAULTS["mail.sender"]


@dataclass(frozen=True)
class JobSettings:
    """The jobs every program enqueues or prunes."""

    # With the default backoff, between 4.6 and 9 hours of retries (the delay
    # doubles from 2 s up to an hour): a mail outage of a few hours ends with
    # every email delivered, not kept as failed for someone to retry by hand.
    max_attempts: int = DEFAULTS["jobs.max_attempts"]
    # Done jobs older than this are pruned by toko-recap.
    retention: float = DEFAULTS["jobs.retention"]


@dataclass(frozen=True)
class PoolSettings:
    """toko-api's worker pool."""

    workers: int = DEFAULTS["pool.workers"]
    backoff: float = DEFAULTS["pool.backoff"]
    timeout: float = DEFAULTS["pool.timeout"]
    drain_timeout: float = DEFAULTS["pool.drain_timeout"]


@dataclass(frozen=True)
class BackupSettings:
    dir: str = DEFAULTS["backup.dir"]
    keep: int = DEFAULTS["backup.keep"]


@dataclass(frozen=True)
class TextfileSettings:
    """Where the timer jobs report to node_exporter's textfile collector."""

    dir: str = DEFAULTS["textfile.dir"]


@dataclass(frozen=True)
class LogSettings:
    level: str = DEFAULTS["log.level"]
    # Whether the output is the journal (JOURNAL_STREAM): fields, not JSON lines.
    journal: bool = False


@dataclass(frozen=True)
class SystemdSettings:
    """systemd's environment contract, read here so the rest stays pure."""

    notify_socket: str | None = None
    watchdog_interval: float | None = None


@dataclass(frozen=True)
class FaultSettings:
    """For the tests' fault injection."""

    injection: bool = DEFAULTS["faults.injection"]
    block_seconds: float = DEFAULTS["faults.block_seconds"]


@dataclass(frozen=True)
class ToolSettings:
    """What the timer jobs and admin commands use: the store, the jobs they
    enqueue, backups, logging. Every program reads and checks every variable
    (a typo fails alike everywhere); these keep the groups they need."""

    store: StoreSettings = field(default_factory=StoreSettings)
    jobs: JobSettings = field(default_factory=JobSettings)
    backup: BackupSettings = field(default_factory=BackupSettings)
    textfile: TextfileSettings = field(default_factory=TextfileSettings)
    log: LogSettings = field(default_factory=LogSettings)
    # TOKO_ variables set but read by nothing: see unknown_variables_line().
    unknown_variables: tuple[str, ...] = ()

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> ToolSettings:
        full = Settings.from_env(environ)
        return ToolSettings(**{f.name: getattr(full, f.name) for f in fields(ToolSettings)})

    def unknown_variables_line(self) -> str | None:
        """The warning for TOKO_ variables nothing reads, with the likely meant ones.

        Names only: a value may be a secret someone put in the wrong place.
        """
        if not self.unknown_variables:
            return None
        named = []
        for name in self.unknown_variables:
            meant = closest_known(name)
            named.append(f"{name!r} (meant {meant}?)" if meant else repr(name))
        return f"unknown settings ignored: {', '.join(named)} (man toko.env lists the known ones)"


@dataclass(frozen=True)
class Settings(ToolSettings):
    """toko-api's settings: the tools' groups, and HTTP, mail, the worker
    pool, systemd's contract and the tests' fault injection."""

    http: HttpSettings = field(default_factory=HttpSettings)
    mail: MailSettings = field(default_factory=MailSettings)
    pool: PoolSettings = field(default_factory=PoolSettings)
    systemd: SystemdSettings = field(default_factory=SystemdSettings)
    faults: FaultSettings = field(default_factory=FaultSettings)

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> Settings:
        group: dict[str, dict[str, Any]] = {}
        for path, value in read_variables(environ).items():
            name, _, attribute = path.partition(".")
            group.setdefault(name, {})[attribute] = value
        return cls(
            http=HttpSettings(**group["http"], listen_given="TOKO_LISTEN" in environ),
            store=StoreSettings(**group["store"]),
            mail=MailSettings(**group["mail"]),
            jobs=JobSettings(**group["jobs"]),
            pool=PoolSettings(**group["pool"]),
            backup=BackupSettings(**group["backup"]),
            textfile=TextfileSettings(**group["textfile"]),
            log=LogSettings(
                **group["log"], journal=output_is_journal(environ.get("JOURNAL_STREAM"))
            ),
            systemd=SystemdSettings(
                notify_socket=environ.get("NOTIFY_SOCKET") or None,
                watchdog_interval=_watchdog_interval(environ),
            ),
            faults=FaultSettings(**group["faults"]),
            unknown_variables=unknown_variables(environ),
        )


def check_for_api(settings: Settings) -> None:
    """What only toko-api needs. The timer jobs load the same settings but send
    no mail, so they are not given the SMTP credential."""
    smtp = settings.mail.smtp
    if smtp is not None and smtp.logs_in and not smtp.password:
        # An empty file too, as for the API token: a login with an empty
        # password fails every email, long after the start looked fine.
        given = "an empty password was" if smtp.password == "" else "no password was"
        raise ConfigError(
            f"TOKO_SMTP_URL logs in as {smtp.username!r}, but {given} given "
            "(the systemd credential 'smtp-password' or TOKO_SMTP_PASSWORD_FILE)"
        )


def output_is_journal(stream: str | None) -> bool:
    """Whether stdout or stderr is the journal stream JOURNAL_STREAM names.

    systemd.exec(5): compare its ``device:inode`` with the descriptors. A
    process started from within a service (a shell in it, a CI job under a
    systemd-run runner) inherits the variable with its output elsewhere, and
    logging to the journal would then make every line vanish from where its
    user looks.
    """
    if not stream:
        return False
    for fd in (1, 2):
        try:
            st = os.fstat(fd)
        except OSError:
            continue
        if f"{st.st_dev}:{st.st_ino}" == stream.strip():
            return True
    return False


def _watchdog_interval(environ: Mapping[str, str]) -> float | None:
    """Half of WATCHDOG_USEC, as sd_watchdog_enabled(3) advises, when it is meant for us."""
    # ascii_int, not int(): isdigit() passes "²", which int() refuses with a traceback.
    usec = ascii_int(environ.get("WATCHDOG_USEC", ""), 1, 2**64 - 1)
    if usec is None:
        return None
    pid = environ.get("WATCHDOG_PID", "")
    if pid and pid != str(os.getpid()):
        return None
    return usec / 1_000_000 / 2
