"""The Debian packages the system tests install, built once per session.

For each suite, scripts/build_deb.py builds the package of this working tree
(the one an admin installs) and the same source as a lower version (the one
an upgrade starts from), each in a clean tree of that release. The source is
copied once, at the start: others may edit the tree while a session runs,
and the two builds must be of the same files. The build of the current one
also runs the release's lintian and writes its report beside the package.

The first suite's package is what the session waits for: it is built at once
and alone; everything else after it, at a lower priority while the tests
run, in the order they need it, one build of a suite at a time (see
_suite_chain). A third and fourth package, higher versions whose
``/etc/toko/toko.env`` differs, are the current one repacked: what dpkg does
with an admin's edited conffile depends only on the conffile having changed,
and a repack takes a second where a build takes a minute. piuparts runs
last, in the background.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar, cast

from tests.system.machine import Machine, cached_tree, host_mirrors, log

REPO = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = REPO / "scripts" / "build_deb.py"
CONFFILE = "etc/toko/toko.env"  # in the package's tree
# Added by the repack to the package's toko.env, so that the conffile changed.
CHANGED_LINE = "# systest: this toko.env is the package's, version {version}\n"
# The builds the first tests do not wait for run at this nice value: on a
# 2-core machine they would otherwise take half the CPU from the first build
# and from the tests that run meanwhile.
BACKGROUND_NICE = 10

T = TypeVar("T")


def snapshot_source(dest: Path) -> Path:
    """The working tree as git sees it (tracked, and untracked but not
    ignored), copied to ``dest``: every build of the session is of this one
    source, whatever others edit in the tree meanwhile."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout
    for name in sorted({n.decode() for n in out.split(b"\0") if n}):
        if (REPO / name).is_file():  # not one deleted but still tracked
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, dest / name)
    return dest


def _load_build(source: Path) -> Callable[..., Any]:
    """``build(suite, out_dir, version=None) -> Path`` from the copy of
    scripts/build_deb.py in ``source``, which builds the files beside it.

    scripts/ is no package: loaded by path, when the tests need it.
    """
    script = source / BUILD_SCRIPT.relative_to(REPO)
    if not script.is_file():
        raise FileNotFoundError(f"{BUILD_SCRIPT} is missing: the package cannot be built")
    spec = importlib.util.spec_from_file_location("toko_build_deb", script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return cast(Callable[..., Any], module.build)


def deb_field(deb: Path, field: str) -> str:
    out = subprocess.run(
        ["dpkg-deb", "--field", str(deb), field], capture_output=True, text=True, check=True
    )
    return out.stdout.strip()


def version_lower(version: str) -> str:
    """A version dpkg sorts right below ``version`` (``1.2-1`` -> ``1.2~systest-1``)."""
    upstream, dash, revision = version.rpartition("-")
    if not dash:
        return f"{version}~systest"
    return f"{upstream}~systest{dash}{revision}"


def version_gt(a: str, b: str) -> bool:
    return subprocess.run(["dpkg", "--compare-versions", a, "gt", b], check=False).returncode == 0


def source_version(source: Path) -> str:
    """The package version debian/changelog gives ``source`` (its first line)."""
    first = (source / "debian" / "changelog").read_text().split("\n", 1)[0]
    match = re.match(r"\S+ \(([^)]+)\)", first)
    if match is None:
        raise ValueError(f"debian/changelog: no version in its first line {first!r}")
    return match.group(1)


def repack_with_changed_conffile(deb: Path, version: str, out_dir: Path) -> Path:
    """``deb`` as version ``version``, its toko.env with one line more."""
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="toko-repack-", dir=out_dir) as tmp:
        tree = Path(tmp) / "tree"
        subprocess.run(["dpkg-deb", "--raw-extract", str(deb), str(tree)], check=True)
        conffile = tree / CONFFILE
        with conffile.open("a") as f:
            f.write(CHANGED_LINE.format(version=version))
        control = tree / "DEBIAN" / "control"
        text, n = re.subn(r"(?m)^Version: .*$", f"Version: {version}", control.read_text())
        assert n == 1, text
        control.write_text(text)
        md5sums = tree / "DEBIAN" / "md5sums"
        if md5sums.is_file():  # debhelper leaves conffiles out of it; in case it did not
            lines = md5sums.read_text().splitlines()
            if any(line.endswith(f"  {CONFFILE}") for line in lines):
                digest = subprocess.run(
                    ["md5sum", str(conffile)], capture_output=True, text=True, check=True
                ).stdout.split()[0]
                lines = [
                    f"{digest}  {CONFFILE}" if line.endswith(f"  {CONFFILE}") else line
                    for line in lines
                ]
                md5sums.write_text("\n".join(lines) + "\n")
        arch = deb_field(deb, "Architecture")
        out = out_dir / f"toko_{version}_{arch}.deb"
        # gzip -1: the repack is for this session only, speed over size.
        subprocess.run(
            ["dpkg-deb", "--root-owner-group", "-Zgzip", "-z1", "--build", str(tree), str(out)],
            check=True,
            stdout=subprocess.DEVNULL,
        )
    log(f"repacked {deb.name} as {out.name} in {time.monotonic() - started:.1f} s")
    return out


