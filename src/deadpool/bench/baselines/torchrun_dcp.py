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

Checkpoints (dcp_checkpoints.py) are written atomically: `step-{k}` appears complete or not at all.

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

from deadpool.bench.baselines.dcp_checkpoints import (
    SAVE_TIMEOUT_S,
    AsyncCheckpointer,
    load_checkpoint,
    newest_checkpoint,
    save_checkpoint,
    set_rng_state,
)
from deadpool.examples.gpt.data import BatchSampler, CharTokenizer, load_text, make_batch
from deadpool.examples.gpt.model import GPT, GPTConfig

ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
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
    saver = AsyncCheckpointer(args.ckpt_dir, rank, world_size, events.emit) if args.async_save else None

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
