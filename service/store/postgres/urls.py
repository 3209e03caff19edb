"""A database URL's password, kept out of messages and command lines."""

from __future__ import annotations

import re
from urllib.parse import unquote, urlsplit, urlunsplit

# libpq and asyncpg also take the password as a query parameter (?password=).
_QUERY_PASSWORD = re.compile(r"(?<![^&])password=([^&]*)")


def redact(url: str) -> str:
    """The URL without its password, for messages and logs."""
    return _replace_password(url, "***")[0]


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
