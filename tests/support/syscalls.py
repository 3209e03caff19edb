"""The system calls of a running process, recorded with strace.

For contracts that are an order of system calls: "the commit is synced to disk
before the 201 goes out" is what makes a power cut harmless, and no test can
cut the power, but a trace shows the order. Usage::

    async with traced(svc.pid, tmp_path / "trace", ["fdatasync", "sendto"]) as calls:
        ...make the process do something...
    # calls now holds every traced call, in the order they happened

    run = await trace_command(["toko-backup"], tmp_path / "trace", ["fsync"], env)

``traced`` attaches to every thread of a running process and detaches
afterwards; the process goes on as before. Calls made in the first moment
after it attaches may be missing (strace seizes the threads, then stops each
in turn), so a check must not hang on the very first call. ``trace_command``
runs a command under strace to its end. ``-y`` names each descriptor's file.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
from collections.abc import AsyncIterator, Callable, Collection, Mapping, Sequence
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


SYNCS = ("fdatasync", "fsync")


def where(calls: Sequence[Call], matches: Callable[[Call], bool]) -> list[int]:
    """The places in ``calls`` of those that match."""
    return [index for index, call in enumerate(calls) if matches(call)]


def synced(calls: Sequence[Call], path: Path) -> list[int]:
    """Where a sync of ``path`` (a file or a folder) returned successfully."""
    return where(calls, lambda c: c.name in SYNCS and c.args.endswith(f"<{path}>") and c.succeeded)


def numbered(calls: Sequence[Call], only: Collection[int] | None = None) -> str:
    """The calls (or those at ``only``), one per line with their place: for failures."""
    places = sorted(only) if only is not None else range(len(calls))
    return "\n".join(f"{i:3d} {calls[i]}" for i in places)


def _strace(out: Path, syscalls: Sequence[str]) -> list[str]:
    # -s 32: the first 32 bytes of a buffer, enough for "POST /produk" or a
    # status line; file names are always printed whole.
    return [STRACE, "-f", "-y", "-s", "32", "-e", "trace=" + ",".join(syscalls), "-o", str(out)]


@contextlib.asynccontextmanager
async def traced(pid: int, out: Path, syscalls: Sequence[str]) -> AsyncIterator[list[Call]]:
    """Trace ``syscalls`` of every thread of ``pid`` while the block runs."""
    proc = await asyncio.create_subprocess_exec(
        *_strace(out, syscalls),
        *["-p", str(pid)],
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    assert proc.stderr is not None
    calls: list[Call] = []
    try:
        # "strace: Process N attached with K threads": traced from about here on.
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


@dataclass(frozen=True)
class TracedRun:
    returncode: int
    output: str  # stdout and stderr together
    calls: list[Call]


async def trace_command(
    argv: Sequence[str],
    out: Path,
    syscalls: Sequence[str],
    env: Mapping[str, str],
    timeout: float = 60.0,  # noqa: ASYNC109
) -> TracedRun:
    """Run ``argv`` under strace, with exactly ``env``, to its end."""
    proc = await asyncio.create_subprocess_exec(
        *_strace(out, syscalls),
        *["--", *argv],
        env=dict(env),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    async with asyncio.timeout(timeout):
        output, _ = await proc.communicate()
    assert proc.returncode is not None
    calls = parse(await asyncio.to_thread(out.read_text))
    return TracedRun(proc.returncode, output.decode(errors="replace"), calls)
