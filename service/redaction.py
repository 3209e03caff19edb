"""URLs without their passwords: the one place that knows where a URL holds one.

A password can sit in the user part (``user:password@host``) or, for libpq
and asyncpg, in the query (``?password=``). Messages and logs get the URL
with it masked (``redact``); a command line gets it with the password left
out, and the password apart (``without_password``).
"""

from __future__ import annotations

import re
from urllib.parse import unquote, urlsplit, urlunsplit

# libpq and asyncpg also take the password as a query parameter (?password=).
_QUERY_PASSWORD = re.compile(r"(?<![^&])password=([^&]*)")
# The same anywhere in a URL that urlsplit could not read.
_ANY_QUERY_PASSWORD = re.compile(r"(?<=[?&])password=[^&#]*")

MASK = "***"


def redact(url: str) -> str:
    """The URL without its password, for messages and logs.

    A URL that urlsplit cannot read ("Invalid IPv6 URL"), or with an "@" in
    its path or fragment, where no user part can be (a typo in the scheme:
    "smtp:/u:pw@host", "smt%p://u:pw@host"), may hold a password where
    urlsplit does not look: what comes before its last "@" is cut then
    ("...@host:25").
    """
    try:
        parts = urlsplit(url)
        readable = "@" not in parts.path + parts.fragment
    except ValueError:
        readable = False
    if not readable:
        _, at, after = url.rpartition("@")
        shown = f"...@{after}" if at else url
        return _ANY_QUERY_PASSWORD.sub(f"password={MASK}", shown)
    return _replace_password(url, MASK)[0]


def without_password(url: str) -> tuple[str, str | None]:
    """``url`` with no password in it, for a command line; and the password
    it held (decoded), the one in the user part first, as libpq takes it."""
    return _replace_password(url, None)


def _replace_password(url: str, mask: str | None) -> tuple[str, str | None]:
    parts = urlsplit(url)
    in_query = _QUERY_PASSWORD.search(parts.query)
    if parts.password is None and in_query is None:
        return url, None
    password = parts.password if parts.password is not None else in_query and in_query[1]
    netloc = parts.netloc
    if parts.password is not None:
        user = parts.username or ""
        hosts = netloc.rpartition("@")[2]
        netloc = f"{user}@{hosts}" if mask is None else f"{user}:{mask}@{hosts}"
    query = _QUERY_PASSWORD.sub("" if mask is None else f"password={mask}", parts.query)
    query = "&".join(param for param in query.split("&") if param)
    return urlunsplit(parts._replace(netloc=netloc, query=query)), unquote(password or "")
