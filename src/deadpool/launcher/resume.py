"""`--persist-dir` and `--resume DIR|auto` before a job starts: a directory it can write, the checkpoint it starts
from (refused in one line if it does not fit), checkpoints of an earlier run never mixed with its own; and the
launcher's SIGTERM, which asks the coordinator to persist the newest commit before the job stops."""

from __future__ import annotations

import itertools
import json
import shlex
import shutil
import signal
import sys
import tempfile
import threading
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Callable, Iterator, TextIO

from deadpool.config import JobConfig
from deadpool.errors import ConfigError


def prepare_disk(config: JobConfig, echo: TextIO | None) -> tuple[JobConfig, list[tuple[str, str]],
                                                                    list[tuple[Path, Path]]]:
    """Before a job starts: the checkpoint it resumes from (config.resume becomes its path; "" if `auto` found
    nothing ever written), or the check that a job starting afresh finds no earlier run's checkpoints. Returns
    the config, the damaged checkpoints passed over (path, why) and the newer ones set aside (old, new path),
    each said here on the console, for the caller to log as events."""
    skipped: list[tuple[str, str]] = []
    if config.persist_dir:
        writable(Path(config.persist_dir))
    if not config.resume:
        if config.persist_dir:
            refuse_used(config)
        return config, skipped, []
    found = resolve(config, lambda p, why: skipped.append((str(p), why)))
    step = found[1] if found is not None else -1
    moved = set_aside_newer(config, step)
    for p, why in skipped:
        print(f"[deadpool] skipped checkpoint {p}: {why}", file=sys.stderr, flush=True)
    for old, aside in moved:
        print(f"[deadpool] set aside checkpoint {old} as {aside.name}: newer than step {step}, which this run "
              "resumes from and writes again", file=sys.stderr, flush=True)
    if found is None:
        if echo is not None:
            print(f"[deadpool] --resume auto: no checkpoint in {config.persist_dir} yet, the job starts from the "
                  "beginning", file=echo, flush=True)
        return replace(config, resume=""), skipped, moved
    path, step = found
    if echo is not None:
        print(f"[deadpool] resuming from {path} (step {step})", file=echo, flush=True)
    note = reshard_note(json.loads((path / "manifest.json").read_text()), config)
    if note is not None:
        print(f"[deadpool] note: {note}", file=sys.stderr, flush=True)
    return replace(config, resume=str(path)), skipped, moved


def resolve(config: JobConfig, skipped: Callable[[Path, str], None]) -> tuple[Path, int] | None:
    """The checkpoint `--resume` names: one checkpoint directory, or the newest intact one under a persist dir
    (`auto`: --persist-dir), after completing those whose parts a stopped job left (its coordinator died: the
    ranks wrote their parts as they exited). Damaged ones are skipped, each reported through `skipped`. None:
    `auto` found no checkpoint ever completed there (the job's first run: one command starts a job and, requeued
    by a scheduler, goes on)."""
    from deadpool.disk import finalize, listing, newest, verify  # torch.distributed.checkpoint: only to resume

    spec = config.resume
    if spec == "auto" and not config.persist_dir:
        raise ConfigError("--resume auto resumes from --persist-dir: give --persist-dir DIR (or --resume DIR)")
    root = Path(config.persist_dir if spec == "auto" else spec).resolve()
    if spec == "auto" and not root.exists():
        return None
    if not root.is_dir():
        raise ConfigError(f"--resume {spec}: {root} is not a directory")
    if (root / "manifest.json").exists():  # one checkpoint, named
        reason = verify(root)
        if reason is not None:
            raise ConfigError(f"cannot resume from {root}: {reason}")
        path, manifest = root, json.loads((root / "manifest.json").read_text())
    else:
        for step, _ in listing(root, ".tmp"):  # newest first: the first that is complete is the one to resume
            if finalize(root, step, config.workers, None, config.keep) is not None:
                break
        passed: list[str] = []

        def skip(path: Path, why: str) -> None:
            passed.append(f"{path.name}: {why}")
            skipped(path, why)

        found = newest(root, on_skip=skip)
        if found is None and spec == "auto" and not passed:
            return None
        if found is None:
            why = "; ".join(passed) or ("checkpoints appear there once a job with --persist-dir has committed and "
                                        "written one")
            raise ConfigError(f"--resume {spec}: no intact checkpoint in {root} ({why})")
        path, manifest = found
    misfit = misfits(manifest, config)
    if misfit is not None:
        raise ConfigError(f"cannot resume from {path}: {misfit}")
    return path, int(manifest["step"])


