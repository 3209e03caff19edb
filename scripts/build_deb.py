"""Build toko's Debian package for one Debian release.

    python3 scripts/build_deb.py --suite bookworm|trixie|host [--version V] [--out DIR]

prints the path of the .deb, ``dist/deb/<suite>/toko_<version>_<arch>.deb``
unless ``--out`` says otherwise; progress goes to stderr.

``bookworm`` and ``trixie`` build in a clean tree of that release, never with
this machine's Python: the system tests' debootstrapped tree
(:func:`tests.system.machine.cached_tree`) plus debian/control's
Build-Depends and lintian, cached per release in /var/cache/toko-build/<suite>
(TOKO_BUILD_CACHE), keyed by what it installs and built beside it then renamed
into place, like the system tests' trees. Each build runs
``dpkg-buildpackage -b`` in it under ``systemd-nspawn --volatile=overlay``
(the cached tree stays pristine, nothing is copied), then that release's
lintian, and fails on a lintian error. ``host`` builds on this machine with
its python3, for ``make install`` on a bare server, installing the missing
Build-Depends with apt-get first.

``--version V`` builds the same source as package version V (the upgrade
tests install a lower one first): a changelog entry added to the build's copy
of the source, never to the repository.
"""

from __future__ import annotations

import argparse
import contextlib
import email.utils
import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SUITES = ("bookworm", "trixie")
CACHE_ROOT = Path(os.environ.get("TOKO_BUILD_CACHE", "/var/cache/toko-build"))
# Beside the Build-Depends in every build tree: what dpkg-buildpackage itself
# needs, and the release's own lintian. Bump RECIPE when the way a tree is
# made changes, so cached ones are rebuilt.
EXTRA_PACKAGES = ("build-essential", "lintian")
RECIPE = "v1"
STAMP = ".toko-build-key"
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# Where the source sits inside a build tree; dpkg-buildpackage writes the
# .deb into its parent.
SRC_IN_TREE = "/build/toko"
# The host's extra CA certificates (a TLS-inspecting egress, say), trusted in
# the build tree too so pip reaches the package index.
EXTRA_CERTS = Path("/usr/local/share/ca-certificates")
CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"
# Not part of the source, if there is no git to ask.
NOT_SOURCE = {".git", ".venv", "build", "dist", "var", "__pycache__", ".mypy_cache"}
NOT_SOURCE_SUFFIXES = (".egg-info", ".pyc")


class BuildError(RuntimeError):
    """The package could not be built (the message says which step and why)."""


def log(message: str) -> None:
    print(f"[build_deb {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def run(
    argv: Sequence[str],
    *,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
    log_file: Path | None = None,
) -> str:
    """Run a step; its output is returned (and written to ``log_file``), its end
    shown when it fails."""
    proc = subprocess.run(
        argv,
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        check=False,
    )
    if log_file is not None:
        log_file.write_text(proc.stdout)
    if proc.returncode != 0:
        where = f" (all of it in {log_file})" if log_file is not None else ""
        raise BuildError(
            f"{' '.join(argv[:8])}{' ...' if len(argv) > 8 else ''} exited {proc.returncode}"
            f"{where}:\n{proc.stdout[-6000:]}"
        )
    return proc.stdout


# -- the source ------------------------------------------------------------------


def source_files(repo: Path = REPO) -> list[str]:
    """The working tree as git sees it (tracked plus untracked-but-not-ignored),
    so uncommitted work is built; every file but the usual leftovers without git."""
    if (repo / ".git").exists() and shutil.which("git"):
        out = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=repo,
            capture_output=True,
            check=True,
        ).stdout
        names = {name.decode() for name in out.split(b"\0") if name}
        return sorted(name for name in names if (repo / name).is_file())
    found: list[str] = []
    for root, dirs, files in os.walk(repo):
        dirs[:] = [d for d in dirs if d not in NOT_SOURCE and not d.endswith(NOT_SOURCE_SUFFIXES)]
        rel = Path(root).relative_to(repo)
        found += [str(rel / f) for f in files if not f.endswith(NOT_SOURCE_SUFFIXES)]
    return sorted(found)