@dataclass
class Lintian:
    """What the release's lintian said of a package, as the build wrote it beside it."""

    output: str

    def tags(self, kind: str) -> list[str]:
        """The lines of one kind of tag: ``E`` errors, ``W`` warnings."""
        return [line for line in self.output.splitlines() if line.startswith(f"{kind}: ")]


def lintian_of(deb: Path) -> Lintian:
    return Lintian((deb.parent / f"{deb.name}.lintian.txt").read_text())


@dataclass
class Piuparts:
    returncode: int
    output: str

    @property
    def verdict(self) -> list[str]:
        """piuparts' PASS and FAIL lines, each FAIL with the lines it lists."""
        verdict: list[str] = []
        for line in self.output.splitlines():
            if "PASS:" in line or "FAIL:" in line:
                verdict.append(line)
            elif verdict and "FAIL:" in verdict[-1] and line.startswith("  "):
                verdict[-1] += "\n" + line
        return verdict


def run_piuparts(suite: str, current: Path, lower: Path) -> Piuparts:
    """piuparts of ``suite``'s own release on ``current``: install and purge,
    then install ``lower`` (from a local repository, as if it were in the
    archive), upgrade to ``current``, purge; in a copy of the release's tree,
    its chroots from a tarball of the same tree."""
    started = time.monotonic()
    tree = Machine(suite, cached_tree(suite), role="tokopiu")
    try:
        tree.prepare()
        work = tree.root / "var/piu"
        (work / "repo").mkdir(parents=True)
        shutil.copy2(current, work / current.name)
        shutil.copy2(lower, work / "repo" / lower.name)
        subprocess.run(
            ["tar", "-C", str(tree.pristine), "-I", "gzip -1", "-cf", str(work / "base.tgz"), "."],
            check=True,
        )
        tools = (
            "export DEBIAN_FRONTEND=noninteractive && apt-get update -qq"
            " && apt-get install -y -qq --no-install-recommends piuparts apt-utils >/dev/null"
            " && cd /var/piu/repo && apt-ftparchive packages . > Packages"
        )
        tree.run_unbooted(["sh", "-c", tools], timeout=900)
        prepared = time.monotonic() - started
        # Its chroots go on the tree's disk: /tmp in the container is a tmpfs
        # mounted nodev, where the base tarball's /dev/null would not open.
        argv = ["piuparts", "--tmpdir=/var/piu", "-b", "/var/piu/base.tgz", "-d", suite]
        argv += ["-m", host_mirrors()[0], "--bindmount", "/var/piu/repo"]
        argv += ["--extra-repo", "deb [trusted=yes] file:///var/piu/repo ./"]
        proc = tree.run_unbooted([*argv, f"/var/piu/{current.name}"], check=False, timeout=900)
        log(
            f"{suite}: piuparts on {current.name} (upgrade from {lower.name}) exited"
            f" {proc.returncode} after {time.monotonic() - started:.0f} s"
            f" ({prepared:.0f} s of it to get piuparts)"
        )
        return Piuparts(proc.returncode, proc.stdout + proc.stderr)
    finally:
        tree.close()


@dataclass
class SuitePackages:
    """One suite's packages, as futures: each is waited for by the test that needs it."""

    suite: str
    current: Future[Path]
    lower: Future[Path]
    changed: Future[tuple[Path, Path]]  # two successive versions above current, toko.env changed
    piuparts: Future[Piuparts]


