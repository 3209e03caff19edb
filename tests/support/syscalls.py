"""The system calls of a running process, recorded with strace.

For contracts that are an order of system calls: "the commit is synced to disk
before the 201 goes out" is what makes a power cut harmless, and no test can
cut the power, but a trace shows the order. Usage::

    async with traced(svc.pid, tmp_path / "trace", ["fdatasync", "sendto"]) as calls:
        ...make the process do something...
    # calls now holds every traced call, in the order they happened

strace attaches to every thread of the process and detaches afterwards; the
process goes on as before. ``-y`` names each descriptor's file.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path

STRACE = "strace"
ATTACH_TIMEOUT_S = 10.0
# A complete call: name(args) = result, with strace's padding before the "=".
_COMPLETE = re.compile(r"(\w+)\((.*)\)\s+= (.*)$")
_RESUMED = re.compile(r"<\.\.\. (\w+) resumed>(.*)\)\s+= (.*)$")
_UNFINISHED = " <unfinished ...>"


@dataclass(frozen=True)
class Call:
    """One system call. Its place in the trace is where it *returned*, except a
    call still unfinished when others ran, which appears twice: where it started
    (``result`` None) and where it returned."""

    tid: int
    name: str
    args: str  # as strace prints them: 8</path/of/fd>, "string"..., flags
    result: str | None

    @property
    def succeeded(self) -> bool:
        return self.result is not None and self.result.split(" ", 1)[0] == "0"


def parse(text: str) -> list[Call]:
    """The calls of an ``strace -f`` output, in file order (see :class:`Call`)."""
    calls: list[Call] = []
    started: dict[int, Call] = {}
    for line in text.splitlines():
        tid_text, _, rest = line.partition(" ")
        if not tid_text.isdigit():
            continue
        tid, rest = int(tid_text), rest.lstrip()
        if rest.endswith(_UNFINISHED):
            name, _, args = rest.removesuffix(_UNFINISHED).partition("(")
            started[tid] = Call(tid, name, args, None)
            calls.append(started[tid])
        elif match := _RESUMED.match(rest):
            start = started.pop(tid, Call(tid, match[1], "", None))
            calls.append(Call(tid, match[1], start.args + match[2], match[3]))
        elif match := _COMPLETE.match(rest):
            calls.append(Call(tid, match[1], match[2], match[3]))
        # Anything else is a signal or an exit: "--- SIGCHLD ...", "+++ exited ...".
    return calls


@contextlib.asynccontextmanager
async def traced(pid: int, out: Path, syscalls: Sequence[str]) -> AsyncIterator[list[Call]]:
    """Trace ``syscalls`` of every thread of ``pid`` while the block runs."""
    only = "trace=" + ",".join(syscalls)
    proc = await asyncio.create_subprocess_exec(
        *[STRACE, "-f", "-y", "-s", "32", "-e", only, "-o", str(out), "-p", str(pid)],
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    assert proc.stderr is not None
    calls: list[Call] = []
    try:
        # "strace: Process N attached with K threads": from here on, every call counts.
        async with asyncio.timeout(ATTACH_TIMEOUT_S):
            line = (await proc.stderr.readline()).decode(errors="replace")
        assert "attached" in line, f"strace did not attach to {pid}: {line!r}"
        yield calls
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGINT)  # detach, leaving the process running
        async with asyncio.timeout(ATTACH_TIMEOUT_S):
            await proc.wait()
    calls.extend(parse(await asyncio.to_thread(out.read_text)))
