"""Configuration: built once from the environment, then passed around frozen.

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
from dataclasses import dataclass, field

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
    "ConfigError",
    "Settings",
    "SmtpTarget",
    "check_for_api",
    "output_is_journal",
]


@dataclass(frozen=True)
class Settings:
    # The fields the TOKO_ variables set take their defaults from the spec.
    listen_host: str = DEFAULTS["listen_host"]
    listen_port: int = DEFAULTS["listen_port"]
    database: str = DEFAULTS["database"]
    # PostgreSQL password when not in the URL: systemd credential or file, never env.
    database_password: str | None = field(default=DEFAULTS["database_password"], repr=False)
    smtp: SmtpTarget | None = DEFAULTS["smtp"]
    # Everyone told about new products, recaps and alerts: one email to all.
    admin_emails: tuple[str, ...] = DEFAULTS["admin_emails"]
    mail_from: str = DEFAULTS["mail_from"]
    workers: int = DEFAULTS["workers"]
    # With the default backoff, between 4.6 and 9 hours of retries (the delay
    # doubles from 2 s up to an hour): a mail outage of a few hours ends with
    # every email delivered, not kept as failed for someone to retry by hand.
    job_max_attempts: int = DEFAULTS["job_max_attempts"]
    job_backoff: float = DEFAULTS["job_backoff"]
    job_timeout: float = DEFAULTS["job_timeout"]
    drain_timeout: float = DEFAULTS["drain_timeout"]
    # How long an HTTP client may take to send a request (from connecting, or
    # from the last answer on a kept-alive connection) and then its body.
    client_timeout: float = DEFAULTS["client_timeout"]
    log_level: str = DEFAULTS["log_level"]
    # Not configurable.
    max_body_bytes: int = 64 * 1024
    backup_dir: str = DEFAULTS["backup_dir"]
    backup_keep: int = DEFAULTS["backup_keep"]
    # Bearer token for writes (systemd credential api-token or TOKO_API_TOKEN_FILE).
    # None: writes are open (development). Kept out of repr so it never reaches a log.
    api_token: str | None = field(default=DEFAULTS["api_token"], repr=False)
    # Done jobs older than this are pruned by toko-recap.
    job_retention: float = DEFAULTS["job_retention"]
    # systemd's environment contract, read here so the rest stays pure.
    notify_socket: str | None = None
    watchdog_interval: float | None = None
    journal: bool = False
    fault_injection: bool = DEFAULTS["fault_injection"]
    fault_block_seconds: float = DEFAULTS["fault_block_seconds"]
    # TOKO_ variables set but read by nothing: see unknown_variables_line().
    unknown_variables: tuple[str, ...] = ()
    # Whether TOKO_LISTEN was set: socket activation then overrides it (listener).
    listen_given: bool = False

    @property
    def is_postgres(self) -> bool:
        return is_postgres_url(self.database)

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> Settings:
        return cls(
            **read_variables(environ),
            notify_socket=environ.get("NOTIFY_SOCKET") or None,
            watchdog_interval=_watchdog_interval(environ),
            journal=output_is_journal(environ.get("JOURNAL_STREAM")),
            unknown_variables=unknown_variables(environ),
            listen_given="TOKO_LISTEN" in environ,
        )

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
        return (
            f"unknown settings ignored: {', '.join(named)} "
            "(README: Configuration lists the known ones)"
        )


def check_for_api(settings: Settings) -> None:
    """What only toko-api needs. The timer jobs load the same settings but send
    no mail, so they are not given the SMTP credential."""
    smtp = settings.smtp
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
