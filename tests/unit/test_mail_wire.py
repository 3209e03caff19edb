"""The bytes an email goes out as (service.mail_wire) are those the email
package makes of ``Email.to_mime()``, byte for byte, wherever the shortcut
applies; elsewhere the mailer sends ``to_mime()`` itself."""

from __future__ import annotations

import email.policy
import email.utils
import itertools

import pytest
from aiosmtplib.email import extract_sender, flatten_message

from service.mail import SmtpMailer
from service.mail_message import Email
from service.mail_wire import wire_message
from service.settings import SmtpTarget
from tests.support.smtp import SmtpServer

ENQUEUED = 1_764_520_000.123456
# Several dates: a day and a month of one digit, a leap day, the end of a year.
WHEN = (1_764_649_876.9, 1_709_164_800.0, 1_767_225_599.5, 946_684_800.0)

# Plain addresses, as TOKO_MAIL_FROM takes them; then others the email package
# reads, left to it.
PLAIN_SENDERS = (
    "toko@toko.test",
    "toko@[127.0.0.1]",
    "toko@" + "sub." * 14 + "toko.test",  # a Message-ID too long for one line
)
SENDERS = (
    *PLAIN_SENDERS,
    "Toko Kopi <toko@toko.test>",
    "Toko Kopi Ünal <toko@toko.test>",
    '"Toko, Kopi" <toko@toko.test>',
)
RECIPIENTS = (
    ("bos@toko.test",),
    ("bos@toko.test", "Kasir Ünal <kasir@toko.test>"),
    tuple(f"admin{n}@toko.test" for n in range(9)),  # a To: line that folds
)
SUBJECTS = (
    "Produk baru: Kopi Susu",
    "Produk baru: " + "Kopi Susu Gula Aren ☕ " * 9 + "☕",
    "Produk baru: " + "a" * 50 + "  " + "b" * 140,
    "Produk baru: Teh =?utf-8?q?Hijau?= Melati",
    "Produk baru: Kopi\u2028Susu",
    "Produk baru:  dua  spasi ",
)
BODIES = (
    "Produk baru masuk.\n\nID:    7\nNama:  Kopi Susu\nHarga: Rp 25.000\n",
    "Produk baru masuk.\n\nNama:  Kopi ☕\n",
    "no final newline",
    "crlf\r\nand a lone\rcarriage return\n",
    "",
    "x" * 78 + "\n",
    "x" * 79 + "\n",  # too long: quoted-printable, the email package's own way
    "☕" * 26 + "\n",  # 78 bytes of UTF-8
    ".\n..starts with dots\nFrom the start\n",
)


def _emails() -> list[Email]:
    out = []
    for n, (sender, to, subject, body) in enumerate(
        itertools.product(SENDERS, RECIPIENTS, SUBJECTS, BODIES)
    ):
        out.append(Email(n + 1, ENQUEUED + n, sender, to, subject, body))
    return out


EMAILS = _emails()


@pytest.mark.parametrize("eight_bit", [True, False], ids=["8bitmime", "7bit-server"])
def test_the_wire_bytes_are_the_email_packages_wherever_they_are_made(eight_bit: bool) -> None:
    made = []
    for mail, now in zip(EMAILS, itertools.cycle(WHEN), strict=False):
        wire = wire_message(mail, eight_bit=eight_bit, now=now)
        if wire is None:
            continue
        made.append(mail)
        mime = mail.to_mime(now)
        expected = flatten_message(mime, utf8=False, cte_type="8bit" if eight_bit else "7bit")
        assert wire.data == expected, (mail, now)
        assert wire.sender == extract_sender(mime)
        assert wire.eight_bit is eight_bit
    # The shortcut covers every subject, plain sender and recipient list
    # in ASCII, and every body it can send as it is.
    assert {m.subject for m in made} == set(SUBJECTS)
    assert {m.mail_from for m in made} == set(PLAIN_SENDERS)
    assert {m.to for m in made} == {to for to in RECIPIENTS if all(map(str.isascii, to))}
    sendable = {b for b in BODIES if "x" * 79 not in b and (eight_bit or b.isascii())}
    assert {m.body for m in made} == sendable


def test_toko_s_own_emails_all_take_the_shortcut() -> None:
    mail = Email(
        7,
        ENQUEUED,
        "toko@toko.test",
        ("bos@toko.test", "kasir@toko.test"),
        "Produk baru: Kopi ☕",
        "Produk baru masuk.\n\nID:    7\nNama:  Kopi ☕\nHarga: Rp 25.000\n",
    )
    assert wire_message(mail, eight_bit=True) is not None
    ascii_mail = Email(7, ENQUEUED, "toko@toko.test", ("bos@toko.test",), "Teh", "isi\n")
    assert wire_message(ascii_mail, eight_bit=False) is not None


@pytest.mark.parametrize(
    ("mail", "eight_bit"),
    [
        (Email(1, ENQUEUED, "toko@tokö.test", ("bos@toko.test",), "Teh", "isi"), True),
        (Email(1, ENQUEUED, "toko@toko.test", ("bös@toko.test",), "Teh", "isi"), True),
        (Email(1, ENQUEUED, "toko@toko.test", ("bos@toko.test",), "Teh", "x" * 79), True),
        (Email(1, ENQUEUED, "toko@toko.test", ("bos@toko.test",), "Teh", "☕"), False),
    ],
    ids=["utf8-sender", "utf8-recipient", "long-body-line", "8bit-body-7bit-server"],
)
def test_what_needs_the_email_package_is_left_to_it(mail: Email, eight_bit: bool) -> None:
    assert wire_message(mail, eight_bit=eight_bit) is None


@pytest.mark.parametrize(
    "mail",
    [
        Email(7, ENQUEUED, "Toko <toko@toko.test>", ("bos@toko.test",), "Kopi ☕", "Kopi ☕\n"),
        Email(8, ENQUEUED, "toko@toko.test", ("bos@toko.test",), "Teh", "x" * 100 + "\n"),
    ],
    ids=["shortcut", "email-package"],
)
async def test_a_real_server_receives_the_email_packages_message(
    smtp: SmtpServer, mail: Email
) -> None:
    target = SmtpTarget("127.0.0.1", smtp.port, None, None, use_tls=False)
    mailer = SmtpMailer(target, timeout=10)
    try:
        # The second goes on the kept connection, whose EHLO reply is known.
        await mailer.send(mail)
        await mailer.send(mail)
    finally:
        await mailer.close()
    for received in smtp.delivered():
        date = email.utils.parsedate_to_datetime(received.headers["Date"])
        expected = flatten_message(mail.to_mime(date.timestamp()), utf8=False, cte_type="8bit")
        assert received.raw == expected
        assert received.mail_from == "toko@toko.test"
    assert len(smtp.delivered()) == 2