def misfits(manifest: dict, config: JobConfig) -> str | None:
    """What the launcher can tell of a checkpoint that does not fit the job (the ranks check the shapes when they
    load it): the config it was written under."""
    if manifest["identity"]["config_hash"] != config.config_hash():
        return "it was written by another script or --seed"
    return None


def reshard_note(manifest: dict, config: JobConfig) -> str | None:
    """What a job resumed on another number of workers should know (None: the same number)."""
    saved = manifest["world_size"]
    if saved == config.workers:
        return None
    shared = ("every rank loads the shared parameters and optimizer state"
              if manifest["identity"]["parallelism"] == "replicated" else
              f"every rank loads its shard of the parameters and optimizer state, cut anew for {config.workers} "
              "workers from the saved shards")
    return (f"the checkpoint was written by {saved} workers, this job has {config.workers}: {shared}, and rank r "
            f"the own state (RNGs, data position) of rank r mod {saved}; the run goes on, but not bit for bit as "
            f"the {saved}-worker job would have")


def writable(root: Path) -> None:
    """Made if missing and written to once, before any process starts: a directory the ranks cannot write would
    otherwise fail every checkpoint of the run, in events only."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=root):
            pass
    except OSError as error:
        raise ConfigError(f"cannot write checkpoints to --persist-dir {root} ({error.strerror or error}): give a "
                          "directory this job can write") from None


def refuse_used(config: JobConfig) -> None:
    """A job that does not resume starts with an empty (or new) --persist-dir: checkpoints there are an earlier
    run's, and this run's of the same steps would count as written, or be pruned at once as the older ones. (By
    name alone: deadpool.disk would import torch's checkpointing into the launcher, seconds.)"""
    root = Path(config.persist_dir)
    found = sorted(p.name for p in root.iterdir() if p.name.startswith(("step-", ".tmp-"))) if root.is_dir() else []
    if found:
        raise ConfigError(f"--persist-dir {config.persist_dir} already holds checkpoints of an earlier run "
                          f"({', '.join(found)}): go on from them with --resume auto, or give an empty directory")


def set_aside_newer(config: JobConfig, step: int) -> list[tuple[Path, Path]]:
    """Checkpoints newer than the one a job resumes from were left by the job it replaces, damaged (`auto` passed
    over them) or superseded (an older one was named): this run writes those steps again, and one found in place
    would count as written. Their parts are deleted; whole ones are renamed `step-N.set-aside` (kept for a look,
    never read or pruned). Returns (old path, new path) of each renamed one."""
    from deadpool.disk import listing

    moved: list[tuple[Path, Path]] = []
    if not config.persist_dir or not Path(config.persist_dir).is_dir():
        return moved
    for newer, path in listing(config.persist_dir, ".tmp"):
        if newer > step:
            shutil.rmtree(path, ignore_errors=True)
    for newer, path in listing(config.persist_dir, "step"):
        if newer > step:
            names = (path.with_name(f"{path.name}.set-aside{'' if k == 1 else f'-{k}'}") for k in itertools.count(1))
            aside = next(name for name in names if not name.exists())
            path.rename(aside)
            moved.append((path, aside))
    return moved


def resume_command(argv: list[str]) -> str:
    """The command that goes on from where a stopped `deadpool run` (or `deadpool coordinator`) left: the same
    one, with --resume auto."""
    rest, skip = [], False
    for arg in argv[1:]:  # argv[0] is the command, "run" or "coordinator"; an earlier --resume is replaced
        if skip:
            skip = False
        elif arg == "--resume":
            skip = True
        elif not arg.startswith("--resume="):
            rest.append(arg)
    return shlex.join(["deadpool", argv[0], "--resume", "auto", *rest])


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
