"""Parsers of the settings' values: the text of one variable to what toko uses.

A parser raises ValueError saying what the value must be ("must be an
integer from 1 to 256"); the spec (service.settings_spec) puts the variable's
name before it and the value, cut short, after. A ConfigError is a whole
message of its own, for values that may hold a password and are not echoed.
"""

from __future__ import annotations

import ipaddress
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from email.utils import parseaddr
from urllib.parse import unquote, urlsplit

from service.durations import parse_duration
from service.redaction import redact
from service.validation import ascii_int


class ConfigError(ValueError):
    """A setting is missing or malformed; the message names the variable."""


def shown(raw: str) -> str:
    """``raw`` quoted for a message; a long one cut short, so the line stays readable."""
    if len(raw) <= 100:
        return repr(raw)
    return f"{raw[:40]!r}... ({len(raw)} characters)"


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


def parse_listen(raw: str) -> tuple[str, int]:
    host, sep, port_text = raw.rpartition(":")
    host = host.strip("[]")
    # ascii_int, not int(): int() raises its own message for "²" or 5000 digits.
    port = ascii_int(port_text, 1, 65535)
    if not sep or not host or port is None:
        raise ValueError("must be host:port with a port from 1 to 65535")
    if not is_host(host):
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


def is_postgres_url(database: str) -> bool:
    return database.startswith(("postgresql://", "postgres://"))


def parse_database(raw: str) -> str:
    if "://" not in raw and not _is_usable_path(raw):
        # No file can have such a path: toko-api said so only when opening
        # it, and toko-recap and toko-queue ended in a traceback.
        raise ValueError(
            f"must be a file path shorter than {_PATH_MAX} bytes, with no name in it "
            f"over {_NAME_MAX} bytes and no NUL character"
        )
    _check_database_url(raw)
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
            f"got a URL starting {shown(scheme + separator)}"
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


def parse_email(raw: str) -> str:
    local, at, domain = raw.partition("@")
    plain = not any(c.isspace() or c in "<>," for c in raw)
    # parseaddr is how the SMTP client reads the header: an address it cannot
    # read back whole (a@b@c, a;b@c) would fail every send, not start-up.
    if not (at and local and domain and plain) or parseaddr(raw) != ("", raw):
        raise ValueError("must be one plain address like name@example.com")
    return raw


def parse_email_list(raw: str) -> tuple[str, ...]:
    addresses = [part.strip() for part in raw.split(",")]
    if "" in addresses:
        raise ValueError("must be addresses separated by commas, with none empty")
    try:
        parsed = tuple(parse_email(address) for address in addresses)
    except ValueError:
        raise ValueError(
            "must be one or more plain addresses like name@example.com, separated by commas"
        ) from None
    twice = next((a for i, a in enumerate(parsed) if a in parsed[:i]), None)
    if twice is not None:
        raise ValueError(f"names {twice} twice")
    return parsed


def int_between(low: int, high: int) -> Callable[[str], int]:
    def parse(raw: str) -> int:
        # ASCII digits, as TOKO_LISTEN's port: int() also took "+7", "1_0"
        # (ten) and other scripts' digits.
        value = ascii_int(raw.strip(), low, high)
        if value is None:
            raise ValueError(f"must be an integer from {low} to {high}")
        return value

    return parse


def seconds(low: float, high: float) -> Callable[[str], float]:
    def parse(raw: str) -> float:
        try:
            value = float(raw)
        except ValueError:
            value = math.nan
        if not low <= value <= high:  # NaN fails this too
            raise ValueError(f"must be a number of seconds from {low:g} to {high:g}")
        return value

    return parse


def retention(raw: str) -> float:
    value = parse_duration(raw)
    # Under an hour would prune jobs an admin may still want to look at or retry.
    if value < 3600:
        raise ValueError("must be a duration of at least 1h, like 12h or 7d")
    return value


def parse_log_level(raw: str) -> str:
    level = raw.upper()
    if level not in {"DEBUG", "INFO", "WARNING", "ERROR"}:
        raise ValueError("must be one of debug, info, warning, error")
    return level


def parse_bool(raw: str) -> bool:
    lowered = raw.lower()
    if lowered in {"1", "true", "yes", "on"}:
        return True
    if lowered in {"0", "false", "no", "off"}:
        return False
    raise ValueError("must be 1 or 0")


def parse_smtp_url(raw: str) -> SmtpTarget:
    """The mail server ``raw`` names, its password not yet known (read apart)."""
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
            f"to 65535, got {shown(redact(raw))}"
        )
    if not is_host(host):
        raise ConfigError(
            "TOKO_SMTP_URL must name the mail server by a host name (letters, digits, "
            f"'-', '_' and dots) or an IP address, got {shown(redact(raw))}"
        )
    use_tls = parts.scheme == "smtps"
    return SmtpTarget(
        host=host,
        port=(465 if use_tls else 25) if port is None else port,
        username=unquote(parts.username) if parts.username else None,
        password=None,
        use_tls=use_tls,
    )


# One label of a host name (RFC 1123), plus "_", which resolvers and
# /etc/hosts take and some internal names have.
_HOST_LABEL = re.compile(r"(?!-)[a-z0-9_-]{1,63}(?<!-)", re.IGNORECASE)


def is_host(host: str) -> bool:
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


# What no HTTP header value can carry (RFC 9110 field-value): the C0 controls
# but the tab, and DEL. A line break inside a token file (base64 wraps at 76)
# is the usual one.
_NOT_IN_A_HEADER = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")


def check_api_token(token: str) -> None:
    if not token:
        # An empty file would let an empty Bearer token in; refuse rather than guess.
        raise ConfigError("the API token (TOKO_API_TOKEN_FILE or credential api-token) is empty")
    if _NOT_IN_A_HEADER.search(token):
        # No client could send it, so every write would get a 401 that blames the client.
        raise ConfigError(
            "the API token (TOKO_API_TOKEN_FILE or credential api-token) has a line break or "
            "another control character inside, which no Authorization header can carry; "
            "write the token on one line"
        )
