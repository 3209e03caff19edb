from __future__ import annotations

import os
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from service import cli
from service.settings import KNOWN_VARIABLES, ConfigError, Settings, check_for_api


def test_defaults_need_no_configuration() -> None:
    s = Settings.from_env({})
    assert (s.http.host, s.http.port) == ("127.0.0.1", 8080)
    assert s.store.database == "var/toko.db"
    assert s.mail.smtp is None
    assert s.mail.admin_emails == ("admin@toko.com",)
    assert s.mail.sender == "toko@localhost"
    assert s.pool.workers == 3
    # The README's "4.6 to 9 hours of retries" rests on these two.
    assert (s.jobs.max_attempts, s.pool.backoff) == (20, 2.0)
    assert s.pool.timeout == 30.0
    assert s.pool.drain_timeout == 10.0
    assert s.http.client_timeout == 75.0
    assert s.log.level == "INFO"
    assert s.http.api_token is None
    assert s.systemd.watchdog_interval is None
    assert s.backup.dir == "var/backups"
    assert s.backup.keep == 7
    assert s.jobs.retention == 7 * 86400


def test_state_directory_holds_the_database_and_backups() -> None:
    s = Settings.from_env({"STATE_DIRECTORY": "/var/lib/toko"})
    assert s.store.database == "/var/lib/toko/toko.db"
    assert s.backup.dir == "/var/lib/toko/backups"


