"""The example GPT trained the conventional way, as the baseline DeadPool's hot swap is compared with.

Plain DDP on gloo, launched by torchrun with `--max-restarts`; every `--ckpt-every` steps a
torch.distributed.checkpoint (DCP) save: synchronous (dcp.save), or with `--async-save` dcp.async_save
(see `AsyncCheckpointer`); `--ckpt-every 0` never checkpoints. When a worker dies, torchrun kills the
others and restarts all of them; they resume from the newest complete checkpoint and replay the steps
since. A worker that hangs instead (--hang-rank/--hang-step: it SIGSTOPs itself) is alive to torchrun,
which watches only exit codes: the others wait in their gradient all-reduce until gloo's timeout
(init_process_group's default, 30 minutes) and nothing restarts before then (observed with torch 2.13:
no step in the 60 s after the SIGSTOP, nothing in torchrun's log). The workload is DeadPool's example
(examples/gpt: same model, data, sampler, optimizer, seeds, arguments and defaults).

Checkpoint layout, under --ckpt-dir:
  step-{k}/                DCP checkpoint of {"model", "optim"} (get_state_dict helpers) plus
  step-{k}/rank{r}.pt      rank r's own state: {"step", "world_size", "sampler", "rng": python/numpy/torch}
A checkpoint is written into `.tmp-step-{k}` and renamed to `step-{k}` by rank 0 once every rank's files
and the DCP metadata are written (dcp.save ends collectively, then a barrier), so a directory named
`step-{k}` is always complete; a kill during a save leaves only a `.tmp-*` directory, which is never
loaded and is deleted at the next start. An async save is renamed by rank 0 only once its save has
finished on every rank (see `AsyncCheckpointer`).

With no checkpoint the job starts fresh (no step-0 checkpoint): the run is seeded, so starting fresh is
exactly the state a step-0 checkpoint would hold. A resumed job restores model, optimizer, data position
and RNG states, and does one throw-away forward/backward so DDP rebuilds the gradient buckets of the
uninterrupted run (see `rebuild_ddp_buckets`): the replay is then bit-identical to a run without failure.

Events (JSON lines appended to --events, one os.write each, O_APPEND; all carry "t" = time.monotonic(),
which is system-wide on Linux, plus "rank", "attempt" (TORCHELASTIC_RESTART_COUNT), "wall" and "pid"):
process_start (before joining the process group), resumed (from_step, load_s: DCP and per-rank load,
warmup_s: the bucket warm-up), step (step, loss, dur_s, samples: the batch's sample ids; t at the step's
end), checkpoint (step, mode, save_s; async: wait_s), fault_injected (kind: kill or hang), finished (step, state_sha256,
documented at `state_sha256` below). With --async-save also checkpoint_written (step; t when this rank's
background save finished; ok: without error) and, from rank 0, checkpoint_renamed (step; t after the
rename).

Step time: `step.dur_s` is the step's own work (batch, forward, backward, optimizer step, loss.item()),
timed the same way in every mode. A checkpoint is taken after the step's event, so its cost is in no
dur_s: `checkpoint.save_s` is the time it held the training thread (sync: the whole save and barrier;
async: waiting for the previous save, the rank file, staging a copy of the state and starting the
background save). The time per step a user sees is the time between consecutive steps' ends (the `t`
of their step events), which includes any checkpoint taken in between; `deadpool bench overhead`
measures it that way, for DeadPool too, whose step events are likewise written at the step's end.

Run: torchrun --standalone --nproc-per-node 4 --max-restarts 1 torchrun_dcp.py --ckpt-dir D --events F
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from deadpool.examples.gpt.data import BatchSampler, CharTokenizer, load_text, make_batch
from deadpool.examples.gpt.model import GPT, GPTConfig

ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
SAVE_TIMEOUT_S = 600.0  # the longest a rank waits for a background save to finish
FAULT_SIGNALS = {"kill": signal.SIGKILL, "hang": signal.SIGSTOP}  # what a worker does to itself per fault kind


def add_example_arguments(p: argparse.ArgumentParser) -> None:
    """The example's arguments (examples/gpt/train.py), same defaults: every baseline trains the same job."""
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--data", default=None, help="a UTF-8 text file (default: the Python docs' topics)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=256)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=1337)


def add_fault_arguments(p: argparse.ArgumentParser) -> None:
    """--kill-rank/--kill-step or --hang-rank/--hang-step: the one fault a run injects (first incarnation)."""
    for kind, does in (("kill", "SIGKILLs"), ("hang", "SIGSTOPs")):
        p.add_argument(f"--{kind}-rank", type=int, default=None, help=f"rank that {does} itself (first attempt only)")
        p.add_argument(f"--{kind}-step", type=int, default=None, help="step in whose backward pass it does so")


def planned_fault(p: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[str, int, int] | None:
    """The fault the arguments ask for, as (kind, rank, step), or None; a parser error for half a fault or two."""
    faults = []
    for kind in FAULT_SIGNALS:
        rank, step = getattr(args, f"{kind}_rank"), getattr(args, f"{kind}_step")
        if (rank is None) != (step is None):
            p.error(f"--{kind}-rank and --{kind}-step go together")
        if rank is not None:
            faults.append((kind, rank, step))
    if len(faults) > 1:
        p.error("one fault per run: --kill-rank/--kill-step or --hang-rank/--hang-step")
    return faults[0] if faults else None


def inject_fault(model: torch.nn.Module, kind: str, step: int, rank: int, current: dict[str, int],
                 events: Events) -> None:
    """Makes this process SIGKILL (kind "kill") or SIGSTOP (kind "hang") itself midway through the backward
    pass of `step` (current["step"] is the step in progress), where DeadPool's injector strikes too. A
    stopped worker is alive to its launcher and keeps its sockets open: its peers only see it go silent."""
    def hook(grad: torch.Tensor) -> None:
        if current["step"] == step:
            events.emit("fault_injected", kind=kind, target_rank=rank, step=step)
            os.kill(os.getpid(), FAULT_SIGNALS[kind])

    params = [p for p in model.parameters() if p.requires_grad]
    params[len(params) // 2].register_hook(hook)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_example_arguments(p)
    # The baseline's own.
    p.add_argument("--ckpt-every", type=int, default=20, help="checkpoint after every K-th step (0 = never)")
    p.add_argument("--async-save", action="store_true",
                   help="dcp.async_save: stage a copy in the step, write it in a background thread")
    p.add_argument("--ckpt-dir", required=True, type=Path)
    p.add_argument("--events", required=True, type=Path, help="JSON-lines file shared by all ranks and restarts")
    add_fault_arguments(p)
    args = p.parse_args()
    args.fault = planned_fault(p, args)
    if args.ckpt_every < 0:
        p.error("--ckpt-every must be 0 (never) or more")
    return args


class Events:
    """Appends one JSON object per line with a single write, so lines of many processes never interleave."""

    def __init__(self, path: Path, rank: int) -> None:
        self.rank = rank
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def emit(self, event: str, **fields: Any) -> None:
        record = {"event": event, "rank": self.rank, "attempt": ATTEMPT, "t": time.monotonic(),
                  "wall": time.time(), "pid": os.getpid(), **fields}
        os.write(self._fd, (json.dumps(record) + "\n").encode())


# ---- per-rank state: data position and random number generators ---------------------------------

def rng_state() -> dict[str, Any]:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def state_sha256(model: torch.nn.Module, optimizer: torch.optim.Optimizer, sampler: BatchSampler, step: int) -> str:
    """SHA-256 of one rank's whole training state, fed in this order:
    1. model.state_dict() (the unwrapped GPT), in key order: per entry the key, dtype and shape as text,
       then the tensor's raw bytes (the tied embedding/output weight appears under both its keys);
    2. optimizer.state_dict()["state"], by ascending parameter index, then state name in sorted order
       ("exp_avg", "exp_avg_sq", "step"): "{index}.{name}", dtype, shape, raw bytes;
       then json.dumps(param_groups, sort_keys=True);
    3. json.dumps(sampler.state_dict(), sort_keys=True);
    4. RNG states: json.dumps(random.getstate()); NumPy's (name, pos, has_gauss, cached_gaussian) as JSON
       then its key array's bytes; torch.get_rng_state() bytes;
    5. the step, as text "step={step}".
    Equal on two runs only if the state is bit-identical."""
    h = hashlib.sha256()

    def tensor(label: str, t: torch.Tensor) -> None:
        h.update(f"{label}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())

    for key, value in model.state_dict().items():
        tensor(key, value)
    optim = optimizer.state_dict()
    for index in sorted(optim["state"]):
        for name in sorted(optim["state"][index]):
            value = optim["state"][index][name]
            if isinstance(value, torch.Tensor):
                tensor(f"{index}.{name}", value)
            else:
                h.update(f"{index}.{name}={json.dumps(value)}".encode())
    h.update(json.dumps(optim["param_groups"], sort_keys=True, default=str).encode())
    h.update(json.dumps(sampler.state_dict(), sort_keys=True).encode())
    h.update(json.dumps(random.getstate()).encode())
    name, keys, pos, has_gauss, cached = np.random.get_state()
    h.update(json.dumps([name, int(pos), int(has_gauss), float(cached)]).encode())
    h.update(np.ascontiguousarray(keys).tobytes())
    h.update(torch.get_rng_state().numpy().tobytes())
    h.update(f"step={step}".encode())
    return h.hexdigest()


# ---- checkpoints --------------------------------------------------------------------------------

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

    def __init__(self, ckpt_dir: Path, rank: int, world_size: int, events: Events) -> None:
        self.ckpt_dir, self.rank, self.world_size, self.events = ckpt_dir, rank, world_size, events
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
        future.add_done_callback(lambda f: self.events.emit("checkpoint_written", step=step,
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
            self.events.emit("checkpoint_renamed", step=step)


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


def rebuild_ddp_buckets(model: torch.nn.parallel.DistributedDataParallel, tokens: torch.Tensor,
                        block_size: int) -> None:
    """One throw-away forward and backward (one sequence; gradients discarded, no optimizer step), so the
    replay reduces gradients in the same buckets as the run it repeats.

    DDP starts with all gradients in a single bucket and, after the first backward, rebuilds its buckets
    in the order the gradients became ready. An uninterrupted run reduces step 1 in the initial bucket and
    every later step in the rebuilt ones; a resumed job would reduce its first step in the initial bucket.
    A different bucket layout changes where each element falls in gloo's ring all-reduce and so the order
    in which the ranks' values are summed: with more than 2 ranks (2 values add commutatively) the replay
    then drifts in the last bits (observed with 4 ranks: losses differ from step 25 on). The throw-away
    pass records the same ready order, and the first replayed step's forward rebuilds the same buckets.
    It draws dropout random numbers: the caller restores the RNG states after it."""
    x, y = make_batch(tokens, [0], block_size)
    _, loss = model(x, y)
    loss.backward()
    model.zero_grad(set_to_none=True)


# ---- training -----------------------------------------------------------------------------------

def main() -> None:
    args = parse_args()
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    events = Events(args.events, int(os.environ["RANK"]))  # torchrun sets RANK and WORLD_SIZE
    events.emit("process_start", world_size=int(os.environ["WORLD_SIZE"]))  # before the group: a failed join shows
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    saver = AsyncCheckpointer(args.ckpt_dir, rank, world_size, events) if args.async_save else None

    text = load_text(args.data)
    tokenizer = CharTokenizer(text)
    tokens = torch.tensor(tokenizer.encode(text), dtype=torch.long)
    config = GPTConfig(vocab_size=tokenizer.vocab_size, block_size=args.block_size, n_layer=args.n_layer,
                       n_head=args.n_head, n_embd=args.n_embd, dropout=args.dropout)
    gpt = GPT(config)
    model = torch.nn.parallel.DistributedDataParallel(gpt)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    sampler = BatchSampler(num_tokens=len(tokens), block_size=args.block_size, batch_size=args.batch_size,
                           rank=rank, world_size=world_size, seed=args.seed)

    current = {"step": 0}
    if args.fault is not None and args.fault[1] == rank and ATTEMPT == 0:
        inject_fault(gpt, args.fault[0], args.fault[2], rank, current, events)

    if rank == 0:  # leftovers of a save that was interrupted
        args.ckpt_dir.mkdir(parents=True, exist_ok=True)
        for stale in args.ckpt_dir.glob(".tmp-step-*"):
            shutil.rmtree(stale, ignore_errors=True)
    dist.barrier()
    start = 1
    newest = newest_checkpoint(args.ckpt_dir, world_size)
    if newest is not None:
        t0 = time.monotonic()
        loaded, rng = load_checkpoint(newest[1], model, optimizer, sampler, rank, world_size)
        t1 = time.monotonic()
        rebuild_ddp_buckets(model, tokens, args.block_size)
        set_rng_state(rng)  # last: nothing may draw random numbers between this and the first replayed step
        start = loaded + 1
        t2 = time.monotonic()
        events.emit("resumed", from_step=loaded, load_s=t1 - t0, warmup_s=t2 - t1, path=str(newest[1]))

    for step in range(start, args.steps + 1):
        t0 = time.monotonic()
        current["step"] = step
        sample_ids = sampler.next_batch()
        x, y = make_batch(tokens, sample_ids, args.block_size)
        _, loss = model(x, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        value = loss.item()
        t1 = time.monotonic()
        events.emit("step", step=step, loss=value, dur_s=t1 - t0, t=t1, samples=sample_ids,
                    thread_cpu_s=time.thread_time())
        if saver is not None:
            saver.poll()
        if args.ckpt_every and step % args.ckpt_every == 0:
            if saver is None:
                save_checkpoint(args.ckpt_dir, step, model, optimizer, sampler, rank, world_size)
                t2 = time.monotonic()
                events.emit("checkpoint", step=step, mode="sync", save_s=t2 - t1, t=t2)
            else:
                waited = saver.start(step, model, optimizer, sampler)
                t2 = time.monotonic()
                events.emit("checkpoint", step=step, mode="async", save_s=t2 - t1, wait_s=waited, t=t2)

    if saver is not None:
        saver.wait(SAVE_TIMEOUT_S)  # the last checkpoint is complete and renamed before the job says finished
    events.emit("finished", step=args.steps, state_sha256=state_sha256(gpt, optimizer, sampler, args.steps))
    dist.barrier()
    # Straight out once every rank is done: twice, on a loaded machine, a run hung after every rank had
    # written `finished` (not reproduced since), so in the group's teardown, the interpreter's exit or
    # torchrun's; the first two have nothing left to do for this benchmark.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
