"""Every TOKO_ variable, declared once: how it is read, and what it is for.

``Settings.from_env`` reads the environment through this table, in its
order (so the first bad variable in it is the one named); the unknown
variable warning takes the names from it; ``toko-api --help``,
deploy/toko.env.example and the README's configuration table are generated
from it (service.settings_doc) and tested against it.

Texts are written once, for all three: ``help`` is one line (lower case, no
full stop), ``doc`` the README's longer meaning, ``note`` what the env example
adds for an admin editing toko.env. Backquotes mark code for the README and
are dropped elsewhere.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from service.secret_files import read_secret
from service.settings_parsers import (
    ConfigError,
    check_api_token,
    int_between,
    is_postgres_url,
    parse_bool,
    parse_database,
    parse_email,
    parse_email_list,
    parse_listen,
    parse_log_level,
    parse_smtp_url,
    retention,
    seconds,
    shown,
)

# The console scripts that read the settings (pyproject.toml's [project.scripts]).
PROGRAMS = ("toko-api", "toko-recap", "toko-backup", "toko-queue", "toko-alert")
_API = ("toko-api",)

# A default that depends on the environment, or on the settings read before.
Derived = Callable[[Mapping[str, str], Mapping[str, Any]], Any]


@dataclass(frozen=True)
class Variable:
    name: str
    # The setting it sets, as ``group.field`` of Settings (two: a value parsed
    # into both). One more part is a field of another setting's value, read
    # only when that one has a value: the SMTP password, only with TOKO_SMTP_URL.
    field: str | tuple[str, str]
    help: str
    # Which programs use the value (all of them check it, whatever they use).
    programs: tuple[str, ...]
    # The value as written (blanks around it dropped) to the setting; a
    # ValueError says what it must be.
    parse: Callable[[str], Any] = str
    # As written in toko.env, parsed like a value. None: unset, or derived.
    default: str | None = None
    # The default when it depends on the environment (not parsed: it is not
    # the admin's), with ``default_doc`` saying it in words.
    derive: Derived | None = None
    default_doc: str = ""
    doc: str = ""
    note: str = ""
    # Values the env example shows, commented out; none: the default.
    examples: tuple[str, ...] = ()
    # A secret: read from the file the variable names, else from this systemd
    # credential; ``check`` refuses one toko could not use.
    credential: str | None = None
    check: Callable[[str], None] | None = None
    # For the tests' fault injection: known, not documented.
    testing: bool = False

    @property
    def fields(self) -> tuple[str, ...]:
        return (self.field,) if isinstance(self.field, str) else self.field

    def read(self, environ: Mapping[str, str], earlier: Mapping[str, Any]) -> Any:
        """This variable's setting from ``environ``; ``earlier``: the ones before it."""
        if self.credential is not None:
            secret = read_secret(environ, self.name, self.credential)
            if secret is not None and self.check is not None:
                self.check(secret)
            return secret
        raw = environ.get(self.name)
        if raw is None or raw.strip() == "":
            if self.derive is not None:
                return self.derive(environ, earlier)
            return None if self.default is None else self.parse(self.default)
        try:
            return self.parse(raw.strip())
        except ConfigError:
            raise  # a message of its own, which may not echo the value
        except ValueError as exc:
            raise ConfigError(f"{self.name} {exc}, got {shown(raw)}") from None


def _state_directory(environ: Mapping[str, str]) -> str:
    return environ.get("STATE_DIRECTORY", "").split(":")[0]


def _default_database(environ: Mapping[str, str], earlier: Mapping[str, Any]) -> str:
    state_dir = _state_directory(environ)
    return str(Path(state_dir) / "toko.db") if state_dir else "var/toko.db"


def _default_backup_dir(environ: Mapping[str, str], earlier: Mapping[str, Any]) -> str:
    # Backups live beside a SQLite file; a PostgreSQL host keeps its dumps locally.
    database: str = earlier["store.database"]
    if not is_postgres_url(database):
        return str(Path(database).parent / "backups")
    state_dir = _state_directory(environ)
    return str(Path(state_dir) / "backups") if state_dir else "var/backups"


