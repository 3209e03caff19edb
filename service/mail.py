"""Outgoing email: a real SMTP client, or the log when no server is configured.

Every message carries a Message-ID derived from its job (id and enqueue time),
identical on every retry, so a duplicate after a crash (delivery is
at-least-once) is detectable.
When the server takes some recipients and defers others (4xx), the send raises
``RecipientsDeferred`` naming those left, so the retry goes to them alone.
An SMTP connection is kept for the next email for a moment (mail_connections).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import socket
import ssl
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from email.header import Header
from email.headerregistry import BaseHeader, HeaderRegistry
from email.message import EmailMessage
from email.policy import default as default_policy
from email.utils import formatdate
from typing import Protocol, TypeVar

import aiosmtplib

from service.mail_connections import Connection, ConnectionCache
from service.settings import SmtpTarget

log = logging.getLogger("toko.mail")

# A reply that the server is closing the connection (RFC 5321, 3.8).
SERVER_CLOSING = 421
# How long looking up the host's name may hold up an email. A resolver that
# does not answer takes 5 s per server and attempt (resolv.conf), often more.
EHLO_LOOKUP_SECONDS = 3.0
# The share of an attempt's time (TOKO_JOB_TIMEOUT) that reaching the server
# may take: TCP, TLS on smtps://, the server's greeting. A server that never
# answers (a firewall dropping the packets, an smtps:// port asked for plain
# text) then fails with its reason, where the attempt's own limit, as long as
# aiosmtplib's, cut it off first as a bare "timed out".
CONNECT_SHARE = 0.5
# Where an admin puts the SMTP password, for messages that send them there.
PASSWORD_PLACES = "the systemd credential 'smtp-password' or TOKO_SMTP_PASSWORD_FILE"


class _HeaderClasses(HeaderRegistry):
    """The email package's header registry, making each header's class once.

    The stock one builds a new class (``type(...)``) for every header of
    every message: a third of the CPU of building and flattening an email
    (600 µs a message here, 400 µs with the classes kept), and garbage that
    only the cycle collector frees. A header class holds no state of its own.
    """

    def __init__(self) -> None:
        super().__init__()
        self._made: dict[str, type[BaseHeader]] = {}

    def __getitem__(self, name: str) -> type[BaseHeader]:
        key = name.lower()
        made = self._made.get(key)
        if made is None:
            made = self._made[key] = super().__getitem__(name)
        return made

    def map_to_type(self, name: str, cls: type[BaseHeader]) -> None:
        super().map_to_type(name, cls)
        self._made.pop(name.lower(), None)


# email.policy.default, the EmailMessage default, with the classes kept.
MESSAGE_POLICY = default_policy.clone(header_factory=_HeaderClasses())


def encoded_subject(subject: str) -> str:
    """``subject`` folded as the Subject header, in encoded words where it must be.

    Not the email package's own folding (policy.default): where it splits a
    long subject into several encoded words it drops or doubles a space, so
    a long name arrived as another one. email.header.Header keeps every space
    inside an encoded word; set_raw keeps its lines as they are.
    """
    # Plain text that looks like an encoded word ("=?utf-8?q?...") would be
    # decoded by the reader.
    if subject.isascii() and "=?" not in subject:
        plain = Header(subject, "us-ascii", header_name="Subject").encode()
        if _fits_unfolded(plain):
            return plain
        # A word too long for a line: the policy would fold it its own way.
    return Header(subject, "utf-8", header_name="Subject").encode()


def _fits_unfolded(folded: str) -> bool:
    """Whether the policy sends ``folded``'s lines as they are (EmailPolicy._fold)."""
    limit = MESSAGE_POLICY.max_line_length or math.inf
    first, *rest = folded.splitlines() or [""]
    return len("Subject: " + first) <= limit and all(len(line) <= limit for line in rest)


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


def message_id(job_id: int, job_created_at: float, mail_from: str) -> str:
    """The Message-ID of a job's email, the same on every attempt of the job.

    The id alone is not enough: a restore from backup hands the ids issued
    since the backup out again, and a mailbox may drop a message whose
    Message-ID it has seen. The job's enqueue time (whole milliseconds) tells
    such a job from the one that had its id before.
    """
    domain = mail_from.rpartition("@")[2] or "localhost"
    return f"<job-{job_id}.{math.floor(job_created_at * 1000)}@{domain}>"


