"""Session fixtures of the system tests: one booted machine per Debian suite,
with toko installed from its package.

The suites come from TOKO_SYSTEST_SUITES (default "bookworm trixie"). A suite
whose tree cannot be bootstrapped or booted, or whose package cannot be
built, errors every test of that suite: it is never skipped. Missing caches
of all selected suites are built in parallel at the start, so a cold run pays
for one debootstrap, not two; the packages of every suite are built
concurrently too (tests/system/packages.py), the first suite's first.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.support.ports import free_port
from tests.support.smtp import SmtpServer
from tests.system.deployment import Deployment
from tests.system.machine import Machine, cached_tree, log
from tests.system.packages import SuitePackages, lower_priority, start_builds

SUITES = os.environ.get("TOKO_SYSTEST_SUITES", "bookworm trixie").split()


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if {"deployment", "suite"} & set(metafunc.fixturenames):
        metafunc.parametrize("suite", SUITES, scope="session")


def _selected_suites(session: pytest.Session) -> list[str]:
    wanted = {
        item.callspec.params["suite"]
        for item in session.items
        if hasattr(item, "callspec") and "suite" in item.callspec.params
    }
    return [s for s in SUITES if s in wanted]


@pytest.fixture(scope="session")
def trees(request: pytest.FixtureRequest) -> Iterator[dict[str, Future[Path]]]:
    """Futures of the cached trees of every selected suite, built concurrently."""
    if os.geteuid() != 0:
        pytest.fail("the system tests boot containers and must run as root", pytrace=False)
    # dpkg-deb reads and repacks the packages; git lists the checkout to build.
    for tool in ("systemd-nspawn", "debootstrap", "nsenter", "dpkg-deb", "git"):
        if shutil.which(tool) is None:
            pytest.fail(f"{tool} is missing: run `make test-system`", pytrace=False)
    suites = _selected_suites(request.session)
    with ThreadPoolExecutor(max_workers=max(1, len(suites))) as pool:
        yield {suite: pool.submit(cached_tree, suite) for suite in suites}


@pytest.fixture(scope="session")
def packages(
    request: pytest.FixtureRequest,
    trees: dict[str, Future[Path]],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[dict[str, SuitePackages]]:
    """Futures of every selected suite's packages, built in clean trees.

    The first suite's package is built at once, alone; then, at a lower
    priority while the first suite's tests run, the other suites' packages and
    every suite's lower version.
    """
    out = tmp_path_factory.mktemp("debs")
    suites = _selected_suites(request.session)
    stop = threading.Event()
    with (
        ThreadPoolExecutor(max_workers=1) as first,
        ThreadPoolExecutor(max_workers=max(1, len(suites)), initializer=lower_priority) as rest,
    ):
        try:
            yield start_builds(first, rest, suites, out, stop)
        finally:
            # A session ended early does not wait for builds nobody needs.
            stop.set()


@pytest.fixture(scope="session")
def deployment(
    suite: str, trees: dict[str, Future[Path]], packages: dict[str, SuitePackages]
) -> Iterator[Deployment]:
    """Debian ``suite`` booted, with ``apt-get install ./toko_….deb`` done."""
    started = time.monotonic()
    pristine = trees[suite].result()
    log(f"{suite}: tree ready after {time.monotonic() - started:.1f} s")
    machine = Machine(suite, pristine)
    toko = Deployment(machine, free_port(), packages[suite])
    try:
        machine.prepare()
        toko.stage()
        machine.boot()
        toko.prepare_apt()
        deb = packages[suite].current.result()
        log(f"{suite}: package ready after {time.monotonic() - started:.1f} s")
        try:
            install_started = time.monotonic()
            toko.install(deb)
            toko.read_token()
            toko.wait_created("Pertama")
        except Exception:
            log(
                f"{suite}: installing the package failed; the units' state and journal:\n"
                f"{toko.diagnose()}"
            )
            raise
        log(
            f"{suite}: from apt-get install to the first 201:"
            f" {time.monotonic() - install_started:.1f} s; {deb.name}: {deb.stat().st_size} bytes"
        )
        yield toko
    finally:
        log(f"{suite}: console tail:\n{machine.console_tail(15)}")
        machine.close()
        log(f"{suite}: session took {time.monotonic() - started:.1f} s")


@pytest.fixture(scope="session")
def smtp_server() -> Iterator[SmtpServer]:
    """A real SMTP server on the host's 127.0.0.1, reachable from the container."""
    with SmtpServer() as server:
        yield server


@pytest.fixture
def toko(deployment: Deployment) -> Deployment:
    """The deployment with the current package installed and toko-api running,
    whatever the previous test left."""
    deployment.ensure_installed()
    deployment.ensure_running()
    return deployment
