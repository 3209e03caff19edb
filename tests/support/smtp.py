"""A real SMTP server on 127.0.0.1 whose behaviour a test switches at run time.

Usage::

    with SmtpServer() as smtp:                 # listening on smtp.port
        env = {"TOKO_SMTP_URL": smtp.url}
        smtp.set_delay(1.5)                    # every reply to DATA waits 1.5 s
        smtp.fail_next(3)                      # next 3 messages get 451 (4xx)
        smtp.fail_for(2.0)                     # every message for 2 s gets 451
        smtp.refuse_subject("BAD")             # subject containing BAD gets 550 (5xx)
        smtp.refuse_recipient("x@toko.test")   # RCPT TO:<x@toko.test> gets 550
        smtp.defer_recipient("x@toko.test", 2) # its next 2 RCPT TOs get 450 (4xx)
        smtp.limit_per_connection(2)           # MAIL FROM after 2 messages: 421, closed
        smtp.limit_per_connection(2, at="RCPT")  # ... or RCPT TO after 2 messages
        smtp.drop_connections()                # close every open connection now (how many)
        smtp.reset()                           # back to: deliver at once
        await smtp.async_wait_delivered(10, timeout=30)   # 10 distinct Message-IDs
        smtp.delivered()                       # list[SmtpMessage], outcome "delivered"

    SmtpServer(tls=ctx)                        # offers STARTTLS with ctx's certificate
    SmtpServer(tls=ctx, implicit_tls=True)     # TLS from the first byte (smtps://)
    SmtpServer(account=("shop", "pw"))         # offers AUTH (over TLS only, unless
                                               # auth_in_clear=True); url has the user

Each message records whether it came over TLS, as which login, and the name the
client gave in EHLO; every AUTH attempt is recorded in :attr:`SmtpServer.logins`,
so a test can tell that a password never reached the server.

Every ``RCPT TO`` is recorded in :attr:`SmtpServer.rcpts` with its reply code.
Connections are numbered from 1 as they greet (:attr:`SmtpServer.connections`);
each message records the number of the one it came over, and every QUIT is
recorded in :attr:`SmtpServer.quits`, so a test can tell how a client reuses
its connections and whether it says goodbye.
Every message that reaches the end of DATA is recorded in :attr:`SmtpServer.log`
(a :class:`~tests.support.recorder.Recorder`) with its outcome, *including*
rejected ones, so a test can compare the Message-ID of a rejected attempt with
the one finally delivered. :attr:`SmtpServer.arrivals` records each message when
its DATA arrives, before any delay, so a test can tell that a send is in flight.

The decision for a message is made in this order: refused subject (550), then
temporary failure (451), else delivery; the delay applies before every reply.
The server runs in aiosmtpd's own thread and loop; every method here is
thread-safe and can be called from a test's event loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import email
import email.policy
import socket
import ssl
import threading
import time
import weakref
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Literal

import trustme
from aiosmtpd.controller import Controller
from aiosmtpd.smtp import SMTP, AuthResult, Envelope, LoginPassword, Session

from tests.support.recorder import Recorder

Outcome = Literal["arrived", "delivered", "tempfailed", "refused"]

TEMPFAIL_REPLY = "451 4.3.0 Temporary failure injected by the test"
REFUSE_REPLY = "550 5.7.1 Message refused by the test"
REFUSE_RCPT_REPLY = "550 5.1.1 Recipient refused by the test"
DEFER_RCPT_REPLY = "450 4.2.1 Mailbox busy, try again later (the test)"
# As Exim answers past smtp_accept_max_per_connection.
TOO_MANY_REPLY = "421 4.7.0 Too many messages on this connection (the test)"
# As Postfix answers past smtpd_hard_error_limit, to whichever command comes next.
TOO_MANY_ERRORS_REPLY = "421 4.7.0 Error: too many errors (the test)"

# The command a connection's limit of messages is enforced at.
LimitAt = Literal["MAIL", "RCPT"]


@dataclass(frozen=True)
class SmtpMessage:
    """One message as the server saw it at the end of DATA."""

    outcome: Outcome
    message_id: str
    subject: str
    to: tuple[str, ...]  # envelope recipients (RCPT TO)
    mail_from: str
    raw: bytes = field(repr=False)
    at: float  # time.monotonic() when recorded
    tls: bool = False  # the session was encrypted (STARTTLS or implicit TLS)
    login: str | None = None  # the user it authenticated as
    helo: str | None = None  # the name the client gave in EHLO (or HELO)
    connection: int = 0  # the number of the connection it came over

    @property
    def headers(self) -> email.message.EmailMessage:
        """The parsed message (headers decoded, RFC 2047 included)."""
        msg = email.message_from_bytes(self.raw, policy=email.policy.default)
        assert isinstance(msg, email.message.EmailMessage)
        return msg


@dataclass
class _Behaviour:
    delay: float = 0.0
    fail_next: int = 0
    fail_until: float = 0.0
    refuse: list[str] = field(default_factory=list)
    refuse_rcpt: list[str] = field(default_factory=list)
    defer_rcpt: Counter[str] = field(default_factory=Counter)  # address -> RCPTs left to defer
    per_connection: int | None = None  # messages a connection may carry
    per_connection_at: LimitAt = "MAIL"  # the command that says it has carried them


class _Handler:
    def __init__(self, server: SmtpServer) -> None:
        self._server = server

    @property
    def server(self) -> SmtpServer:
        return self._server

    async def handle_RCPT(
        self,
        server: SMTP,
        session: Session,
        envelope: Envelope,
        address: str,
        rcpt_options: list[str],
    ) -> str:
        reply = self._server._recipient_reply(address)
        if reply is not None:
            return reply
        envelope.rcpt_tos.append(address)
        return "250 OK"

    async def handle_DATA(self, server: SMTP, session: Session, envelope: Envelope) -> str:
        assert isinstance(server, _Connection)
        auth = session.auth_data
        login = auth.login.decode() if isinstance(auth, LoginPassword) else None
        reply = await self._server._handle(
            envelope,
            tls=_encrypted(server),
            login=login,
            helo=session.host_name,
            connection=server.number,
        )
        if reply.startswith("250"):
            server.delivered += 1
        return reply


@dataclass(frozen=True)
class LoginAttempt:
    user: str
    accepted: bool
    tls: bool  # whether the password came over TLS


def _encrypted(server: SMTP) -> bool:
    transport = server.transport
    return transport is not None and transport.get_extra_info("ssl_object") is not None


class _OneWriteReplies(SMTP):
    """aiosmtpd's SMTP, sending each multi-line reply (EHLO's) in one write.

    aiosmtpd writes such a reply one line at a time, and some network stacks
    (the test machines' among them) hold each further line until the client's
    delayed ACK: 40 ms per EHLO, nine tenths of a test email's time (47 ms
    against 4-5 ms). Postfix sends the whole reply at once, as this does, so
    tests and benchmarks time toko rather than that stall.
    """

    _held = b""

    async def push(self, status: bytes | str) -> None:
        encoding = "utf-8" if self.enable_SMTPUTF8 else "ascii"
        line = status.encode(encoding) if isinstance(status, str) else status
        if line[3:4] == b"-":  # "250-...": more lines of this reply follow
            self._held += line + b"\r\n"
            return
        held, self._held = self._held, b""
        await super().push(held + line)


class _Connection(_OneWriteReplies):
    """One client's connection: numbered, its messages counted, its QUIT recorded."""

    def __init__(self, handler: _Handler, **kwargs: Any) -> None:
        super().__init__(handler, **kwargs)
        self.owner = handler.server
        self.number = 0
        self.delivered = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self.owner._open.add(self)

    # Numbered when the client greets, not when it connects: aiosmtpd's
    # controller connects once itself, to tell that the server is up.
    async def smtp_EHLO(self, hostname: str) -> None:
        self._greeted()
        await super().smtp_EHLO(hostname)

    async def smtp_HELO(self, hostname: str) -> None:
        self._greeted()
        await super().smtp_HELO(hostname)

    def _greeted(self) -> None:
        if self.number == 0:  # a client greets again after STARTTLS
            self.number = self.owner._numbered()

    def connection_lost(self, error: Exception | None) -> None:
        self.owner._lost(self)
        super().connection_lost(error)

    async def smtp_MAIL(self, arg: str) -> None:
        if self.owner._too_many(self.delivered, "MAIL"):
            await self._close_with(TOO_MANY_REPLY)
            return
        await super().smtp_MAIL(arg)

    async def smtp_RCPT(self, arg: str) -> None:
        if self.owner._too_many(self.delivered, "RCPT"):
            await self._close_with(TOO_MANY_ERRORS_REPLY)
            return
        await super().smtp_RCPT(arg)

    async def _close_with(self, reply: str) -> None:
        await self.push(reply)
        assert self.transport is not None
        self.transport.close()

    async def smtp_QUIT(self, arg: str) -> None:
        self.owner.quits.append(self.number)
        await super().smtp_QUIT(arg)