def copy_source(dest: Path, version: str | None) -> None:
    for rel in source_files():
        out = dest / rel
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / rel, out)
    if version is not None:
        add_changelog_entry(dest / "debian/changelog", version)


def add_changelog_entry(changelog: Path, version: str) -> None:
    """A new top entry for ``version``, by the maintainer of the current top one."""
    if not re.fullmatch(r"(\d+:)?[0-9][A-Za-z0-9.+~-]*", version):
        raise BuildError(f"not a Debian version: {version!r}")
    text = changelog.read_text()
    maintainer = re.search(r"^ -- (.+?)  ", text, re.MULTILINE)
    if maintainer is None:
        raise BuildError(f"no maintainer line in {changelog}")
    entry = (
        f"toko ({version}) unstable; urgency=medium\n\n"
        f"  * The same source built as version {version} (scripts/build_deb.py --version).\n\n"
        f" -- {maintainer.group(1)}  {email.utils.formatdate()}\n\n"
    )
    changelog.write_text(entry + text)


def build_depends(control: Path = REPO / "debian/control") -> str:
    """debian/control's Build-Depends field, continuation lines joined."""
    field: list[str] = []
    inside = False
    for line in control.read_text().splitlines():
        if line.startswith("#"):
            continue
        if inside and line[:1] in (" ", "\t"):
            field.append(line.strip())
            continue
        inside = line.startswith("Build-Depends:")
        if inside:
            field.append(line.partition(":")[2].strip())
    if not field:
        raise BuildError(f"no Build-Depends in {control}")
    return " ".join(part for part in field if part)


# -- the build trees ---------------------------------------------------------------


def nspawn(
    tree: Path,
    script: str,
    *,
    volatile: bool,
    binds: Sequence[str] = (),
    log_file: Path | None = None,
) -> str:
    """Run ``script`` as root in ``tree`` (systemd need not be PID 1 here)."""
    argv = [
        "systemd-nspawn",
        "--quiet",
        "--register=no",
        "--keep-unit",
        "--as-pid2",
        "--pipe",
        f"--directory={tree}",
        f"--setenv=PATH={PATH}",
        "--setenv=LANG=C.UTF-8",
        "--setenv=DEBIAN_FRONTEND=noninteractive",
        f"--setenv=PIP_CERT={CA_BUNDLE}",
    ]
    if volatile:
        # Writes go to a tmpfs over the tree, gone when the container ends.
        argv.append("--volatile=overlay")
    argv += [f"--bind={bind}" for bind in binds]
    return run([*argv, "--", "/bin/sh", "-euc", script], log_file=log_file)


def _trust_host_certs() -> str:
    """Shell lines that make the tree trust this host's extra CA certificates."""
    if not EXTRA_CERTS.is_dir() or not any(EXTRA_CERTS.iterdir()):
        return ""
    return (
        "cp /host-certs/* /usr/local/share/ca-certificates/\n"
        "update-ca-certificates >/dev/null 2>&1\n"
    )


def _cert_binds() -> list[str]:
    return [f"{EXTRA_CERTS}:/host-certs"] if EXTRA_CERTS.is_dir() else []


def tree_key(suite: str, depends: str) -> str:
    from tests.system.machine import RECIPE as BASE_RECIPE

    text = "\n".join([RECIPE, BASE_RECIPE, suite, depends, *EXTRA_PACKAGES])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@contextlib.contextmanager
def _locked(name: str) -> Iterator[None]:
    CACHE_ROOT.mkdir(parents=True, exist_ok=True)
    with open(CACHE_ROOT / f".{name}.lock", "w") as lockfile:
        fcntl.flock(lockfile, fcntl.LOCK_EX)
        yield


