"""`deadpool run --resume DIR|auto`: which checkpoint a job starts from, refused in one line if it does not fit;
and the launcher's SIGTERM, which asks the coordinator to persist the newest commit before the job stops."""

from __future__ import annotations

import json
import shlex
import signal
import sys
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from deadpool.config import JobConfig
from deadpool.errors import ConfigError


def resolve(config: JobConfig, skipped: Callable[[str, str], None]) -> tuple[Path, int]:
    """The checkpoint `--resume` names: one checkpoint directory, or the newest intact one under a persist dir
    (`auto`: --persist-dir). Damaged ones are skipped, each reported through `skipped(path, reason)`."""
    from deadpool.disk import compatible, newest, verify  # torch.distributed.checkpoint: only when resuming

    spec = config.resume
    if spec == "auto" and not config.persist_dir:
        raise ConfigError("--resume auto resumes from --persist-dir: give --persist-dir DIR (or --resume DIR)")
    root = Path(config.persist_dir if spec == "auto" else spec).resolve()
    if not root.is_dir():
        raise ConfigError(f"--resume {spec}: {root} is not a directory")
    if (root / "manifest.json").exists():  # one checkpoint, named
        reason = verify(root)
        if reason is not None:
            raise ConfigError(f"cannot resume from {root}: {reason}")
        path, manifest = root, json.loads((root / "manifest.json").read_text())
    else:
        found = newest(root, on_skip=skipped)
        if found is None:
            raise ConfigError(f"--resume {spec}: no complete checkpoint in {root} (checkpoints appear there once a job "
                              "with --persist-dir has committed and written one)")
        path, manifest = found
    misfit = compatible(manifest, config.identity())
    if misfit is not None:
        raise ConfigError(f"cannot resume from {path}: {misfit}")
    return path, int(manifest["step"])


def resume_command(argv: list[str]) -> str:
    """The command that goes on from where a stopped `deadpool run` left: the same one, with --resume auto."""
    rest, skip = [], False
    for arg in argv[1:]:  # argv[0] is "run"; an earlier --resume is replaced
        if skip:
            skip = False
        elif arg == "--resume":
            skip = True
        elif not arg.startswith("--resume="):
            rest.append(arg)
    return shlex.join(["deadpool", "run", "--resume", "auto", *rest])


@contextmanager
def on_sigterm(stop: Callable[[], None]) -> Iterator[None]:
    """While the job runs, a SIGTERM calls `stop` (persist, then exit 143); a second one exits at once. Only the
    main thread can handle signals: a launch from another thread (tests) keeps the handler it has."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    asked = False

    def handler(signum: int, _frame: object) -> None:
        nonlocal asked
        if asked:
            raise SystemExit(128 + signum)
        asked = True
        print("[deadpool] SIGTERM: persisting the newest commit before stopping (again to stop at once)",
              file=sys.stderr, flush=True)
        stop()

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
