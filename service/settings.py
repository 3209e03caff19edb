"""Configuration: built once from the environment, then passed around frozen.

Nothing else in the service reads ``os.environ``; a bad value stops start-up
with one line that names the variable.
"""

from __future__ import annotations

import difflib
import ipaddress
import math
import os
import pwd
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from email.utils import parseaddr
from pathlib import Path
from typing import TypeVar
from urllib.parse import unquote, urlsplit

from service.durations import parse_duration
from service.validation import ascii_int

T = TypeVar("T")


class ConfigError(ValueError):
    """A setting is missing or malformed; the message names the variable."""


# Every TOKO_ variable a toko program reads. Any other one is almost always a
# typo (TOKO_WORKER=8, TOKO_SMTP_ULR=...) that would be ignored without a word,
# the default quietly used instead.
KNOWN_VARIABLES = frozenset(
    {
        "TOKO_LISTEN",
        "TOKO_DATABASE",
        "TOKO_DATABASE_PASSWORD_FILE",
        "TOKO_SMTP_URL",
        "TOKO_SMTP_PASSWORD_FILE",
        "TOKO_ADMIN_EMAIL",
        "TOKO_MAIL_FROM",
        "TOKO_WORKERS",
        "TOKO_JOB_MAX_ATTEMPTS",
        "TOKO_JOB_BACKOFF",
        "TOKO_JOB_TIMEOUT",
        "TOKO_DRAIN_TIMEOUT",
        "TOKO_CLIENT_TIMEOUT",
        "TOKO_LOG_LEVEL",
        "TOKO_BACKUP_DIR",
        "TOKO_BACKUP_KEEP",
        "TOKO_API_TOKEN_FILE",
        "TOKO_JOB_RETENTION",
        "TOKO_FAULT_INJECTION",
        "TOKO_FAULT_BLOCK_SECONDS",
    }
)


@dataclass(frozen=True)
class SmtpTarget:
    host: str
    port: int
    username: str | None
    password: str | None = field(repr=False)  # never in logs or tracebacks
    # smtps:// wraps the whole connection in TLS; smtp:// upgrades with STARTTLS.
    use_tls: bool

    @property
    def logs_in(self) -> bool:
        return self.username is not None

    @property
    def start_tls(self) -> bool | None:
        """STARTTLS on smtp://: required to log in, else used when offered (None)."""
        if self.use_tls:
            return None  # already TLS; aiosmtplib refuses True with use_tls
        return True if self.logs_in else None

    @property
    def verify_certificate(self) -> bool:
        """Whether the server's certificate must check out.

        Always for smtps:// and for a login, so that the password only ever
        reaches the server named in the URL. Not for a plain smtp:// relay:
        there STARTTLS is opportunistic (RFC 7435), plain text is accepted
        when the server offers no STARTTLS, so checking the certificate would
        stop no attacker, only the mail. The usual such relay, a local
        Postfix, offers STARTTLS with a self-signed certificate.
        """
        return self.use_tls or self.logs_in


