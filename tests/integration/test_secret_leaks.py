"""No secret in any output, whatever goes wrong (SQLite, SMTP, the API token).

A real toko-api at log level debug, with random secrets, through a refused
SMTP login, a mail server that is down, a certificate that does not check
out, and clients with a missing and a wrong token; then the timer jobs and
``--check-config`` through configuration mistakes. Every byte of stdout and
stderr, every STATUS= line, and every HTTP response (status line, headers,
body, /healthz and /metrics included) is searched for each secret as it is,
percent-encoded, JSON-escaped, and base64 as SMTP AUTH PLAIN and LOGIN send it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import trustme

from tests.conftest import ServiceFactory
from tests.operability.cli import run
from tests.support.http import RawResponse, request
from tests.support.leaks import assert_no_secret, make_secret
from tests.support.service import ServiceProcess
from tests.support.smtp import SmtpServer, server_tls

USER = "toko"
PRODUCT = json.dumps({"nama": "Kopi Rahasia", "harga": 9000}).encode()


class Secrets:
    """The configured secrets, and the wrong ones that clients and files present."""

    def __init__(self, folder: Path) -> None:
        self.smtp_password = make_secret()
        self.wrong_smtp_password = make_secret()
        self.token = make_secret()
        self.wrong_token = make_secret()
        self.folder = folder
        folder.mkdir(exist_ok=True)

    def all(self) -> list[str]:
        return [self.smtp_password, self.wrong_smtp_password, self.token, self.wrong_token]

    def file(self, name: str, content: str | bytes) -> str:
        path = self.folder / name
        if isinstance(content, str):
            content = content.encode()
        path.write_bytes(content)
        path.chmod(0o600)
        return str(path)


@pytest.fixture
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture
def planted(tmp_path: Path) -> Secrets:
    return Secrets(tmp_path / "secrets")


def seen(response: RawResponse) -> str:
    return f"{response.status} {response.reason}\n{response.headers}\n" + response.body.decode(
        "utf-8", "replace"
    )


class Client:
    """Requests to one toko-api; every response is kept, to be searched."""

    def __init__(self, svc: ServiceProcess, token: str) -> None:
        self.svc = svc
        self.token = token
        self.responses: list[str] = []

    async def call(self, method: str, path: str, authorization: str | None = None) -> RawResponse:
        headers = {"Content-Type": "application/json"}
        if authorization is not None:
            headers["Authorization"] = authorization
        body = PRODUCT if method == "POST" else None
        response = await request(self.svc.port, method, path, body=body, headers=headers)
        self.responses.append(seen(response))
        return response

    async def post(self) -> int:
        response = await self.call("POST", "/produk", f"Bearer {self.token}")
        assert response.status == 201, response
        return int(response.json()["id"])

    async def look_around(self) -> None:
        for path in ("/healthz", "/metrics", "/produk", "/produk/1", "/openapi.json"):
            await self.call("GET", path)


def output(svc: ServiceProcess, client: Client) -> str:
    assert svc.notify is not None
    statuses = "\n".join(note.raw for note in svc.notify.messages())
    return "\n".join([svc.stdout_text(), svc.stderr_text(), statuses, *client.responses])


async def started(
    factory: ServiceFactory, planted: Secrets, smtp: SmtpServer, env: dict[str, str]
) -> tuple[ServiceProcess, Client]:
    svc = factory(
        {
            "TOKO_SMTP_URL": smtp.url,
            "TOKO_LOG_LEVEL": "debug",
            "TOKO_JOB_MAX_ATTEMPTS": "1",
            "TOKO_JOB_TIMEOUT": "10",
            "TOKO_API_TOKEN_FILE": planted.file("api-token", planted.token + "\n"),
            **env,
        }
    ).start()
    await svc.async_wait_ready(timeout=20)
    return svc, Client(svc, planted.token)


async def stopped(svc: ServiceProcess) -> None:
    svc.terminate()
    assert await svc.async_wait_exit(20) == 0, svc.output_tail()


def trusting(ca: trustme.CA, folder: Path) -> dict[str, str]:
    bundle = folder / "ca.pem"
    ca.cert_pem.write_to_path(str(bundle))
    return {"SSL_CERT_FILE": str(bundle), "SSL_CERT_DIR": str(folder / "no-other-cas")}


async def test_no_secret_leaks_from_toko_api_when_mail_and_clients_go_wrong(
    service_factory: ServiceFactory, ca: trustme.CA, planted: Secrets, tmp_path: Path
) -> None:
    trust = trusting(ca, tmp_path)
    with SmtpServer(tls=server_tls(ca), account=(USER, planted.smtp_password)) as smtp:
        # The right password: one email sent, logged at debug.
        good = planted.file("smtp-password", planted.smtp_password)
        svc, client = await started(
            service_factory, planted, smtp, {**trust, "TOKO_SMTP_PASSWORD_FILE": good}
        )
        await client.post()
        await smtp.async_wait_delivered(1, timeout=20)
        await svc.async_wait_log("email sent", timeout=20)
        # A client without a token, with a wrong one, with one in the wrong scheme.
        for authorization in (
            None,
            f"Bearer {planted.wrong_token}",
            f"Basic {planted.wrong_token}",
            f"Bearer {planted.token}x",
        ):
            assert (await client.call("POST", "/produk", authorization)).status == 401
        await client.look_around()
        await stopped(svc)
        assert_no_secret(output(svc, client), planted.all(), "toko-api sending mail")

        # A wrong password: the server refuses the login.
        wrong = planted.file("wrong-smtp-password", planted.wrong_smtp_password)
        svc, client = await started(
            service_factory, planted, smtp, {**trust, "TOKO_SMTP_PASSWORD_FILE": wrong}
        )
        await client.post()
        refused = await svc.async_wait_log("job failed permanently", timeout=20)
        assert "535" in str(refused["ERROR"]), refused
        # The wrong password did reach the server (PLAIN, then LOGIN), and was refused.
        first, *later = [a.accepted for a in smtp.logins.snapshot()]
        assert first and later and not any(later)
        await client.look_around()
        # The mail server goes away.
        smtp.stop()
        await client.post()
        await svc.async_wait_log("job failed permanently", timeout=20, JOB_ID=3)
        await client.look_around()
        await stopped(svc)
        assert_no_secret(output(svc, client), planted.all(), "toko-api refused and cut off")

    # A certificate that does not check out.
    stranger = trustme.CA()
    with SmtpServer(tls=server_tls(stranger), account=(USER, planted.smtp_password)) as smtp:
        svc, client = await started(
            service_factory, planted, smtp, {**trust, "TOKO_SMTP_PASSWORD_FILE": good}
        )
        await client.post()
        failed = await svc.async_wait_log("job failed permanently", timeout=20)
        assert "CERTIFICATE_VERIFY_FAILED" in str(failed["ERROR"]), failed
        await client.look_around()
        await stopped(svc)
        assert_no_secret(output(svc, client), planted.all(), "toko-api over failing TLS")


def mistakes(planted: Secrets) -> dict[str, dict[str, str]]:
    """Configuration mistakes that hold a secret, each with its environment."""
    secret = planted.smtp_password
    return {
        "password in the SMTP URL": {"TOKO_SMTP_URL": f"smtp://{USER}:{secret}@127.0.0.1:25"},
        "SMTP URL with a slash missing": {"TOKO_SMTP_URL": f"smtp:/{USER}:{secret}@127.0.0.1"},
        "SMTP URL with a bad port": {"TOKO_SMTP_URL": f"smtp://{USER}:{secret}@127.0.0.1:x"},
        "SMTP URL with an unclosed bracket": {"TOKO_SMTP_URL": f"smtp://{USER}:{secret}@[::1"},
        "database URL with a slash missing": {
            "TOKO_DATABASE": f"postgresql:/{USER}:{secret}@127.0.0.1:5432/toko"
        },
        "database URL with the colon missing": {
            "TOKO_DATABASE": f"postgresql//{USER}:{secret}@127.0.0.1:5432/toko"
        },
        "database URL with a bad port": {
            "TOKO_DATABASE": f"postgresql://{USER}:{secret}@127.0.0.1:99999/toko"
        },
        "secret file not UTF-8": {
            "TOKO_SMTP_URL": f"smtp://{USER}@127.0.0.1:25",
            "TOKO_SMTP_PASSWORD_FILE": planted.file("latin1", secret.encode() + b"\xff"),
        },
        "token with a line break": {
            "TOKO_API_TOKEN_FILE": planted.file("two-lines", f"{secret}\n{planted.token}\n")
        },
        "secret file that is a folder": {"TOKO_API_TOKEN_FILE": str(planted.folder)},
    }


async def test_no_secret_leaks_from_a_configuration_mistake(
    planted: Secrets, tmp_path: Path
) -> None:
    database = tmp_path / "toko.db"
    commands = [("toko-api", "--check-config"), ("toko-recap",), ("toko-backup",)]
    commands.append(("toko-queue", "stats"))
    for case, env in mistakes(planted).items():
        full = {"TOKO_DATABASE": str(database), "TOKO_LOG_LEVEL": "debug", "HOME": str(tmp_path)}
        full.update(env)
        for command in commands:
            done = await run(*command, env=full)
            assert done.returncode != 0, (case, command, done.stdout, done.stderr)
            assert_no_secret(done.stdout + done.stderr, planted.all(), f"{command[0]}: {case}")
