"""Outgoing email: a real SMTP client, or the log when no server is configured.

Every message carries a Message-ID derived from its job id, identical on every
retry, so a duplicate after a crash (delivery is at-least-once) is detectable.
"""

from __future__ import annotations

import logging
from email.message import EmailMessage
from email.utils import formatdate
from typing import Protocol

import aiosmtplib

from service.settings import SmtpTarget

log = logging.getLogger("toko.mail")


class MailError(Exception):
    """Sending failed. ``permanent`` marks a 5xx refusal that a retry will not fix."""

    def __init__(self, message: str, *, permanent: bool = False) -> None:
        super().__init__(message)
        self.permanent = permanent


def message_id(job_id: int, mail_from: str) -> str:
    domain = mail_from.rpartition("@")[2] or "localhost"
    return f"<job-{job_id}@{domain}>"


def build_message(*, job_id: int, mail_from: str, to: str, subject: str, body: str) -> EmailMessage:
    msg = EmailMessage()
    msg["From"] = mail_from
    msg["To"] = to
    msg["Subject"] = subject
    msg["Date"] = formatdate(localtime=False, usegmt=True)
    msg["Message-ID"] = message_id(job_id, mail_from)
    msg["X-Toko-Job-Id"] = str(job_id)
    msg.set_content(body)
    return msg


class Mailer(Protocol):
    async def send(self, msg: EmailMessage) -> None: ...


class LogMailer:
    """The zero-configuration mailer: writes each email to the log instead."""

    async def send(self, msg: EmailMessage) -> None:
        log.info(
            "email logged",
            extra={
                "TO": msg["To"],
                "SUBJECT": msg["Subject"],
                "MESSAGE_ID": msg["Message-ID"],
                "BODY": msg.get_content(),
            },
        )


class SmtpMailer:
    def __init__(self, target: SmtpTarget, timeout: float) -> None:
        self._target = target
        self._timeout = timeout

    async def send(self, msg: EmailMessage) -> None:
        target = self._target
        try:
            await aiosmtplib.send(
                msg,
                hostname=target.host,
                port=target.port,
                username=target.username,
                password=target.password,
                use_tls=target.use_tls,
                timeout=self._timeout,
            )
        except aiosmtplib.SMTPResponseException as exc:
            raise MailError(
                f"SMTP {exc.code}: {exc.message}", permanent=500 <= exc.code < 600
            ) from exc
        except aiosmtplib.SMTPRecipientsRefused as exc:
            codes = [r.code for r in exc.recipients]
            raise MailError(
                f"recipients refused: {exc}", permanent=all(500 <= c < 600 for c in codes)
            ) from exc
        except (aiosmtplib.SMTPException, OSError) as exc:
            raise MailError(f"SMTP delivery failed: {exc}") from exc
        log.info(
            "email sent",
            extra={"TO": msg["To"], "SUBJECT": msg["Subject"], "MESSAGE_ID": msg["Message-ID"]},
        )
