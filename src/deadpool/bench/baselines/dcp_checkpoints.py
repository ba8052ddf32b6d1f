"""The torchrun + DCP baseline's checkpoints (torchrun_dcp.py): written atomically, synchronously or in the
background, and loaded on restart.

Checkpoint layout, under --ckpt-dir:
  step-{k}/                DCP checkpoint of {"model", "optim"} (get_state_dict helpers) plus
  step-{k}/rank{r}.pt      rank r's own state: {"step", "world_size", "sampler", "rng": python/numpy/torch}
A checkpoint is written into `.tmp-step-{k}` and renamed to `step-{k}` by rank 0 once every rank's files
and the DCP metadata are written (dcp.save ends collectively, then a barrier), so a directory named
`step-{k}` is always complete; a kill during a save leaves only a `.tmp-*` directory, which is never
loaded and is deleted at the next start. An async save is renamed by rank 0 only once its save has
finished on every rank (see `AsyncCheckpointer`).
"""

from __future__ import annotations

import os
import random
import shutil
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from deadpool.examples.gpt.data import BatchSampler

SAVE_TIMEOUT_S = 600.0  # the longest a rank waits for a background save to finish


def rng_state() -> dict[str, Any]:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def _rank_file(directory: Path, rank: int) -> Path:
    return directory / f"rank{rank}.pt"


def newest_checkpoint(ckpt_dir: Path, world_size: int) -> tuple[int, Path] | None:
    """The newest complete checkpoint: a renamed `step-{k}` directory with DCP metadata and every rank's file."""
    found = []
    for d in ckpt_dir.glob("step-*"):
        try:
            step = int(d.name.removeprefix("step-"))
        except ValueError:
            continue
        if (d / ".metadata").is_file() and all(_rank_file(d, r).is_file() for r in range(world_size)):
            found.append((step, d))
    return max(found) if found else None


def _begin_checkpoint(ckpt_dir: Path, step: int, sampler: BatchSampler, rank: int, world_size: int) -> Path:
    """Creates `.tmp-step-{step}` and writes this rank's own file into it; returns the directory."""
    tmp = ckpt_dir / f".tmp-step-{step}"
    tmp.mkdir(parents=True, exist_ok=True)  # every rank, before anyone writes: no race on creation
    torch.save({"step": step, "world_size": world_size, "sampler": sampler.state_dict(), "rng": rng_state()},
               _rank_file(tmp, rank))
    return tmp


def _publish(ckpt_dir: Path, step: int) -> None:
    """Rank 0, once every rank's files and the DCP metadata are written: `.tmp-step-{k}` -> `step-{k}`."""
    final = ckpt_dir / f"step-{step}"
    if final.exists():  # only possible if an older world size left one; never a newer state than ours
        shutil.rmtree(final)
    os.rename(ckpt_dir / f".tmp-step-{step}", final)  # atomic: `step-{k}` appears complete or not at all


def save_checkpoint(ckpt_dir: Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    sampler: BatchSampler, rank: int, world_size: int) -> None:
    """Synchronous and atomic: everything goes to `.tmp-step-{step}`, renamed by rank 0 when all is written."""
    tmp = _begin_checkpoint(ckpt_dir, step, sampler, rank, world_size)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))  # collective; rank 0 writes .metadata
    dist.barrier()  # every rank's rank{r}.pt and shards are on disk
    if rank == 0:
        _publish(ckpt_dir, step)


class AsyncCheckpointer:
    """dcp.async_save under the same atomic-rename rule as `save_checkpoint`; one save in flight at a time.

    In the step: wait for the previous save, write the rank file, stage a copy of model and optimizer
    state (DCP's default stager copies every tensor into fresh CPU storage, so training may go on
    changing the originals), and hand the copy to DCP's background thread, which writes it.

    The background save runs its collectives (plan gather/scatter, the final all-reduce) on a gloo group
    of its own: on the default group they would be issued from two threads at once, interleaved with
    DDP's all-reduces in an order that differs between ranks.

    The rename: DCP's save ends in an all-reduce whose coordinator, rank 0, writes `.metadata` only after
    every rank has reported its shards written, and every rank wrote its rank file before it entered the
    save. So once rank 0's save future is done (successfully), the whole checkpoint is on disk, and only
    then does rank 0 rename it: at the first step end that finds it done (`poll`), or when the next save
    or the exit waits for it (`wait`, bounded by SAVE_TIMEOUT_S). A save that failed raises there.
    """

    def __init__(self, ckpt_dir: Path, rank: int, world_size: int, emit: Callable[..., None]) -> None:
        self.ckpt_dir, self.rank, self.world_size, self.emit = ckpt_dir, rank, world_size, emit
        self.group = dist.new_group(backend="gloo")  # collective: every rank creates it, in the same order
        self.pending: tuple[int, Any] | None = None  # (step, dcp.async_save's future)

    def start(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
              sampler: BatchSampler) -> float:
        """Starts checkpoint `step` in the background; returns the seconds spent waiting for the previous one."""
        waited = self.wait(SAVE_TIMEOUT_S)
        tmp = _begin_checkpoint(self.ckpt_dir, step, sampler, self.rank, self.world_size)
        model_sd, optim_sd = get_state_dict(model, optimizer)
        future: Any = dcp.async_save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp),
                                process_group=self.group)
        future.add_done_callback(lambda f: self.emit("checkpoint_written", step=step,
                                                            ok=f.exception() is None))
        self.pending = (step, future)
        return waited

    def poll(self) -> None:
        """Completes the pending save if it is done, without waiting."""
        if self.pending is not None and self.pending[1].done():
            self._complete()

    def wait(self, timeout_s: float) -> float:
        """Waits for the pending save (at most timeout_s, else TimeoutError) and completes it; returns the
        seconds waited."""
        start = time.monotonic()
        if self.pending is not None:
            self.pending[1].result(timeout=timeout_s)
            self._complete()
        return time.monotonic() - start

    def _complete(self) -> None:
        assert self.pending is not None
        step, future = self.pending
        self.pending = None
        future.result()  # a failed save raises here, and is never renamed
        if self.rank == 0:
            _publish(self.ckpt_dir, step)
            self.emit("checkpoint_renamed", step=step)


def load_checkpoint(directory: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    sampler: BatchSampler, rank: int, world_size: int) -> tuple[int, dict[str, Any]]:
    """Restores model, optimizer and data position; returns the step and this rank's RNG states, which the
    caller sets last (after the DDP warm-up, which draws random numbers)."""
    own = torch.load(_rank_file(directory, rank), weights_only=False)  # our own file: numpy RNG state inside
    if own["world_size"] != world_size:
        raise RuntimeError(f"{directory} was written by {own['world_size']} ranks, this job has {world_size}")
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(directory))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    sampler.load_state_dict(own["sampler"])
    return int(own["step"]), own["rng"]