@dataclass(frozen=True)
class Settings:
    listen_host: str = "127.0.0.1"
    listen_port: int = 8080
    database: str = "var/toko.db"
    # PostgreSQL password when not in the URL: systemd credential or file, never env.
    database_password: str | None = field(default=None, repr=False)
    smtp: SmtpTarget | None = None
    # Everyone told about new products, recaps and alerts: one email to all.
    admin_emails: tuple[str, ...] = ("admin@toko.com",)
    mail_from: str = "toko@localhost"
    workers: int = 3
    # With the default backoff, between 4.6 and 9 hours of retries (the delay
    # doubles from 2 s up to an hour): a mail outage of a few hours ends with
    # every email delivered, not kept as failed for someone to retry by hand.
    job_max_attempts: int = 20
    job_backoff: float = 2.0
    job_timeout: float = 30.0
    drain_timeout: float = 10.0
    # How long an HTTP client may take to send a request (from connecting, or
    # from the last answer on a kept-alive connection) and then its body.
    client_timeout: float = 75.0
    log_level: str = "INFO"
    max_body_bytes: int = 64 * 1024
    backup_dir: str = "var/backups"
    backup_keep: int = 7
    # Bearer token for writes (systemd credential api-token or TOKO_API_TOKEN_FILE).
    # None: writes are open (development). Kept out of repr so it never reaches a log.
    api_token: str | None = field(default=None, repr=False)
    # Done jobs older than this are pruned by toko-recap.
    job_retention: float = 7 * 86400.0
    # systemd's environment contract, read here so the rest stays pure.
    notify_socket: str | None = None
    watchdog_interval: float | None = None
    journal: bool = False
    fault_injection: bool = False
    fault_block_seconds: float = 5.0
    # TOKO_ variables set but read by nothing: see unknown_variables_line().
    unknown_variables: tuple[str, ...] = ()
    # Whether TOKO_LISTEN was set: socket activation then overrides it (listener).
    listen_given: bool = False

    @property
    def is_postgres(self) -> bool:
        return self.database.startswith(("postgresql://", "postgres://"))

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> Settings:
        env = _Env(environ)
        host, port = env.get("TOKO_LISTEN", _parse_listen, ("127.0.0.1", 8080))
        state_dir = environ.get("STATE_DIRECTORY", "").split(":")[0]
        default_db = str(Path(state_dir) / "toko.db") if state_dir else "var/toko.db"
        database = env.get("TOKO_DATABASE", _parse_database, default_db)
        _check_database_url(database)
        # Backups live beside a SQLite file; a PostgreSQL host keeps its dumps locally.
        if database.startswith(("postgresql://", "postgres://")):
            default_backups = str(Path(state_dir) / "backups") if state_dir else "var/backups"
        else:
            default_backups = str(Path(database).parent / "backups")
        return cls(
            listen_host=host,
            listen_port=port,
            database=database,
            database_password=_secret_file(environ, "TOKO_DATABASE_PASSWORD_FILE", "db-password"),
            smtp=_smtp_from_env(environ),
            admin_emails=env.get("TOKO_ADMIN_EMAIL", _parse_email_list, ("admin@toko.com",)),
            mail_from=env.get("TOKO_MAIL_FROM", _parse_email, "toko@localhost"),
            workers=env.get("TOKO_WORKERS", _int_between(1, 256), 3),
            job_max_attempts=env.get("TOKO_JOB_MAX_ATTEMPTS", _int_between(1, 100), 20),
            job_backoff=env.get("TOKO_JOB_BACKOFF", _seconds(0.0, 3600.0), 2.0),
            job_timeout=env.get("TOKO_JOB_TIMEOUT", _seconds(0.1, 3600.0), 30.0),
            drain_timeout=env.get("TOKO_DRAIN_TIMEOUT", _seconds(0.0, 3600.0), 10.0),
            client_timeout=env.get("TOKO_CLIENT_TIMEOUT", _seconds(1.0, 3600.0), 75.0),
            log_level=env.get("TOKO_LOG_LEVEL", _parse_log_level, "INFO"),
            backup_dir=env.get("TOKO_BACKUP_DIR", str, default_backups),
            backup_keep=env.get("TOKO_BACKUP_KEEP", _int_between(1, 10000), 7),
            api_token=_api_token(environ),
            job_retention=env.get("TOKO_JOB_RETENTION", _retention, 7 * 86400.0),
            notify_socket=environ.get("NOTIFY_SOCKET") or None,
            watchdog_interval=_watchdog_interval(environ),
            journal=output_is_journal(environ.get("JOURNAL_STREAM")),
            fault_injection=env.get("TOKO_FAULT_INJECTION", _parse_bool, False),
            fault_block_seconds=env.get("TOKO_FAULT_BLOCK_SECONDS", _seconds(0.0, 600.0), 5.0),
            unknown_variables=tuple(
                sorted(n for n in environ if n.startswith("TOKO_") and n not in KNOWN_VARIABLES)
            ),
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
            meant = _closest_known(name)
            named.append(f"{name!r} (meant {meant}?)" if meant else repr(name))
        return (
            f"unknown settings ignored: {', '.join(named)} "
            "(README: Configuration lists the known ones)"
        )


def _closest_known(name: str) -> str | None:
    """The known variable ``name`` is most likely a typo of, if one is close.

    Compared without the TOKO_ prefix they all share, which alone made
    TOKO_SOMETHING_ELSE "close" to TOKO_ADMIN_EMAIL.
    """
    known = {known[5:]: known for known in KNOWN_VARIABLES}
    close = difflib.get_close_matches(name[5:], known, n=1, cutoff=0.75)
    return known[close[0]] if close else None


class _Env:
    def __init__(self, environ: Mapping[str, str]) -> None:
        self._environ = environ

    def get(self, name: str, parse: Callable[[str], T], default: T) -> T:
        raw = self._environ.get(name)
        if raw is None or raw.strip() == "":
            return default
        try:
            return parse(raw.strip())
        except ValueError as exc:
            raise ConfigError(f"{name} {exc}, got {_shown(raw)}") from None


def _shown(raw: str) -> str:
    """``raw`` quoted for a message; a long one cut short, so the line stays readable."""
    if len(raw) <= 100:
        return repr(raw)
    return f"{raw[:40]!r}... ({len(raw)} characters)"


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


def _parse_listen(raw: str) -> tuple[str, int]:
    host, sep, port_text = raw.rpartition(":")
    host = host.strip("[]")
    # ascii_int, not int(): int() raises its own message for "²" or 5000 digits.
    port = ascii_int(port_text, 1, 65535)
    if not sep or not host or port is None:
        raise ValueError("must be host:port with a port from 1 to 65535")
    if not _is_host(host):
        # A space, a line break or 100 KB of host failed only at bind, in a
        # line that named neither the variable nor, readably, the host.
        raise ValueError("must name a host name or an IP address to listen on")
    return host, port


# Linux's PATH_MAX and NAME_MAX, in bytes.
_PATH_MAX = 4096
_NAME_MAX = 255


# A postgresql:// URL with a slash or the colon missing, which would be taken
# for a SQLite file path: toko-api made a database file named after it, and
# toko-backup and toko-recap printed that path, password and all.
_MISTYPED_URL = re.compile(r"postgres(ql)?(:/?(?!//)|//)", re.IGNORECASE)


def _parse_database(raw: str) -> str:
    if "://" in raw:
        return raw  # _check_database_url, which echoes no password
    if not _is_usable_path(raw):
        # No file can have such a path: toko-api said so only when opening
        # it, and toko-recap and toko-queue ended in a traceback.
        raise ValueError(
            f"must be a file path shorter than {_PATH_MAX} bytes, with no name in it "
            f"over {_NAME_MAX} bytes and no NUL character"
        )
    return raw


def _is_usable_path(path: str) -> bool:
    try:
        encoded = os.fsencode(path)
    except UnicodeEncodeError:  # a lone surrogate that no file name can hold
        return False
    names = encoded.split(b"/")
    return b"\0" not in encoded and len(encoded) < _PATH_MAX and max(map(len, names)) <= _NAME_MAX


def _check_database_url(database: str) -> None:
    """Refuse a URL that is no postgresql:// one, or whose hosts and ports asyncpg
    cannot take, without echoing it: it may hold a password.

    A malformed one ended toko-api in a traceback ("Invalid IPv6 URL" from
    urlsplit, OverflowError from getaddrinfo for a port of 20 digits); an out
    of range port was looked up as a service name ("Name or service not
    known").
    """
    scheme, separator, _ = database.partition("://")
    if not separator and _MISTYPED_URL.match(database):
        raise ConfigError(
            "TOKO_DATABASE looks like a postgresql:// URL with a slash or a colon missing; "
            "write it as postgresql://[user@]host[:port]/database"
        )
    if not separator:
        return
    if scheme not in {"postgresql", "postgres"}:
        raise ConfigError(
            "TOKO_DATABASE must be a SQLite file path or a postgresql:// URL, "
            f"got a URL starting {_shown(scheme + separator)}"
        )
    try:
        netloc = urlsplit(database).netloc
        # Several hosts, comma separated, are asyncpg's way to list fallbacks.
        ports = [urlsplit(f"//{host}").port for host in netloc.rpartition("@")[2].split(",")]
    except ValueError:
        ports = [0]
    if 0 in ports:
        raise ConfigError(
            "TOKO_DATABASE must look like postgresql://[user@]host[:port]/database with a "
            "port from 1 to 65535, and an IPv6 address in brackets like "
            "postgresql://toko@[::1]:5432/toko"
        )


def _parse_email(raw: str) -> str:
    local, at, domain = raw.partition("@")
    plain = not any(c.isspace() or c in "<>," for c in raw)
    # parseaddr is how the SMTP client reads the header: an address it cannot
    # read back whole (a@b@c, a;b@c) would fail every send, not start-up.
    if not (at and local and domain and plain) or parseaddr(raw) != ("", raw):
        raise ValueError("must be one plain address like name@example.com")
    return raw


def _parse_email_list(raw: str) -> tuple[str, ...]:
    addresses = [part.strip() for part in raw.split(",")]
    if "" in addresses:
        raise ValueError("must be addresses separated by commas, with none empty")
    try:
        parsed = tuple(_parse_email(address) for address in addresses)
    except ValueError:
        raise ValueError(
            "must be one or more plain addresses like name@example.com, separated by commas"
        ) from None
    twice = next((a for i, a in enumerate(parsed) if a in parsed[:i]), None)
    if twice is not None:
        raise ValueError(f"names {twice} twice")
    return parsed


def _int_between(low: int, high: int) -> Callable[[str], int]:
    def parse(raw: str) -> int:
        # ASCII digits, as TOKO_LISTEN's port: int() also took "+7", "1_0"
        # (ten) and other scripts' digits.
        value = ascii_int(raw.strip(), low, high)
        if value is None:
            raise ValueError(f"must be an integer from {low} to {high}")
        return value

    return parse


def _seconds(low: float, high: float) -> Callable[[str], float]:
    def parse(raw: str) -> float:
        try:
            value = float(raw)
        except ValueError:
            value = math.nan
        if not low <= value <= high:  # NaN fails this too
            raise ValueError(f"must be a number of seconds from {low:g} to {high:g}")
        return value

    return parse


def _parse_log_level(raw: str) -> str:
    level = raw.upper()
    if level not in {"DEBUG", "INFO", "WARNING", "ERROR"}:
        raise ValueError("must be one of debug, info, warning, error")
    return level


def _parse_bool(raw: str) -> bool:
    lowered = raw.lower()
    if lowered in {"1", "true", "yes", "on"}:
        return True
    if lowered in {"0", "false", "no", "off"}:
        return False
    raise ValueError("must be 1 or 0")


def _smtp_from_env(environ: Mapping[str, str]) -> SmtpTarget | None:
    raw = environ.get("TOKO_SMTP_URL", "").strip()
    if not raw:
        return None
    try:
        parts = urlsplit(raw)
    except ValueError:
        # An unclosed "[" or a bracketed host that is no IP address. Not echoed:
        # nothing has checked yet that the URL holds no password.
        raise ConfigError(
            "TOKO_SMTP_URL must look like smtp://[user@]host[:port], with an IPv6 "
            "address in brackets like smtp://[::1]:25"
        ) from None
    try:
        port = parts.port
    except ValueError:
        port = -1
    # First, so that no later message echoes the password.
    if parts.password:
        raise ConfigError(
            "TOKO_SMTP_URL must not contain a password; use the systemd credential "
            "'smtp-password' or TOKO_SMTP_PASSWORD_FILE"
        )
    host = parts.hostname
    if parts.scheme not in {"smtp", "smtps"} or not host or port in (-1, 0):
        raise ConfigError(
            f"TOKO_SMTP_URL must look like smtp://[user@]host[:port] with a port from 1 "
            f"to 65535, got {_shown(_without_userinfo(raw))}"
        )
    if not _is_host(host):
        raise ConfigError(
            "TOKO_SMTP_URL must name the mail server by a host name (letters, digits, "
            f"'-', '_' and dots) or an IP address, got {_shown(_without_userinfo(raw))}"
        )
    use_tls = parts.scheme == "smtps"
    return SmtpTarget(
        host=host,
        port=(465 if use_tls else 25) if port is None else port,
        username=unquote(parts.username) if parts.username else None,
        password=_smtp_password(environ),
        use_tls=use_tls,
    )


def _without_userinfo(url: str) -> str:
    """``url`` with what comes before its last "@" cut, for a message.

    A URL urlsplit cannot read (a typo in the scheme: "smtp:/u:pw@host",
    "smt%p://u:pw@host") has no password to it, so the check for one passed
    it, and the message echoed the password whole.
    """
    _, at, after = url.rpartition("@")
    return f"...@{after}" if at else url


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


def check_database_folder(settings: Settings) -> None:
    """Fail, naming TOKO_DATABASE, where the SQLite file is a folder, or it or its
    folder is read-only or not the user's to write.

    The units let toko write in /var/lib/toko only (ProtectSystem=strict). A
    database moved elsewhere without a ReadWritePaths= drop-in failed with
    "[Errno 30] Read-only file system" on its lock file, exit 1, which
    Restart=on-failure retried until systemd gave up; this is exit 2 instead,
    with what to do. SQLite writes its -wal, -shm and lock file beside the
    database, so the folder must be writable, not only the file.
    """
    if settings.is_postgres:
        return
    if Path(settings.database).is_dir():
        # TOKO_DATABASE=/srv/toko, meant as the folder: "cannot open database
        # /srv/toko: unable to open database file", exit 1, retried by systemd.
        file = Path(settings.database) / "toko.db"
        raise ConfigError(
            f"TOKO_DATABASE names {settings.database}, which is a folder; "
            f"name the database file in it, like {file}"
        )
    # SQLite writes beside the file a symbolic link points to, as toko its lock
    # file: that folder must be writable, not the link's.
    folder = Path(os.path.realpath(settings.database)).parent
    existing = folder
    try:
        while not existing.exists() and existing != existing.parent:
            existing = existing.parent  # toko-api creates the rest
        read_only = bool(os.statvfs(existing).f_flag & os.ST_RDONLY)
    except OSError:
        return  # not ours to judge here: opening the database says what is wrong
    if read_only:
        raise ConfigError(
            f"TOKO_DATABASE names a file in {folder}, which is read-only here: toko's units "
            f"may write only in /var/lib/toko unless a drop-in adds ReadWritePaths={folder} "
            "(README: A database outside /var/lib/toko)"
        )
    # A folder made, or a database copied in, by root (mkdir, cp): "unable to
    # open database file", exit 1, retried until systemd gave up.
    for path, needed in (
        (existing, os.W_OK | os.X_OK),
        (Path(settings.database), os.R_OK | os.W_OK),
    ):
        try:
            owner = path.stat().st_uid
        except OSError:
            continue  # not there yet, or not ours to see: opening it says so
        if owner == 0 and not os.access(path, needed):
            me = user_name(os.geteuid())
            raise ConfigError(
                f"TOKO_DATABASE: {path} belongs to root, and {me} cannot write to it: "
                f"chown {me}: {path}"
            )


def user_name(uid: int) -> str:
    """The name of user ``uid``, or ``#uid`` where it has none."""
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"#{uid}"


# One label of a host name (RFC 1123), plus "_", which resolvers and
# /etc/hosts take and some internal names have.
_HOST_LABEL = re.compile(r"(?!-)[a-z0-9_-]{1,63}(?<!-)", re.IGNORECASE)


def _is_host(host: str) -> bool:
    """Whether ``host`` could be resolved or connected to at all.

    urlsplit passes on whatever stands between "@" and ":", percent escapes
    ("ho%20st"), spaces and quotes included; such a host passed the checks and
    failed every send.
    """
    if ":" in host:  # only a bracketed host can hold one: an IPv6 address
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            return False
        return True
    try:
        # A name in another script is looked up by its ASCII form (IDNA), as
        # the resolver will; that also refuses empty and overlong labels.
        name = host.encode("idna").decode("ascii")
    except UnicodeError:
        return False
    labels = name.removesuffix(".").split(".")
    return len(name) <= 253 and all(_HOST_LABEL.fullmatch(label) for label in labels)


def _smtp_password(environ: Mapping[str, str]) -> str | None:
    return _secret_file(environ, "TOKO_SMTP_PASSWORD_FILE", "smtp-password")


# What no HTTP header value can carry (RFC 9110 field-value): the C0 controls
# but the tab, and DEL. A line break inside a token file (base64 wraps at 76)
# is the usual one.
_NOT_IN_A_HEADER = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")


def _api_token(environ: Mapping[str, str]) -> str | None:
    token = _secret_file(environ, "TOKO_API_TOKEN_FILE", "api-token")
    if token is not None and not token:
        # An empty file would let an empty Bearer token in; refuse rather than guess.
        raise ConfigError("the API token (TOKO_API_TOKEN_FILE or credential api-token) is empty")
    if token is not None and _NOT_IN_A_HEADER.search(token):
        # No client could send it, so every write would get a 401 that blames the client.
        raise ConfigError(
            "the API token (TOKO_API_TOKEN_FILE or credential api-token) has a line break or "
            "another control character inside, which no Authorization header can carry; "
            "write the token on one line"
        )
    return token


def _retention(raw: str) -> float:
    seconds = parse_duration(raw)
    # Under an hour would prune jobs an admin may still want to look at or retry.
    if seconds < 3600:
        raise ValueError("must be a duration of at least 1h, like 12h or 7d")
    return seconds


def _secret_file(environ: Mapping[str, str], file_variable: str, credential: str) -> str | None:
    """A secret from the file ``file_variable`` names, else from a systemd credential."""
    candidates: list[tuple[str, Path]] = []
    if environ.get(file_variable):
        candidates.append((file_variable, Path(environ[file_variable])))
    if environ.get("CREDENTIALS_DIRECTORY"):
        path = Path(environ["CREDENTIALS_DIRECTORY"]) / credential
        if _may_exist(path):
            candidates.append((f"CREDENTIALS_DIRECTORY/{credential}", path))
    for name, path in candidates:
        try:
            return _read_secret(path).decode("utf-8").strip()
        except OSError as exc:
            raise ConfigError(f"{name}: cannot read {_path_shown(path)}: {exc.strerror}") from None
        except UnicodeDecodeError as exc:
            # Say where, not what: the bytes are (part of) a secret.
            raise ConfigError(
                f"{name}: {_path_shown(path)} is not UTF-8 text (byte {exc.start}); "
                "save the secret as UTF-8"
            ) from None
        except _SecretTooLong:
            raise ConfigError(
                f"{name}: {_path_shown(path)} is longer than a secret can be "
                f"({_SECRET_MAX_BYTES} bytes); name the file that holds the secret"
            ) from None
        except ValueError:
            # A NUL in the path: only an env file (toko-queue --env-file) can carry one.
            raise ConfigError(f"{name}: {_path_shown(path)} is not a file path") from None
    return None


# Far more than any password or token; /dev/zero or /dev/urandom named by
# mistake was read until memory ran out, start-up hanging meanwhile.
_SECRET_MAX_BYTES = 64 * 1024


class _SecretTooLong(Exception):
    pass


def _read_secret(path: Path) -> bytes:
    # O_NONBLOCK for the open only: opening a FIFO that no process writes to
    # waited for a writer for ever, start-up hanging without a word. Opened
    # so, it reads as empty and is refused as such; a pipe with a writer (a
    # shell's <(...)) is then read as usual.
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    os.set_blocking(fd, True)
    with open(fd, "rb") as file:
        data = file.read(_SECRET_MAX_BYTES + 1)
    if len(data) > _SECRET_MAX_BYTES:
        raise _SecretTooLong
    return data


def _may_exist(path: Path) -> bool:
    """``path.exists()``, except that a path no file can have (too long, say) is
    taken as present, so that reading it says what is wrong, not a traceback."""
    try:
        return path.exists()
    except OSError:
        return True


def _path_shown(path: Path) -> str:
    """``path`` as it is when plain, quoted and cut short when it holds a line
    break or other control character or is long, so the message stays one line."""
    text = str(path)
    if text.isprintable() and len(text) <= 100:
        return text
    return _shown(text)


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
