"""TLS and login on the way to the SMTP server: the password only goes over
TLS to the server the URL names, a relay's self-signed STARTTLS does not
stop the mail, and the wrong scheme for a port says which one to use."""

from __future__ import annotations

import time
from pathlib import Path

import aiohttp
import pytest
import trustme

from tests.conftest import ServiceFactory
from tests.support import db
from tests.support.api import create_product
from tests.support.service import ServiceProcess
from tests.support.smtp import SmtpMessage, SmtpServer, server_tls

USER, PASSWORD = "toko", "s3cret-pw"


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture
def trusted(ca: trustme.CA, tmp_path: Path) -> dict[str, str]:
    """toko-api's environment that trusts ``ca``, as update-ca-certificates would."""
    bundle = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(bundle))
    return {"SSL_CERT_FILE": str(bundle), "SSL_CERT_DIR": str(tmp_path / "no-other-cas")}


@pytest.fixture
def password_file(tmp_path: Path) -> str:
    path = tmp_path / "smtp-password"
    path.write_text(PASSWORD + "\n")
    return str(path)


async def start(factory: ServiceFactory, smtp: SmtpServer, env: dict[str, str]) -> ServiceProcess:
    svc = factory(
        {"TOKO_SMTP_URL": smtp.url, "TOKO_JOB_MAX_ATTEMPTS": "1", "TOKO_JOB_TIMEOUT": "10", **env}
    ).start()
    await svc.async_wait_ready(timeout=20)
    return svc


async def post_one(svc: ServiceProcess) -> None:
    async with aiohttp.ClientSession() as session:
        await create_product(session, svc.base_url, "Kopi Aman", 15000)


async def sent_one(svc: ServiceProcess, smtp: SmtpServer) -> SmtpMessage:
    await post_one(svc)
    await smtp.async_wait_delivered(1, timeout=20)
    # Logged after QUIT: the server is not stopped under a closing TLS session.
    await svc.async_wait_log("email sent", timeout=20)
    (message,) = smtp.delivered()
    return message


async def test_a_login_goes_over_starttls_to_the_named_server(
    service_factory: ServiceFactory, ca: trustme.CA, trusted: dict[str, str], password_file: str
) -> None:
    with SmtpServer(tls=server_tls(ca), account=(USER, PASSWORD)) as smtp:
        svc = await start(
            service_factory, smtp, {**trusted, "TOKO_SMTP_PASSWORD_FILE": password_file}
        )
        message = await sent_one(svc, smtp)
        assert message.tls and message.login == USER
        assert [(a.accepted, a.tls) for a in smtp.logins.snapshot()] == [(True, True)]


async def test_smtps_logs_in_over_tls(
    service_factory: ServiceFactory, ca: trustme.CA, trusted: dict[str, str], password_file: str
) -> None:
    with SmtpServer(tls=server_tls(ca), implicit_tls=True, account=(USER, PASSWORD)) as smtp:
        assert smtp.url.startswith("smtps://")
        svc = await start(
            service_factory, smtp, {**trusted, "TOKO_SMTP_PASSWORD_FILE": password_file}
        )
        message = await sent_one(svc, smtp)
        assert message.tls and message.login == USER


async def test_no_password_to_a_server_without_starttls(
    service_factory: ServiceFactory, password_file: str
) -> None:
    # A server (or whoever sits between) that offers no STARTTLS but would take
    # the password in clear.
    with SmtpServer(account=(USER, PASSWORD), auth_in_clear=True) as smtp:
        svc = await start(service_factory, smtp, {"TOKO_SMTP_PASSWORD_FILE": password_file})
        await post_one(svc)
        failed = await svc.async_wait_log("job failed permanently", timeout=20)
        assert "STARTTLS" in str(failed["ERROR"]), failed
        assert smtp.logins.snapshot() == [] and smtp.messages() == []
        (job,) = db.jobs(svc.database)
        assert job["state"] == "failed" and "STARTTLS" in job["last_error"]