def build_tree(suite: str) -> Path:
    """The cached build tree of ``suite``: its bare tree plus the Build-Depends.

    Made in a temporary directory beside it and renamed into place, so an
    interrupted build never leaves a broken tree; safe for several processes.
    """
    from tests.system.machine import cached_tree

    depends = build_depends()
    key = tree_key(suite, depends)
    final = CACHE_ROOT / suite
    with _locked(suite):
        stamp = final / STAMP
        if stamp.is_file() and stamp.read_text().strip() == key:
            return final
        bare = cached_tree(suite)
        for stale in CACHE_ROOT.glob(f".{suite}.build-*"):
            shutil.rmtree(stale, ignore_errors=True)
        started = time.monotonic()
        tmp = Path(tempfile.mkdtemp(prefix=f".{suite}.build-", dir=CACHE_ROOT))
        try:
            root = tmp / "root"
            log(f"making the {suite} build tree (Build-Depends: {depends})")
            run(["cp", "-a", "--reflink=auto", str(bare), str(root)])
            # apt-get build-dep reads the field from debian/control as it is.
            (root / "root/deps/debian").mkdir(parents=True)
            shutil.copy2(REPO / "debian/control", root / "root/deps/debian/control")
            shutil.copy2(REPO / "debian/changelog", root / "root/deps/debian/changelog")
            nspawn(
                root,
                "apt-get update -qq\n"
                "apt-get build-dep -y -qq --no-install-recommends /root/deps\n"
                f"apt-get install -y -qq --no-install-recommends {' '.join(EXTRA_PACKAGES)}\n"
                "apt-get clean\n"
                "rm -rf /root/deps\n",
                volatile=False,
            )
            (root / STAMP).write_text(key + "\n")
            old = final.with_name(f".{suite}.old-{os.getpid()}")
            if final.exists():
                final.rename(old)
            root.rename(final)
            shutil.rmtree(old, ignore_errors=True)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        log(f"{suite} build tree ready in {time.monotonic() - started:.0f} s")
        return final


# -- building ----------------------------------------------------------------------


def build(suite: str, out_dir: Path, version: str | None = None, *, lintian: bool = True) -> Path:
    """Build the package for ``suite`` (bookworm, trixie or host) into ``out_dir``.

    Returns the path of the .deb. ``lintian`` (suites only, not host) runs the
    release's lintian on it, writes its output beside it as
    ``<deb>.lintian.txt`` and fails on an error.
    """
    if suite != "host" and suite not in SUITES:
        raise BuildError(f"unknown suite {suite!r}: one of {', '.join(SUITES)} or host")
    started = time.monotonic()
    out_dir.mkdir(parents=True, exist_ok=True)
    # On disk, not a tmpfs /tmp: the build holds a venv and its wheels.
    with tempfile.TemporaryDirectory(prefix=f"toko-deb-{suite}-", dir="/var/tmp") as tmp:
        work = Path(tmp)
        src = work / "toko"
        copy_source(src, version)
        if suite == "host":
            _build_on_host(src, out_dir / "build.log")
        else:
            _build_in_tree(suite, work, out_dir / "build.log")
        debs = sorted(work.glob("toko_*.deb"))
        if len(debs) != 1:
            raise BuildError(f"expected one toko_*.deb, the build made {[d.name for d in debs]}")
        deb = out_dir / debs[0].name
        shutil.copy2(debs[0], deb)
        errors: list[str] = []
        if lintian and suite != "host":
            errors = _lintian(suite, work, deb, out_dir / "lintian.log")
            shutil.copy2(work / "lintian.txt", deb.with_name(deb.name + ".lintian.txt"))
    if errors:
        raise BuildError(f"lintian found {len(errors)} errors in {deb}:\n" + "\n".join(errors[:40]))
    size = deb.stat().st_size / 1e6
    log(f"{deb} ({size:.1f} MB) built in {time.monotonic() - started:.0f} s")
    return deb


