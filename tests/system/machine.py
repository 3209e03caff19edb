"""A Debian tree booted with systemd-nspawn, for the system tests.

:func:`cached_tree` debootstraps a minimal Debian (``systemd``, ``dbus``,
``make``, ``ca-certificates``: a bare server plus the ``make`` a user would
install) once per suite into ``/var/cache/toko-systest/<suite>`` and reuses it
afterwards. It is built in a temporary directory beside it and renamed into
place, so an interrupted build never leaves a broken cache; a stamp names the
recipe, so changing :data:`RECIPE` rebuilds. The mirror comes from the host's
apt sources at run time.

:class:`Machine` copies a cached tree (``cp -a --reflink=auto``) so the cache
stays pristine, prepares it for this test environment (the host's extra CA
certificates), boots it with ``systemd-nspawn --boot --register=no
--keep-unit`` (systemd need not be PID 1 here) and runs commands inside with
``nsenter`` in a clean environment, as an admin's root shell would;
``run_unbooted()`` runs a command in a copy that is not booted.
Without ``--private-network`` the container shares the host's network, so its
sockets are on the host's 127.0.0.1. ``reboot()``, and ``cut_power()`` then
``boot_after_cut()``, take it down (cleanly, or by killing every process at
once) and boot the same tree again.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shlex
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

CACHE_ROOT = Path(os.environ.get("TOKO_SYSTEST_CACHE", "/var/cache/toko-systest"))
# Bump when the tree's recipe changes so existing caches are rebuilt.
RECIPE = "minbase:systemd,systemd-sysv,dbus,make,ca-certificates:v1"
INCLUDE = "systemd,systemd-sysv,dbus,make,ca-certificates"
STAMP = ".toko-systest-recipe"
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

T = TypeVar("T")


class MachineError(RuntimeError):
    """The container could not be built, booted or reached."""


def log(message: str) -> None:
    """Progress on stderr, shown by pytest with -s and in the captured output of a failure."""
    print(f"[systest {time.strftime('%H:%M:%S')}] {message}", flush=True)


def wait_until(check: Callable[[], T | None], timeout: float, what: str, step: float = 0.2) -> T:
    """Poll ``check`` until it returns a truthy value; fail naming ``what`` at the deadline.

    For conditions inside the container that offer no event to wait on.
    """
    deadline = time.monotonic() + timeout
    last: T | None = None
    while True:
        last = check()
        if last:
            return last
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"timed out after {timeout:.0f} s waiting for {what} (last: {last!r})"
            )
        time.sleep(step)


# -- the host's apt sources ------------------------------------------------------


def _apt_entries(root: Path = Path("/")) -> Iterator[tuple[str, list[str], list[str]]]:
    """(uri, suites, components) of every enabled ``deb`` entry of the host's apt sources."""
    apt = root / "etc/apt"
    one_line = [apt / "sources.list", *sorted((apt / "sources.list.d").glob("*.list"))]
    for path in one_line:
        if not path.is_file():
            continue
        for line in path.read_text().splitlines():
            # "deb [options] uri suite component...": drop comments and options.
            words = re.sub(r"\[[^]]*\]", "", line.split("#", 1)[0]).split()
            if len(words) >= 3 and words[0] == "deb":
                yield words[1], [words[2]], words[3:]
    for path in sorted((apt / "sources.list.d").glob("*.sources")):
        for stanza in re.split(r"\n\s*\n", path.read_text()):
            fields: dict[str, str] = {}
            for raw in stanza.splitlines():
                if raw.startswith("#") or ":" not in raw:
                    continue
                key, _, value = raw.partition(":")
                fields[key.strip().lower()] = value.strip()
            if "deb" not in fields.get("types", "").split():
                continue
            if fields.get("enabled", "yes").lower() == "no":
                continue
            for uri in fields.get("uris", "").split():
                yield uri, fields.get("suites", "").split(), fields.get("components", "").split()


def _host_codename() -> str:
    for line in Path("/etc/os-release").read_text().splitlines():
        if line.startswith("VERSION_CODENAME="):
            return line.partition("=")[2].strip().strip('"')
    raise MachineError("no VERSION_CODENAME in /etc/os-release: not a Debian host?")


