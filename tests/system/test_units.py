"""The unit files themselves, checked on the host in a second (no container needed)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.system

UNITS = Path(__file__).resolve().parents[2] / "deploy" / "systemd"
SERVICES = ("toko-api.service", "toko-recap.service", "toko-backup.service", "toko-alert@.service")
# The sandbox the services share (systemd applies it to every toko-*.service).
HARDENING = "toko-.service.d/00-hardening.conf"
# What `systemd-analyze security` has rated every toko service since the sandbox was written.
EXPOSURE_MAX = 1.1


def settings(text: str, section: str) -> dict[str, list[str]]:
    """Key -> values of one [section] of a unit file (comments and continuation-free)."""
    out: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("["):
            current = line.strip("[]")
        elif current == section and line and not line.startswith("#") and "=" in line:
            key, _, value = line.partition("=")
            out.setdefault(key, []).append(value)
    return out


@pytest.mark.parametrize("unit", [*SERVICES, HARDENING])
def test_every_hardening_line_says_why(unit: str) -> None:
    lines = (UNITS / unit).read_text().splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("# --- Hardening"))
    body = lines[start + 1 :]
    body = body[: next((i for i, ln in enumerate(body) if ln.startswith("[")), len(body))]
    for i, line in enumerate(body):
        if line and not line.startswith("#"):
            assert i > 0 and body[i - 1].startswith("# "), f"{unit}: no reason above {line!r}"


def offline_exposure(unit: str) -> tuple[float, str]:
    """``systemd-analyze security`` of the unit file (and the drop-ins beside it)."""
    if shutil.which("systemd-analyze") is None:
        pytest.fail("systemd-analyze is missing (Debian package systemd)")
    out = subprocess.run(
        ["systemd-analyze", "security", "--offline=true", "--no-pager", str(UNITS / unit)],
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    match = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", out)
    assert match, out
    return float(match.group(1)), out


@pytest.mark.parametrize("unit", SERVICES)
def test_exposure_offline_at_most_2(unit: str) -> None:
    exposure, out = offline_exposure(unit)
    assert exposure <= 2.0, out


@pytest.mark.parametrize("unit", SERVICES)
def test_exposure_offline_stays_where_the_sandbox_put_it(unit: str) -> None:
    exposure, out = offline_exposure(unit)
    assert exposure <= EXPOSURE_MAX, out


def test_no_unit_sets_what_the_shared_sandbox_sets() -> None:
    # A unit file is read before its drop-ins: a line of its own for one of
    # these settings would be overridden (or merged) without a word.
    shared = settings((UNITS / HARDENING).read_text(), "Service")
    for unit in SERVICES:
        own = settings((UNITS / unit).read_text(), "Service")
        assert not shared.keys() & own.keys(), unit


def test_api_service_contract() -> None:
    svc = settings((UNITS / "toko-api.service").read_text(), "Service")
    assert svc["Type"] == ["notify"] and svc["Restart"] == ["on-failure"]
    assert svc["User"] == ["toko"] and svc["StateDirectory"] == ["toko"]
    assert svc["UMask"] == ["0077"]
    assert svc["EnvironmentFile"] == ["-/etc/toko/toko.env"]
    # Above the 10 s drain, which EXTEND_TIMEOUT_USEC may lengthen anyway.
    assert int(svc["TimeoutStopSec"][0].removesuffix("s")) > 10
    assert svc["WatchdogSec"]
    unit = settings((UNITS / "toko-api.service").read_text(), "Unit")
    # Leases are wall-clock time: not before the clock is set (and synced, if waited for).
    assert {"time-set.target", "time-sync.target"} <= set(" ".join(unit["After"]).split())
    sock = settings((UNITS / "toko-api.socket").read_text(), "Socket")
    assert sock["ListenStream"] == ["127.0.0.1:8080"]


@pytest.mark.parametrize("job", ["recap", "backup"])
def test_timer_jobs_contract(job: str) -> None:
    svc = settings((UNITS / f"toko-{job}.service").read_text(), "Service")
    assert svc["Type"] == ["oneshot"] and svc["TimeoutStartSec"]
    assert svc["ExecStart"] == [f"/usr/bin/toko-{job}"]
    assert svc["User"] == ["toko"] and svc["StateDirectory"] == ["toko"]
    assert svc["EnvironmentFile"] == ["-/etc/toko/toko.env"]
    timer = settings((UNITS / f"toko-{job}.timer").read_text(), "Timer")
    assert timer["Persistent"] == ["true"] and timer["RandomizedDelaySec"]
    assert timer["OnCalendar"]