class _PreboundController(Controller):
    """aiosmtpd's Controller on a socket bound beforehand, so port 0 can be used."""

    def __init__(self, handler: Any, sock: socket.socket, **kwargs: Any) -> None:
        self._sock = sock
        super().__init__(handler, hostname="127.0.0.1", port=sock.getsockname()[1], **kwargs)

    def factory(self) -> SMTP:
        return _Connection(self.handler, **self.SMTP_kwargs)

    def _create_server(self) -> Any:
        return self.loop.create_server(self._factory_invoker, sock=self._sock, ssl=self.ssl_context)


class SmtpServer:
    """A switchable, recording SMTP server; a context manager (or start()/stop())."""

    def __init__(
        self,
        *,
        tls: ssl.SSLContext | None = None,
        implicit_tls: bool = False,
        account: tuple[str, str] | None = None,
        auth_in_clear: bool = False,
    ) -> None:
        self._lock = threading.Lock()
        self._behaviour = _Behaviour()
        self.log: Recorder[SmtpMessage] = Recorder("smtp")
        self.arrivals: Recorder[SmtpMessage] = Recorder("smtp arrivals")
        self.logins: Recorder[LoginAttempt] = Recorder("smtp logins")
        # Every RCPT TO as (address, the reply's code), refused ones included.
        self.rcpts: Recorder[tuple[str, int]] = Recorder("smtp rcpts")
        # The number of each connection as it greets, and of each that sent QUIT.
        self.connections: Recorder[int] = Recorder("smtp connections")
        self.quits: Recorder[int] = Recorder("smtp quits")
        # aiosmtpd's thread only. Weak: a connection aiosmtpd let go of (a
        # failed STARTTLS) is collected with its transports, as without it.
        self._open: weakref.WeakSet[_Connection] = weakref.WeakSet()
        self._controller: _PreboundController | None = None
        self.port = 0
        self._tls = tls
        self._implicit_tls = implicit_tls
        self._account = account
        self._auth_in_clear = auth_in_clear

    # -- lifecycle ---------------------------------------------------------

    def start(self) -> SmtpServer:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        sock.listen(128)
        self.port = sock.getsockname()[1]
        options: dict[str, Any] = {}
        if self._tls is not None:
            options["ssl_context" if self._implicit_tls else "tls_context"] = self._tls
        if self._account is not None:
            options["authenticator"] = self._authenticate
            # Like a submission server: no mail without a login, no login in
            # clear. aiosmtpd counts only STARTTLS as TLS, and warns against
            # requiring a login without TLS: implicit TLS just offers AUTH.
            guarded = not (self._auth_in_clear or self._implicit_tls)
            options["auth_require_tls"] = guarded
            options["auth_required"] = guarded
        self._controller = _PreboundController(
            _Handler(self), sock, enable_SMTPUTF8=True, decode_data=False, **options
        )
        self._controller.start()
        return self

    def stop(self) -> None:
        if self._controller is not None:
            # A client may keep a connection open between emails (toko does):
            # closed here, its socket is not left for the garbage collector.
            self.drop_connections()
            self._controller.stop()
            self._controller = None

    def __enter__(self) -> SmtpServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    @property
    def url(self) -> str:
        """The value for TOKO_SMTP_URL."""
        scheme = "smtps" if self._implicit_tls else "smtp"
        user = f"{self._account[0]}@" if self._account else ""
        return f"{scheme}://{user}127.0.0.1:{self.port}"

    # -- behaviour switches (any thread) -----------------------------------

    def reset(self) -> None:
        """Deliver every message at once."""
        with self._lock:
            self._behaviour = _Behaviour()

    def set_delay(self, seconds: float) -> None:
        """Wait ``seconds`` before replying to each message's DATA."""
        with self._lock:
            self._behaviour.delay = seconds

    def fail_next(self, count: int) -> None:
        """Answer 451 (temporary) to the next ``count`` messages."""
        with self._lock:
            self._behaviour.fail_next = count

    def fail_for(self, seconds: float) -> None:
        """Answer 451 (temporary) to every message for the next ``seconds``."""
        with self._lock:
            self._behaviour.fail_until = time.monotonic() + seconds

    def refuse_subject(self, contains: str) -> None:
        """Answer 550 (permanent) to messages whose subject contains ``contains``."""
        with self._lock:
            self._behaviour.refuse.append(contains)

    def refuse_recipient(self, address: str) -> None:
        """Answer 550 (permanent) to ``RCPT TO:<address>``; the other recipients still get it."""
        with self._lock:
            self._behaviour.refuse_rcpt.append(address)

    def defer_recipient(self, address: str, times: int) -> None:
        """Answer 450 (temporary) to the next ``times`` ``RCPT TO:<address>``."""
        with self._lock:
            self._behaviour.defer_rcpt[address] = times

    def limit_per_connection(self, count: int, at: LimitAt = "MAIL") -> None:
        """Answer MAIL FROM (or RCPT TO, ``at``) with 421 and close, on a
        connection that carried ``count``."""
        with self._lock:
            self._behaviour.per_connection = count
            self._behaviour.per_connection_at = at

    def drop_connections(self) -> int:
        """Close every open connection now, as a server's idle timeout does;
        how many there were."""
        assert self._controller is not None, "not started"
        dropped = threading.Event()
        closed: list[_Connection] = []

        def drop() -> None:
            for connection in list(self._open):
                if connection.transport is not None:
                    # Not close(): a TLS connection would wait for the
                    # client's close_notify, and the socket outlive stop().
                    connection.transport.abort()
                    closed.append(connection)
            dropped.set()

        self._controller.loop.call_soon_threadsafe(drop)
        assert dropped.wait(5), "the server's loop did not run"
        return len(closed)

    # -- queries -----------------------------------------------------------

    def messages(self, outcome: Outcome | None = None) -> list[SmtpMessage]:
        """Recorded messages, optionally only those with ``outcome``."""
        return [m for m in self.log.snapshot() if outcome is None or m.outcome == outcome]

    def delivered(self) -> list[SmtpMessage]:
        return self.messages("delivered")

    def delivered_ids(self) -> set[str]:
        """Distinct Message-IDs delivered so far."""
        return {m.message_id for m in self.delivered()}

    def duplicates(self) -> dict[str, int]:
        """Message-IDs delivered more than once, with their counts."""
        counts = Counter(m.message_id for m in self.delivered())
        return {mid: n for mid, n in counts.items() if n > 1}

    def wait_delivered(self, count: int, timeout: float) -> set[str]:
        """Block until ``count`` distinct Message-IDs were delivered; return them."""
        return self.log.wait_for(
            _distinct_delivered(count), timeout, f"{count} distinct delivered Message-IDs"
        )

    async def async_wait_delivered(self, count: int, timeout: float) -> set[str]:  # noqa: ASYNC109
        """Await ``count`` distinct delivered Message-IDs; return them."""
        return await self.log.async_wait_for(
            _distinct_delivered(count), timeout, f"{count} distinct delivered Message-IDs"
        )

    # -- the SMTP side (aiosmtpd's thread) ---------------------------------

    def _authenticate(
        self, server: SMTP, session: Session, envelope: Envelope, mechanism: str, auth_data: Any
    ) -> AuthResult:
        assert isinstance(auth_data, LoginPassword)
        attempt = (auth_data.login.decode(), auth_data.password.decode())
        accepted = attempt == self._account
        self.logins.append(LoginAttempt(attempt[0], accepted, tls=_encrypted(server)))
        # handled=False: aiosmtpd answers a refusal with 535 itself. Its default
        # (True) means "already answered", and a client with a wrong password
        # waited for a reply until its timeout.
        return AuthResult(
            success=accepted, handled=False, auth_data=auth_data if accepted else None
        )

    def _numbered(self) -> int:
        number = len(self.connections) + 1
        self.connections.append(number)
        return number

    def _lost(self, connection: _Connection) -> None:
        self._open.discard(connection)

    def _too_many(self, delivered: int, command: LimitAt) -> bool:
        with self._lock:
            limit = self._behaviour.per_connection
            at = self._behaviour.per_connection_at
        return limit is not None and at == command and delivered >= limit

    def _recipient_reply(self, address: str) -> str | None:
        """The refusal for ``RCPT TO:<address>``, or None to accept it."""
        with self._lock:
            b = self._behaviour
            reply = None
            if address in b.refuse_rcpt:
                reply = REFUSE_RCPT_REPLY
            elif b.defer_rcpt[address] > 0:
                b.defer_rcpt[address] -= 1
                reply = DEFER_RCPT_REPLY
        self.rcpts.append((address, int((reply or "250")[:3])))
        return reply

    async def _handle(
        self,
        envelope: Envelope,
        *,
        tls: bool,
        login: str | None,
        helo: str | None,
        connection: int,
    ) -> str:
        raw = envelope.original_content or b""
        parsed = email.message_from_bytes(raw, policy=email.policy.default)
        message_id = str(parsed.get("Message-ID", "")).strip()
        subject = str(parsed.get("Subject", ""))
        arrived = SmtpMessage(
            outcome="arrived",
            message_id=message_id,
            subject=subject,
            to=tuple(envelope.rcpt_tos),
            mail_from=envelope.mail_from or "",
            raw=raw,
            at=time.monotonic(),
            tls=tls,
            login=login,
            helo=helo,
            connection=connection,
        )
        self.arrivals.append(arrived)
        with self._lock:
            b = self._behaviour
            delay = b.delay
            outcome: Outcome
            if any(pattern in subject for pattern in b.refuse):
                outcome, reply = "refused", REFUSE_REPLY
            elif b.fail_next > 0:
                b.fail_next -= 1
                outcome, reply = "tempfailed", TEMPFAIL_REPLY
            elif time.monotonic() < b.fail_until:
                outcome, reply = "tempfailed", TEMPFAIL_REPLY
            else:
                outcome, reply = "delivered", "250 OK"
        if delay > 0:
            await asyncio.sleep(delay)
        self.log.append(dataclasses.replace(arrived, outcome=outcome, at=time.monotonic()))
        return reply


def server_tls(ca: trustme.CA, name: str = "127.0.0.1") -> ssl.SSLContext:
    """The server side of TLS with a certificate for ``name`` issued by ``ca``."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert(name).configure_cert(context)
    return context


def _distinct_delivered(count: int) -> Any:
    def predicate(items: Sequence[SmtpMessage]) -> set[str] | None:
        ids = {m.message_id for m in items if m.outcome == "delivered"}
        return ids if len(ids) >= count else None

    return predicate
