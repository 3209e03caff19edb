"""Whether toko.env changed after toko-api started: toko-queue would then work
on settings the running service does not have.

toko-queue reads the file as it is now; systemd gave toko-api the file as it
was at its start. After an edit without `systemctl restart toko-api` (another
TOKO_DATABASE, say), the two disagree without a word. The file's modification
time against the start of toko-api's main process says so cheaply; the
service's own environment is out of reach (PrivateUsers=yes hides it).
"""

from __future__ import annotations

import subprocess
import time
from datetime import UTC, datetime
from pathlib import Path

SERVICE = "toko-api.service"


def service_start(unit: str = SERVICE) -> float | None:
    """When ``unit``'s running main process started (epoch seconds), else None.

    None too where there is no systemd to ask (a development checkout, a
    container without it) or the unit does not run.
    """
    try:
        shown = subprocess.run(
            ["systemctl", "show", "-p", "MainPID,ExecMainStartTimestampMonotonic", unit],
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    fields = dict(line.split("=", 1) for line in shown.stdout.splitlines() if "=" in line)
    started = fields.get("ExecMainStartTimestampMonotonic", "")
    if shown.returncode != 0 or fields.get("MainPID", "0") in ("", "0") or not started.isdigit():
        return None
    # systemd's monotonic clock is CLOCK_MONOTONIC, as time.monotonic(); its
    # µs survive where the wall-clock form would be whole seconds.
    return time.time() - (time.monotonic() - int(started) / 1e6)


def stale_settings_warning(env_file: Path) -> str | None:
    """The warning when ``env_file`` changed after toko-api started, else None."""
    try:
        changed = env_file.stat().st_mtime
    except OSError:
        return None
    started = service_start()
    if started is None or changed <= started:
        return None
    at = datetime.fromtimestamp(started, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    return (
        f"{env_file} changed after toko-api started ({at}): toko-api runs with the settings "
        "from before, this command with the new ones (sudo systemctl restart toko-api)"
    )