def test_backups_go_beside_a_database_named_elsewhere() -> None:
    environ = {"STATE_DIRECTORY": "/var/lib/toko", "TOKO_DATABASE": "/srv/shop/toko.db"}
    s = Settings.from_env(environ)
    assert s.backup.dir == "/srv/shop/backups"


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("TOKO_LISTEN", "nonsense"),
        ("TOKO_LISTEN", "127.0.0.1:0"),
        ("TOKO_LISTEN", "127.0.0.1:99999"),
        ("TOKO_LISTEN", "127.0.0.1:" + "1" * 5000),  # past int()'s 4300 digits
        ("TOKO_LISTEN", "127.0.0.1:\u00b2"),  # SUPERSCRIPT TWO: a digit to isdigit()
        ("TOKO_WORKERS", "abc"),
        ("TOKO_WORKERS", "0"),
        ("TOKO_WORKERS", "1_0"),  # int() read ten
        ("TOKO_WORKERS", "+7"),
        ("TOKO_BACKUP_KEEP", "\u0663"),  # ARABIC-INDIC DIGIT THREE
        ("TOKO_JOB_MAX_ATTEMPTS", "-1"),
        ("TOKO_JOB_BACKOFF", "-1"),
        ("TOKO_JOB_BACKOFF", "nan"),
        ("TOKO_JOB_TIMEOUT", "0"),
        ("TOKO_DRAIN_TIMEOUT", "soon"),
        ("TOKO_CLIENT_TIMEOUT", "0"),
        ("TOKO_CLIENT_TIMEOUT", "forever"),
        ("TOKO_ADMIN_EMAIL", "not-an-address"),
        ("TOKO_MAIL_FROM", "a@b, c@d"),
        ("TOKO_ADMIN_EMAIL", "a@b@c"),
        ("TOKO_ADMIN_EMAIL", "a;b@toko.test"),
        ("TOKO_ADMIN_EMAIL", "bos@toko.test,"),
        ("TOKO_ADMIN_EMAIL", "bos@toko.test, , kasir@toko.test"),
        ("TOKO_ADMIN_EMAIL", "bos@toko.test kasir@toko.test"),
        ("TOKO_ADMIN_EMAIL", "bos@toko.test, bos@toko.test"),
        ("TOKO_MAIL_FROM", "kasir(toko)@toko.test"),
        ("TOKO_LOG_LEVEL", "loud"),
        ("TOKO_DATABASE", "mysql://x"),
        ("TOKO_SMTP_URL", "http://mail:25"),
        ("TOKO_SMTP_URL", "smtp://user:secret@mail:25"),
        ("TOKO_SMTP_URL", "smtp://mail:0"),
        ("TOKO_SMTP_URL", "smtp://user:secret@mail:99999"),
        ("TOKO_SMTP_URL", "smtp://mail:70000"),
        ("TOKO_SMTP_URL", "smtp://mail host:25"),
        # urlsplit passes these hosts on as they are; none resolves.
        ("TOKO_SMTP_URL", "smtp://mail%20host:25"),
        ("TOKO_SMTP_URL", "smtp://mail%2Ehost"),
        ("TOKO_SMTP_URL", 'smtp://mail"host'),
        ("TOKO_SMTP_URL", "smtp://mail;host"),
        ("TOKO_SMTP_URL", "smtp://mail..host"),
        ("TOKO_SMTP_URL", "smtp://-mail.host"),
        ("TOKO_SMTP_URL", "smtp://" + "m" * 64 + ".host"),
        ("TOKO_SMTP_URL", "smtp://user:secret@mail%20host:25"),
        ("TOKO_SMTP_URL", "smtp://mail:" + "1" * 5000),
        # urlsplit raises for these, before any check of ours.
        ("TOKO_SMTP_URL", "smtp://[::1"),
        ("TOKO_SMTP_URL", "smtp://[zzz]"),
        ("TOKO_SMTP_URL", "smtp://user:secret@[::1"),
        ("TOKO_BACKUP_KEEP", "0"),
        ("TOKO_FAULT_INJECTION", "maybe"),
        # Tracebacks in toko-api: urlsplit's "Invalid IPv6 URL", getaddrinfo's OverflowError.
        ("TOKO_DATABASE", "postgresql://toko:secret@[::1/toko"),
        ("TOKO_DATABASE", "postgresql://db.example:" + "9" * 20 + "/toko"),
        ("TOKO_DATABASE", "postgresql://db.example:0/toko"),
        ("TOKO_DATABASE", "postgres ql://toko:secret@db.example/toko"),
        # Taken for SQLite file paths, and printed as such, password and all.
        ("TOKO_DATABASE", "postgresql:/toko:secret@db.example/toko"),
        ("TOKO_DATABASE", "postgresql//toko:secret@db.example/toko"),
        ("TOKO_DATABASE", "PostgreSQL:toko:secret@db.example/toko"),
        # No file can have these paths; toko-recap and toko-queue ended in a traceback.
        ("TOKO_DATABASE", "var/" + "t" * 256 + ".db"),
        ("TOKO_DATABASE", "var/toko" * 600),
        # urlsplit reads no password here, so the message echoed it.
        ("TOKO_SMTP_URL", "smtp:/user:secret@mail:25"),
        ("TOKO_SMTP_URL", "smt%p://user:secret@mail:25"),
        # Refused only at bind, in a line that did not name the variable.
        ("TOKO_LISTEN", "local host:8080"),
        ("TOKO_LISTEN", "x" * 300 + ":8080"),
    ],
)
def test_bad_values_name_the_variable(name: str, value: str) -> None:
    with pytest.raises(ConfigError) as info:
        Settings.from_env({name: value})
    message = str(info.value)
    assert message.startswith(name)
    assert "\n" not in message
    assert len(message) < 300  # a long value is not echoed whole
    if "secret" in value:
        assert "secret" not in message  # never echo a password


def test_admin_email_takes_a_list_separated_by_commas() -> None:
    s = Settings.from_env({"TOKO_ADMIN_EMAIL": " bos@toko.test,kasir@toko.test , ibu@toko.test"})
    assert s.mail.admin_emails == ("bos@toko.test", "kasir@toko.test", "ibu@toko.test")


@pytest.mark.parametrize(
    ("url", "host"),
    [
        ("smtp://mail.example.com:587", "mail.example.com"),
        ("smtp://Mail.Example.COM", "mail.example.com"),
        ("smtp://mail.example.com.", "mail.example.com."),
        ("smtp://mail_relay", "mail_relay"),
        ("smtp://192.0.2.25:2525", "192.0.2.25"),
        ("smtp://[::1]:25", "::1"),
        ("smtp://[2001:db8::25]", "2001:db8::25"),
        ("smtp://toko@surat.contoh.id", "surat.contoh.id"),
        ("smtp://bücher.example", "bücher.example"),
    ],
)
def test_smtp_host_names_and_addresses_are_taken(url: str, host: str) -> None:
    smtp = Settings.from_env({"TOKO_SMTP_URL": url}).mail.smtp
    assert smtp is not None
    assert smtp.host == host


