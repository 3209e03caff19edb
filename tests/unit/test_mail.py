"""Email: the MIME message the SMTP mailer sends, and what a refusal means."""

from __future__ import annotations

import email.policy

import pytest

from service.mail import Email, MailError, RecipientsDeferred, SmtpMailer
from service.settings import SmtpTarget
from tests.support.smtp import SmtpServer

OWNERS = ("bos@toko.test", "kasir@toko.test")


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


def mailer_for(smtp: SmtpServer) -> SmtpMailer:
    return SmtpMailer(SmtpTarget("127.0.0.1", smtp.port, None, None, use_tls=False), timeout=10)


def owners_email(resend_to: tuple[str, ...] = ()) -> Email:
    return Email(9, "toko@toko.test", OWNERS, "Produk baru: Teh", "isi", resend_to=resend_to)


async def test_an_admin_deferred_while_another_accepts_is_the_only_one_left(
    smtp: SmtpServer,
) -> None:
    smtp.defer_recipient("kasir@toko.test", 1)
    with pytest.raises(RecipientsDeferred) as raised:
        await mailer_for(smtp).send(owners_email())
    assert raised.value.deferred == ("kasir@toko.test",)
    assert not raised.value.permanent
    (mail,) = smtp.delivered()
    assert mail.to == ("bos@toko.test",)


async def test_an_admin_refused_for_good_is_not_left_to_retry(smtp: SmtpServer) -> None:
    smtp.refuse_recipient("bos@toko.test")
    smtp.defer_recipient("kasir@toko.test", 1)
    # Nobody got it, but only kasir is worth another attempt.
    with pytest.raises(RecipientsDeferred) as raised:
        await mailer_for(smtp).send(owners_email())
    assert raised.value.deferred == ("kasir@toko.test",)
    assert smtp.delivered() == []


@pytest.mark.parametrize(
    ("refuse", "defer", "permanent"),
    [((), OWNERS, False), (OWNERS, (), True)],
    ids=["all deferred", "all refused for good"],
)
async def test_every_admin_refused_the_same_way_leaves_the_recipients_as_they_are(
    smtp: SmtpServer, refuse: tuple[str, ...], defer: tuple[str, ...], permanent: bool
) -> None:
    for address in refuse:
        smtp.refuse_recipient(address)
    for address in defer:
        smtp.defer_recipient(address, 1)
    with pytest.raises(MailError) as raised:
        await mailer_for(smtp).send(owners_email())
    assert not isinstance(raised.value, RecipientsDeferred)
    assert raised.value.permanent is permanent


async def test_a_resend_goes_to_those_left_with_the_same_message(smtp: SmtpServer) -> None:
    await mailer_for(smtp).send(owners_email(resend_to=("kasir@toko.test",)))
    (mail,) = smtp.delivered()
    assert mail.to == ("kasir@toko.test",)
    assert str(mail.headers["To"]) == ", ".join(OWNERS)
    assert mail.message_id == "<job-9@toko.test>"