def host_mirrors() -> tuple[str, str | None]:
    """The Debian archive and security archive URIs the host's apt uses.

    Taken at run time so no registry host is written into the project: the
    entries for the host's own release (``bookworm``, ``bookworm-security``)
    with component ``main``; a URI ending in /debian(-security) wins over a
    third-party repository that happens to use the same suite names.
    TOKO_SYSTEST_MIRROR (and TOKO_SYSTEST_SECURITY_MIRROR) override them.
    """
    if "TOKO_SYSTEST_MIRROR" in os.environ:
        return os.environ["TOKO_SYSTEST_MIRROR"], os.environ.get("TOKO_SYSTEST_SECURITY_MIRROR")
    codename = _host_codename()
    archives: list[str] = []
    securities: list[str] = []
    for uri, suites, components in _apt_entries():
        if "main" not in components:
            continue
        if f"{codename}-security" in suites:
            securities.append(uri)
        elif codename in suites or f"{codename}-updates" in suites:
            archives.append(uri)

    def best(uris: list[str], name: str) -> str | None:
        named = [u for u in uris if u.rstrip("/").endswith("/" + name)]
        candidates = named or uris
        return candidates[0] if candidates else None

    archive = best(archives, "debian")
    if archive is None:
        raise MachineError(
            f"no Debian archive for {codename} (a 'deb' entry with component main) in the "
            "host's apt sources; set TOKO_SYSTEST_MIRROR"
        )
    return archive, best(securities, "debian-security")


# -- the cached tree -------------------------------------------------------------

_build_locks: dict[str, threading.Lock] = {}
_build_locks_guard = threading.Lock()


def cached_tree(suite: str) -> Path:
    """The pristine tree of ``suite``, debootstrapped now if missing or stale.

    Safe to call from several threads and several processes at once.
    """
    with _build_locks_guard:
        lock = _build_locks.setdefault(suite, threading.Lock())
    CACHE_ROOT.mkdir(parents=True, exist_ok=True)
    final = CACHE_ROOT / suite
    with lock, open(CACHE_ROOT / f".{suite}.lock", "w") as lockfile:
        fcntl.flock(lockfile, fcntl.LOCK_EX)
        stamp = final / STAMP
        if stamp.is_file() and stamp.read_text().strip() == RECIPE:
            return final
        # Leftovers of a build that was killed (we hold the lock: nobody builds now).
        for stale in CACHE_ROOT.glob(f".{suite}.build-*"):
            shutil.rmtree(stale, ignore_errors=True)
        _build_tree(suite, final)
        return final


def _build_tree(suite: str, final: Path) -> None:
    archive, security = host_mirrors()
    tmp = Path(tempfile.mkdtemp(prefix=f".{suite}.build-", dir=CACHE_ROOT))
    started = time.monotonic()
    log(f"debootstrap {suite} from {archive} into {tmp} (cold cache)")
    try:
        root = tmp / "root"
        proc = subprocess.run(
            ["debootstrap", "--variant=minbase", f"--include={INCLUDE}", suite, str(root), archive],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            check=False,
        )
        if proc.returncode != 0:
            raise MachineError(
                f"debootstrap {suite} failed (exit {proc.returncode}):\n{proc.stdout[-4000:]}"
            )
        # A bare server's apt sources: the release, its updates and security.
        lines = [f"deb {archive} {suite} main", f"deb {archive} {suite}-updates main"]
        if security is not None:
            lines.append(f"deb {security} {suite}-security main")
        (root / "etc/apt/sources.list").write_text("\n".join(lines) + "\n")
        # nspawn names the host after --machine when the tree has no hostname.
        (root / "etc/hostname").unlink(missing_ok=True)
        # Leave no apt archives behind: the tree is copied for every session.
        subprocess.run(["chroot", str(root), "apt-get", "clean"], check=True)
        (root / STAMP).write_text(RECIPE + "\n")
        old = final.with_name(f".{suite}.old-{os.getpid()}")
        if final.exists():
            final.rename(old)
        root.rename(final)
        shutil.rmtree(old, ignore_errors=True)
        log(f"debootstrap {suite} done in {time.monotonic() - started:.0f} s")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# -- a booted machine ----------------------------------------------------------------