@dataclass(frozen=True)
class Email:
    job_id: int
    job_created_at: float  # the job's enqueue time (Job.created_at)
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
        return message_id(self.job_id, self.job_created_at, self.mail_from)

    @property
    def recipients(self) -> tuple[str, ...]:
        """The envelope's recipients (RCPT TO)."""
        return self.resend_to or self.to

    def to_mime(self) -> EmailMessage:
        msg = EmailMessage(policy=MESSAGE_POLICY)
        msg["From"] = self.mail_from
        msg["To"] = ", ".join(self.to)
        # The email package refuses a header with a line break in it, and counts
        # U+2028/U+2029 as ones: a subject is one line, whatever text it quotes.
        msg.set_raw("Subject", encoded_subject(" ".join(self.subject.splitlines())))
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


class EhloName:
    """The name this host gives in EHLO: its FQDN, looked up once.

    aiosmtplib would look it up again for every connection: a lookup on a
    thread that costs a seventh of an email's CPU, a DNS round trip where the
    name is not in /etc/hosts, and no time limit. Here one lookup serves every
    worker and email; a renamed host is picked up at the next start.

    The lookup runs on a daemon thread of its own: with DNS broken it blocks
    for as long as the resolver likes, and a thread of the default executor
    would also hold up the process's exit (asyncio.run waits for those). An
    email waits for it at most ``limit`` seconds from its start; after that,
    this email and every later one say ``fallback()``, the short host name.
    """

    def __init__(
        self,
        lookup: Callable[[], str] = socket.getfqdn,
        fallback: Callable[[], str] = socket.gethostname,
        limit: float = EHLO_LOOKUP_SECONDS,
    ) -> None:
        self._lookup = lookup
        self._fallback = fallback
        self._limit = limit
        self._name: str | None = None
        self._found: concurrent.futures.Future[str] | None = None
        self._deadline = 0.0

    async def get(self) -> str:
        if self._name is not None:
            return self._name
        found = asyncio.wrap_future(self._started())
        remaining = max(0.0, self._deadline - time.monotonic())
        done, _ = await asyncio.wait({found}, timeout=remaining)
        if not done:
            found.cancel()  # this wait only: the thread runs on, ignored
            return self._settle(None, f"took over {self._limit:g} s")
        error = found.exception()
        if error is not None:
            return self._settle(None, f"failed: {error}")
        return self._settle(found.result(), "")

    def _started(self) -> concurrent.futures.Future[str]:
        if self._found is None:
            self._found = concurrent.futures.Future()
            # Running: a waiter that gives up cannot cancel it for the others.
            self._found.set_running_or_notify_cancel()
            self._deadline = time.monotonic() + self._limit
            threading.Thread(
                target=self._look_up, args=(self._found,), name="ehlo-name", daemon=True
            ).start()
        return self._found

    def _look_up(self, found: concurrent.futures.Future[str]) -> None:
        try:
            found.set_result(self._lookup())
        except Exception as exc:
            found.set_exception(exc)

    def _settle(self, name: str | None, problem: str) -> str:
        # Emails waiting together all get here: the first decides, and logs.
        if self._name is None:
            if name is None:
                name = self._fallback()
                log.warning(
                    "looking up this host's name for EHLO %s; saying %s instead",
                    problem,
                    name,
                    extra={"EHLO_NAME": name},
                )
            self._name = name
        return self._name


# One per process: all workers' connections, however many mailers.
EHLO_NAME = EhloName()


