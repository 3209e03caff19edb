"""The one URL-password redaction (service.redaction), for every URL toko shows."""

from __future__ import annotations

import pytest

from service import redaction


@pytest.mark.parametrize(
    ("url", "shown", "for_tools"),
    [
        ("postgresql://toko@db/toko", "postgresql://toko@db/toko", "postgresql://toko@db/toko"),
        (
            "postgresql://toko:s%2Fcret@db/toko",
            "postgresql://toko:***@db/toko",
            "postgresql://toko@db/toko",
        ),
        (
            "postgresql://toko@db/toko?sslmode=require&password=s%2Fcret",
            "postgresql://toko@db/toko?sslmode=require&password=***",
            "postgresql://toko@db/toko?sslmode=require",
        ),
        (
            "postgresql://toko@db1,db2/toko?password=s%2Fcret&connect_timeout=5",
            "postgresql://toko@db1,db2/toko?password=***&connect_timeout=5",
            "postgresql://toko@db1,db2/toko?connect_timeout=5",
        ),
        (
            "postgresql:///toko?host=/run/postgresql",
            "postgresql:///toko?host=/run/postgresql",
            "postgresql:///toko?host=/run/postgresql",
        ),
    ],
)
def test_a_password_is_masked_for_messages_and_left_out_for_the_tools(
    url: str, shown: str, for_tools: str
) -> None:
    assert redaction.redact(url) == shown
    assert redaction.without_password(url) == (for_tools, "s/cret" if "cret" in url else None)


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        # urlsplit reads no user part here, so a check for a password passes them.
        ("smtp:/user:s3cret@mail:25", "...@mail:25"),
        ("smt%p://user:s3cret@mail:25", "...@mail:25"),
        # urlsplit cannot read these at all ("Invalid IPv6 URL").
        ("postgresql://toko:s3cret@[::1/toko", "...@[::1/toko"),
        ("postgresql://[::1/toko?password=s3cret&x=1", "postgresql://[::1/toko?password=***&x=1"),
        ("smtp://[::1", "smtp://[::1"),
        # A user and no password: shown as it is.
        ("smtp://toko@mail:0", "smtp://toko@mail:0"),
    ],
)
def test_a_url_urlsplit_misreads_or_cannot_read_shows_no_password(url: str, shown: str) -> None:
    assert redaction.redact(url) == shown
    assert "s3cret" not in redaction.redact(url)
