"""An email's bytes as they go to the SMTP server, built without the email package.

``Email.to_mime()`` and aiosmtplib's ``send_message`` (which flattens with
``email.policy.SMTP``) cost about 0.6 ms of CPU an email: the email package
parses every header it is given and folds it again on the way out. For the
emails toko sends almost all of that is the same every time (From, To, the
MIME headers) or plain ASCII whose folding is known (Date, Message-ID, the
job id). ``wire_message`` builds those bytes directly, the changing parts by
the email package's own rules and the fixed ones once per setting, in about
a tenth of the time. Where an email falls outside what it covers it returns
None and the caller sends ``to_mime()`` as before; tests/unit/test_mail_wire.py
checks, byte for byte, that both ways give the same message.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from email.policy import SMTP
from email.utils import format_datetime

from service.mail_message import MESSAGE_POLICY, Email, encoded_subject

# What a line may hold before the email package folds it (SMTP policy).
MAX_LINE: int = SMTP.max_line_length or 78
CRLF = b"\r\n"
_TEXT_HEADERS = b'Content-Type: text/plain; charset="utf-8"\r\n'
_MIME_VERSION = b"MIME-Version: 1.0\r\n"


@dataclass(frozen=True)
class WireMessage:
    sender: str  # the envelope's MAIL FROM, as send_message takes it from From:
    data: bytes
    eight_bit: bool  # sent with BODY=8BITMIME, as send_message does whenever the server has it


def wire_message(email: Email, *, eight_bit: bool, now: float | None = None) -> WireMessage | None:
    """``email`` as send_message would send ``email.to_mime()`` to a server that
    does (``eight_bit``) or does not take 8BITMIME; None where that needs the
    email package: an address outside ASCII (SMTPUTF8) or a sender that is not
    a plain address, a body line too long to send as it is, or an 8-bit body for
    a server without 8BITMIME."""
    recipients = email.recipients
    if not (email.mail_from.isascii() and all(r.isascii() for r in recipients)):
        return None
    body = _body(email.body, eight_bit)
    if body is None:
        return None
    cte, payload = body
    from_line, sender = _address_header("From", email.mail_from)
    # A plain address, as TOKO_MAIL_FROM is: message_id() takes its domain as is.
    if sender != email.mail_from:
        return None
    to_line, _ = _address_header("To", ", ".join(email.to))
    subject = encoded_subject(" ".join(email.subject.splitlines()))
    data = b"".join(
        (
            from_line,
            to_line,
            # The raw value set_raw stores, folded as the generator folds it.
            SMTP.fold_binary("Subject", subject),
            _date_line(time.time() if now is None else now),
            _message_id_line(email.message_id),
            b"X-Toko-Job-Id: %d\r\n" % email.job_id,
            _TEXT_HEADERS,
            b"Content-Transfer-Encoding: " + cte + CRLF,
            _MIME_VERSION,
            CRLF,
            payload,
        )
    )
    return WireMessage(sender, data, eight_bit)


@functools.lru_cache(maxsize=64)
def _address_header(name: str, value: str) -> tuple[bytes, str | None]:
    """``name: value`` folded as the generator folds it, and its first address:
    a setting, the same for every email, parsed once."""
    header = MESSAGE_POLICY.header_factory(name, value)
    addresses = header.addresses
    return SMTP.fold_binary(name, header), addresses[0].addr_spec if addresses else None


def _date_line(now: float) -> bytes:
    # to_mime() sets formatdate(usegmt=True); the Date header parses it and
    # writes it back with a numeric zone.
    stamp = format_datetime(datetime.fromtimestamp(int(now), UTC))
    return b"Date: " + stamp.encode("ascii") + CRLF


def _message_id_line(message_id: str) -> bytes:
    line = "Message-ID: " + message_id
    if len(line) <= MAX_LINE and message_id.isascii() and " " not in message_id:
        return line.encode("ascii") + CRLF
    # A long sender domain: the Message-ID header's own folding.
    return SMTP.fold_binary("Message-ID", MESSAGE_POLICY.header_factory("Message-ID", message_id))


def _body(text: str, eight_bit: bool) -> tuple[bytes, bytes] | None:
    """(Content-Transfer-Encoding, payload) as set_content chooses them for
    ``text`` (email.contentmanager), where no encoding is needed."""
    lines = text.encode("utf-8").splitlines()
    if any(len(line) > MAX_LINE for line in lines):
        return None  # quoted-printable or base64
    payload = CRLF.join(lines) + CRLF
    if payload.isascii():
        return b"7bit", payload
    if eight_bit:
        return b"8bit", payload
    return None
