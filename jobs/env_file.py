"""The installed service's environment for commands an admin runs by hand.

toko-api gets /etc/toko/toko.env from ``EnvironmentFile=`` and its state
directory from ``StateDirectory=toko``; a shell does not. ``toko-queue`` reads
the same file so it opens the same database as the running service.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

DEFAULT_ENV_FILE = Path("/etc/toko/toko.env")
# What StateDirectory=toko gives the units (see deploy/systemd/*.service).
INSTALLED_STATE_DIRECTORY = "/var/lib/toko"


class EnvFileError(ValueError):
    """The environment file cannot be read or parsed; the message says which line."""


def parse_env_file(text: str, source: str) -> dict[str, str]:
    """``KEY=value`` lines as systemd's EnvironmentFile= reads them (the subset toko uses)."""
    values: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        key, sep, value = line.partition("=")
        key = key.strip()
        if not sep or not key.replace("_", "").isalnum() or key[0].isdigit():
            raise EnvFileError(f"{source}:{number}: expected KEY=value, got {raw!r}")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        values[key] = value
    return values


def cli_environment(
    environ: Mapping[str, str], env_file: str | None, *, use_default: bool = True
) -> dict[str, str]:
    """``environ`` plus the env file's values (the caller's own variables win).

    Without ``env_file``, /etc/toko/toko.env is used when it exists and the
    caller did not name a database (``TOKO_DATABASE``) themselves; when it
    does not exist, the database is still the installed service's if
    /var/lib/toko exists.
    """
    path: Path | None = Path(env_file) if env_file else None
    if path is None and use_default and "TOKO_DATABASE" not in environ:
        if DEFAULT_ENV_FILE.exists():
            path = DEFAULT_ENV_FILE
        elif Path(INSTALLED_STATE_DIRECTORY).is_dir():
            # The units read the file only if it is there (EnvironmentFile=-);
            # toko-api then still keeps its database in StateDirectory=, not
            # ./var. A development machine has no such directory: ./var it is.
            return {"STATE_DIRECTORY": INSTALLED_STATE_DIRECTORY, **environ}
    if path is None:
        return dict(environ)
    try:
        data = path.read_bytes()
    except OSError as exc:
        hint = " (run as the service user: sudo -u toko ...)" if exc.errno == 13 else ""
        raise EnvFileError(f"cannot read {path}: {exc.strerror}{hint}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        # Where, not what: the bytes would not print, and the line may hold a secret.
        line = data.count(b"\n", 0, exc.start) + 1
        raise EnvFileError(
            f"{path}:{line}: not UTF-8 text (byte {exc.start} of the file); save it as UTF-8"
        ) from None
    merged = {**parse_env_file(text, str(path)), **environ}
    # The units' StateDirectory= is where the default database lives.
    merged.setdefault("STATE_DIRECTORY", INSTALLED_STATE_DIRECTORY)
    return merged