def _build_current(build: Callable[..., Any], suite: str, out: Path, lower_version: str) -> Path:
    started = time.monotonic()
    deb = Path(build(suite, out))
    version = deb_field(deb, "Version")
    size = deb.stat().st_size
    log(
        f"{suite}: built {deb.name} in {time.monotonic() - started:.0f} s,"
        f" {size / 1e6:.1f} MB (Installed-Size {deb_field(deb, 'Installed-Size')} KiB)"
    )
    # The lower build was asked for before this one was done: check it is lower.
    if not version_gt(version, lower_version):
        raise ValueError(f"{lower_version} is not below the built version {version}")
    return deb


def _build_lower(build: Callable[..., Any], suite: str, out: Path, version: str) -> Path:
    started = time.monotonic()
    # lintian runs on the current package's build: the same source.
    deb = Path(build(suite, out, version=version, lintian=False))
    log(f"{suite}: built {deb.name} (the lower version) in {time.monotonic() - started:.0f} s")
    assert deb_field(deb, "Version") == version, deb
    return deb


def _changed(deb: Path, out: Path) -> tuple[Path, Path]:
    version = deb_field(deb, "Version")
    first = repack_with_changed_conffile(deb, f"{version}+systest1", out)
    return first, repack_with_changed_conffile(first, f"{version}+systest2", out)


def _settle(future: Future[T], step: Callable[[], T], stop: threading.Event) -> None:
    """``future`` gets what ``step()`` returns or raises; cancelled once ``stop`` is set."""
    if stop.is_set():
        future.cancel()
    if not future.set_running_or_notify_cancel():
        return
    try:
        future.set_result(step())
    except BaseException as exc:  # the test that waits for it shows it
        future.set_exception(exc)


def _suite_chain(
    build: Callable[..., Any],
    pkgs: SuitePackages,
    out: Path,
    lower_version: str,
    stop: threading.Event,
    *,
    first: Future[Path],
    build_current: bool,
) -> None:
    """A suite's builds one after the other, then what needs them, once the
    first suite's package (``first``), which the session waits for, is built.

    One at a time: the builds of a suite share its pip cache
    (/var/cache/toko-build/pip-<suite>), and two that build the same wheel
    there at once can read the other's half-written origin.json and fail.
    """
    suite = pkgs.suite
    first.exception()  # waits; a failed one is its own suite's error
    if build_current:
        _settle(pkgs.current, lambda: _build_current(build, suite, out, lower_version), stop)
    pkgs.current.exception()
    _settle(pkgs.lower, lambda: _build_lower(build, suite, out / "lower", lower_version), stop)
    _settle(pkgs.changed, lambda: _changed(pkgs.current.result(), out), stop)
    _settle(
        pkgs.piuparts,
        lambda: run_piuparts(suite, pkgs.current.result(), pkgs.lower.result()),
        stop,
    )


def lower_priority() -> None:
    """Make the calling thread, and every process it starts from now on, yield
    the CPU to the rest of the session (the nice value is per thread)."""
    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)


def start_builds(
    first: ThreadPoolExecutor,
    background: ThreadPoolExecutor,
    suites: list[str],
    out_root: Path,
    stop: threading.Event,
) -> dict[str, SuitePackages]:
    """Submit every suite's builds: the first suite's package to ``first``, the
    rest of each suite's to one task of ``background`` (one worker a suite,
    at a lower priority) that starts once that package is built, in the order
    the tests need them. Setting ``stop`` cancels the steps not begun."""
    source = snapshot_source(out_root / "source")
    build = _load_build(source)
    lower_version = version_lower(source_version(source))
    packages: dict[str, SuitePackages] = {}
    for n, suite in enumerate(suites):
        out = out_root / suite
        (out / "lower").mkdir(parents=True)
        pkgs = SuitePackages(suite, Future(), Future(), Future(), Future())
        if n == 0:
            pkgs.current = first.submit(_build_current, build, suite, out, lower_version)
        head = packages[suites[0]].current if n else pkgs.current
        chain = functools.partial(_suite_chain, first=head, build_current=n > 0)
        background.submit(chain, build, pkgs, out, lower_version, stop)
        packages[suite] = pkgs
    return packages
