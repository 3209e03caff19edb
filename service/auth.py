"""Write authentication: a bearer token on every request that may change something.

Reads (GET, HEAD, OPTIONS) stay open. Everything else that reaches a handler
needs ``Authorization: Bearer <token>``; requests that match no route keep
their 404/405, which reveal nothing and write nothing. The token is compared
as a SHA-256 digest with ``hmac.compare_digest``: equal-length digests, so
neither the token's content nor its length leaks through timing. Neither the
expected nor the presented token is ever logged.
"""

from __future__ import annotations

import hashlib
import hmac
import logging

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from service.errors import json_error

log = logging.getLogger("toko.auth")

READ_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
REALM = 'Bearer realm="toko"'


def _digest(token: str) -> bytes:
    # surrogatepass: a header aiohttp decoded leniently still hashes, and never matches.
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()


def presented_token(header: str | None) -> str | None:
    """The credentials of an ``Authorization: Bearer ...`` header, or None."""
    if header is None:
        return None
    scheme, _, credentials = header.strip().partition(" ")
    # RFC 7235: the scheme name is case-insensitive.
    if scheme.lower() != "bearer":
        return None
    return credentials.strip() or None


def bearer_auth(token: str | None) -> Middleware | None:
    """The middleware enforcing ``token`` on writes; None (writes open) without a token."""
    if token is None:
        log.warning(
            "NO API TOKEN CONFIGURED: POST and every other write is open to anyone who can "
            "reach this port. Set the systemd credential api-token or TOKO_API_TOKEN_FILE."
        )
        return None
    expected = _digest(token)
    log.info("writes require a bearer token")

    @web.middleware
    async def require_token(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.method in READ_METHODS or request.match_info.http_exception is not None:
            return await handler(request)
        presented = presented_token(request.headers.get("Authorization"))
        if presented is None:
            return json_error(
                401,
                "this request needs an API token: send 'Authorization: Bearer <token>'",
                {"WWW-Authenticate": REALM},
            )
        if not hmac.compare_digest(_digest(presented), expected):
            return json_error(
                401,
                "the API token is not valid",
                {"WWW-Authenticate": f'{REALM}, error="invalid_token"'},
            )
        return await handler(request)

    return require_token
