"""Secrets from files: the one a ``TOKO_*_FILE`` variable names, else a systemd
credential (``$CREDENTIALS_DIRECTORY/<name>``). Never from the environment.

Whatever goes wrong reading one ends as a single line that names where it
looked, never what the file holds.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from service.settings_parsers import ConfigError, shown

# Far more than any password or token; /dev/zero or /dev/urandom named by
# mistake was read until memory ran out, start-up hanging meanwhile.
SECRET_MAX_BYTES = 64 * 1024


def read_secret(environ: Mapping[str, str], file_variable: str, credential: str) -> str | None:
    """A secret from the file ``file_variable`` names, else from a systemd credential."""
    candidates: list[tuple[str, Path]] = []
    if environ.get(file_variable):
        candidates.append((file_variable, Path(environ[file_variable])))
    if environ.get("CREDENTIALS_DIRECTORY"):
        path = Path(environ["CREDENTIALS_DIRECTORY"]) / credential
        if _may_exist(path):
            candidates.append((f"CREDENTIALS_DIRECTORY/{credential}", path))
    for name, path in candidates:
        try:
            return _read(path).decode("utf-8").strip()
        except OSError as exc:
            raise ConfigError(f"{name}: cannot read {_path_shown(path)}: {exc.strerror}") from None
        except UnicodeDecodeError as exc:
            # Say where, not what: the bytes are (part of) a secret.
            raise ConfigError(
                f"{name}: {_path_shown(path)} is not UTF-8 text (byte {exc.start}); "
                "save the secret as UTF-8"
            ) from None
        except _SecretTooLong:
            raise ConfigError(
                f"{name}: {_path_shown(path)} is longer than a secret can be "
                f"({SECRET_MAX_BYTES} bytes); name the file that holds the secret"
            ) from None
        except ValueError:
            # A NUL in the path: only an env file (toko-queue --env-file) can carry one.
            raise ConfigError(f"{name}: {_path_shown(path)} is not a file path") from None
    return None


class _SecretTooLong(Exception):
    pass


def _read(path: Path) -> bytes:
    # O_NONBLOCK for the open only: opening a FIFO that no process writes to
    # waited for a writer for ever, start-up hanging without a word. Opened
    # so, it reads as empty and is refused as such; a pipe with a writer (a
    # shell's <(...)) is then read as usual.
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    os.set_blocking(fd, True)
    with open(fd, "rb") as file:
        data = file.read(SECRET_MAX_BYTES + 1)
    if len(data) > SECRET_MAX_BYTES:
        raise _SecretTooLong
    return data


def _may_exist(path: Path) -> bool:
    """``path.exists()``, except that a path no file can have (too long, say) is
    taken as present, so that reading it says what is wrong, not a traceback."""
    try:
        return path.exists()
    except OSError:
        return True


def _path_shown(path: Path) -> str:
    """``path`` as it is when plain, quoted and cut short when it holds a line
    break or other control character or is long, so the message stays one line."""
    text = str(path)
    if text.isprintable() and len(text) <= 100:
        return text
    return shown(text)
