"""A seeded random walk over odd values of every setting, against the contract:
a value is either taken (and used as written) or stops start-up with one line
that names the variable, never a traceback.

Most cases go through ``Settings.from_env`` in-process, where a subprocess
would add nothing but time; a handful run the real ``toko-api`` with a
NOTIFY_SOCKET. The walk is deterministic; run more of it with
``TOKO_SETTINGS_SEEDS=20000``.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import aiohttp
import pytest

from service.settings import ConfigError, Settings, check_for_api
from tests.conftest import ServiceFactory
from tests.support.api import wait_healthy

SEEDS = int(os.environ.get("TOKO_SETTINGS_SEEDS", "400"))

NUMBERS = [
    "1", "+1", "-0", "-1", "0", "7", str(10**30), "9" * 5000, "1.5", "1e3", "nan", "inf", "-inf",
    "\u0663", "\uff13", "\u00b2", "1_0", "0x10", "3600", "36500",
]  # fmt: skip
DURATIONS = [
    "7d", "7 d", "7D", "1w", "1.5h", "0.5h", "36500d", "36501d", "1e3s", "\u0663d", "-1d",
    "1h30m", "9" * 400 + "s",
]  # fmt: skip
ADDRESSES = [
    "a@b", "a@b.c", "a @b.c", "a@b.c,", "a@b.c, d@e.f", '"a"@b.c', "a@\u00fc.de", "@b.c", "a@",
    "a\x01@b.c", "a@[1.2.3.4]", "a@b.c (x)", "a@b.c;d@e.f", "a" * 1000 + "@b.c", "a@b.c,a@b.c",
]  # fmt: skip
LISTEN = [
    "127.0.0.1:8080", ":8080", "[::1]:8080", "::1:8080", "[fe80::1%lo]:8080", "[::1]", "h:+80",
    "h:080", "h:0", "h:65536", "h:-1", "h:\uff18\uff10", "[::1:80", "*:80", "0:80", "a b:80",
    "a" * 300 + ":80", "x\ny:80", "\u00e9:80",
]  # fmt: skip
SMTP = [
    "smtp://h", "smtp://h:0", "smtp://h:65536", "smtp://h:-1", "smtp://:25", "smtp://[::1]:25",
    "smtp://::1:25", "smtp://[fe80::1%25lo]:25", "smtp://u@h:25", "smtp://u:s3cret@h:25",
    "smtp://@h", "smtp://h:25?x=1", "smtp://h:25/p#f", "smtps://h", "SMTP://h", "smtp:/h",
    "ftp://h", "smtp://h:\uff12\uff15", "smtp://h\uff03:25", "smtp://[v1.x]:25", "smtp://[:25",
    "smtp://h:25:26", "smtp://\u00fc.de", "smtp://-h", "smtp://" + "a" * 5000,
    "smtp://h:" + "9" * 30,
]  # fmt: skip
DATABASES = [
    "postgresql://", "postgresql://h:0/db", "postgresql://h:65536/db", "postgresql://[::1/db",
    "postgresql://u:s3cret@[::1", "postgres://u@h/db", "postgresql://h1:5432,h2/db",
    "postgresql://h:" + "9" * 20 + "/db", "postgresql://h:-1/db", "sqlite://x", "file:x?mode=ro",
    "relative/x.db", "/x/" + "a" * 256, "a/" * 3000, "x\ny.db",
]  # fmt: skip
WORDS = ["debug", "DEBUG", "\u0131nfo", "yes", "on", "2", "maybe", "", " ", "\t"]
SECRET_FILES = ["/dev/null", "/dev/zero", "/", "missing", "x\ny", "a" * 5000, "/etc/hostname"]

VARIABLES: dict[str, list[str]] = {
    "TOKO_LISTEN": LISTEN,
    "TOKO_DATABASE": DATABASES,
    "TOKO_SMTP_URL": SMTP,
    "TOKO_ADMIN_EMAIL": ADDRESSES,
    "TOKO_MAIL_FROM": ADDRESSES,
    "TOKO_WORKERS": NUMBERS,
    "TOKO_JOB_MAX_ATTEMPTS": NUMBERS,
    "TOKO_JOB_BACKOFF": NUMBERS,
    "TOKO_JOB_TIMEOUT": NUMBERS,
    "TOKO_DRAIN_TIMEOUT": NUMBERS,
    "TOKO_CLIENT_TIMEOUT": NUMBERS,
    "TOKO_BACKUP_KEEP": NUMBERS,
    "TOKO_FAULT_BLOCK_SECONDS": NUMBERS,
    "TOKO_JOB_RETENTION": DURATIONS + NUMBERS,
    "TOKO_LOG_LEVEL": WORDS,
    "TOKO_FAULT_INJECTION": WORDS,
    "TOKO_API_TOKEN_FILE": SECRET_FILES,
    "TOKO_SMTP_PASSWORD_FILE": SECRET_FILES,
    "TOKO_DATABASE_PASSWORD_FILE": SECRET_FILES,
    # systemd's, read by the same loader: odd ones must not end in a traceback either.
    "CREDENTIALS_DIRECTORY": SECRET_FILES,
    "WATCHDOG_USEC": NUMBERS,
}
INSERTS = ["\x01", " ", "\u0663", ":", "@", ",", "%", "[", "]", "\n", "\u00a0"]


def odd_value(rng: random.Random, variable: str) -> str:
    value = rng.choice(VARIABLES[variable] + WORDS)
    roll = rng.random()
    if roll < 0.15:
        value = f" {value} "
    elif roll < 0.3 and value:
        at = rng.randrange(len(value) + 1)
        value = value[:at] + rng.choice(INSERTS) + value[at:]
    return value


def odd_environment(seed: int) -> dict[str, str]:
    rng = random.Random(seed)
    names = rng.sample(sorted(VARIABLES), rng.choice([1, 1, 1, 2, 3]))
    return {name: odd_value(rng, name) for name in names}


def check_contract(env: dict[str, str]) -> Settings | None:
    """The settings ``env`` gives, or None after checking the refusal's message."""
    try:
        settings = Settings.from_env(env)
        check_for_api(settings)
    except ConfigError as exc:
        message = str(exc)
        assert "\n" not in message, message
        assert len(message) < 400, message  # a long value is not echoed whole
        assert any(name in message for name in env), (env, message)
        assert "s3cret" not in message  # never echo a password
        return None
    return settings


