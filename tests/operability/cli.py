"""Run toko's console scripts as real processes from async tests."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BIN = Path(sys.executable).parent


@dataclass(frozen=True)
class Completed:
    args: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str

    def json(self) -> Any:
        return json.loads(self.stdout)

    def log_records(self) -> list[dict[str, Any]]:
        """The JSON log lines on stdout (timer jobs log there outside systemd)."""
        records = []
        for line in self.stdout.splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict):
                records.append(record)
        return records


async def run(
    command: str,
    *args: str,
    env: dict[str, str] | None = None,
    timeout: float = 30.0,  # noqa: ASYNC109
) -> Completed:
    """``command args...`` with a clean environment plus ``env``; waits for the exit."""
    environ = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "LANG": "C.UTF-8",
        # PYTHONPATH=<checkout> (a worktree): run that checkout's code, not the installed.
        **{k: v for k, v in os.environ.items() if k == "PYTHONPATH"},
        **(env or {}),
    }
    proc = await asyncio.create_subprocess_exec(
        str(BIN / command),
        *args,
        env=environ,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    async with asyncio.timeout(timeout):
        out, err = await proc.communicate()
    assert proc.returncode is not None
    return Completed((command, *args), proc.returncode, out.decode(), err.decode())
