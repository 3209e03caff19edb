"""Email: the MIME message the SMTP mailer sends, what a refusal means, and
how it keeps its connections to the server."""

from __future__ import annotations

import asyncio
import email.policy
import logging
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path

import pytest
import trustme

from service.mail import MailError, RecipientsDeferred, SmtpMailer
from service.mail_connections import REUSE_SECONDS, ConnectionCache
from service.mail_ehlo import EHLO_NAME, EhloName
from service.mail_message import Email, message_id
from service.models import NewJob, Product, stored_job
from service.settings import SmtpTarget
from service.tasks import (
    HANDLERS,
    JobContext,
    UnitFailure,
    alert_email_job,
    product_email_job,
    recap_email_job,
)
from tests.support.backends import FakeClock
from tests.support.smtp import SmtpServer, server_tls

OWNERS = ("bos@toko.test", "kasir@toko.test")
# A job's enqueue time (jobs.created_at), which its Message-ID is made of with its id.
ENQUEUED = 1_764_520_000.123456


@pytest.mark.parametrize(
    "nama",
    [
        "Kopi Susu Gula Aren ☕ " * 9 + "☕",
        "☕ " * 99 + "☕",
        "a" * 50 + "  " + "b" * 140,
        "Teh =?utf-8?q?Hijau?= Melati",
        "Kopi Susu",
    ],
    ids=[
        "long-with-emoji",
        "200-chars-of-words",
        "two-spaces-then-a-long-word",
        "looks-encoded",
        "short",
    ],
)
def test_the_subject_a_mail_reader_sees_names_the_product_exactly(nama: str) -> None:
    # The email package's own folding dropped or doubled a space where it
    # split a long subject into encoded words: the admin read another name.
    mail = Email(7, ENQUEUED, "toko@toko.test", ("bos@toko.test",), f"Produk baru: {nama}", "isi")
    raw = mail.to_mime().as_bytes(policy=email.policy.SMTP)
    assert max(len(line) for line in raw.split(b"\r\n")) <= 78
    read = email.message_from_bytes(raw, policy=email.policy.default)
    assert str(read["Subject"]) == f"Produk baru: {nama}"


@pytest.mark.parametrize("separator", ["\n", "\r\n", "\u2028", "\u2029", "\x85"])
def test_a_subject_with_a_line_break_is_sent_on_one_line(separator: str) -> None:
    # Products stored before nama refused these would otherwise fail every attempt.
    mail = Email(
        7,
        ENQUEUED,
        "toko@toko.test",
        ("bos@toko.test",),
        f"Produk baru: Kopi{separator}Susu",
        "isi",
    )
    raw = mail.to_mime().as_bytes(policy=email.policy.SMTP)
    head = raw.split(b"\r\n\r\n")[0].decode("ascii")
    (subject,) = [line for line in head.split("\r\n") if line.startswith("Subject:")]
    assert subject == "Subject: Produk baru: Kopi Susu"


def test_messages_share_their_header_classes_and_read_as_with_the_stock_policy() -> None:
    # The stock registry made a class for every header of every email: a
    # third of an email's CPU to build and flatten it.
    mails = [
        Email(n, ENQUEUED, "toko@toko.test", ("bos@toko.test", "kasir@toko.test"), "Teh", "isi")
        for n in (1, 2)
    ]
    first, second = (mail.to_mime() for mail in mails)
    for name in ("From", "To", "Subject", "Message-ID", "Content-Type"):
        assert type(first[name]) is type(second[name]), name
    stock = email.message_from_bytes(first.as_bytes(), policy=email.policy.default)
    assert stock.as_bytes(policy=email.policy.SMTP) == first.as_bytes(policy=email.policy.SMTP)
    assert [type(first[name]).__mro__[1:] for name in first] == [
        type(stock[name]).__mro__[1:] for name in stock
    ]


def test_message_id_comes_from_the_job_and_the_sender_domain() -> None:
    mail = Email(42, ENQUEUED, "kasir@toko.test", ("bos@toko.test",), "Produk baru: Teh", "isi")
    assert mail.to_mime()["Message-ID"] == "<job-42.1764520000123@toko.test>"
    assert mail.log_fields()["MESSAGE_ID"] == "<job-42.1764520000123@toko.test>"


