"""Write auth on a real toko-api: the bearer token guards writes, reads stay open."""

from __future__ import annotations

import json
import secrets
from pathlib import Path

import pytest

from service.auth import presented_token
from service.settings import ConfigError, Settings
from tests.conftest import ServiceFactory
from tests.operability.cli import run
from tests.support import db
from tests.support.http import RawResponse, request

TOKEN = "tok-" + secrets.token_hex(20)
PRODUCT = json.dumps({"nama": "Kopi Tubruk", "harga": 12000}).encode()
# aiohttp refuses a header line over 8190 bytes before any handler runs.
AIOHTTP_MAX_FIELD = 8190


async def post(port: int, authorization: str | None) -> RawResponse:
    headers = {"Content-Type": "application/json"}
    if authorization is not None:
        headers["Authorization"] = authorization
    return await request(port, "POST", "/produk", body=PRODUCT, headers=headers)


def assert_unauthorized(response: RawResponse, case: str) -> None:
    assert response.status == 401, (case, response)
    assert response.headers["content-type"].startswith("application/json"), (case, response)
    body = response.json()
    assert set(body) == {"error"} and body["error"], (case, body)
    assert response.headers["www-authenticate"].startswith('Bearer realm="toko"'), case


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "api-token"
    # As an admin's editor would leave it: a trailing newline, maybe spaces.
    path.write_text(f"  {TOKEN}\n")
    return path


async def test_writes_need_the_token_and_it_is_never_printed(
    service_factory: ServiceFactory, token_file: Path
) -> None:
    svc = service_factory({"TOKO_API_TOKEN_FILE": str(token_file)}).start()
    await svc.async_wait_ready(timeout=20)
    refused = {
        "no header": None,
        "empty header": "",
        "scheme only": "Bearer",
        "wrong token": "Bearer " + secrets.token_hex(20),
        "right token plus a character": f"Bearer {TOKEN}x",
        "a prefix of the token": f"Bearer {TOKEN[:-1]}",
        "another scheme": f"Basic {TOKEN}",
        "token without scheme": TOKEN,
        "a very long header": "Bearer " + "x" * (AIOHTTP_MAX_FIELD - 200),
    }
    for case, header in refused.items():
        assert_unauthorized(await post(svc.port, header), case)
    assert db.product_count(svc.database) == 0

    accepted = {
        "right token": f"Bearer {TOKEN}",
        "surrounding whitespace, lower-case scheme": f"bearer   {TOKEN} \t ",
    }
    for case, header in accepted.items():
        response = await post(svc.port, header)
        assert response.status == 201, (case, response)
    assert db.product_count(svc.database) == 2

    # Over aiohttp's header limit the request never reaches toko: a plain 400,
    # and the service carries on.
    oversized = await post(svc.port, "Bearer " + "x" * (AIOHTTP_MAX_FIELD + 100))
    assert oversized.status == 400, oversized

    for method, path in [("GET", "/produk"), ("HEAD", "/produk"), ("GET", "/healthz")]:
        response = await request(svc.port, method, path)
        assert response.status == 200, (method, path, response)
    # A write to no route stays a 404: it reveals nothing and writes nothing.
    assert (await request(svc.port, "POST", "/nowhere")).status == 404

    svc.terminate()
    assert await svc.async_wait_exit(15) == 0
    assert svc.find_logs("writes require a bearer token")
    output = svc.stdout_text() + svc.stderr_text()
    assert TOKEN not in output
    assert TOKEN[4:20] not in output  # not even a part of it


async def test_token_from_the_systemd_credential(
    service_factory: ServiceFactory, tmp_path: Path
) -> None:
    credentials = tmp_path / "credentials"
    credentials.mkdir()
    (credentials / "api-token").write_text(TOKEN + "\n")
    svc = service_factory({"CREDENTIALS_DIRECTORY": str(credentials)}).start()
    await svc.async_wait_ready(timeout=20)
    assert_unauthorized(await post(svc.port, None), "no header")
    assert (await post(svc.port, f"Bearer {TOKEN}")).status == 201


async def test_without_a_token_writes_are_open_and_start_up_says_so(
    service_factory: ServiceFactory,
) -> None:
    svc = service_factory().start()
    await svc.async_wait_ready(timeout=20)
    warning = svc.find_logs()
    warning = [r for r in warning if "NO API TOKEN CONFIGURED" in str(r.get("message"))]
    assert warning and warning[0]["level"] == "WARNING", svc.output_tail()
    assert (await post(svc.port, None)).status == 201


async def test_an_empty_token_file_stops_start_up(tmp_path: Path) -> None:
    empty = tmp_path / "api-token"
    empty.write_text("\n")
    result = await run(
        "toko-api",
        "--check-config",
        env={"TOKO_API_TOKEN_FILE": str(empty), "TOKO_DATABASE": str(tmp_path / "t.db")},
    )
    assert result.returncode == 2, result
    assert "TOKO_API_TOKEN_FILE" in result.stderr and len(result.stderr.splitlines()) == 1


@pytest.mark.parametrize(
    "content",
    [
        # `head -c 64 /dev/urandom | base64` wraps its output at 76 characters.
        f"{TOKEN}{TOKEN}\n{TOKEN}\n",
        f"{TOKEN}\r\n# written by hand\n",
        f"{TOKEN}\x00{TOKEN}",
        f"{TOKEN}\x7f",
    ],
    ids=["wrapped", "a second line", "NUL", "DEL"],
)
async def test_a_token_no_header_can_carry_stops_start_up(tmp_path: Path, content: str) -> None:
    # Such a token got every write a 401 "not valid", whatever the client sent.
    token_file = tmp_path / "api-token"
    token_file.write_text(content)
    result = await run(
        "toko-api",
        "--check-config",
        env={"TOKO_API_TOKEN_FILE": str(token_file), "TOKO_DATABASE": str(tmp_path / "t.db")},
    )
    assert result.returncode == 2, result
    assert "TOKO_API_TOKEN_FILE" in result.stderr and "one line" in result.stderr, result
    assert len(result.stderr.splitlines()) == 1, result
    assert TOKEN[4:20] not in result.stderr + result.stdout


def test_a_token_with_a_tab_or_space_inside_is_taken_as_written(tmp_path: Path) -> None:
    # A header carries both, and presented_token keeps what is inside.
    token_file = tmp_path / "api-token"
    token_file.write_text(f"{TOKEN}\t{TOKEN} x\n")
    settings = Settings.from_env({"TOKO_API_TOKEN_FILE": str(token_file)})
    assert settings.http.api_token == f"{TOKEN}\t{TOKEN} x"
    assert presented_token(f"Bearer {settings.http.api_token}") == settings.http.api_token


def test_token_is_not_in_the_settings_repr(token_file: Path) -> None:
    settings = Settings.from_env({"TOKO_API_TOKEN_FILE": str(token_file)})
    assert settings.http.api_token == TOKEN
    assert TOKEN not in repr(settings)


def test_unreadable_token_file_names_the_variable(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="TOKO_API_TOKEN_FILE"):
        Settings.from_env({"TOKO_API_TOKEN_FILE": str(tmp_path / "missing")})


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        (None, None),
        ("", None),
        ("Bearer", None),
        ("Bearer ", None),
        ("Bearer abc", "abc"),
        ("BEARER  abc ", "abc"),
        ("Basic abc", None),
        ("Bearer a b", "a b"),  # compared whole, so it simply does not match
    ],
)
def test_presented_token(header: str | None, expected: str | None) -> None:
    assert presented_token(header) == expected
