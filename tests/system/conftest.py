"""Session fixtures of the system tests: one booted, installed machine per Debian suite.

The suites come from TOKO_SYSTEST_SUITES (default "bookworm trixie"). A suite
whose tree cannot be bootstrapped or booted errors every test of that suite:
it is never skipped. Missing caches of all selected suites are built in
parallel at the start, so a cold run pays for one debootstrap, not two.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.support.ports import free_port
from tests.support.smtp import SmtpServer
from tests.system.deployment import Deployment
from tests.system.machine import Machine, cached_tree, log

SUITES = os.environ.get("TOKO_SYSTEST_SUITES", "bookworm trixie").split()


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "deployment" in metafunc.fixturenames:
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
    for tool in ("systemd-nspawn", "debootstrap", "nsenter"):
        if shutil.which(tool) is None:
            pytest.fail(f"{tool} is missing: run `make test-system`", pytrace=False)
    suites = _selected_suites(request.session)
    with ThreadPoolExecutor(max_workers=max(1, len(suites))) as pool:
        yield {suite: pool.submit(cached_tree, suite) for suite in suites}


@pytest.fixture(scope="session")
def deployment(suite: str, trees: dict[str, Future[Path]]) -> Iterator[Deployment]:
    """Debian ``suite`` booted, with ``make install`` run in the copied checkout."""
    started = time.monotonic()
    pristine = trees[suite].result()
    log(f"{suite}: tree ready after {time.monotonic() - started:.1f} s")
    machine = Machine(suite, pristine)
    toko = Deployment(machine, free_port())
    try:
        machine.prepare()
        toko.stage()
        machine.boot()
        try:
            toko.make("install")
            toko.read_token()
        except Exception:
            log(f"{suite}: make install failed; the units' state and journal:\n{toko.diagnose()}")
            raise
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
    """The deployment with toko-api running, whatever the previous test left."""
    deployment.ensure_running()
    return deployment