VARIABLES: tuple[Variable, ...] = (
    Variable(
        "TOKO_LISTEN",
        ("http.host", "http.port"),
        "host:port to listen on",
        _API,
        parse_listen,
        default="127.0.0.1:8080",
        doc="host:port, the host a name or an IP address (IPv6 in brackets: `[::1]:8080`); "
        "a socket passed by systemd socket activation wins (and a WARNING says that "
        "TOKO_LISTEN is ignored)",
        note="Under systemd, toko-api.socket says where toko-api listens (127.0.0.1:8080):\n"
        "  systemctl edit toko-api.socket\n"
        "TOKO_LISTEN is only used when toko-api runs without socket activation.",
    ),
    Variable(
        "TOKO_DATABASE",
        "store.database",
        "the SQLite file, or a `postgresql://user@host:port/db` URL",
        PROGRAMS,
        parse_database,
        derive=_default_database,
        default_doc="`$STATE_DIRECTORY/toko.db`, else `./var/toko.db`",
        doc="the SQLite file, or a `postgresql://user@host:port/db` URL (see "
        "[Run on several hosts](../how-to/several-hosts.md)); a URL whose host or port "
        "cannot be read, or with a slash or the colon missing after `postgresql` (taken for "
        "a file name before), stops start-up without echoing the URL, which may hold a "
        "password; so does a folder, the file in it not named",
        note="$STATE_DIRECTORY is /var/lib/toko under systemd. Several hosts share a "
        "PostgreSQL database instead (password as the credential db-password; see "
        "/usr/share/doc/toko/docs/how-to/several-hosts.md):",
        examples=("postgresql://toko@db.example.com:5432/toko", "/var/lib/toko/toko.db"),
    ),
    Variable(
        "TOKO_DATABASE_PASSWORD_FILE",
        "store.database_password",
        "the PostgreSQL password",
        PROGRAMS,
        credential="db-password",
        doc="used when the URL holds none",
    ),
    Variable(
        "TOKO_SMTP_URL",
        "mail.smtp",
        "the mail server, `smtp://[user@]host[:port]` or `smtps://…`",
        _API,
        parse_smtp_url,
        default_doc="unset: emails go to the log",
        doc="`smtp://[user@]host[:port]` (port 25; STARTTLS, see below) or `smtps://…` "
        "(port 465); the host is a name (letters, digits, `-`, `_`, dots; no `%` escapes) "
        "or an IP address, IPv6 in brackets (`smtp://[::1]`)",
        note='Unset, every email is written to the journal instead ("email logged"), so a '
        "fresh install works without a mail server. With a user, the password only goes "
        "over TLS whose certificate checks out (STARTTLS on smtp://, or smtps://). Without "
        "one, as for the host's own Postfix, STARTTLS is used when offered and its "
        "certificate is not checked.",
        examples=("smtp://toko@mail.example.com:587", "smtp://127.0.0.1"),
    ),
    Variable(
        "TOKO_SMTP_PASSWORD_FILE",
        "mail.smtp.password",
        "the SMTP password",
        _API,
        credential="smtp-password",
        doc="needed when `TOKO_SMTP_URL` has a user",
    ),
    Variable(
        "TOKO_ADMIN_EMAIL",
        "mail.admin_emails",
        "who gets the emails; several addresses, separated by commas, share one",
        _API,
        parse_email_list,
        default="admin@toko.com",
        doc="who gets the emails (new products, recaps, failed timer jobs); several "
        "addresses separated by commas share one email. One the server refuses for good "
        "(5xx) is logged as a warning while the others still get it; one it defers (4xx) "
        "gets the same email at the next attempt, and those who have it are not sent it again",
    ),
    Variable(
        "TOKO_MAIL_FROM",
        "mail.sender",
        "sender address",
        _API,
        parse_email,
        default="toko@localhost",
        doc="sender; its domain ends every Message-ID",
    ),
    Variable(
        "TOKO_WORKERS",
        "pool.workers",
        "concurrent job workers",
        _API,
        int_between(1, 256),
        default="3",
    ),
    Variable(
        "TOKO_JOB_MAX_ATTEMPTS",
        "jobs.max_attempts",
        "attempts before a job is kept as `failed`",
        ("toko-api", "toko-recap", "toko-alert"),
        int_between(1, 100),
        default="20",
        doc="attempts before a job is kept as `failed`: with the default backoff, 4.6 to 9 "
        "hours of retries, so a mail outage of a few hours needs no hand",
        note="20 attempts at 2 s doubling up to an hour: 4.6 to 9 hours of retries.",
    ),
    Variable(
        "TOKO_JOB_BACKOFF",
        "pool.backoff",
        "base seconds of the exponential retry backoff",
        _API,
        seconds(0.0, 3600.0),
        default="2",
        doc="base seconds of the retry backoff: the retries wait 1\u20132, 2\u20134, "
        "4\u20138, … seconds (the delay doubles and its upper half is random), at most an hour",
    ),
    Variable(
        "TOKO_JOB_TIMEOUT",
        "pool.timeout",
        "seconds one attempt may take",
        _API,
        seconds(0.1, 3600.0),
        default="30",
        doc="seconds one attempt may take; reaching the mail server (TCP, TLS on `smtps://`, "
        "its greeting) may take half of it",
    ),
    Variable(
        "TOKO_DRAIN_TIMEOUT",
        "pool.drain_timeout",
        "seconds running jobs get to finish when toko-api stops",
        _API,
        seconds(0.0, 3600.0),
        default="10",
        note="Keep it below the unit's TimeoutStopSec= (30 s).",
    ),
    Variable(
        "TOKO_CLIENT_TIMEOUT",
        "http.client_timeout",
        "seconds a client has to send a request, then its body",
        _API,
        seconds(1.0, 3600.0),
        default="75",
        doc="seconds a client has to send a whole request (from connecting, or from its last "
        "answer on a kept-alive connection), and then its body; then the connection is "
        "closed (a body gets a `408`)",
        note="toko-api then closes the connection. Keep it above a reverse proxy's keep-alive.",
    ),
    Variable(
        "TOKO_LOG_LEVEL",
        "log.level",
        "`debug`, `info`, `warning` or `error`",
        ("toko-api", "toko-recap", "toko-backup", "toko-alert"),
        parse_log_level,
        default="info",
    ),
    Variable(
        "TOKO_BACKUP_DIR",
        "backup.dir",
        "where `toko-backup` writes",
        ("toko-backup",),
        derive=_default_backup_dir,
        default_doc="`backups/` beside a SQLite file; for PostgreSQL "
        "`$STATE_DIRECTORY/backups`, else `./var/backups`",
        note="toko-backup.timer runs it nightly. A folder outside /var/lib/toko also "
        "needs `systemctl edit toko-backup` with\n"
        "  [Service]\n"
        "  ReadWritePaths=/srv/toko-backups",
        examples=("/var/lib/toko/backups",),
    ),
    Variable(
        "TOKO_BACKUP_KEEP",
        "backup.keep",
        "how many backups `toko-backup` keeps",
        ("toko-backup",),
        int_between(1, 10000),
        default="7",
    ),
    Variable(
        "TOKO_TEXTFILE_DIR",
        "textfile.dir",
        "node_exporter's textfile folder, where `toko-recap` and `toko-backup` report",
        ("toko-recap", "toko-backup"),
        default="/var/lib/prometheus/node-exporter",
        doc="the folder node_exporter's textfile collector reads: after each run `toko-recap` "
        "and `toko-backup` replace `toko-recap.prom` and `toko-backup.prom` there (last run, "
        "last success, duration, exit status and their own figures). A folder that does not "
        "exist is no error (a host without node_exporter); one they cannot write gets a "
        "warning; neither changes how the job ends",
        note="The folder Debian's prometheus-node-exporter reads. Only root may write there: "
        "to let toko-recap and toko-backup (user toko) write their .prom files,\n"
        "  dpkg-statoverride --update --add root toko 1775 /var/lib/prometheus/node-exporter",
    ),
    Variable(
        "TOKO_API_TOKEN_FILE",
        "http.api_token",
        "the token that writes must carry",
        _API,
        credential="api-token",
        check=check_api_token,
        doc="without one, writes are open",
    ),
    Variable(
        "TOKO_JOB_RETENTION",
        "jobs.retention",
        "age after which toko-recap prunes done jobs, like `12h` or `7d`",
        ("toko-recap",),
        retention,
        default="7d",
        doc="done jobs older than this are pruned by `toko-recap`",
        note="It prunes them after each daily recap.",
    ),
    Variable(
        "TOKO_FAULT_INJECTION",
        "faults.injection",
        "SIGUSR1 kills a worker, SIGUSR2 blocks the event loop",
        _API,
        parse_bool,
        default="0",
        testing=True,
    ),
    Variable(
        "TOKO_FAULT_BLOCK_SECONDS",
        "faults.block_seconds",
        "how long SIGUSR2 blocks the event loop",
        _API,
        seconds(0.0, 600.0),
        default="5",
        testing=True,
    ),
)

