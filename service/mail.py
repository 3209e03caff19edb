"""Outgoing email: a real SMTP client, or the log when no server is configured.

The message itself is service.mail_message, its bytes service.mail_wire; the
EHLO name, service.mail_ehlo.
When the server takes some recipients and defers others (4xx), the send raises
``RecipientsDeferred`` naming those left, so the retry goes to them alone.
An SMTP connection is kept for the next email for a moment (mail_connections).
"""

from __future__ import annotations

import logging
import socket
import ssl
from collections.abc import Mapping
from typing import Protocol, TypeVar

import aiosmtplib

from service.mail_connections import Connection, ConnectionCache
from service.mail_ehlo import EHLO_NAME, EhloName
from service.mail_message import Email
from service.mail_wire import wire_message
from service.settings import SmtpTarget

log = logging.getLogger("toko.mail")

# A reply that the server is closing the connection (RFC 5321, 3.8).
SERVER_CLOSING = 421
# The share of an attempt's time (TOKO_JOB_TIMEOUT) that reaching the server
# may take: TCP, TLS on smtps://, the server's greeting. A server that never
# answers (a firewall dropping the packets, an smtps:// port asked for plain
# text) then fails with its reason, where the attempt's own limit, as long as
# aiosmtplib's, cut it off first as a bare "timed out".
CONNECT_SHARE = 0.5
# Where an admin puts the SMTP password, for messages that send them there.
PASSWORD_PLACES = "the systemd credential 'smtp-password' or TOKO_SMTP_PASSWORD_FILE"


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
        try:
            connection, refused = await self._transact(email)
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
        self, email: Email
    ) -> tuple[Connection, dict[str, aiosmtplib.SMTPResponse]]:
        """One mail transaction, on an idle connection if there is one; the
        connection used (for the next email) and the recipients refused."""
        kept = self._connections.take()
        if kept is not None:
            try:
                return kept, await _send_on(kept.client, email)
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
        return connection, await _send_on(connection.client, email)

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


async def _send_on(client: aiosmtplib.SMTP, email: Email) -> dict[str, aiosmtplib.SMTPResponse]:
    recipients = list(email.recipients)
    try:
        # The server's extensions are known once it answered EHLO (aiosmtplib
        # says it on connecting, for STARTTLS): then the message's bytes can
        # be made for it (mail_wire); else send_message finds out itself.
        wire = None
        if not client.is_ehlo_or_helo_needed:
            wire = wire_message(email, eight_bit=client.supports_extension("8bitmime"))
        if wire is None:
            refused, _ = await client.send_message(email.to_mime(), recipients=recipients)
        else:
            options = ["BODY=8BITMIME"] if wire.eight_bit else []
            refused, _ = await client.sendmail(
                wire.sender, recipients, wire.data, mail_options=options
            )
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
