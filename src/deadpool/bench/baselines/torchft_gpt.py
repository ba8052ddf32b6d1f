"""The example GPT trained with torchft, the third way of surviving a SIGKILL that DeadPool is compared with.

N replica groups of one process each (this script is one of them; run_torchft.py starts them, restarts a
killed one and runs torchft's lighthouse on loopback). Each replica runs torchft 0.2.0's `Manager` over
`torchft.ProcessGroupGloo` and averages gradients itself, one `manager.allreduce` per parameter; the
optimizer steps only if `manager.should_commit()` says so. torchft's DDP wrapper
(torchft.ddp.DistributedDataParallel) is not used: when a peer dies, the survivors' all-reduce fails,
torchft's _ManagedWork.wait() records the error and returns before it sets up the future that the
wrapper's comm hook returns, so the hook's `assert fut._fut` (torchft/ddp.py) raises an AssertionError
out of loss.backward() and the survivors die too (seen with torchft 0.2.0, torch 2.13, gloo). The workload
is DeadPool's example (examples/gpt: same model, data, sampler, optimizer, seeds, arguments and
defaults); replica r holds data rank r of N.

Recovery, the torchft way:
  * A replica dies. The survivors' gradient all-reduce of the step in flight fails, the manager records
    the error and should_commit() returns False: the step is discarded (event `step_discarded`) and
    retried under the same number, on the next batch (the data of a discarded step is skipped, as in
    torchft's own examples).
    Only the dead replica's neighbours in gloo's ring see its connections close; the others learn of
    it when the all-reduce times out (--pg-timeout-s).
  * At the next start_quorum() the lighthouse leaves the dead replica out once its heartbeat is older
    than the lighthouse's heartbeat timeout and every live replica has asked; the survivors go on with
    N-1 replicas (min_replica_size is N-1 by default, so should_commit() accepts a step without it).
  * The launcher restarts the dead replica's process (same replica index, so the same data rank). It
    joins a quorum at step 0, behind the others, so torchft heals it: it fetches the live state of a
    peer (model, optimizer, data position, RNG states and the step) over torchft's HTTP checkpoint
    transport, then trains with the others.
  * A replica that hangs instead (--hang-rank/--hang-step: it SIGSTOPs itself, its heartbeat with it)
    stays alive and is never restarted. The survivors' all-reduce times out after --pg-timeout-s, the
    step is discarded, and by then the lighthouse has dropped the silent replica (no heartbeat within
    its timeout), so the survivors go on with N-1 replicas to the end (observed with 3 replicas and the
    5 s defaults: the retried step committed 5.05 s after the SIGSTOP).

Step numbering: step k is the k-th committed optimizer step, i.e. manager.current_step() after the
commit; a discarded attempt is retried under the same k. A healed replica takes the step of the peer it
healed from and continues at that step + 1.

The quorum is synchronous (use_async_quorum=False): the state a healing replica receives includes the
data position and RNG states, which are only consistent between steps; torchft's asynchronous quorum
would read them in a background thread while this thread already drew the step's batch and dropout.
It also lets a healed replica contribute to the step in which it heals (the asynchronous one zeroes its
gradients for that step). init_sync=False: every replica is seeded identically, so step 0 needs no sync.

Events (JSON lines, as torchrun_dcp.py writes them: "t" = time.monotonic(), "rank" = replica index,
"attempt" = incarnation, 0 then 1 after a restart): process_start, manager_ready (manager and its
heartbeat to the lighthouse up), quorum (a new membership: quorum_id, participants, quorum_s),
healed (from_step: the step taken from the peer, quorum_s: the quorum including the state transfer),
step (step, loss, samples: the batch's sample ids, participants, quorum_s, dur_s: from the quorum to the
commit; t at the step's end), step_discarded (step, participants, error), fault_injected, finished
(step, state_sha256 as in torchrun_dcp.py).
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torchft import Manager, ProcessGroupGloo

from deadpool.bench.baselines.dcp_checkpoints import rng_state, set_rng_state
from deadpool.bench.baselines.torchrun_dcp import (
    Events,
    add_example_arguments,
    add_fault_arguments,
    inject_fault,
    planned_fault,
    state_sha256,
)
from deadpool.examples.gpt.data import BatchSampler, CharTokenizer, load_text, make_batch
from deadpool.examples.gpt.model import GPT, GPTConfig

START_KEY = "torchft_gpt/started"  # in the launcher's start store: replicas whose manager is up
MAX_DISCARDED_IN_A_ROW = 10  # then should_commit() raises instead of retrying forever


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_example_arguments(p)
    # The baseline's own.
    p.add_argument("--replica", type=int, required=True, help="this replica group's index, its data rank")
    p.add_argument("--replicas", type=int, required=True, help="replica groups in the job (N)")
    p.add_argument("--min-replicas", type=int, default=None, help="min_replica_size (default: N-1, at least 1)")
    p.add_argument("--incarnation", type=int, default=0, help="0, then 1 for the process restarted after a kill")
    p.add_argument("--lighthouse", default=os.environ.get("TORCHFT_LIGHTHOUSE"), help="http://host:port")
    p.add_argument("--start-store", default=None, metavar="HOST:PORT",
                   help="incarnation 0 waits on this TCPStore until all N managers are up")
    # torchft's timeouts, as its train_ddp.py example sets them on CPU.
    p.add_argument("--pg-timeout-s", type=float, default=5.0,
                   help="gloo's: how long a replica waits in an all-reduce for a peer that is gone")
    p.add_argument("--timeout-s", type=float, default=30.0, help="the manager's: RPCs, checkpoint transfer")
    p.add_argument("--events", required=True, type=Path, help="JSON-lines file shared by all replicas")
    add_fault_arguments(p)  # the rank is the replica; only incarnation 0 injects it
    args = p.parse_args()
    args.fault = planned_fault(p, args)
    if not args.lighthouse:
        p.error("--lighthouse or TORCHFT_LIGHTHOUSE is required")
    if args.min_replicas is None:
        args.min_replicas = max(1, args.replicas - 1)
    return args


class ReplicaEvents(Events):
    """torchrun_dcp's events, with "attempt" = this process's incarnation instead of torchrun's restart
    count (a keyword passed to Events.emit overrides the field of the same name)."""

    def __init__(self, path: Path, replica: int, incarnation: int) -> None:
        super().__init__(path, replica)
        self.incarnation = incarnation

    def emit(self, event: str, **fields: Any) -> None:
        super().emit(event, attempt=self.incarnation, **fields)


def wait_for_all_replicas(address: str, replicas: int, timeout_s: float) -> None:
    """Start barrier: every manager heartbeats to the lighthouse before any replica asks for a quorum.
    Without it the lighthouse forms the first quorum from the N-1 replicas that happen to be up (enough
    for min_replica_size) and the last one heals into the job a few steps later."""
    host, port = address.rsplit(":", 1)
    store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout_s))
    store.add(START_KEY, 1)
    deadline = time.monotonic() + timeout_s
    while store.add(START_KEY, 0) < replicas:
        if time.monotonic() > deadline:
            raise TimeoutError(f"not all {replicas} replicas started within {timeout_s} s")
        time.sleep(0.01)


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format=f"[replica {args.replica}.{args.incarnation}] %(message)s")
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    events = ReplicaEvents(args.events, args.replica, args.incarnation)
    events.emit("process_start", world_size=args.replicas)

    text = load_text(args.data)
    tokenizer = CharTokenizer(text)
    tokens = torch.tensor(tokenizer.encode(text), dtype=torch.long)
    config = GPTConfig(vocab_size=tokenizer.vocab_size, block_size=args.block_size, n_layer=args.n_layer,
                       n_head=args.n_head, n_embd=args.n_embd, dropout=args.dropout)
    gpt = GPT(config)
    optimizer = torch.optim.AdamW(gpt.parameters(), lr=args.lr, weight_decay=0.1)
    sampler = BatchSampler(num_tokens=len(tokens), block_size=args.block_size, batch_size=args.batch_size,
                           rank=args.replica, world_size=args.replicas, seed=args.seed)

    def state_dict() -> dict[str, Any]:
        """What a healing replica receives; read inside start_quorum(), between steps."""
        return {"model": gpt.state_dict(), "optim": optimizer.state_dict(), "sampler": sampler.state_dict(),
                "rng": rng_state()}

    def load_state_dict(state: dict[str, Any]) -> None:
        gpt.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])
        sampler.load_state_dict(state["sampler"])
        set_rng_state(state["rng"])

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # this replica group's own
    manager = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=args.pg_timeout_s)),
                      load_state_dict=load_state_dict, state_dict=state_dict, min_replica_size=args.min_replicas,
                      use_async_quorum=False, init_sync=False, timeout=timedelta(seconds=args.timeout_s),
                      store_addr="127.0.0.1", store_port=store.port, rank=0, world_size=1,
                      lighthouse_addr=args.lighthouse, replica_id=f"replica_{args.replica}", hostname="127.0.0.1",
                      max_retries=MAX_DISCARDED_IN_A_ROW)
    events.emit("manager_ready")
    if args.incarnation == 0 and args.start_store:
        wait_for_all_replicas(args.start_store, args.replicas, args.timeout_s)

    current = {"step": 0}
    if args.fault is not None and args.fault[1] == args.replica and args.incarnation == 0:
        inject_fault(gpt, args.fault[0], args.fault[2], args.replica, current, events)

    quorum_id = -1
    while manager.current_step() < args.steps:
        t0 = time.monotonic()
        before = manager.current_step()
        manager.start_quorum()  # synchronous: returns with the new quorum, healed if this replica was behind
        quorum_s = time.monotonic() - t0
        participants = manager.num_participants()
        if manager.current_step() != before:
            events.emit("healed", from_step=manager.current_step(), quorum_s=quorum_s)
        if manager._quorum_id != quorum_id:  # the lighthouse changed the membership (0.2.0 has no public getter)
            first = quorum_id == -1
            quorum_id = manager._quorum_id
            events.emit("quorum", quorum_id=quorum_id, participants=participants, quorum_s=quorum_s)
            if first and args.incarnation == 0 and args.start_store and participants != args.replicas:
                raise RuntimeError(f"first quorum has {participants} of {args.replicas} replicas")
        step = manager.current_step() + 1
        current["step"] = step
        sample_ids = sampler.next_batch()
        x, y = make_batch(tokens, sample_ids, args.block_size)
        _, loss = gpt(x, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        works = [manager.allreduce(p.grad) for p in gpt.parameters() if p.grad is not None]  # average
        for work in works:
            if manager.errored():  # the step is lost: the rest would only fail (and log) the same way
                break
            work.wait()
        if manager.should_commit():
            optimizer.step()
            t1 = time.monotonic()
            events.emit("step", step=step, loss=loss.item(), dur_s=t1 - t0, t=t1, participants=participants,
                        quorum_s=quorum_s, samples=sample_ids)
        else:
            error = manager.errored()
            events.emit("step_discarded", step=step, participants=participants,
                        error=str(error.original_exception)[:300] if error else "too few replicas")

    events.emit("finished", step=args.steps, state_sha256=state_sha256(gpt, optimizer, sampler, args.steps))
    manager.shutdown(wait=False)


if __name__ == "__main__":
    main()