# Every TOKO_ variable a toko program reads. Any other one is almost always a
# typo (TOKO_WORKER=8, TOKO_SMTP_ULR=...) that would be ignored without a word,
# the default quietly used instead.
KNOWN_VARIABLES = frozenset(variable.name for variable in VARIABLES)


def read_variables(environ: Mapping[str, str]) -> dict[str, Any]:
    """The settings the variables set, by path (``jobs.workers``), read from
    ``environ`` in the table's order."""
    values: dict[str, Any] = {}
    for variable in VARIABLES:
        if isinstance(variable.field, tuple):
            values.update(zip(variable.field, variable.read(environ, values), strict=True))
            continue
        owner, _, attribute = variable.field.rpartition(".")
        if owner.count(".") == 0:
            values[variable.field] = variable.read(environ, values)
        elif values[owner] is not None:
            values[owner] = replace(values[owner], **{attribute: variable.read(environ, values)})
    return values


# What Settings() holds without a word of configuration: from_env({}) as well.
DEFAULTS = read_variables({})


def unknown_variables(environ: Mapping[str, str]) -> tuple[str, ...]:
    """TOKO_ variables set but read by nothing, sorted."""
    return tuple(sorted(n for n in environ if n.startswith("TOKO_") and n not in KNOWN_VARIABLES))


def closest_known(name: str) -> str | None:
    """The known variable ``name`` is most likely a typo of, if one is close.

    Compared without the TOKO_ prefix they all share, which alone made
    TOKO_SOMETHING_ELSE "close" to TOKO_ADMIN_EMAIL.
    """
    known = {variable.name[5:]: variable.name for variable in VARIABLES}
    close = difflib.get_close_matches(name[5:], known, n=1, cutoff=0.75)
    return known[close[0]] if close else None