@pytest.mark.parametrize(
    ("url", "port"),
    [("smtp://mail.example.com", 25), ("smtps://mail.example.com", 465), ("smtp://[::1]", 25)],
)
def test_smtp_port_defaults_to_the_schemes(url: str, port: int) -> None:
    smtp = Settings.from_env({"TOKO_SMTP_URL": url}).mail.smtp
    assert smtp is not None
    assert smtp.port == port


def test_smtp_url_and_password_from_credentials(tmp_path: Path) -> None:
    (tmp_path / "smtp-password").write_text("s3cret\n")
    s = Settings.from_env(
        {"TOKO_SMTP_URL": "smtp://mailer@127.0.0.1:2525", "CREDENTIALS_DIRECTORY": str(tmp_path)}
    )
    assert s.mail.smtp is not None
    assert (s.mail.smtp.host, s.mail.smtp.port, s.mail.smtp.username) == (
        "127.0.0.1",
        2525,
        "mailer",
    )
    assert s.mail.smtp.password == "s3cret"
    assert "s3cret" not in repr(s)  # settings may end up in a log line or a traceback
    assert not s.mail.smtp.use_tls


@pytest.mark.parametrize(
    ("url", "start_tls", "verify"),
    [
        ("smtp://relay.lan", None, False),  # a relay: STARTTLS when offered
        ("smtp://toko@mail.example.com:587", True, True),  # a login: TLS, checked
        ("smtps://mail.example.com", None, True),
        ("smtps://toko@mail.example.com", None, True),
    ],
)
def test_smtp_tls_follows_whether_a_password_is_sent(
    url: str, start_tls: bool | None, verify: bool
) -> None:
    smtp = Settings.from_env({"TOKO_SMTP_URL": url}).mail.smtp
    assert smtp is not None
    assert (smtp.start_tls, smtp.verify_certificate) == (start_tls, verify)


def test_unreadable_password_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="TOKO_SMTP_PASSWORD_FILE"):
        Settings.from_env(
            {
                "TOKO_SMTP_URL": "smtp://127.0.0.1:25",
                "TOKO_SMTP_PASSWORD_FILE": str(tmp_path / "missing"),
            }
        )


@pytest.mark.parametrize(("content", "said"), [("", "an empty"), (None, "no")])
def test_an_smtp_login_without_a_password_is_a_config_error(
    tmp_path: Path, content: str | None, said: str
) -> None:
    # An empty file logged in with an empty password: every email failed,
    # long after a start that looked fine.
    env = {"TOKO_SMTP_URL": "smtp://toko@127.0.0.1:25"}
    if content is not None:
        (tmp_path / "smtp-password").write_text(content)
        env["TOKO_SMTP_PASSWORD_FILE"] = str(tmp_path / "smtp-password")
    settings = Settings.from_env(env)
    with pytest.raises(ConfigError, match=f"^TOKO_SMTP_URL logs in as 'toko', but {said} password"):
        check_for_api(settings)


@pytest.mark.parametrize(
    "variable", ["TOKO_API_TOKEN_FILE", "TOKO_SMTP_PASSWORD_FILE", "TOKO_DATABASE_PASSWORD_FILE"]
)
def test_a_secret_file_that_is_not_utf8_is_a_config_error(tmp_path: Path, variable: str) -> None:
    secret = tmp_path / "secret"
    secret.write_bytes(b"s3cret\xff\n")
    env = {"TOKO_SMTP_URL": "smtp://toko@127.0.0.1:25", variable: str(secret)}
    with pytest.raises(ConfigError, match=f"^{variable}: .* is not UTF-8 text"):
        Settings.from_env(env)