def test_a_job_keeps_its_message_id_and_a_job_that_only_shares_its_id_gets_another() -> None:
    # Every attempt of a job reads the same id and enqueue time: one Message-ID.
    assert message_id(42, ENQUEUED, "toko@toko.test") == message_id(42, ENQUEUED, "toko@toko.test")
    # A restore from backup hands id 42 out again, to a job enqueued later:
    # the admin's mailbox must not take its email for one it already has.
    assert message_id(42, ENQUEUED + 3600, "toko@toko.test") != message_id(
        42, ENQUEUED, "toko@toko.test"
    )
    assert message_id(42, ENQUEUED + 0.001, "toko@toko.test") != message_id(
        42, ENQUEUED, "toko@toko.test"
    )


@pytest.mark.parametrize(
    "new_job",
    [
        product_email_job(Product(3, "Teh", 45000, ENQUEUED), 5),
        recap_email_job("2026-11-29", 10, 2, 5),
        alert_email_job(UnitFailure("toko-backup.service", "toko1", "2026-11-29T02:30:00Z"), 5),
    ],
    ids=lambda job: job.kind,
)
async def test_every_kind_of_email_is_named_after_its_job_id_and_enqueue_time(
    smtp: SmtpServer, mailer: SmtpMailer, new_job: NewJob
) -> None:
    # A retry is due later than the job was enqueued: its Message-ID stays.
    job = replace(stored_job(42, new_job, ENQUEUED), attempts=2, run_at=ENQUEUED + 60)
    await HANDLERS[job.kind](job, JobContext(mailer, "toko@toko.test", ("bos@toko.test",)))
    (sent,) = smtp.delivered()
    assert sent.message_id == "<job-42.1764520000123@toko.test>"


def test_every_recipient_is_in_the_to_header() -> None:
    mail = Email(
        5,
        ENQUEUED,
        "toko@toko.test",
        ("bos@toko.test", "kasir@toko.test"),
        "Produk baru: Teh",
        "isi",
    )
    assert mail.to_mime()["To"] == "bos@toko.test, kasir@toko.test"
    assert mail.log_fields()["TO"] == "bos@toko.test, kasir@toko.test"


MailerFactory = Callable[..., SmtpMailer]


@pytest.fixture
async def mailers(smtp: SmtpServer) -> AsyncIterator[MailerFactory]:
    """Mailers to ``smtp`` (or the server given), each closed after the test."""
    made: list[SmtpMailer] = []

    def make(
        server: SmtpServer | None = None,
        connections: ConnectionCache | None = None,
        ehlo_name: EhloName = EHLO_NAME,
    ) -> SmtpMailer:
        target = SmtpTarget("127.0.0.1", (server or smtp).port, None, None, use_tls=False)
        made.append(SmtpMailer(target, timeout=10, connections=connections, ehlo_name=ehlo_name))
        return made[-1]

    yield make
    for mailer in made:
        await mailer.close()


@pytest.fixture
def mailer(mailers: MailerFactory) -> SmtpMailer:
    return mailers()


def owners_email(resend_to: tuple[str, ...] = ()) -> Email:
    return Email(
        9, ENQUEUED, "toko@toko.test", OWNERS, "Produk baru: Teh", "isi", resend_to=resend_to
    )


async def test_an_admin_deferred_while_another_accepts_is_the_only_one_left(
    smtp: SmtpServer, mailer: SmtpMailer
) -> None:
    smtp.defer_recipient("kasir@toko.test", 1)
    with pytest.raises(RecipientsDeferred) as raised:
        await mailer.send(owners_email())
    assert raised.value.deferred == ("kasir@toko.test",)
    assert not raised.value.permanent
    (mail,) = smtp.delivered()
    assert mail.to == ("bos@toko.test",)


async def test_an_admin_refused_for_good_is_not_left_to_retry(
    smtp: SmtpServer, mailer: SmtpMailer
) -> None:
    smtp.refuse_recipient("bos@toko.test")
    smtp.defer_recipient("kasir@toko.test", 1)
    # Nobody got it, but only kasir is worth another attempt.
    with pytest.raises(RecipientsDeferred) as raised:
        await mailer.send(owners_email())
    assert raised.value.deferred == ("kasir@toko.test",)
    assert smtp.delivered() == []


@pytest.mark.parametrize(
    ("refuse", "defer", "permanent"),
    [((), OWNERS, False), (OWNERS, (), True)],
    ids=["all deferred", "all refused for good"],
)
async def test_every_admin_refused_the_same_way_leaves_the_recipients_as_they_are(
    smtp: SmtpServer,
    mailer: SmtpMailer,
    refuse: tuple[str, ...],
    defer: tuple[str, ...],
    permanent: bool,
) -> None:
    for address in refuse:
        smtp.refuse_recipient(address)
    for address in defer:
        smtp.defer_recipient(address, 1)
    with pytest.raises(MailError) as raised:
        await mailer.send(owners_email())
    assert not isinstance(raised.value, RecipientsDeferred)
    assert raised.value.permanent is permanent


