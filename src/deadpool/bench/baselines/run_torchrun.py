"""Launches the torchrun + DCP baseline (torchrun_dcp.py) on the example GPT and returns its events."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from deadpool.bench.baselines.bounded import FaultWatch, wait_bounded
from deadpool.events import read_events

SCRIPT = Path(__file__).resolve().with_name("torchrun_dcp.py")


def _kill_stray_workers(events: list[dict[str, Any]]) -> None:
    """SIGKILLs any worker of this run still alive after torchrun is gone (normally none: torchrun reaps
    them), found by the pids of their process_start events and checked by command line against reuse."""
    for pid in {e["pid"] for e in events if e.get("event") == "process_start" and "pid" in e}:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if str(SCRIPT).encode() in cmdline:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def torchrun_command(out_dir: Path, *, workers: int, steps: int, ckpt_every: int, kill: tuple[int, int] | None,
                     hang: tuple[int, int] | None = None, script_args: tuple[str, ...] = (), max_restarts: int = 1,
                     async_save: bool = False) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(workers),
           "--max-restarts", str(max_restarts), str(SCRIPT), "--steps", str(steps), "--ckpt-every", str(ckpt_every),
           "--ckpt-dir", str(out_dir / "ckpt"), "--events", str(out_dir / "events.jsonl"), *script_args]
    if kill is not None:
        cmd += ["--kill-rank", str(kill[0]), "--kill-step", str(kill[1])]
    if hang is not None:
        cmd += ["--hang-rank", str(hang[0]), "--hang-step", str(hang[1])]
    if async_save:
        cmd.append("--async-save")
    return cmd


def run_torchrun_dcp(out_dir: Path, *, workers: int, steps: int, ckpt_every: int, kill: tuple[int, int] | None,
                     hang: tuple[int, int] | None = None, script_args: tuple[str, ...] = (),
                     timeout_s: float = 300, hang_wait_s: float | None = None,
                     share_rdzv_store: bool = False, async_save: bool = False,
                     max_restarts: int = 1) -> tuple[int, list[dict]]:
    """Runs the example GPT under torchrun (--standalone, --max-restarts max_restarts) with DCP checkpoints
    every `ckpt_every` steps (0: none), synchronous or, with async_save, dcp.async_save; `kill=(rank, step)`
    makes that rank SIGKILL itself in the backward pass of that step on the first attempt, `hang=(rank, step)`
    SIGSTOP itself there instead (torchrun sees a live worker: see torchrun_dcp.py). Returns torchrun's exit
    code, or, when it was killed with all its workers, bounded.TIMEOUT_EXIT if it ran past timeout_s and
    bounded.STALLED_EXIT if it completed no step within hang_wait_s (None: no such bound) of the fault;
    and the events of every rank and attempt, in file order.

    Writes out_dir/events.jsonl, out_dir/ckpt/ (both cleared first: stale checkpoints would be resumed
    from) and out_dir/torchrun.log (torchrun's and the workers' stdout and stderr).

    share_rdzv_store=False sets TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: with torch 2.13's default (the
    workers reuse the agent's rendezvous TCPStore) a restart on gloo does not recover, as the restarted
    workers read the previous attempt's addresses from the shared store. True keeps the default, to show it.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    events_path = out_dir / "events.jsonl"
    events_path.unlink(missing_ok=True)
    shutil.rmtree(out_dir / "ckpt", ignore_errors=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    if share_rdzv_store:
        env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    else:
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    cmd = torchrun_command(out_dir, workers=workers, steps=steps, ckpt_every=ckpt_every, kill=kill, hang=hang,
                           script_args=script_args, max_restarts=max_restarts, async_save=async_save)
    with open(out_dir / "torchrun.log", "wb") as log:
        log.write((" ".join(cmd) + "\n").encode())
        log.flush()
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        code = wait_bounded(proc, FaultWatch(events_path, hang_wait_s), timeout_s, log)
    events = list(read_events(events_path)) if events_path.is_file() else []
    _kill_stray_workers(events)
    return code, events
