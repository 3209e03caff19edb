"""toko as installed by ``make install`` in a booted :class:`~tests.system.machine.Machine`.

The helpers here speak to it the way an admin and a client would: HTTP from
the host to the socket unit's port, ``systemctl``/``journalctl`` inside, and
the SQLite database read as the ``toko`` user.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.system.machine import Machine, log, wait_until

REPO = Path(__file__).resolve().parents[2]
CHECKOUT = "/root/toko"  # where the admin's checkout lives inside the machine
VENV_PYTHON = "/opt/toko/venv/bin/python"
DATABASE = "/var/lib/toko/toko.db"
INSTALLED_UNITS = (
    "toko-api.socket",
    "toko-api.service",
    "toko-recap.service",
    "toko-recap.timer",
    "toko-backup.service",
    "toko-backup.timer",
    "toko-alert@.service",
)
# The sandbox of every toko-*.service: one drop-in beside the units, which
# systemd applies to each service whose name starts with "toko-".
HARDENING_DROP_IN = "toko-.service.d/00-hardening.conf"
TOKEN_FILE = "/etc/toko/api-token"
ENV_FILE = "/etc/toko/toko.env"


def checkout_files() -> list[str]:
    """The checkout as git sees it: tracked plus untracked-but-not-ignored files.

    Reads the working tree, so uncommitted work is what gets installed.
    """
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout
    return sorted({name.decode() for name in out.split(b"\0") if name})


@dataclass
class Response:
    status: int
    body: Any


class Deployment:
    """toko installed in ``machine``, its socket on the host's 127.0.0.1:``port``."""

    def __init__(self, machine: Machine, port: int) -> None:
        self.machine = machine
        self.port = port
        self.token = ""  # the write token, once installed

    def read_token(self) -> str:
        """The installer's API token (root-only file), remembered for post_product()."""
        self.token = self.machine.run(["cat", TOKEN_FILE]).stdout.strip()
        return self.token

    # -- set-up (before boot: files an admin could have put there)

    def stage(self) -> None:
        self.machine.copy_in(REPO, checkout_files(), CHECKOUT)
        # A free port instead of 8080, so a toko or anything else running on
        # the host cannot collide with the container (they share the network).
        # This is also how an admin moves the socket (`systemctl edit`).
        self.machine.write(
            "/etc/systemd/system/toko-api.socket.d/test-port.conf",
            f"[Socket]\nListenStream=\nListenStream=127.0.0.1:{self.port}\n",
        )

    def make(self, target: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
        """``make <target>`` in the checkout, exactly as an admin types it."""
        started = time.monotonic()
        proc = self.machine.sh(f"cd {CHECKOUT} && make {target}", timeout=timeout)
        log(f"make {target} took {time.monotonic() - started:.1f} s:\n{proc.stdout[-2000:]}")
        return proc

    # -- HTTP from the host

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        timeout: float = 30,
        headers: dict[str, str] | None = None,
        on_sent: Callable[[], None] | None = None,
    ) -> Response:
        """One request on a fresh connection (Connection: close); ``on_sent()`` once
        it is sent, before its answer is read."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            headers = {"Connection": "close", **(headers or {})}
            data = None
            if body is not None:
                data = json.dumps(body).encode()
                headers["Content-Type"] = "application/json"
            conn.request(method, path, body=data, headers=headers)
            if on_sent is not None:
                on_sent()
            resp = conn.getresponse()
            raw = resp.read()
            return Response(resp.status, json.loads(raw) if raw else None)
        finally:
            conn.close()

    def post(
        self, nama: str, harga: int = 1000, on_sent: Callable[[], None] | None = None
    ) -> Response:
        """``POST /produk`` with the write token, whatever the answer."""
        auth = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        body = {"nama": nama, "harga": harga}
        return self.request("POST", "/produk", body, headers=auth, on_sent=on_sent)

    def post_product(self, nama: str, harga: int = 1000) -> dict[str, Any]:
        resp = self.post(nama, harga)
        assert resp.status == 201, resp
        assert isinstance(resp.body, dict)
        return resp.body

    def healthz(self) -> Response:
        return self.request("GET", "/healthz", timeout=10)

    # -- systemd inside

    def show(self, unit: str, prop: str) -> str:
        return self.machine.run(["systemctl", "show", "-P", prop, unit]).stdout.strip()

    def timers_scheduled(self, *timers: str) -> bool:
        """Whether ``systemctl list-timers`` shows a next run for each of ``timers``.

        A timer has none (NEXT shows "-") while the run it started goes on, so
        a caller waits for this. A timer not listed at all is no matter of
        time: it fails at once.
        """
        listing = self.machine.run(["systemctl", "list-timers", "--all", "--no-pager"]).stdout
        lines = [next((ln for ln in listing.splitlines() if t in ln), None) for t in timers]
        assert None not in lines, listing
        # NEXT is the first column; an unscheduled timer shows "-" or "n/a" there.
        return not any(ln.startswith(("-", "n/a")) for ln in lines if ln is not None)

    def main_pid(self) -> int:
        return int(self.show("toko-api.service", "MainPID"))

    def n_restarts(self) -> int:
        return int(self.show("toko-api.service", "NRestarts"))

    def wait_serving(self, timeout: float = 60, old_pid: int | None = None) -> int:
        """Wait until toko-api is active (with a main PID other than ``old_pid``) and healthy."""

        def serving() -> int | None:
            if self.show("toko-api.service", "ActiveState") != "active":
                return None
            pid = self.main_pid()
            if pid == 0 or pid == old_pid:
                return None
            try:
                ok = self.healthz().status == 200
            except OSError:
                return None
            return pid if ok else None

        return wait_until(serving, timeout, "toko-api to be active and healthy")

    @contextlib.contextmanager
    def settings_added(self, *lines: str, restart: bool = False) -> Iterator[None]:
        """``lines`` appended to toko.env, as an admin would; the file as it was
        afterwards, and with ``restart`` toko-api restarted to read it again."""
        original = self.machine.run(["cat", ENV_FILE]).stdout
        added = "".join(f"{line}\n" for line in lines)
        self.machine.run(["sh", "-c", f"cat >> {ENV_FILE}"], input=added)
        try:
            yield
        finally:
            self.machine.run(["sh", "-c", f"cat > {ENV_FILE}"], input=original)
            if restart:
                self.machine.run(["systemctl", "restart", "toko-api.service"], timeout=120)

    def ensure_running(self) -> None:
        """Start toko-api if an earlier test left it stopped or failed.

        Also clears the start rate limit: the tests restart toko-api faster
        than StartLimitBurst= allows (5 starts in 10 s), an admin does not.
        """
        self.machine.run(
            ["systemctl", "reset-failed", "toko-api.socket", "toko-api.service"], check=False
        )
        if self.show("toko-api.service", "ActiveState") != "active":
            self.machine.run(["systemctl", "start", "toko-api.socket", "toko-api.service"])
        self.wait_serving()

    def now(self) -> float:
        """A point in time to read the journal from (the container shares the host's clock)."""
        return time.time()

    def journal(self, unit: str, since: float | None = None) -> list[dict[str, Any]]:
        """The unit's journal entries (as journalctl -o json), optionally from ``since`` on.

        ``unit`` may also be a journal match such as ``SYSLOG_IDENTIFIER=toko-alert``.
        """
        match = unit if "=" in unit else f"--unit={unit}"
        # journald reads its sockets on its own schedule: a line a process
        # wrote before `systemctl` returned may still wait in its queue.
        # --sync returns once journald has taken in what was queued before it.
        self.machine.run(["journalctl", "--sync"])
        argv = ["journalctl", match, "-o", "json", "--no-pager"]
        if since is not None:
            argv.append(f"--since=@{int(since)}")
        out = self.machine.run(argv).stdout
        entries = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        if since is not None:
            entries = [e for e in entries if int(e["__REALTIME_TIMESTAMP"]) >= since * 1e6]
        return entries

    def messages(self, unit: str, since: float | None = None) -> list[str]:
        return [str(e.get("MESSAGE", "")) for e in self.journal(unit, since)]

    def diagnose(self) -> str:
        """What an admin would look at first when toko does not run."""
        return self.machine.sh(
            "systemctl --no-pager status 'toko-*'; journalctl --no-pager -n 60 -u 'toko-*'",
            check=False,
        ).stdout

    # -- the database, read as toko (the WAL's -shm must stay toko's)

    def sql(self, query: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        return self.sql_at(DATABASE, query, params)

    def sql_at(self, path: str, query: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        script = (
            "import json, sqlite3, sys\n"
            "q = json.load(sys.stdin)\n"
            "con = sqlite3.connect(q['path'], timeout=30)\n"
            "print(json.dumps(con.execute(q['query'], q['params']).fetchall()))\n"
            "con.commit()\n"  # a test's own INSERT or DELETE
        )
        proc = self.machine.run(
            ["runuser", "-u", "toko", "--", VENV_PYTHON, "-c", script],
            input=json.dumps({"path": path, "query": query, "params": list(params)}),
        )
        return [tuple(row) for row in json.loads(proc.stdout)]