class Machine:
    """One booted copy of a cached tree: prepare(), boot(), then close() in any case."""

    def __init__(self, suite: str, pristine: Path, role: str = "tokotest") -> None:
        self.suite = suite
        self.pristine = pristine
        # Unique on the host: nspawn keeps a machine's state under /run by its name.
        self.name = f"{role}-{suite}-{os.getpid()}"
        self.workdir: Path | None = None
        self._nspawn: subprocess.Popen[bytes] | None = None
        self.init_pid = 0

    @property
    def root(self) -> Path:
        assert self.workdir is not None, "prepare() first"
        return self.workdir / "root"

    @property
    def console_log(self) -> Path:
        assert self.workdir is not None, "prepare() first"
        return self.workdir / "console.log"

    # -- lifecycle

    def prepare(self) -> None:
        """Copy the pristine tree and set it up for this test environment."""
        # On disk (not a tmpfs /tmp): the tree grows to about 600 MB installed.
        self.workdir = Path(tempfile.mkdtemp(prefix=f"toko-systest-{self.suite}-", dir="/var/tmp"))
        subprocess.run(
            ["cp", "-a", "--reflink=auto", str(self.pristine), str(self.root)], check=True
        )
        # The container must trust what this host trusts (a TLS-inspecting
        # egress, say): test-environment preparation, not installer behaviour.
        extra = Path("/usr/local/share/ca-certificates")
        if extra.is_dir():
            for cert in extra.iterdir():
                if cert.is_file():
                    shutil.copy2(cert, self.root / "usr/local/share/ca-certificates" / cert.name)
        subprocess.run(
            ["chroot", str(self.root), "update-ca-certificates"],
            check=True,
            stdout=subprocess.DEVNULL,
            env={"PATH": PATH},
        )

    def boot(self, timeout: float = 90) -> None:
        log(f"booting {self.name} from {self.root}")
        started = time.monotonic()
        # Appended to: a reboot's second boot keeps the first one's lines.
        with open(self.console_log, "ab") as console:
            self._nspawn = subprocess.Popen(
                [
                    "systemd-nspawn",
                    "--boot",
                    "--register=no",
                    "--keep-unit",
                    f"--machine={self.name}",
                    f"--directory={self.root}",
                    "--console=read-only",
                ],
                stdin=subprocess.DEVNULL,
                stdout=console,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.init_pid = wait_until(self._find_init, timeout, "the container's systemd to start")
        # is-system-running --wait returns once boot is over; before the
        # manager listens it fails at once, so retry until the deadline.
        state = wait_until(
            lambda: self._system_state(timeout), timeout, "the container to finish booting"
        )
        log(f"{self.name} booted ({state}) in {time.monotonic() - started:.1f} s")
        if state != "running":
            failed = self.sh("systemctl --failed --no-legend", check=False).stdout
            log(f"boot state {state}; failed units:\n{failed}")

    def reboot(self, while_off: Callable[[], None] = lambda: None, timeout: float = 90) -> None:
        """``systemctl reboot`` inside; once the container is down, ``while_off()``, then boot.

        nspawn ends when its container reboots (exit 133; only a supervisor
        such as systemd-nspawn@.service starts it again), so the same tree is
        booted again here, as the machine's firmware would.
        """
        proc = self._nspawn
        assert proc is not None, "boot() first"
        log(f"rebooting {self.name}")
        # nsenter may be killed with the container before systemctl returns.
        self.run(["systemctl", "reboot"], check=False, timeout=timeout)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise MachineError(
                f"{self.name} did not go down in {timeout:.0f} s:\n{self.console_tail()}"
            ) from None
        if code != 133:  # nspawn's "the container asked for a reboot"
            raise MachineError(f"systemd-nspawn exited {code} on reboot:\n{self.console_tail()}")
        self._nspawn = None
        while_off()
        self.boot(timeout)

    def cut_power(self) -> None:
        """Every process of the container killed at once (SIGKILL); ``boot_after_cut()`` next.

        SIGKILL to the container's PID 1 makes the kernel kill everything in
        its PID namespace in the same instant, and nspawn is killed with it. No
        process gets to flush or sync anything. The tree is a directory on
        the host, whose page cache survives: this is a crash of every process,
        not a lost disk cache. Any thread may call this, so that a test can
        cut the power the instant something happens.
        """
        proc = self._nspawn
        assert proc is not None, "boot() first"
        os.kill(self.init_pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        log(f"cut the power of {self.name}")  # not before: a caller may time the cut

    def boot_after_cut(self, while_off: Callable[[], None], timeout: float = 90) -> None:
        """Once ``cut_power()`` has brought the container down, ``while_off()``, then boot."""
        proc = self._nspawn
        assert proc is not None, "boot() first"
        proc.wait(timeout=timeout)
        self._nspawn = None
        while_off()
        self.boot(timeout)

    def _find_init(self) -> int | None:
        assert self._nspawn is not None
        if self._nspawn.poll() is not None:
            raise MachineError(
                f"systemd-nspawn exited with {self._nspawn.returncode}:\n{self.console_tail()}"
            )
        children = Path(f"/proc/{self._nspawn.pid}/task/{self._nspawn.pid}/children")
        with contextlib.suppress(OSError):
            for pid in children.read_text().split():
                comm = Path(f"/proc/{pid}/comm").read_text().strip()
                if comm == "systemd":
                    return int(pid)
        return None

    def _system_state(self, timeout: float) -> str | None:
        proc = self.run(["systemctl", "is-system-running", "--wait"], check=False, timeout=timeout)
        state = proc.stdout.strip()
        return state if state in ("running", "degraded") else None

    def console_tail(self, lines: int = 40) -> str:
        with contextlib.suppress(OSError, AssertionError):
            text = self.console_log.read_bytes().decode(errors="replace")
            return "\n".join(text.splitlines()[-lines:])
        return ""

    def close(self) -> None:
        """Power off (SIGTERM makes nspawn halt the container), kill if stuck, remove the tree."""
        proc = self._nspawn
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                log(f"{self.name} did not power off in 30 s; killing it")
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
        self._nspawn = None
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)

    # -- commands inside

    def command(self, argv: list[str]) -> list[str]:
        """The host's command line that runs ``argv`` inside the container as root,
        in a clean environment, as an admin's shell would."""
        return ["nsenter", "-t", str(self.init_pid), "-a", "env", "-i", f"PATH={PATH}", *argv]

    def run(
        self, argv: list[str], *, check: bool = True, timeout: float = 120, input: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` inside the container in a clean root environment."""
        proc = subprocess.run(
            self.command(argv),
            capture_output=True,
            text=True,
            timeout=timeout,
            input=input,
            check=False,
            stdin=None if input is not None else subprocess.DEVNULL,
        )
        if check and proc.returncode != 0:
            raise MachineError(
                f"in {self.name}: {shlex.join(argv)} exited {proc.returncode}\n"
                f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
            )
        return proc

    def sh(
        self, script: str, *, check: bool = True, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        """Run a shell script inside the container."""
        return self.run(["sh", "-c", script], check=check, timeout=timeout)

    def run_unbooted(
        self, argv: list[str], *, check: bool = True, timeout: float = 600
    ) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` in the prepared tree without booting it (with nspawn's
        own /proc and /dev, the host's network), in a clean root environment."""
        assert self._nspawn is None, "not while booted"
        nspawn = ["systemd-nspawn", "--quiet", "--register=no", "--keep-unit"]
        nspawn += [f"--machine={self.name}", f"--directory={self.root}", "--"]
        proc = subprocess.run(
            [*nspawn, "env", "-i", f"PATH={PATH}", *argv],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            stdin=subprocess.DEVNULL,
        )
        if check and proc.returncode != 0:
            raise MachineError(
                f"in {self.name} (not booted): {shlex.join(argv)} exited {proc.returncode}\n"
                f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
            )
        return proc

    def write(self, path: str, text: str, mode: int = 0o644) -> None:
        """Write a file inside the tree (from the host, as root)."""
        out = self.root / path.lstrip("/")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
        out.chmod(mode)
