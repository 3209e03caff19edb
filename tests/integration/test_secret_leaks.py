"""No secret in any output, whatever goes wrong (SQLite, SMTP, the API token).

A real toko-api at log level debug, with random secrets, through a refused
SMTP login, a mail server that is down, a certificate that does not check
out, and clients with a missing and a wrong token; then the timer jobs and
``--check-config`` through configuration mistakes. Every byte of stdout and
stderr, every STATUS= line, and every HTTP response (status line, headers,
body, /healthz and /metrics included) is searched for each secret as it is,
percent-encoded, JSON-escaped, and base64 as SMTP AUTH PLAIN and LOGIN send it.

On PostgreSQL, the database password (24 random characters) and a wrong one
are looked for the same way in all that toko-api and the timer jobs write,
and in every HTTP response, when the server refuses the password (from a
file or in the URL), when nothing listens at the URL, and when all goes well.
pg_dump and pg_restore, which every local user can see in ps, get no
password on their command line.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from urllib.parse import quote

import asyncpg  # type: ignore[import-untyped]
import pytest
import trustme

from service.store.postgres import PostgresStore
from tests.conftest import ServiceFactory
from tests.operability.cli import BIN, Completed, environment, run
from tests.support.http import RawResponse, request
from tests.support.leaks import assert_no_secret, make_secret
from tests.support.postgres import PostgresCluster, _children
from tests.support.service import ServiceProcess, free_port
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


# -- PostgreSQL: the database password ----------------------------------------


JOBS = ("toko-recap",), ("toko-backup",), ("toko-queue", "stats")


def with_password(url: str, password: str) -> str:
    """``url`` with ``password`` written into it, percent-encoded as a URL needs."""
    user, at, rest = url.removeprefix("postgresql://").partition("@")
    assert at, url
    return f"postgresql://{user}:{quote(password, safe='')}@{rest}"


def text_of(done: Completed) -> str:
    return done.stdout + done.stderr


async def run_jobs(env: dict[str, str], jobs: tuple[tuple[str, ...], ...] = JOBS) -> str:
    seen = []
    for command in jobs:
        done = await run(*command, env=env, timeout=60)
        seen.append(text_of(done))
    return "\n".join(seen)


async def api_refused(env: dict[str, str], tmp_path: Path) -> str:
    """toko-api started against a database that refuses it: it exits at once."""
    env = {**env, "TOKO_LISTEN": f"127.0.0.1:{free_port()}", "HOME": str(tmp_path)}
    done = await run("toko-api", env=env, timeout=60)
    assert done.returncode == 1, done
    return text_of(done)


async def test_no_password_leaks_when_the_database_refuses_it_or_is_gone(
    pg_cluster: PostgresCluster, pg_url: str, tmp_path: Path
) -> None:
    wrong = make_secret()
    secrets = [pg_cluster.password, wrong]
    wrong_file = tmp_path / "wrong-db-password"
    wrong_file.write_text(wrong + "\n")
    base = {"TOKO_LOG_LEVEL": "debug", "TOKO_BACKUP_DIR": str(tmp_path / "backups")}

    from_file = {**base, "TOKO_DATABASE": pg_url, "TOKO_DATABASE_PASSWORD_FILE": str(wrong_file)}
    refused = await api_refused(from_file, tmp_path) + await run_jobs(from_file)
    assert "password authentication failed" in refused
    assert_no_secret(refused, secrets, "a wrong password from a file")

    in_url = {**base, "TOKO_DATABASE": with_password(pg_url, wrong)}
    refused = await api_refused(in_url, tmp_path) + await run_jobs(in_url)
    assert "password authentication failed" in refused
    assert_no_secret(refused, secrets, "a wrong password in the URL")

    # A "%" not followed by two hex digits: pg_dump quoted the whole token it
    # could not decode, password and all, when it had the URL.
    encoded = quote(wrong, safe="")
    assert encoded.endswith("%25")
    mistyped = {**base, "TOKO_DATABASE": with_password(pg_url, wrong).replace("%25@", "%zz@")}
    printed = await run_jobs(mistyped, (("toko-backup",),))
    assert "toko-backup" in printed and encoded[:-3] not in printed, "the password leaked"

    # libpq and asyncpg also take it as a query parameter.
    in_query = {**base, "TOKO_DATABASE": f"{pg_url}?password={quote(wrong, safe='')}"}
    refused = await api_refused(in_query, tmp_path) + await run_jobs(in_query)
    assert "password authentication failed" in refused
    assert_no_secret(refused, secrets, "a wrong password in the URL's query")

    # Nothing listens there. toko-api waits for it (a booting host): its
    # retry line is what there is to see. The other jobs wait as long.
    gone_url = f"postgresql://{pg_cluster.user}:{pg_cluster.password}@127.0.0.1:{free_port()}/t"
    gone = {**base, "TOKO_DATABASE": gone_url}
    svc = ServiceProcess(tmp_path / "gone", gone, notify=False)
    try:
        svc.start()
        retrying = "database not reachable yet, retrying"
        await svc.logs.async_wait_for(
            lambda records: any(str(r.get("message")).startswith(retrying) for r in records),
            10,
            retrying,
        )
        svc.terminate()
        await svc.async_wait_exit(30)
    finally:
        svc.close()
    backup = await run("toko-backup", env=gone, timeout=60)
    assert backup.returncode == 1, backup
    down = "\n".join([svc.stdout_text(), svc.stderr_text(), text_of(backup)])
    assert_no_secret(down, secrets, "a database that is down")


async def test_no_password_leaks_from_a_working_deployment_at_debug(
    pg_cluster: PostgresCluster, pg_url: str, tmp_path: Path
) -> None:
    secrets = [pg_cluster.password]
    env = {
        "TOKO_DATABASE": with_password(pg_url, pg_cluster.password),
        "TOKO_LOG_LEVEL": "debug",
        "TOKO_BACKUP_DIR": str(tmp_path / "backups"),
    }
    svc = ServiceProcess(tmp_path / "api", env)
    responses = []
    try:
        svc.start()
        await svc.async_wait_ready(timeout=30)
        headers = {"Content-Type": "application/json"}
        for method, path in [("POST", "/produk"), ("GET", "/healthz"), ("GET", "/metrics")]:
            body = PRODUCT if method == "POST" else None
            response = await request(svc.port, method, path, body=body, headers=headers)
            assert response.status < 300, response
            responses.append(f"{response.headers}\n{response.body.decode()}")
        await svc.async_wait_log("email logged")
        svc.terminate()
        assert await svc.async_wait_exit(30) == 0
    finally:
        svc.close()
    assert svc.notify is not None
    jobs = await run_jobs(env)
    statuses = [note.raw for note in svc.notify.messages()]
    everything = "\n".join([svc.stdout_text(), svc.stderr_text(), *statuses, *responses, jobs])
    assert_no_secret(everything, secrets, "a working deployment")


async def migrated(cluster: PostgresCluster, url: str) -> None:
    store = PostgresStore(url, password=cluster.password)
    await store.open()
    await store.close()


@contextlib.asynccontextmanager
async def locked(cluster: PostgresCluster, url: str, table: str) -> AsyncIterator[None]:
    """``table`` locked (ACCESS EXCLUSIVE) until the block ends: a pg_dump or
    pg_restore that touches it waits, its command line there to read."""
    conn: asyncpg.Connection = await cluster.connect(url.rsplit("/", 1)[1])
    try:
        async with conn.transaction():
            await conn.execute(f"LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE")
            yield
    finally:
        await conn.close()


def _running_tool(parent: int, tool: str) -> str | None:
    """The command line of ``parent``'s child ``tool`` connecting to a database, if any."""
    for pid in _children(parent):
        with contextlib.suppress(OSError):
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if Path(argv[0].decode()).name == tool and any(b"--dbname" in a for a in argv):
                return b" ".join(argv).decode()
    return None