async def test_a_resend_goes_to_those_left_with_the_same_message(
    smtp: SmtpServer, mailer: SmtpMailer
) -> None:
    await mailer.send(owners_email(resend_to=("kasir@toko.test",)))
    (mail,) = smtp.delivered()
    assert mail.to == ("kasir@toko.test",)
    assert str(mail.headers["To"]) == ", ".join(OWNERS)
    assert mail.message_id == owners_email().message_id


# Connections kept between emails ------------------------------------------


def product_email(job_id: int) -> Email:
    return Email(
        job_id, ENQUEUED, "toko@toko.test", ("bos@toko.test",), f"Produk baru: #{job_id}#", "isi"
    )


def connections_used(smtp: SmtpServer) -> list[int]:
    """The connection each message came over, refused ones included, in order."""
    return [m.connection for m in smtp.messages()]


async def test_emails_in_a_row_share_one_connection(smtp: SmtpServer, mailer: SmtpMailer) -> None:
    for job_id in (1, 2, 3):
        await mailer.send(product_email(job_id))
    assert connections_used(smtp) == [1, 1, 1]
    assert smtp.quits.snapshot() == []  # kept for the next one


async def test_emails_sent_at_once_take_a_connection_each_and_keep_them(
    smtp: SmtpServer, mailer: SmtpMailer
) -> None:
    await asyncio.gather(*(mailer.send(product_email(job_id)) for job_id in (1, 2)))
    await asyncio.gather(*(mailer.send(product_email(job_id)) for job_id in (3, 4)))
    assert len(smtp.connections) == 2
    assert sorted(connections_used(smtp)) == [1, 1, 2, 2]


async def test_emails_over_starttls_share_the_encrypted_connection(
    mailers: MailerFactory,
) -> None:
    with SmtpServer(tls=server_tls(trustme.CA())) as server:
        mailer = mailers(server)
        for job_id in (1, 2):
            await mailer.send(product_email(job_id))
        await mailer.close()  # before the server stops
        assert [(m.connection, m.tls) for m in server.delivered()] == [(1, True), (1, True)]


async def test_a_connection_the_server_closed_while_idle_is_replaced_at_once(
    smtp: SmtpServer, mailer: SmtpMailer
) -> None:
    await mailer.send(product_email(1))
    smtp.drop_connections()
    await mailer.send(product_email(2))  # no MailError: no attempt is spent on it
    assert connections_used(smtp) == [1, 2]


async def test_a_servers_limit_of_emails_per_connection_spends_no_attempt(
    smtp: SmtpServer, mailer: SmtpMailer
) -> None:
    # The server answers MAIL FROM with 421 and closes: the email goes at
    # once on a new connection, not at the job's next attempt.
    smtp.limit_per_connection(2)
    for job_id in range(1, 6):
        await mailer.send(product_email(job_id))
    assert connections_used(smtp) == [1, 1, 2, 2, 3]
    assert len(smtp.delivered_ids()) == 5


async def test_a_kept_connection_closed_with_a_421_to_rcpt_spends_no_attempt(
    smtp: SmtpServer, mailer: SmtpMailer
) -> None:
    # Postfix past its error limit answers whichever command comes next with
    # 421 and closes: a RCPT TO too. That says nothing about the recipient.
    smtp.limit_per_connection(1, at="RCPT")
    for job_id in range(1, 4):
        await mailer.send(product_email(job_id))
    assert connections_used(smtp) == [1, 2, 3]
    assert len(smtp.delivered_ids()) == 3


async def test_a_connection_is_let_go_after_a_failed_email(
    smtp: SmtpServer, mailer: SmtpMailer
) -> None:
    smtp.refuse_subject("#1#")
    with pytest.raises(MailError):
        await mailer.send(product_email(1))
    await mailer.send(product_email(2))
    assert connections_used(smtp) == [1, 2]


async def test_an_idle_connection_is_closed_with_a_quit(
    smtp: SmtpServer, mailers: MailerFactory
) -> None:
    mailer = mailers(connections=ConnectionCache(idle_seconds=0.05))
    await mailer.send(product_email(1))
    quits = await smtp.quits.async_wait_for(lambda q: list(q) or None, 5, "a QUIT")
    assert quits == [1]
    await mailer.send(product_email(2))
    assert connections_used(smtp) == [1, 2]


