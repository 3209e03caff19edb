"""Outgoing email: a real SMTP client, or the log when no server is configured.

Every message carries a Message-ID derived from its job id, identical on every
retry, so a duplicate after a crash (delivery is at-least-once) is detectable.
When the server takes some recipients and defers others (4xx), the send raises
``RecipientsDeferred`` naming those left, so the retry goes to them alone.
An SMTP connection is kept for the next email for a moment (mail_connections).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field
from email.message import EmailMessage
from email.utils import formatdate
from typing import Protocol

import aiosmtplib

from service.mail_connections import Connection, ConnectionCache
from service.settings import SmtpTarget

log = logging.getLogger("toko.mail")

# A reply that the server is closing the connection (RFC 5321, 3.8).
SERVER_CLOSING = 421


class MailError(Exception):
    """Sending failed. ``permanent`` marks a 5xx refusal that a retry will not fix."""

    def __init__(self, message: str, *, permanent: bool = False) -> None:
        super().__init__(message)
        self.permanent = permanent


class RecipientsDeferred(MailError):
    """The server deferred some recipients (4xx) and accepted or refused for
    good the others: only ``deferred`` are worth sending the email again."""

    def __init__(self, message: str, deferred: tuple[str, ...]) -> None:
        super().__init__(message)
        self.deferred = deferred


def message_id(job_id: int, mail_from: str) -> str:
    domain = mail_from.rpartition("@")[2] or "localhost"
    return f"<job-{job_id}@{domain}>"


@dataclass(frozen=True)
class Email:
    job_id: int
    mail_from: str
    to: tuple[str, ...]
    subject: str
    body: str
    # Structured log fields of the job behind this email (JOB_KIND, PRODUCT_ID, ...).
    fields: Mapping[str, object] = field(default_factory=dict)
    # Whom to send it to, when only some of ``to`` still need it (a server had
    # deferred them). Empty: everyone in ``to``.
    resend_to: tuple[str, ...] = ()

    @property
    def message_id(self) -> str:
        return message_id(self.job_id, self.mail_from)

    @property
    def recipients(self) -> tuple[str, ...]:
        """The envelope's recipients (RCPT TO)."""
        return self.resend_to or self.to

    def to_mime(self) -> EmailMessage:
        msg = EmailMessage()
        msg["From"] = self.mail_from
        msg["To"] = ", ".join(self.to)
        # The email package refuses a header with a line break in it, and counts
        # U+2028/U+2029 as ones: a subject is one line, whatever text it quotes.
        msg["Subject"] = " ".join(self.subject.splitlines())
        msg["Date"] = formatdate(localtime=False, usegmt=True)
        msg["Message-ID"] = self.message_id
        msg["X-Toko-Job-Id"] = str(self.job_id)
        msg.set_content(self.body)
        return msg

    def log_fields(self) -> dict[str, object]:
        fields = {
            **self.fields,
            "JOB_ID": self.job_id,
            "TO": ", ".join(self.to),
            "SUBJECT": self.subject,
            "MESSAGE_ID": self.message_id,
        }
        if self.resend_to:
            fields["RESEND_TO"] = ", ".join(self.resend_to)
        return fields


class Mailer(Protocol):
    async def send(self, email: Email) -> None: ...

    async def close(self) -> None:
        """Let go of what it holds (open connections); no email is sent after."""


class LogMailer:
    """The zero-configuration mailer: writes each email to the log instead.

    It skips building a MIME message: the email package is slow, and nothing
    here needs one.
    """

    async def send(self, email: Email) -> None:
        log.info("email logged", extra={**email.log_fields(), "BODY": email.body})

    async def close(self) -> None:
        pass


def tls_context(verify: bool) -> ssl.SSLContext:
    """The TLS settings of every connection to the mail server.

    Made once per mailer: loading the system's CAs takes tens of milliseconds
    of CPU, which aiosmtplib would otherwise spend on every email.
    """
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
    if not verify:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return context