async def test_no_password_to_a_server_whose_certificate_does_not_check_out(
    service_factory: ServiceFactory, password_file: str
) -> None:
    stranger = trustme.CA()  # toko-api does not trust it
    with SmtpServer(tls=server_tls(stranger), account=(USER, PASSWORD)) as smtp:
        svc = await start(service_factory, smtp, {"TOKO_SMTP_PASSWORD_FILE": password_file})
        await post_one(svc)
        failed = await svc.async_wait_log("job failed permanently", timeout=20)
        assert "CERTIFICATE_VERIFY_FAILED" in str(failed["ERROR"]), failed
        assert smtp.logins.snapshot() == [] and smtp.messages() == []


async def test_a_relays_self_signed_starttls_does_not_stop_the_mail(
    service_factory: ServiceFactory,
) -> None:
    # Debian's Postfix offers STARTTLS with its self-signed "snakeoil"
    # certificate, issued to the host's name: smtp://127.0.0.1 without a user.
    snakeoil = trustme.CA()
    with SmtpServer(tls=server_tls(snakeoil, "mail.shop.internal")) as smtp:
        svc = await start(service_factory, smtp, {})
        message = await sent_one(svc, smtp)
        assert message.tls and message.login is None


# A server that speaks TLS first (port 465) asked for smtp://, and one that
# speaks plain text first (587, 25) asked for smtps://: what the journal says
# at the first attempt, and that the email goes once the URL is fixed.
SCHEME_MISTAKES = {
    "smtp-to-implicit-tls": (True, "smtp", "the server may expect implicit TLS (smtps://"),
    "smtps-to-starttls": (False, "smtps", "the server may expect STARTTLS (smtp://"),
}


@pytest.mark.parametrize("mistake", SCHEME_MISTAKES)
async def test_the_wrong_scheme_for_the_port_says_which_and_the_fixed_url_delivers(
    service_factory: ServiceFactory, ca: trustme.CA, trusted: dict[str, str], mistake: str
) -> None:
    implicit_tls, wrong_scheme, says = SCHEME_MISTAKES[mistake]
    attempt_seconds = 4.0
    retrying = {
        **trusted,
        "TOKO_JOB_MAX_ATTEMPTS": "20",
        "TOKO_JOB_BACKOFF": "0.1",
        "TOKO_JOB_TIMEOUT": str(attempt_seconds),
    }
    with SmtpServer(tls=server_tls(ca), implicit_tls=implicit_tls) as smtp:
        wrong_url = f"{wrong_scheme}://127.0.0.1:{smtp.port}"
        svc = await start(service_factory, smtp, {**retrying, "TOKO_SMTP_URL": wrong_url})
        posted = time.monotonic()
        await post_one(svc)
        retry = await svc.async_wait_log("job failed, will retry", timeout=20)
        # Before the attempt's own limit, which said no more than "timed out".
        assert time.monotonic() - posted < attempt_seconds, retry
        assert says in str(retry["ERROR"]), retry
        svc.terminate()
        assert await svc.async_wait_exit(timeout=20) == 0

        fixed = await start(service_factory, smtp, retrying)
        await smtp.async_wait_delivered(1, timeout=20)
        await fixed.async_wait_log("email sent", timeout=20)
        (message,) = smtp.delivered()
        assert message.tls


async def test_smtps_to_a_plain_text_port_is_an_error_from_the_first_attempt(
    service_factory: ServiceFactory, trusted: dict[str, str]
) -> None:
    # No retry fixes it, as with a wrong password: `journalctl -p err` shows it now.
    with SmtpServer() as smtp:
        env = {**trusted, "TOKO_SMTP_URL": f"smtps://127.0.0.1:{smtp.port}"}
        svc = await start(service_factory, smtp, {**env, "TOKO_JOB_MAX_ATTEMPTS": "5"})
        await post_one(svc)
        retry = await svc.async_wait_log("job failed, will retry", timeout=20)
        assert retry["level"] == "ERROR", retry
