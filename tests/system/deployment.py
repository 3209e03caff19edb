"""toko as installed from its Debian package in a booted :class:`~tests.system.machine.Machine`.

The helpers here speak to it the way an admin and a client would: apt-get
and dpkg-query inside, HTTP from the host to the socket unit's port,
``systemctl``/``journalctl`` inside, and the SQLite database read as the
``toko`` user.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.system.machine import Machine, log, wait_until
from tests.system.packages import SuitePackages, deb_field

REPO = Path(__file__).resolve().parents[2]
PACKAGE = "toko"
VENV = "/opt/venvs/toko"
VENV_PYTHON = f"{VENV}/bin/python"
UNIT_DIR = "/usr/lib/systemd/system"
DATA_DIR = "/var/lib/toko"
DATABASE = f"{DATA_DIR}/toko.db"
CONF_DIR = "/etc/toko"
TOKEN_FILE = f"{CONF_DIR}/api-token"
ENV_FILE = f"{CONF_DIR}/toko.env"
DEB_DIR = "/root"  # where the admin copied the .deb files to
COMMANDS = ("toko-api", "toko-recap", "toko-backup", "toko-queue", "toko-alert")
MAN_PAGES = (*(f"man8/{c}.8" for c in COMMANDS), "man5/toko.env.5")
INSTALLED_UNITS = (
    "toko-api.socket",
    "toko-api.service",
    "toko-recap.service",
    "toko-recap.timer",
    "toko-backup.service",
    "toko-backup.timer",
    "toko-alert@.service",
)
# What the package enables and starts on install.
ENABLED_UNITS = ("toko-api.socket", "toko-api.service", "toko-recap.timer", "toko-backup.timer")
# The sandbox of every toko-*.service: one drop-in beside the units, which
# systemd applies to each service whose name starts with "toko-".
HARDENING_DROP_IN = "toko-.service.d/00-hardening.conf"
# The admin's drop-in that moves the socket to this session's port.
PORT_DROP_IN = "/etc/systemd/system/toko-api.socket.d/test-port.conf"
NONINTERACTIVE = "DEBIAN_FRONTEND=noninteractive"


@dataclass
class Traffic:
    """What clients posting products saw: answers with the time each was sent, and failures."""

    created: list[tuple[float, int]] = field(default_factory=list)  # (sent, product id)
    failures: list[tuple[float, str]] = field(default_factory=list)  # (sent, what went wrong)

    def sent_between(self, began: float, ended: float) -> list[int]:
        return [pid for sent, pid in self.created if began <= sent <= ended]


@dataclass
class Response:
    status: int
    body: Any


class Deployment:
    """toko installed in ``machine`` from ``packages``, its socket on the host's
    127.0.0.1:``port``."""

    def __init__(self, machine: Machine, port: int, packages: SuitePackages) -> None:
        self.machine = machine
        self.port = port
        self.packages = packages
        self.token = ""  # the write token, once installed

    def read_token(self) -> str:
        """The package's API token (root-only file), remembered for post_product()."""
        self.token = self.machine.run(["cat", TOKEN_FILE]).stdout.strip()
        return self.token

    # -- set-up (before boot: files an admin could have put there)

    def stage(self) -> None:
        # A free port instead of 8080, so a toko or anything else running on
        # the host cannot collide with the container (they share the network).
        # This is also how an admin moves the socket (`systemctl edit`).
        self.machine.write(
            PORT_DROP_IN, f"[Socket]\nListenStream=\nListenStream=127.0.0.1:{self.port}\n"
        )

    # -- the package, the admin's way

    def prepare_apt(self) -> None:
        """What a server has before toko: current package lists, and man-db
        (Debian's standard system utilities; minbase lacks it)."""
        started = time.monotonic()
        self.apt("update", "-qq")
        self.apt("install", "-y", "-qq", "--no-install-recommends", "man-db")
        log(f"{self.machine.suite}: apt-get update, man-db in {time.monotonic() - started:.1f} s")

    def apt(
        self, *args: str, check: bool = True, timeout: float = 600
    ) -> subprocess.CompletedProcess[str]:
        """``apt-get args`` as root, debconf asking no questions (dpkg still may)."""
        argv = ["env", NONINTERACTIVE, "apt-get", *args]
        return self.machine.run(argv, check=check, timeout=timeout)

    def deb_path(self, deb: Path) -> str:
        """``deb`` copied into the machine (once), as apt-get is given it: a path."""
        inside = f"{DEB_DIR}/{deb.name}"
        target = self.machine.root / inside.lstrip("/")
        if not target.exists():
            shutil.copy2(deb, target)
        return inside

    def install(
        self, deb: Path, *options: str, check: bool = True, timeout: float = 600
    ) -> subprocess.CompletedProcess[str]:
        """``apt-get install -y ./toko_….deb`` (and ``options``), as an admin types it."""
        started = time.monotonic()
        path = self.deb_path(deb)
        proc = self.apt("install", "-y", *options, path, check=False, timeout=timeout)
        log(
            f"{self.machine.suite}: apt-get install {' '.join(options)} {deb.name} exited"
            f" {proc.returncode} in {time.monotonic() - started:.1f} s:\n"
            f"{(proc.stdout + proc.stderr)[-1500:]}"
        )
        if check and proc.returncode != 0:
            raise AssertionError(f"apt-get install {deb.name} failed:\n{proc.stdout}{proc.stderr}")
        return proc

    def status(self) -> str:
        """dpkg's status of the package as ``dpkg -l`` shows it: ``ii``, ``rc``, or ``un``."""
        proc = self.machine.run(
            ["dpkg-query", "-W", "-f=${db:Status-Abbrev}", PACKAGE], check=False
        )
        return proc.stdout.strip() if proc.returncode == 0 else "un"

    def version(self) -> str:
        return self.machine.run(["dpkg-query", "-W", "-f=${Version}", PACKAGE]).stdout

    def ensure_installed(self) -> None:
        """The current package installed and configured, whatever a test left."""
        current = self.packages.current.result()
        status = self.status()
        if status != "ii" or self.version() != deb_field(current, "Version"):
            log(f"{self.machine.suite}: reinstalling {current.name}: an earlier test left {status}")
            # dpkg runs no prerm for a package that is only unpacked (a conffile
            # question left unanswered): stopped here, nothing of it runs on.
            units = ["toko-api.socket", "toko-api.service", "toko-*.timer", "toko-*.service"]
            self.machine.run(["systemctl", "stop", *units], check=False)
            self.apt("purge", "-y", PACKAGE, check=False)
            self.install(current)
        self.read_token()

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

    def wait_created(self, nama: str, timeout: float = 60) -> dict[str, Any]:
        """``POST /produk`` until the first 201 (a refused connection or other
        answer meanwhile is retried): the product."""

        def created() -> dict[str, Any] | None:
            try:
                resp = self.post(nama)
            except OSError:
                return None
            return resp.body if resp.status == 201 else None

        return wait_until(created, timeout, f"a 201 for {nama!r}")

    def healthz(self) -> Response:
        return self.request("GET", "/healthz", timeout=10)

    # -- systemd inside

    def show(self, unit: str, prop: str) -> str:
        return self.machine.run(["systemctl", "show", "-P", prop, unit]).stdout.strip()

    def real_paths(self, *paths: str) -> list[str]:
        """``paths`` with every link resolved: systemd on Debian 12 names the
        package's units by /lib, which is /usr/lib there (merged /usr)."""
        return self.machine.run(["readlink", "-f", *paths]).stdout.split() if paths else []

    def fragment(self, unit: str) -> str:
        """The unit file systemd loaded ``unit`` from."""
        (path,) = self.real_paths(self.show(unit, "FragmentPath"))
        return path

    def drop_ins(self, unit: str) -> list[str]:
        return self.real_paths(*self.show(unit, "DropInPaths").split())

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
        try:
            self.wait_serving()
        except TimeoutError as exc:
            raise TimeoutError(f"{exc}; the units' state and journal:\n{self.diagnose()}") from None

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


@contextlib.contextmanager
def posting_meanwhile(toko: Deployment, label: str, clients: int = 2) -> Iterator[Traffic]:
    """``clients`` clients POST products named ``label …`` back to back while the block runs.

    Each request opens a new connection to the socket's port, so a moment
    without a listening socket shows as a refused connection. Every answer
    but a 201 and every error is a failure. Waits for the first 201 of each
    client before the block starts, and for each client to end after it.
    """
    traffic = Traffic()
    stop = threading.Event()
    progress = threading.Condition()
    started: set[int] = set()

    def client(worker: int) -> None:
        n = 0
        while not stop.is_set():
            n += 1
            sent = time.monotonic()
            try:
                resp = toko.post(f"{label} {worker}-{n}")
            except OSError as exc:
                traffic.failures.append((sent, repr(exc)))
                continue
            with progress:
                if resp.status == 201:
                    traffic.created.append((sent, resp.body["id"]))
                    started.add(worker)
                else:
                    traffic.failures.append((sent, f"{resp.status} {resp.body}"))
                progress.notify_all()

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    try:
        with progress:
            assert progress.wait_for(lambda: len(started) == clients, 60), traffic.failures[:5]
        yield traffic
    finally:
        stop.set()
        for t in threads:
            t.join(60)