async def test_no_email_goes_on_a_connection_older_than_the_reuse_limit(
    smtp: SmtpServer, mailers: MailerFactory, clock: FakeClock
) -> None:
    mailer = mailers(connections=ConnectionCache(clock=clock))
    await mailer.send(product_email(1))
    clock.now += REUSE_SECONDS - 0.1
    await mailer.send(product_email(2))
    clock.now += 0.1
    await mailer.send(product_email(3))
    assert connections_used(smtp) == [1, 1, 2]
    quits = await smtp.quits.async_wait_for(lambda q: list(q) or None, 5, "a QUIT")
    assert quits == [1]


async def test_close_says_goodbye_to_every_idle_connection(
    smtp: SmtpServer, mailer: SmtpMailer
) -> None:
    await asyncio.gather(*(mailer.send(product_email(job_id)) for job_id in (1, 2)))
    await mailer.close()
    assert sorted(smtp.quits.snapshot()) == [1, 2]


async def test_the_ehlo_name_is_looked_up_once_for_every_worker_and_email(
    smtp: SmtpServer, mailers: MailerFactory
) -> None:
    found: list[str] = []

    def lookup() -> str:
        found.append(socket.getfqdn())
        return found[-1]

    ehlo_name = EhloName(lookup=lookup)
    # Three workers of two mailers, all sending at once: each opens a connection.
    senders = [mailers(ehlo_name=ehlo_name), mailers(ehlo_name=ehlo_name)] * 3
    await asyncio.gather(*(m.send(product_email(n)) for n, m in enumerate(senders, 1)))
    await senders[0].send(product_email(7))
    assert len(found) == 1
    assert [m.helo for m in smtp.delivered()] == found * 7


async def test_a_lookup_that_hangs_holds_no_email_past_the_limit(
    smtp: SmtpServer, mailers: MailerFactory, caplog: pytest.LogCaptureFixture
) -> None:
    answer = threading.Event()

    def hangs() -> str:
        answer.wait(60)  # a resolver that does not answer
        return "late.toko.test"

    limit = 0.3
    mailer = mailers(ehlo_name=EhloName(lookup=hangs, fallback=lambda: "kasir", limit=limit))
    try:
        with caplog.at_level(logging.WARNING, logger="toko.mail"):
            started = time.monotonic()
            async with asyncio.timeout(10):
                await asyncio.gather(*(mailer.send(product_email(n)) for n in (1, 2)))
            waited = time.monotonic() - started
            await mailer.send(product_email(3))
    finally:
        answer.set()
    assert waited < limit + 2, waited  # the lookup's limit, plus the sending
    assert [m.helo for m in smtp.delivered()] == ["kasir"] * 3
    (warning,) = [r for r in caplog.records if "EHLO" in r.getMessage()]
    assert warning.getMessage() == (
        "looking up this host's name for EHLO took over 0.3 s; saying kasir instead"
    )


async def test_a_lookup_that_fails_gives_the_short_name(
    smtp: SmtpServer, mailers: MailerFactory
) -> None:
    def fails() -> str:
        raise OSError("no resolver")

    mailer = mailers(ehlo_name=EhloName(lookup=fails, fallback=lambda: "kasir"))
    await mailer.send(product_email(1))
    assert [m.helo for m in smtp.delivered()] == ["kasir"]


# Set-up mistakes: each fails with what is wrong, in words, and soon.

ATTEMPT_SECONDS = 4.0  # the mailer's timeout (TOKO_JOB_TIMEOUT) in these tests


async def failure(target: SmtpTarget) -> tuple[MailError, float]:
    """The MailError of one email to ``target``, and how long it took to come."""
    mailer = SmtpMailer(target, timeout=ATTEMPT_SECONDS)
    started = time.monotonic()
    try:
        with pytest.raises(MailError) as failed:
            await mailer.send(product_email(1))
    finally:
        await mailer.close()
    return failed.value, time.monotonic() - started


def at(server: SmtpServer, *, use_tls: bool, user: str | None = None) -> SmtpTarget:
    password = "s3cret" if user else None
    return SmtpTarget("127.0.0.1", server.port, user, password, use_tls=use_tls)


