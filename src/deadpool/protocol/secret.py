"""The job's secret: made once by the launcher, kept in files only their owner can read, never in a key or argv."""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

from deadpool.errors import ConfigError

ENV_SECRET = "DEADPOOL_SECRET"  # for agents started by hand on other machines, instead of --secret-file


def new_secret() -> bytes:
    return secrets.token_bytes(32)


def write_secret(path: Path, secret: bytes) -> Path:
    """Writes the secret (hex) into a new file of mode 0600, replacing any old one atomically."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(secret.hex())
    os.replace(tmp, path)
    return path


def read_secret(path: str | Path) -> bytes:
    """Reads a secret file, refusing one that others could read (the secret would be theirs too)."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
        text = path.read_text().strip()
    except OSError as error:
        raise ConfigError(f"cannot read the job's secret from {path}: {error.strerror}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(f"the secret file {path} is readable by others (mode {stat.S_IMODE(mode):o}): "
                          f"run `chmod 600 {path}` and try again")
    return _decode(text, str(path))


def find_secret(path: str | Path | None) -> bytes:
    """An agent's secret: from --secret-file, else from the environment; a clear error without either."""
    if path:
        return read_secret(path)
    if os.environ.get(ENV_SECRET):
        return _decode(os.environ[ENV_SECRET].strip(), f"${ENV_SECRET}")
    raise ConfigError(f"the coordinator accepts only processes that hold the job's secret: pass --secret-file "
                      f"RUN_DIR/secret (copied from the coordinator's run directory, mode 600) or set {ENV_SECRET}")


def _decode(text: str, where: str) -> bytes:
    try:
        secret = bytes.fromhex(text)
    except ValueError:
        raise ConfigError(f"{where} does not hold a DeadPool secret (hex digits expected)") from None
    if len(secret) < 16:
        raise ConfigError(f"{where} holds a secret of {len(secret)} bytes; at least 16 are needed")
    return secret