async def tool_command_line(parent: asyncio.subprocess.Process, tool: str) -> str:
    """The command line of ``parent``'s child ``tool``, once it runs."""
    async with asyncio.timeout(30):
        while parent.returncode is None:
            if (found := _running_tool(parent.pid, tool)) is not None:
                return found
            await asyncio.sleep(0.01)  # no event tells that a child started
    raise AssertionError(f"toko-backup ended ({parent.returncode}) before {tool} was seen")


async def started_tool(command: str, *args: str, env: dict[str, str]) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        str(BIN / command),
        *args,
        env=environment(env),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )


async def finished(proc: asyncio.subprocess.Process) -> str:
    async with asyncio.timeout(60):
        out, err = await proc.communicate()
    assert proc.returncode == 0, (out, err)
    return out.decode() + err.decode()


async def test_pg_dump_and_pg_restore_get_no_password_on_their_command_line(
    pg_cluster: PostgresCluster, pg_url: str, tmp_path: Path
) -> None:
    # The password written into the URL, where an admin may well put it.
    password = pg_cluster.password
    folder = tmp_path / "backups"
    env = {"TOKO_DATABASE": with_password(pg_url, password), "TOKO_BACKUP_DIR": str(folder)}
    await migrated(pg_cluster, pg_url)

    async with locked(pg_cluster, pg_url, "products"):
        backup = await started_tool("toko-backup", env=env)
        dump_argv = await tool_command_line(backup, "pg_dump")
    printed = await finished(backup)
    (archive,) = folder.glob("toko-*.dump")

    # Restored into a database without products (so no safety dump first),
    # where pg_restore's --clean waits on a table it drops.
    empty = await pg_cluster.async_create_database()
    try:
        conn = await pg_cluster.connect(empty.rsplit("/", 1)[1])
        await conn.execute("CREATE TABLE jobs (id int)")
        await conn.close()
        target = {**env, "TOKO_DATABASE": with_password(empty, password)}
        async with locked(pg_cluster, empty, "jobs"):
            restore = await started_tool("toko-backup", "--restore", str(archive), env=target)
            restore_argv = await tool_command_line(restore, "pg_restore")
        printed += await finished(restore)
    finally:
        await pg_cluster.async_drop_database(empty)

    assert pg_url.rsplit("/", 1)[1] in dump_argv and empty.rsplit("/", 1)[1] in restore_argv
    assert_no_secret(dump_argv, [password], "pg_dump's command line")
    assert_no_secret(restore_argv, [password], "pg_restore's command line")
    assert_no_secret(printed, [password], "toko-backup's output")
