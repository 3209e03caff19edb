"""``toko-api --check-config --env-file FILE``: the settings as toko-api.service
would give them, checked before a restart instead of after it.

The unit's environment is FILE read as ``EnvironmentFile=`` reads it, its
``StateDirectory=`` and its credentials: ``LoadCredential=NAME:/etc/toko/NAME``
copies each file into ``$CREDENTIALS_DIRECTORY``, so pointing that variable at
the folder of those files (``--credentials-dir``) makes start-up's own code
read them (service.secret_files), with start-up's own messages.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from service.env_file import EnvFileError, cli_environment
from service.settings_parsers import ConfigError
from service.settings_spec import VARIABLES

# Where the credentials' files are, as toko-api.service and the README's
# drop-ins map them (LoadCredential=NAME:/etc/toko/NAME).
DEFAULT_CREDENTIALS_DIR = Path("/etc/toko")
# The credentials toko-api.service itself loads (tests hold this to the unit):
# systemd does not start the service without their files (243/CREDENTIALS).
UNIT_CREDENTIALS = ("api-token",)
# Every credential toko-api reads; the others come with an admin's drop-in.
API_CREDENTIALS = tuple(
    v.credential for v in VARIABLES if v.credential is not None and "toko-api" in v.programs
)


@dataclass(frozen=True)
class UnitEnvironment:
    environ: dict[str, str]
    env_file: str
    credentials_dir: Path
    # The credentials found there, in the spec's order.
    credentials: tuple[str, ...]

    def checked(self) -> str:
        """What a valid check says it checked."""
        found = ", ".join(self.credentials)
        return f"{self.env_file}, credentials from {self.credentials_dir} ({found})"


def unit_environment(
    environ: Mapping[str, str], env_file: str, credentials_dir: str | None
) -> UnitEnvironment:
    """What toko-api.service hands toko-api, from ``env_file`` and ``credentials_dir``.

    The shell's own TOKO_ variables are left out: the service does not get
    them, and one of them must not hide a bad line of the file.
    """
    folder = Path(credentials_dir) if credentials_dir else DEFAULT_CREDENTIALS_DIR
    if not os.access(env_file, os.R_OK) and os.path.exists(env_file):
        # cli_environment's hint (sudo -u toko) is toko-queue's: this check
        # reads root's credentials too.
        raise ConfigError(f"cannot read {env_file}: Permission denied ({_AS_ROOT})")
    try:
        # With STATE_DIRECTORY as StateDirectory= sets it, unless a line of the file does.
        from_file = cli_environment({}, env_file)
    except EnvFileError as exc:
        raise ConfigError(str(exc)) from None
    base = {
        name: value
        for name, value in environ.items()
        if not name.startswith("TOKO_") and name not in ("CREDENTIALS_DIRECTORY", "STATE_DIRECTORY")
    }
    credentials = _check_credentials(folder)
    given = {**base, **from_file, "CREDENTIALS_DIRECTORY": str(folder)}
    return UnitEnvironment(given, env_file, folder, credentials)


_AS_ROOT = "run the check as root, as systemd reads it: sudo toko-api --check-config ..."


def _check_credentials(folder: Path) -> tuple[str, ...]:
    """The credentials present in ``folder``; refused: one the unit needs and
    does not find, one that is no file or that every user may read."""
    found = []
    for name in API_CREDENTIALS:
        path = folder / name
        try:
            status = path.stat()
        except FileNotFoundError:
            if name in UNIT_CREDENTIALS:
                raise ConfigError(
                    f"credential {name}: no file {path}; toko-api.service loads it "
                    f"(LoadCredential={name}:{DEFAULT_CREDENTIALS_DIR / name}) and does not "
                    "start without it"
                ) from None
            continue
        except OSError as exc:
            raise ConfigError(f"credential {name}: cannot read {path}: {exc.strerror}") from None
        if not stat.S_ISREG(status.st_mode):
            raise ConfigError(f"credential {name}: {path} is not a file")
        if status.st_mode & (stat.S_IROTH | stat.S_IWOTH):
            mode = stat.S_IMODE(status.st_mode)
            raise ConfigError(
                f"credential {name}: every user may read or change {path} (mode {mode:04o}); "
                f"chmod 600 {path}"
            )
        if not os.access(path, os.R_OK):
            raise ConfigError(
                f"credential {name}: cannot read {path}: Permission denied ({_AS_ROOT})"
            )
        found.append(name)
    return tuple(found)