class SmtpMailer:
    def __init__(
        self,
        target: SmtpTarget,
        timeout: float,
        connections: ConnectionCache | None = None,
        ehlo_name: EhloName = EHLO_NAME,
    ) -> None:
        self._target = target
        self._timeout = timeout
        self._connect_timeout = timeout * CONNECT_SHARE
        self._tls = tls_context(target.verify_certificate)
        self._ehlo_name = ehlo_name
        self._connections = connections or ConnectionCache()

    async def send(self, email: Email) -> None:
        msg = email.to_mime()
        try:
            connection, refused = await self._transact(msg, list(email.recipients))
        except aiosmtplib.SMTPResponseException as exc:
            message = f"SMTP {exc.code}: {exc.message}"
            advice = self._reply_advice(exc)
            raise MailError(
                f"{message}; {advice}" if advice else message, permanent=500 <= exc.code < 600
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
            except aiosmtplib.SMTPRecipientsRefused as exc:
                # A 421 may answer RCPT TO as well (Postfix past its error
                # limit): it is about the connection, not the recipient.
                if all(r.code != SERVER_CLOSING for r in exc.recipients):
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
            local_hostname=await self._ehlo_name.get(),
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
            await client.connect(timeout=self._connect_timeout)
        except (aiosmtplib.SMTPException, OSError) as exc:
            client.close()  # see _send_on
            # Here, not in send(): the same errors on a kept connection, in
            # the middle of a transaction, say nothing about the settings.
            advice, hopeless = self._connection_advice(exc)
            if not advice:
                raise
            raise MailError(f"SMTP delivery failed: {advice} ({exc})", permanent=hopeless) from exc
        except BaseException:
            client.close()  # see _send_on
            raise
        return client

    def _reply_advice(self, exc: aiosmtplib.SMTPResponseException) -> str:
        """What the admin can do about a refusal that is about the settings."""
        target = self._target
        if isinstance(exc, aiosmtplib.SMTPAuthenticationError):
            return (
                f"the server refused the login as {target.username!r}: check the user in "
                f"TOKO_SMTP_URL and the password ({PASSWORD_PLACES})"
            )
        if exc.code == 530 and not target.logs_in:
            # 530 5.7.0 Authentication required (RFC 4954): a submission port.
            return (
                "the server wants a login, but TOKO_SMTP_URL names no user: write it as "
                f"smtp://user@{_host_shown(target.host)}:{target.port} and give the "
                f"password ({PASSWORD_PLACES})"
            )
        return ""

    def _connection_advice(self, exc: BaseException) -> tuple[str, bool]:
        """Why connecting failed, in an admin's words, and whether only a change
        of settings (no retry) can fix it; "" when the error says it well
        enough (a refusal with a reply code: see _reply_advice)."""
        target = self._target
        where = f"{_host_shown(target.host)}:{target.port}"
        limit = f"{self._connect_timeout:g} s"
        if isinstance(exc, aiosmtplib.SMTPConnectTimeoutError):
            # aiosmtplib raises it from its own SMTPTimeoutError when the
            # connection stood but no greeting came, from a plain one else.
            if not isinstance(exc.__cause__, aiosmtplib.SMTPTimeoutError):
                return (
                    f"no answer from {where} within {limit}: a firewall may drop the "
                    "packets, or the host or port in TOKO_SMTP_URL is wrong",
                    False,
                )
            if target.use_tls:
                return f"{where} took the connection but sent no greeting within {limit}", False
            return (
                f"{where} took the connection but sent no greeting within {limit}: the "
                "server may expect implicit TLS (smtps://, usually port 465) rather than "
                "plain text or STARTTLS (smtp://)",
                False,
            )
        certificate = _cause(exc, ssl.SSLCertVerificationError)
        if certificate is not None:
            return _certificate_advice(where, certificate), True
        if target.use_tls and _cause(exc, ssl.SSLError) is not None:
            return (
                f"TLS handshake with {where} failed: the server may expect STARTTLS "
                "(smtp://, usually port 587 or 25) rather than implicit TLS (smtps://)",
                True,
            )
        if _cause(exc, ConnectionRefusedError) is not None:
            return (
                f"nothing listens on {where} (connection refused): check the port in "
                "TOKO_SMTP_URL, and that the mail server runs",
                False,
            )
        if _cause(exc, socket.gaierror) is not None:
            return (
                f"the mail host name {target.host!r} could not be looked up: check the "
                "host in TOKO_SMTP_URL, and this host's DNS",
                False,
            )
        return "", False


# OpenSSL's X509_V_ERR_* codes for a certificate no CA of this host vouches
# for: self-signed, or issued by a private CA.
_UNKNOWN_ISSUER = frozenset({18, 19, 20, 21})
# ... and for one issued to another name than the URL's host.
_OTHER_NAME = frozenset({62, 64})


def _certificate_advice(where: str, error: ssl.SSLCertVerificationError) -> str:
    problem = f"the certificate of {where} does not check out ({error.verify_message})"
    if error.verify_code in _UNKNOWN_ISSUER:
        return (
            f"{problem}: it is self-signed or from a private CA; add that CA to this "
            "host's (update-ca-certificates), then restart toko-api"
        )
    if error.verify_code in _OTHER_NAME:
        return (
            f"{problem}: it is issued to another name; name the server in TOKO_SMTP_URL "
            "as its certificate does"
        )
    return problem


_E = TypeVar("_E", bound=BaseException)


def _host_shown(host: str) -> str:
    """``host`` as a URL writes it: an IPv6 address in brackets."""
    return f"[{host}]" if ":" in host else host


def _cause(exc: BaseException, kind: type[_E]) -> _E | None:
    """``exc`` or the first exception it was raised from that is a ``kind``."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, kind):
            return seen
        seen = seen.__cause__
    return None


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
