"""``toko-api --check-config --env-file FILE``: the file as systemd's
EnvironmentFile= reads it, and the credentials toko-api.service loads, checked
by a real toko-api process on real files."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from service.check_config import DEFAULT_CREDENTIALS_DIR, UNIT_CREDENTIALS

ROOT = Path(__file__).resolve().parents[2]
TOKO_API = Path(sys.executable).parent / "toko-api"
WORKERS = "TOKO_WORKERS must be an integer from 1 to 256"


def toko_api(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(TOKO_API), *args],
        env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", **(env or {})},
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


@pytest.fixture
def etc(tmp_path: Path) -> Path:
    """A /etc/toko as the package leaves it: toko.env, and a root-only api-token."""
    folder = tmp_path / "etc-toko"
    folder.mkdir()
    (folder / "toko.env").write_text(
        f"# toko configuration\nTOKO_DATABASE={tmp_path / 'toko.db'}\nTOKO_WORKERS=4\n"
    )
    token = folder / "api-token"
    token.write_text("s3cret-token\n")
    token.chmod(0o600)
    return folder


def check(etc: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return toko_api(
        "--check-config",
        "--env-file",
        str(etc / "toko.env"),
        "--credentials-dir",
        str(etc),
        env=env,
    )


def test_a_good_file_and_token_give_one_line_and_exit_0(etc: Path) -> None:
    done = check(etc)
    assert (done.returncode, done.stderr) == (0, ""), done
    assert done.stdout == (
        f"toko-api: configuration is valid: {etc / 'toko.env'}, "
        f"credentials from {etc} (api-token)\n"
    )


def test_a_bad_variable_gives_the_line_start_up_gives(etc: Path, tmp_path: Path) -> None:
    with (etc / "toko.env").open("a") as file:
        file.write("TOKO_WORKERS=lots\n")  # the last assignment wins, as in systemd
    done = check(etc)
    assert done.returncode == 2, done
    assert done.stdout == ""
    (line,) = done.stderr.splitlines()
    assert line == "toko-api: TOKO_WORKERS must be an integer from 1 to 256, got 'lots'"
    # What toko-api itself prints when the unit starts it with that file.
    start = toko_api(env={"TOKO_DATABASE": str(tmp_path / "toko.db"), "TOKO_WORKERS": "lots"})
    assert (start.returncode, start.stderr) == (2, line + "\n")


def test_the_shells_own_settings_do_not_count(etc: Path) -> None:
    # The service gets none of them: one must neither fail nor hide the file.
    assert check(etc, env={"TOKO_WORKERS": "lots"}).returncode == 0
    (etc / "toko.env").write_text((etc / "toko.env").read_text() + "TOKO_WORKERS=0\n")
    hidden = check(etc, env={"TOKO_WORKERS": "4", "CREDENTIALS_DIRECTORY": "/nowhere"})
    assert hidden.returncode == 2 and "TOKO_WORKERS" in hidden.stderr, hidden


def test_a_missing_token_is_what_the_unit_cannot_start_without(etc: Path) -> None:
    (etc / "api-token").unlink()
    done = check(etc)
    assert done.returncode == 2, done
    assert done.stderr == (
        f"toko-api: credential api-token: no file {etc / 'api-token'}; toko-api.service "
        "loads it (LoadCredential=api-token:/etc/toko/api-token) and does not start without it\n"
    )


@pytest.mark.parametrize("content", ["", "  \n"])
def test_an_empty_token_gives_start_ups_line(etc: Path, content: str) -> None:
    (etc / "api-token").write_text(content)
    done = check(etc)
    assert done.returncode == 2, done
    assert done.stderr == (
        "toko-api: the API token (TOKO_API_TOKEN_FILE or credential api-token) is empty\n"
    )


@pytest.mark.parametrize("mode", [0o644, 0o602])
def test_a_token_every_user_may_read_or_change_is_refused(etc: Path, mode: int) -> None:
    token = etc / "api-token"
    token.chmod(mode)
    done = check(etc)
    assert done.returncode == 2, done
    assert done.stderr == (
        f"toko-api: credential api-token: every user may read or change {token} "
        f"(mode {mode:04o}); chmod 600 {token}\n"
    )


def test_a_folder_for_a_token_is_refused(etc: Path) -> None:
    (etc / "api-token").unlink()
    (etc / "api-token").mkdir()
    done = check(etc)
    assert done.returncode == 2 and "api-token" in done.stderr and "not a file" in done.stderr


def test_other_credentials_are_read_from_the_same_folder(etc: Path) -> None:
    with (etc / "toko.env").open("a") as file:
        file.write("TOKO_SMTP_URL=smtp://toko@mail.example.com:587\n")
    without = check(etc)
    assert without.returncode == 2, without
    assert without.stderr.startswith("toko-api: TOKO_SMTP_URL logs in as 'toko'")
    password = etc / "smtp-password"
    password.write_text("mail-s3cret\n")
    password.chmod(0o600)
    done = check(etc)
    assert done.returncode == 0, done
    assert done.stdout.endswith(f"credentials from {etc} (smtp-password, api-token)\n")


@pytest.mark.parametrize(
    ("lines", "problem"),
    [
        # As systemd reads it, a comment after a value is part of the value.
        ("TOKO_WORKERS=4 # four\n", f"{WORKERS}, got '4 # four'"),
        # A backslash continues the value on the next line: 1000, over the limit.
        ("TOKO_WORKERS=1\\\n000\n", f"{WORKERS}, got '1000'"),
        # Inside double quotes a backslash escapes only " \\ ` $: this one stays.
        ('TOKO_LOG_LEVEL="de\\bug"\n', "TOKO_LOG_LEVEL"),
        # What systemd would read otherwise than it looks is refused, with the line.
        ('TOKO_WORKERS="4" # four\n', "toko.env:4: text after the closing quote of TOKO_WORKERS"),
        ("TOKO_MAIL_FROM='toko@example.com\n", "toko.env:4: the quote in the value of"),
        ("export TOKO_WORKERS=4\n", "toko.env:4: systemd ignores a line with 'export'"),
    ],
)
def test_the_file_is_read_as_systemd_reads_it(etc: Path, lines: str, problem: str) -> None:
    with (etc / "toko.env").open("a") as file:
        file.write(lines)
    done = check(etc)
    assert done.returncode == 2, done
    (line,) = done.stderr.splitlines()
    assert problem in line, line


def test_quotes_comments_and_continuations_that_systemd_takes_pass(etc: Path) -> None:
    with (etc / "toko.env").open("a") as file:
        file.write(
            "; another comment\n"
            "\n"
            'TOKO_ADMIN_EMAIL="admin@example.com, ops@example.com"\n'
            "TOKO_MAIL_FROM='toko@example.com'\n"
            "TOKO_JOB_RETENTION=1\\\n4d\n"
            "   TOKO_LOG_LEVEL = debug   \n"
        )
    done = check(etc)
    assert done.returncode == 0, done


def test_an_unknown_variable_is_warned_about_and_passes(etc: Path) -> None:
    with (etc / "toko.env").open("a") as file:
        file.write("TOKO_WORKER=8\n")
    done = check(etc)
    assert done.returncode == 0, done
    assert "unknown settings ignored: 'TOKO_WORKER' (meant TOKO_WORKERS?)" in done.stderr


def test_a_file_that_cannot_be_read_is_bad_configuration(tmp_path: Path, etc: Path) -> None:
    missing = tmp_path / "nope.env"
    done = toko_api("--check-config", "--env-file", str(missing), "--credentials-dir", str(etc))
    assert done.returncode == 2, done
    assert done.stderr == f"toko-api: cannot read {missing}: No such file or directory\n"


def test_the_env_file_is_for_the_check_only(etc: Path) -> None:
    served = toko_api("--env-file", str(etc / "toko.env"))
    assert served.returncode == 2 and "--env-file goes with --check-config" in served.stderr
    alone = toko_api("--check-config", "--credentials-dir", str(etc))
    assert alone.returncode == 2 and "--credentials-dir goes with --env-file" in alone.stderr


def test_the_credentials_the_unit_loads_are_the_ones_checked() -> None:
    unit = (ROOT / "deploy" / "systemd" / "toko-api.service").read_text()
    loaded = dict(
        line.split("=", 1)[1].split(":", 1)
        for line in unit.splitlines()
        if re.match(r"LoadCredential=", line)
    )
    assert loaded == {name: str(DEFAULT_CREDENTIALS_DIR / name) for name in UNIT_CREDENTIALS}
