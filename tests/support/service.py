"""``toko-api`` as a real subprocess: clean environment, JSON-lines log, signals.

Usage::

    svc = ServiceProcess(tmp_path, {"TOKO_SMTP_URL": smtp.url}, watchdog_usec=400_000)
    try:
        svc.start()
        await svc.async_wait_ready(timeout=15)      # READY=1 on svc.notify
        ...HTTP to svc.base_url...
        svc.terminate()                              # SIGTERM
        assert await svc.async_wait_exit(15) == 0
    finally:
        svc.close()                                  # kill -9 if still running

The environment holds only PATH, LANG, HOME, PYTHONPATH if the tests have one,
and what the test sets: TOKO_LISTEN on a free port, TOKO_DATABASE (``database``,
default ``<workdir>/toko.db``), NOTIFY_SOCKET (a fresh
:class:`~tests.support.notify.NotifyListener`), and WATCHDOG_USEC when given.
A value of ``None`` in ``env`` removes a variable.

Stdout lines are parsed as JSON into :attr:`ServiceProcess.logs` (a line that is
not JSON is kept as ``{"_raw": line}``); stderr lines go to
:attr:`ServiceProcess.stderr`. Waits on the log or on READY fail at once,
with the process's output, if the process exits meanwhile.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from tests.support.notify import Notification, NotifyListener
from tests.support.ports import free_port
from tests.support.recorder import Recorder

TOKO_API = Path(sys.executable).parent / "toko-api"

LogRecord = dict[str, Any]


class ProcessExited(AssertionError):
    """The service exited while a test was waiting for something from it."""


def clean_environment(**extra: str) -> dict[str, str]:
    """What every toko command the tests start gets, as an admin's shell would
    give it: PATH and LANG only, plus ``extra``. And PYTHONPATH when the tests
    have one: from a worktree (PYTHONPATH=<checkout>), the commands run that
    checkout's code, not the installed one."""
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "LANG": "C.UTF-8",
        **{k: v for k, v in os.environ.items() if k == "PYTHONPATH"},
        **extra,
    }