class SmtpMailer:
    def __init__(
        self, target: SmtpTarget, timeout: float, connections: ConnectionCache | None = None
    ) -> None:
        self._target = target
        self._timeout = timeout
        self._tls = tls_context(target.verify_certificate)
        self._local_hostname: str | None = None
        self._connections = connections or ConnectionCache()

    async def _ehlo_name(self) -> str:
        # The name given in EHLO. aiosmtplib would look the host's FQDN up
        # again for every connection: a lookup on a thread that costs a seventh
        # of an email's CPU, and a DNS round trip per email where the name is
        # not in /etc/hosts. Once is enough: a renamed host is picked up at the
        # next start.
        if self._local_hostname is None:
            self._local_hostname = await asyncio.to_thread(socket.getfqdn)
        return self._local_hostname

    async def send(self, email: Email) -> None:
        msg = email.to_mime()
        try:
            connection, refused = await self._transact(msg, list(email.recipients))
        except aiosmtplib.SMTPResponseException as exc:
            raise MailError(
                f"SMTP {exc.code}: {exc.message}", permanent=500 <= exc.code < 600
            ) from exc
        except aiosmtplib.SMTPRecipientsRefused as exc:
            replies = {
                r.recipient: aiosmtplib.SMTPResponse(r.code, r.message) for r in exc.recipients
            }
            message = f"recipients refused: {_describe(replies)}"
            deferred = _deferred(replies)
            if not deferred:
                raise MailError(message, permanent=True) from exc
            if len(deferred) < len(replies):  # the rest are refused for good
                raise RecipientsDeferred(message, deferred) from exc
            raise MailError(message) from exc
        except (aiosmtplib.SMTPException, OSError) as exc:
            raise MailError(f"SMTP delivery failed: {exc}") from exc
        self._connections.keep(connection)
        if refused:
            log.warning(
                "email sent, but some recipients were refused",
                extra={**email.log_fields(), "REFUSED": _describe(refused)},
            )
            # The others have it: a retry goes to the deferred alone, and none
            # goes to addresses refused for good.
            deferred = _deferred(refused)
            if deferred:
                raise RecipientsDeferred(f"recipients deferred: {_describe(refused)}", deferred)
            return
        log.info("email sent", extra=email.log_fields())

    async def close(self) -> None:
        await self._connections.close()

    async def _transact(
        self, msg: EmailMessage, recipients: list[str]
    ) -> tuple[Connection, dict[str, aiosmtplib.SMTPResponse]]:
        """One mail transaction, on an idle connection if there is one; the
        connection used (for the next email) and the recipients refused."""
        kept = self._connections.take()
        if kept is not None:
            try:
                return kept, await _send_on(kept.client, msg, recipients)
            except aiosmtplib.SMTPResponseException as exc:
                if exc.code != SERVER_CLOSING:
                    raise
            except ConnectionError:
                pass
            # The server closed it as it sat idle (its timeout, its limit of
            # emails per connection): no fault of this email, which goes again
            # at once, on a new connection.
        connection = self._connections.opened(await self._connect())
        return connection, await _send_on(connection.client, msg, recipients)

    async def _connect(self) -> aiosmtplib.SMTP:
        target = self._target
        client = aiosmtplib.SMTP(
            local_hostname=await self._ehlo_name(),
            hostname=target.host,
            port=target.port,
            username=target.username,
            password=target.password,
            use_tls=target.use_tls,
            start_tls=target.start_tls,
            tls_context=self._tls,
            timeout=self._timeout,
        )
        try:
            await client.connect()
        except BaseException:
            client.close()  # see _send_on
            raise
        return client


async def _send_on(
    client: aiosmtplib.SMTP, msg: EmailMessage, recipients: list[str]
) -> dict[str, aiosmtplib.SMTPResponse]:
    try:
        refused, _ = await client.send_message(msg, recipients=recipients)
    except BaseException:
        # Abort at once: aiosmtplib's own clean-up would wait for a QUIT
        # reply, which stalls a cancelled send (a drain) for long. And a
        # connection in an unknown state is never kept.
        client.close()
        raise
    return refused


def _describe(replies: Mapping[str, aiosmtplib.SMTPResponse]) -> str:
    return "; ".join(
        f"{address}: {reply.code} {reply.message}" for address, reply in replies.items()
    )


def _deferred(replies: Mapping[str, aiosmtplib.SMTPResponse]) -> tuple[str, ...]:
    """The recipients refused for now (4xx): worth another attempt."""
    return tuple(address for address, reply in replies.items() if 400 <= reply.code < 500)