def _in_tree(suite: str, work: Path, script: str, log_file: Path) -> None:
    """Run ``script`` in the build tree of ``suite``, ``work`` as /build."""
    pip_cache = CACHE_ROOT / f"pip-{suite}"
    pip_cache.mkdir(parents=True, exist_ok=True)
    nspawn(
        build_tree(suite),
        _trust_host_certs() + script,
        volatile=True,
        binds=[f"{work}:/build", f"{pip_cache}:/root/.cache/pip", *_cert_binds()],
        log_file=log_file,
    )


def _build_in_tree(suite: str, work: Path, log_file: Path) -> None:
    build_tree(suite)  # made first, so that the time below is the build's alone
    started = time.monotonic()
    _in_tree(suite, work, f"cd {SRC_IN_TREE}\ndpkg-buildpackage -us -uc -b\n", log_file)
    log(f"dpkg-buildpackage in the {suite} tree took {time.monotonic() - started:.0f} s")


def _lintian(suite: str, work: Path, deb: Path, log_file: Path) -> list[str]:
    """The release's lintian on ``deb`` (info tags shown too); its errors."""
    started = time.monotonic()
    # Its exit status only says whether there are errors: read from the report.
    _in_tree(
        suite,
        work,
        f"lintian --display-info /build/{deb.name} >/build/lintian.txt 2>&1 || true\n",
        log_file,
    )
    lines = (work / "lintian.txt").read_text().splitlines()
    shown = [line for line in lines if line.startswith(("E: ", "W: "))]
    infos = sum(line.startswith("I: ") for line in lines)
    log(
        f"lintian ({suite}, {time.monotonic() - started:.0f} s): {len(shown)} errors and "
        f"warnings, {infos} info tags (all in {deb.name}.lintian.txt)"
        + "".join(f"\n  {line}" for line in shown)
    )
    return [line for line in shown if line.startswith("E: ")]


def _build_on_host(src: Path, log_file: Path) -> None:
    env = {**os.environ, "LANG": "C.UTF-8"}
    satisfied = shutil.which("dpkg-checkbuilddeps") is not None and (
        subprocess.run(["dpkg-checkbuilddeps"], cwd=src, capture_output=True).returncode == 0
    )
    if not satisfied:
        if os.geteuid() != 0:
            raise BuildError(
                f"this host lacks the package's Build-Depends ({build_depends()}): "
                "run as root (sudo) to have them installed"
            )
        log("installing the Build-Depends (apt-get build-dep)")
        apt_env = {**env, "DEBIAN_FRONTEND": "noninteractive"}
        build_dep = ["apt-get", "build-dep", "-y", "-qq", "--no-install-recommends", str(src)]
        try:
            run(build_dep, env=apt_env)
        except BuildError:
            # Stale package lists on a server nobody updated for a while.
            run(["apt-get", "update", "-qq"], env=apt_env)
            run(build_dep, env=apt_env)
    started = time.monotonic()
    run(["dpkg-buildpackage", "-us", "-uc", "-b"], cwd=src, env=env, log_file=log_file)
    log(f"dpkg-buildpackage on this host took {time.monotonic() - started:.0f} s")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="build_deb.py", description="Build toko's Debian package for one Debian release."
    )
    parser.add_argument(
        "--suite",
        required=True,
        choices=[*SUITES, "host"],
        help="the release to build for, in a clean tree of it; host: this machine",
    )
    parser.add_argument("--version", help="package version (default: debian/changelog's)")
    parser.add_argument("--out", type=Path, help="output folder (default: dist/deb/<suite>)")
    parser.add_argument(
        "--no-lintian", action="store_true", help="skip lintian (it runs for suites only)"
    )
    args = parser.parse_args(argv)
    out = args.out if args.out is not None else REPO / "dist/deb" / args.suite
    try:
        deb = build(args.suite, out, args.version, lintian=not args.no_lintian)
    except BuildError as exc:
        print(f"build_deb: {exc}", file=sys.stderr)
        return 1
    print(deb)
    return 0


if __name__ == "__main__":
    # Run as a script: the repository root on the path, for tests.system.machine.
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    sys.exit(main())