class ServiceProcess:
    def __init__(
        self,
        workdir: Path,
        env: Mapping[str, str | None] | None = None,
        *,
        database: Path | None = None,
        port: int | None = None,
        watchdog_usec: int | None = None,
        notify: bool = True,
        args: Sequence[str] = (),
        executable: Path = TOKO_API,
    ) -> None:
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.database = database if database is not None else workdir / "toko.db"
        self.port = port if port is not None else free_port()
        self.args = [str(executable), *args]
        self.notify: NotifyListener | None = None
        self.port_accepting_at_ready: bool | str | None = None
        if notify:
            self.notify = NotifyListener(hooks=[self._check_port_on_ready])
        self.env = clean_environment(
            HOME=str(workdir),
            TOKO_LISTEN=f"127.0.0.1:{self.port}",
            TOKO_DATABASE=str(self.database),
        )
        if self.notify is not None:
            self.env["NOTIFY_SOCKET"] = self.notify.path
        if watchdog_usec is not None:
            self.env["WATCHDOG_USEC"] = str(watchdog_usec)
        for key, value in (env or {}).items():
            if value is None:
                self.env.pop(key, None)
            else:
                self.env[key] = value
        self.logs: Recorder[LogRecord] = Recorder("toko-api stdout")
        self.stderr: Recorder[str] = Recorder("toko-api stderr")
        self._exit: Recorder[int] = Recorder("toko-api exit")
        self.proc: subprocess.Popen[bytes] | None = None
        self._threads: list[threading.Thread] = []

    # -- lifecycle ---------------------------------------------------------

    def start(self) -> ServiceProcess:
        assert self.proc is None, "already started"
        if self.notify is not None:
            self.notify.start()
        self.proc = subprocess.Popen(
            self.args,
            env=self.env,
            cwd=self.workdir,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            # Own session: a Ctrl-C in the pytest terminal does not reach it.
            start_new_session=True,
        )
        assert self.proc.stdout is not None and self.proc.stderr is not None
        readers = [
            threading.Thread(target=self._read_stdout, args=(self.proc.stdout,), daemon=True),
            threading.Thread(target=self._read_stderr, args=(self.proc.stderr,), daemon=True),
        ]
        for t in readers:
            t.start()
        waiter = threading.Thread(target=self._wait_exit, args=(readers,), daemon=True)
        waiter.start()
        self._threads = [*readers, waiter]
        return self

    def close(self) -> None:
        """Kill -9 if still running, reap, stop the notify socket. Idempotent."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
        if self.proc is not None:
            self.proc.wait(10)
        for t in self._threads:
            t.join(10)
        self._threads = []
        if self.notify is not None:
            self.notify.stop()  # its log stays readable

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        items = self._exit.snapshot()
        return items[0] if items else None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def url(self, path: str) -> str:
        return self.base_url + path

    def send_signal(self, sig: signal.Signals) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def wait_exit(self, timeout: float) -> int:
        """Block until the process exited and its output is read; its exit code."""
        return self._exit.wait_for(_exit_code, timeout, "process exit")[0]

    async def async_wait_exit(self, timeout: float) -> int:  # noqa: ASYNC109
        return (await self._exit.async_wait_for(_exit_code, timeout, "process exit"))[0]

    # -- readiness and logs ------------------------------------------------

    def wait_ready(self, timeout: float = 15.0) -> Notification:
        assert self.notify is not None
        return self.notify.log.wait_for(self._ready_predicate, timeout, "READY=1")

    async def async_wait_ready(self, timeout: float = 15.0) -> Notification:  # noqa: ASYNC109
        assert self.notify is not None
        return await self.notify.log.async_wait_for(self._ready_predicate, timeout, "READY=1")

    def find_logs(self, message: str | None = None, **fields: Any) -> list[LogRecord]:
        """Log records whose "message" equals ``message`` and whose fields match."""
        return [r for r in self.logs.snapshot() if _log_matches(r, message, fields)]

    def wait_log(self, message: str, timeout: float = 10.0, **fields: Any) -> LogRecord:
        return self.logs.wait_for(self._log_predicate(message, fields), timeout, message)

    async def async_wait_log(self, message: str, timeout: float = 10.0, **fields: Any) -> LogRecord:  # noqa: ASYNC109
        return await self.logs.async_wait_for(
            self._log_predicate(message, fields), timeout, message
        )

    def stdout_text(self) -> str:
        return "\n".join(r["_raw"] if "_raw" in r else json.dumps(r) for r in self.logs.snapshot())

    def stderr_text(self) -> str:
        return "\n".join(self.stderr.snapshot())

    def output_tail(self, lines: int = 40) -> str:
        out = self.stdout_text().splitlines()[-lines:]
        err = self.stderr_text().splitlines()[-lines:]
        return (
            f"--- toko-api exit={self.returncode} stdout (last {lines}) ---\n"
            + "\n".join(out)
            + f"\n--- stderr (last {lines}) ---\n"
            + "\n".join(err)
        )

    # -- internals ---------------------------------------------------------

    def _check_port_on_ready(self, note: Notification) -> None:
        # Runs in the notify thread before READY is recorded: this is "the moment".
        if note.get("READY") == "1" and self.port_accepting_at_ready is None:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=2).close()
                self.port_accepting_at_ready = True
            except OSError as exc:
                self.port_accepting_at_ready = f"connect failed: {exc!r}"

    def _ready_predicate(self, items: Sequence[Notification]) -> Notification | None:
        for n in items:
            if n.get("READY") == "1":
                return n
        if self.returncode is not None:
            raise ProcessExited(f"toko-api exited before READY=1\n{self.output_tail()}")
        return None

    def _log_predicate(
        self, message: str, fields: Mapping[str, Any]
    ) -> Callable[[Sequence[LogRecord]], LogRecord | None]:
        def predicate(items: Sequence[LogRecord]) -> LogRecord | None:
            for r in items:
                if _log_matches(r, message, fields):
                    return r
            if self.returncode is not None:
                raise ProcessExited(
                    f"toko-api exited before logging {message!r}\n{self.output_tail()}"
                )
            return None

        return predicate

    def _read_stdout(self, stream: IO[bytes]) -> None:
        for raw in stream:
            line = raw.decode("utf-8", errors="replace").rstrip("\n")
            try:
                record = json.loads(line)
            except ValueError:
                record = None
            self.logs.append(record if isinstance(record, dict) else {"_raw": line})
        stream.close()

    def _read_stderr(self, stream: IO[bytes]) -> None:
        for raw in stream:
            self.stderr.append(raw.decode("utf-8", errors="replace").rstrip("\n"))
        stream.close()

    def _wait_exit(self, readers: Sequence[threading.Thread]) -> None:
        assert self.proc is not None
        code = self.proc.wait()
        for t in readers:
            t.join()
        self._exit.append(code)
        # Waiters on READY or on a log line re-check and see that we are gone.
        self.logs.wake()
        if self.notify is not None:
            self.notify.log.wake()


def _exit_code(items: Sequence[int]) -> tuple[int] | None:
    return (items[0],) if items else None


def _log_matches(record: LogRecord, message: str | None, fields: Mapping[str, Any]) -> bool:
    if message is not None and record.get("message") != message:
        return False
    return all(str(record.get(k)) == str(v) for k, v in fields.items())


@contextlib.contextmanager
def ready_service(
    workdir: Path, env: Mapping[str, str | None] | None = None
) -> Iterator[ServiceProcess]:
    """A started toko-api that has sent READY=1, for a module-scoped fixture.

    Killed afterwards, with its output printed (pytest shows it for a failure).
    """
    svc = ServiceProcess(workdir, env)
    try:
        svc.start()
        svc.wait_ready(timeout=20)
        yield svc
    finally:
        svc.close()
        print(svc.output_tail(80))