@pytest.mark.parametrize("user", [None, "toko"])
async def test_smtp_to_a_port_that_speaks_tls_first_says_smtps_before_the_attempts_end(
    user: str | None,
) -> None:
    # Port 465 waits for the client's TLS hello; an smtp:// client waits for
    # the greeting. The attempt's own limit cut that off as "timed out".
    with SmtpServer(tls=server_tls(trustme.CA()), implicit_tls=True) as server:
        error, took = await failure(at(server, use_tls=False, user=user))
    assert "sent no greeting" in str(error) and "smtps://" in str(error), error
    assert took < ATTEMPT_SECONDS * 0.75, took


@pytest.mark.parametrize("starttls", [True, False])
async def test_smtps_to_a_port_that_speaks_plain_text_first_says_starttls(
    starttls: bool,
) -> None:
    with SmtpServer(tls=server_tls(trustme.CA()) if starttls else None) as server:
        error, _ = await failure(at(server, use_tls=True))
    assert "TLS handshake with 127.0.0.1" in str(error), error
    assert "may expect STARTTLS (smtp://" in str(error), error
    assert error.permanent  # logged as an error at once: no retry fixes it


async def test_a_self_signed_certificate_says_so_and_where_to_add_its_ca() -> None:
    with SmtpServer(tls=server_tls(trustme.CA()), implicit_tls=True) as server:
        error, _ = await failure(at(server, use_tls=True))
    assert "self-signed or from a private CA" in str(error), error
    assert "update-ca-certificates" in str(error) and "CERTIFICATE_VERIFY_FAILED" in str(error)
    assert error.permanent


async def test_a_certificate_for_another_name_says_so(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    ca = trustme.CA()
    trust(monkeypatch, tmp_path, ca)
    with SmtpServer(tls=server_tls(ca, "mail.shop.test"), implicit_tls=True) as server:
        error, _ = await failure(at(server, use_tls=True))
    assert "issued to another name" in str(error), error


def trust(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, ca: trustme.CA) -> None:
    """Make ``ca`` the only one trusted by TLS contexts made from now on."""
    bundle = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(bundle))
    monkeypatch.setenv("SSL_CERT_FILE", str(bundle))
    monkeypatch.setenv("SSL_CERT_DIR", str(tmp_path / "no-other-cas"))


async def test_a_server_wanting_a_login_the_url_names_no_user_for_says_how_to_name_one() -> None:
    with SmtpServer(tls=server_tls(trustme.CA()), account=("toko", "s3cret")) as server:
        error, _ = await failure(at(server, use_tls=False))
    assert str(error).startswith("SMTP 530: "), error
    assert "TOKO_SMTP_URL names no user" in str(error), error
    assert f"smtp://user@127.0.0.1:{server.port}" in str(error), error


async def test_a_wrong_password_names_the_user_and_where_the_password_comes_from(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    ca = trustme.CA()
    trust(monkeypatch, tmp_path, ca)
    with SmtpServer(tls=server_tls(ca), account=("toko", "another")) as server:
        error, _ = await failure(at(server, use_tls=False, user="toko"))
    assert str(error).startswith("SMTP 535: "), error
    assert "refused the login as 'toko'" in str(error), error
    assert "TOKO_SMTP_PASSWORD_FILE" in str(error) and "s3cret" not in str(error)


async def test_a_port_where_nothing_listens_says_so() -> None:
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    error, _ = await failure(at_port(port))
    assert f"nothing listens on 127.0.0.1:{port}" in str(error), error


async def test_a_host_name_that_does_not_resolve_says_so() -> None:
    target = SmtpTarget("mail.toko.invalid", 25, None, None, use_tls=False)  # RFC 6761
    error, _ = await failure(target)
    assert "'mail.toko.invalid' could not be looked up" in str(error), error


async def test_a_host_that_never_answers_says_so_before_the_attempts_end() -> None:
    # A listening socket whose backlog is full drops further SYNs, as a
    # firewall that drops packets does: the connection is never made.
    with socket.socket() as full:
        full.bind(("127.0.0.1", 0))
        full.listen(0)
        waiting = [socket.socket() for _ in range(3)]
        try:
            for client in waiting:
                client.setblocking(False)
                client.connect_ex(full.getsockname())
            error, took = await failure(at_port(full.getsockname()[1]))
        finally:
            for client in waiting:
                client.close()
    assert "no answer from 127.0.0.1" in str(error) and "firewall" in str(error), error
    assert took < ATTEMPT_SECONDS * 0.75, took


def at_port(port: int) -> SmtpTarget:
    return SmtpTarget("127.0.0.1", port, None, None, use_tls=False)
