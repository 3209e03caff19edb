"""Email: the MIME message the SMTP mailer sends."""

from __future__ import annotations

import email.policy

import pytest

from service.mail import Email


@pytest.mark.parametrize("separator", ["\n", "\r\n", "\u2028", "\u2029", "\x85"])
def test_a_subject_with_a_line_break_is_sent_on_one_line(separator: str) -> None:
    # Products stored before nama refused these would otherwise fail every attempt.
    mail = Email(
        7, "toko@toko.test", ("bos@toko.test",), f"Produk baru: Kopi{separator}Susu", "isi"
    )
    raw = mail.to_mime().as_bytes(policy=email.policy.SMTP)
    head = raw.split(b"\r\n\r\n")[0].decode("ascii")
    (subject,) = [line for line in head.split("\r\n") if line.startswith("Subject:")]
    assert subject == "Subject: Produk baru: Kopi Susu"


def test_message_id_comes_from_the_job_and_the_sender_domain() -> None:
    mail = Email(42, "kasir@toko.test", ("bos@toko.test",), "Produk baru: Teh", "isi")
    assert mail.to_mime()["Message-ID"] == "<job-42@toko.test>"


def test_every_recipient_is_in_the_to_header() -> None:
    mail = Email(
        5, "toko@toko.test", ("bos@toko.test", "kasir@toko.test"), "Produk baru: Teh", "isi"
    )
    assert mail.to_mime()["To"] == "bos@toko.test, kasir@toko.test"
    assert mail.log_fields()["TO"] == "bos@toko.test, kasir@toko.test"
