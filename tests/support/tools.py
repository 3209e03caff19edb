"""The toko timer jobs and admin tools as real subprocesses, in the clean
environment ServiceProcess also gives toko-api."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from tests.support.service import clean_environment

BIN = Path(sys.executable).parent


def tool_command(name: str, *args: str) -> list[str]:
    return [str(BIN / name), *args]


def clean_env(workdir: Path, env: Mapping[str, str]) -> dict[str, str]:
    """The clean environment ServiceProcess also gives toko-api."""
    return clean_environment(HOME=str(workdir), **env)


def run_tool(
    name: str, workdir: Path, env: Mapping[str, str], *args: str, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """Run toko-recap / toko-backup to completion; its exit code, stdout and stderr."""
    workdir.mkdir(parents=True, exist_ok=True)
    return subprocess.run(
        tool_command(name, *args),
        env=clean_env(workdir, env),
        cwd=workdir,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
