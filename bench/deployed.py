"""toko-api installed the way the Debian package installs it, for scenarios (c) and (g).

The package (debian/rules) makes a venv with the system's ``python3``,
installs the hash-locked requirements into it and then toko from a wheel.
The developers' venv differs in two ways: its interpreter is whichever
``python3`` comes first on PATH (a locally built one, here, compiled
without the profile-guided and link-time optimisation of Debian's), and toko
is an editable install, whose import hook every import passes through.
Start-up and memory (c) feel both, CPU a request (g) the first. So those
scenarios measure a venv made the package's way, from the working tree, and
hold that one to the targets.

The venv is kept in ``build/`` and remade when the locked requirements or
the system's python3 change; toko itself is reinstalled on every run.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import tempfile
from pathlib import Path

from bench.toko import TokoCommand

SYSTEM_PYTHON = Path("/usr/bin/python3")
LOCKS = ("requirements/build.txt", "requirements/runtime.txt")
# What building toko's wheel reads; copied out, so that setuptools' build/
# folder never holds a module the tree no longer has.
SOURCES = ("pyproject.toml", "README.md", "LICENSE", "service", "jobs")


def _stamp(repo: Path) -> str:
    digest = hashlib.sha256(SYSTEM_PYTHON.resolve().as_posix().encode())
    for lock in LOCKS:
        digest.update((repo / lock).read_bytes())
    return digest.hexdigest()


def _pip(venv: Path, *args: str) -> None:
    cmd = [str(venv / "bin" / "pip"), "--disable-pip-version-check", "--no-input", "-q"]
    subprocess.run([*cmd, *args], check=True)


def deployed_toko(repo: Path, venv: Path) -> TokoCommand | None:
    """toko-api of a package-style venv at ``venv`` holding ``repo``'s working
    tree; None where there is no system python3 to make one with."""
    if not SYSTEM_PYTHON.exists():
        return None
    stamp = venv / ".locked-requirements"
    if not stamp.exists() or stamp.read_text() != _stamp(repo):
        shutil.rmtree(venv, ignore_errors=True)
        subprocess.run([str(SYSTEM_PYTHON), "-m", "venv", str(venv)], check=True)
        # As debian/rules: the build tools, then the runtime, all hash-checked;
        # systemd-python builds from its sdist with those tools.
        _pip(venv, "install", "--no-deps", "--require-hashes", "-r", str(repo / LOCKS[0]))
        _pip(
            venv,
            "install",
            "--no-deps",
            "--require-hashes",
            "--no-build-isolation",
            "-r",
            str(repo / LOCKS[1]),
        )
        stamp.write_text(_stamp(repo))
    with tempfile.TemporaryDirectory(prefix="toko-bench-source-") as tmp:
        for name in SOURCES:
            src, dst = repo / name, Path(tmp) / name
            if src.is_dir():
                shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                shutil.copy2(src, dst)
        _pip(venv, "install", "--no-deps", "--no-build-isolation", "--force-reinstall", tmp)
    version = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import platform; print(platform.python_version())"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    return TokoCommand(
        [str(venv / "bin" / "toko-api")],
        revision=f"working tree, package-style (python {version})",
        python=str(venv / "bin" / "python"),
    )
