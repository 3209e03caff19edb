"""Secrets to plant and look for: every form in which one could leak.

A secret is 24 random characters with a "/", a "+" and a "%" among them, so
that its percent-encoded form differs from it; :func:`leaked_forms` adds the
base64 of what SMTP AUTH PLAIN and LOGIN send.
"""

from __future__ import annotations

import base64
import json
import secrets
import string
from collections.abc import Iterable
from urllib.parse import quote

_ALPHABET = string.ascii_letters + string.digits


def make_secret() -> str:
    body = "".join(secrets.choice(_ALPHABET) for _ in range(21))
    return f"{body[:7]}/{body[7:14]}+{body[14:]}%"


def _b64(data: str) -> str:
    return base64.b64encode(data.encode()).decode()


def leaked_forms(secret: str, user: str | None = None) -> set[str]:
    """``secret`` as it is, percent-encoded, JSON-escaped, base64 (AUTH LOGIN) and,
    with ``user``, as AUTH PLAIN's base64 of "\\0user\\0secret"."""
    forms = {secret, quote(secret, safe=""), json.dumps(secret)[1:-1], _b64(secret)}
    if user is not None:
        forms.add(_b64(f"\0{user}\0{secret}"))
    return forms


def assert_no_secret(text: str, secrets_: Iterable[str], where: str) -> None:
    """Fail naming the place and the form, never printing the secret itself."""
    for number, secret in enumerate(secrets_):
        for form in leaked_forms(secret, "toko"):
            at = text.find(form)
            assert at < 0, (
                f"secret #{number} leaked into {where} at character {at} "
                f"({'as is' if form == secret else 'encoded'})"
            )