@pytest.mark.parametrize(
    ("name", "value", "line"),
    [
        (
            "TOKO_SMTP_URL",
            "smtp://[::1",
            "TOKO_SMTP_URL must look like smtp://[user@]host[:port], with an IPv6 address "
            "in brackets like smtp://[::1]:25",
        ),
        (
            "TOKO_SMTP_URL",
            "smtp://ho%20st:25",
            "TOKO_SMTP_URL must name the mail server by a host name (letters, digits, '-', "
            "'_' and dots) or an IP address, got 'smtp://ho%20st:25'",
        ),
        (
            "TOKO_LISTEN",
            "127.0.0.1:" + "1" * 5000,
            "TOKO_LISTEN must be host:port with a port from 1 to 65535, "
            "got '127.0.0.1:111111111111111111111111111111'... (5010 characters)",
        ),
        (
            "TOKO_API_TOKEN_FILE",
            "token",  # written below, not UTF-8
            "TOKO_API_TOKEN_FILE: token is not UTF-8 text (byte 0); save the secret as UTF-8",
        ),
        (
            "TOKO_DATABASE",
            "shop",  # made below: the folder meant to hold the database
            "TOKO_DATABASE names shop, which is a folder; name the database file in it, "
            "like shop/toko.db",
        ),
    ],
)
def test_check_config_says_one_line_and_exits_2(
    name: str,
    value: str,
    line: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    (tmp_path / "token").write_bytes(b"\xff\xfe")
    (tmp_path / "shop").mkdir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(name, value)
    assert cli.main(["--check-config"]) == 2
    assert capsys.readouterr().err == f"toko-api: {line}\n"


def test_watchdog_interval_is_half_of_watchdog_usec() -> None:
    assert Settings.from_env({"WATCHDOG_USEC": "10000000"}).systemd.watchdog_interval == 5.0
    # Meant for another process: not ours to send.
    assert (
        Settings.from_env(
            {"WATCHDOG_USEC": "10000000", "WATCHDOG_PID": "1"}
        ).systemd.watchdog_interval
        is None
    )


def test_an_odd_watchdog_usec_means_no_watchdog_not_a_traceback() -> None:
    # isdigit() passed both, and int() then raised.
    assert Settings.from_env({"WATCHDOG_USEC": "\u00b2"}).systemd.watchdog_interval is None
    assert Settings.from_env({"WATCHDOG_USEC": "9" * 5000}).systemd.watchdog_interval is None


@pytest.mark.parametrize(
    ("path", "problem"),
    [
        ("/dev/zero", "longer than a secret can be"),  # was read until memory ran out
        ("pass\nword", "cannot read 'pass\\nword'"),  # the message was two lines
        ("pass\x00word", "is not a file path"),  # only from an env file; was a traceback
    ],
)
def test_a_secret_file_that_cannot_be_a_secret_is_one_line(path: str, problem: str) -> None:
    with pytest.raises(ConfigError) as info:
        Settings.from_env({"TOKO_API_TOKEN_FILE": path})
    message = str(info.value)
    assert message.startswith("TOKO_API_TOKEN_FILE: ") and problem in message
    assert "\n" not in message


def test_a_fifo_no_process_writes_to_is_refused_not_waited_for(tmp_path: Path) -> None:
    fifo = tmp_path / "api-token"
    os.mkfifo(fifo)
    with ThreadPoolExecutor(1) as pool:
        reading = pool.submit(Settings.from_env, {"TOKO_API_TOKEN_FILE": str(fifo)})
        try:
            # Opening it waited for a writer for ever: start-up hung without a word.
            with pytest.raises(ConfigError, match="is empty"):
                reading.result(timeout=10)
        finally:
            if not reading.done():  # let the blocked open go, so the test can end
                os.close(os.open(fifo, os.O_WRONLY))


def test_a_pipe_is_read_once_its_writer_has_written() -> None:
    # As a shell's TOKO_API_TOKEN_FILE=<(pass show toko) hands it over.
    read_end, write_end = os.pipe()
    try:
        with ThreadPoolExecutor(1) as pool:
            path = f"/proc/self/fd/{read_end}"
            reading = pool.submit(Settings.from_env, {"TOKO_API_TOKEN_FILE": path})
            os.write(write_end, b"tok-from-a-pipe\n")
            os.close(write_end)
            write_end = -1
            assert reading.result(timeout=10).http.api_token == "tok-from-a-pipe"
    finally:
        os.close(read_end)
        if write_end >= 0:
            os.close(write_end)


def test_a_credentials_directory_no_file_can_be_in_is_a_config_error() -> None:
    # Path.exists() raised "File name too long" for the credential in it.
    with pytest.raises(ConfigError, match=r"^CREDENTIALS_DIRECTORY/db-password: cannot read"):
        Settings.from_env({"CREDENTIALS_DIRECTORY": "c" * 5000})


def test_sqlite_files_named_like_postgres_are_taken() -> None:
    for path in ["postgres.db", "postgresql/toko.db", "var/postgresql:/toko.db"]:
        assert Settings.from_env({"TOKO_DATABASE": path}).store.database == path


def test_postgres_urls_with_several_hosts_or_a_socket_are_taken() -> None:
    for url in [
        "postgresql://toko@db1.example:5432,db2.example/toko",
        "postgresql://toko@[::1]:5432,[2001:db8::5]/toko",
        "postgresql:///toko?host=/run/postgresql",
    ]:
        assert Settings.from_env({"TOKO_DATABASE": url}).store.database == url


def test_listen_accepts_ipv6_brackets() -> None:
    s = Settings.from_env({"TOKO_LISTEN": "[::1]:9000"})
    assert (s.http.host, s.http.port) == ("::1", 9000)


def test_journal_only_when_an_output_is_the_stream_journal_stream_names() -> None:
    # Inherited by a process whose output goes elsewhere (a shell started
    # from a service): logging to the journal would lose every line.
    assert not Settings.from_env({"JOURNAL_STREAM": "8:12345"}).log.journal
    assert not Settings.from_env({}).log.journal
    st = os.fstat(2)
    assert Settings.from_env({"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"}).log.journal


def test_unknown_toko_variables_are_named_with_the_one_meant() -> None:
    # Ignored without a word before: TOKO_WORKER=8 ran 3 workers, and a
    # misspelt TOKO_SMTP_URL wrote every email to the log instead of sending it.
    s = Settings.from_env(
        {
            "TOKO_WORKER": "8",
            "TOKO_SMTP_ULR": "smtp://secret-host",
            "TOKO_WORKERS": "2",
            "TOKO_SOMETHING_ELSE": "1",
            "HOME": "/root",
        }
    )
    assert s.unknown_variables == ("TOKO_SMTP_ULR", "TOKO_SOMETHING_ELSE", "TOKO_WORKER")
    assert s.unknown_variables_line() == (
        "unknown settings ignored: 'TOKO_SMTP_ULR' (meant TOKO_SMTP_URL?), "
        "'TOKO_SOMETHING_ELSE', 'TOKO_WORKER' (meant TOKO_WORKERS?) "
        "(man toko.env lists the known ones)"
    )
    assert (
        Settings.from_env({"TOKO_WORKERS": "2", "HOME": "/root"}).unknown_variables_line() is None
    )


def test_every_variable_toko_reads_is_a_known_one() -> None:
    # A new setting missing from KNOWN_VARIABLES would be warned about as a typo.
    root = Path(__file__).resolve().parents[2]
    sources = [*root.glob("service/**/*.py"), *root.glob("jobs/**/*.py")]
    read = {
        name for path in sources for name in re.findall(r"\"(TOKO_[A-Z0-9_]+)\"", path.read_text())
    }
    assert read and read <= KNOWN_VARIABLES, sorted(read - KNOWN_VARIABLES)


def test_check_config_warns_of_unknown_settings_and_still_passes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TOKO_WORKER", "8")
    assert cli.main(["--check-config"]) == 0
    out = capsys.readouterr()
    assert out.err == (
        "toko-api: warning: unknown settings ignored: 'TOKO_WORKER' (meant TOKO_WORKERS?) "
        "(man toko.env lists the known ones)\n"
    )
    assert out.out == "toko-api: configuration is valid\n"