def check_used_as_written(env: dict[str, str], settings: Settings) -> None:
    """A number that was taken is the one written."""
    for name, taken in [
        ("TOKO_WORKERS", settings.pool.workers),
        ("TOKO_BACKUP_KEEP", settings.backup.keep),
    ]:
        raw = env.get(name, "").strip()
        if raw:
            assert taken == int(raw), (env, settings)


@pytest.mark.parametrize("seed", range(SEEDS))
def test_an_odd_setting_is_taken_or_refused_in_one_line(
    seed: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Relative secret-file names ("missing") resolve here, not in the checkout.
    monkeypatch.chdir(tmp_path)
    env = odd_environment(seed)
    settings = check_contract(env)
    if settings is not None:
        check_used_as_written(env, settings)


@pytest.mark.parametrize(
    ("variable", "value", "code"),
    [
        # Each ended toko-api in a traceback before the fix.
        ("TOKO_DATABASE", "postgresql://toko@[::1/toko", 2),
        ("TOKO_DATABASE", "postgresql://db.example:99999999999999999999/toko", 2),
        ("CREDENTIALS_DIRECTORY", "c" * 5000, 2),
        # Refused only at bind before, in a line that did not name the variable.
        ("TOKO_LISTEN", "a b:8080", 2),
        # A well-formed address of no interface here (TEST-NET-1): still named.
        ("TOKO_LISTEN", "192.0.2.1:8080", 1),
    ],
)
async def test_the_real_toko_api_refuses_in_one_line_before_ready(
    service_factory: ServiceFactory, variable: str, value: str, code: int
) -> None:
    svc = service_factory({variable: value}).start()
    assert await svc.async_wait_exit(timeout=15) == code, svc.output_tail()
    lines = svc.stderr.snapshot()
    assert svc.notify is not None
    svc.notify.flush()
    assert len(lines) == 1, f"expected one line on stderr, got {lines}"
    assert variable in lines[0] and "Traceback" not in lines[0], lines[0]
    assert svc.notify.first("READY") is None


async def test_the_real_toko_api_uses_an_odd_but_valid_setting_as_written(
    service_factory: ServiceFactory,
) -> None:
    # Spaces around, and an odd WATCHDOG_USEC (systemd's, not ours to refuse: no watchdog).
    svc = service_factory({"TOKO_WORKERS": " 5 ", "WATCHDOG_USEC": "\u00b2"}).start()
    await svc.async_wait_ready(timeout=15)
    async with aiohttp.ClientSession() as session:
        body = await wait_healthy(session, svc.base_url, timeout=10)
    assert body["workers"]["configured"] == 5
    svc.terminate()
    assert await svc.async_wait_exit(timeout=15) == 0
    assert svc.stderr.snapshot() == []
