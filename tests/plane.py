"""For tests of runtime parts without a launcher: a real control-plane store and the secret file to reach it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from deadpool.protocol.secret import new_secret, write_secret
from deadpool.protocol.store import StoreServer


@contextmanager
def control_plane(run_dir: Path) -> Iterator[tuple[StoreServer, dict[str, Any]]]:
    """A store on loopback and the JobConfig fields (port, secret file) that let `connect(config)` reach it."""
    secret = new_secret()
    server = StoreServer("127.0.0.1", 0, secret)
    try:
        yield server, {"store_port": server.port, "secret_file": str(write_secret(run_dir / "secret", secret))}
    finally:
        server.close()
