"""Tests for deadpool/runtime/comms.py: a failure inside DeadPool's own communication is a peer's,
waiting for a collective until it completed (not merely enqueued, as NCCL's future says), DDP's
gradient-accumulation switches, and releasing a rank blocked in a synchronous gloo collective."""

import multiprocessing as mp
import os
import socket
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from deadpool.errors import ConfigError, PeerFailure
from deadpool.runtime import comms
from deadpool.runtime.comms import (
    CollectiveAborted,
    DataParallel,
    abandon_group,
    collective,
    communicating,
    finish,
    join_group,
    leave_group,
    pick_backend,
)
from deadpool.runtime.failures import raised_in_torch_distributed


def test_a_failure_inside_deadpools_communication_is_a_peer_failure():
    """gloo raises a dead peer's error as a plain RuntimeError: inside DeadPool's own communication that is
    enough to know it is a peer's, whatever the message says."""
    with pytest.raises(PeerFailure, match="the stop agreement failed: RuntimeError: anything at all") as caught:
        with communicating("the stop agreement"):
            raise RuntimeError("anything at all")
    assert isinstance(caught.value.__cause__, RuntimeError)


@pytest.mark.parametrize("error", [ValueError("a bug"), CollectiveAborted("abandoned"), KeyError("lr")])
def test_other_errors_pass_through_deadpools_communication_as_they_are(error):
    with pytest.raises(type(error)) as caught, communicating("the stop agreement"):
        raise error
    assert caught.value is error


def test_a_collective_that_fails_when_issued_is_a_peer_failure():
    def issue():
        raise dist.DistNetworkError("Connection reset by peer")

    with pytest.raises(PeerFailure, match="the gradient all-reduce failed: DistNetworkError"):
        collective(issue, interrupted=lambda: False, timeout_s=1.0, what="the gradient all-reduce")


class EnqueuedWork:
    """A collective as NCCL reports it: its future completes when the kernel is enqueued, and the work
    completes only when the kernel ends (here: when `end()` is called, or never)."""

    def __init__(self) -> None:
        self.future: torch.futures.Future = torch.futures.Future()
        self.future.set_result(None)
        self.ended = threading.Event()
        self.waited = False

    def get_future(self) -> torch.futures.Future:
        return self.future

    def is_completed(self) -> bool:
        return self.ended.is_set()

    def wait(self) -> bool:
        self.waited = True
        return True


@pytest.fixture
def nccl_waits(monkeypatch):
    """finish as it waits when the default group is NCCL's (join_group sets it per backend)."""
    monkeypatch.setattr(comms, "_blocking_wait", False)


def test_finish_waits_for_completion_not_for_the_future(nccl_waits):
    work = EnqueuedWork()
    threading.Timer(0.3, work.ended.set).start()
    start = time.monotonic()
    finish(work, interrupted=lambda: False, timeout_s=10.0)
    assert time.monotonic() - start >= 0.3 and work.waited


def test_finish_releases_a_survivor_whose_collective_never_completes(nccl_waits):
    """The peer died mid-collective: the future said done at enqueue, the kernel never ends. The abort
    (seen by the watch thread) releases the training thread within a poll, and wait() is never called."""
    work, aborted = EnqueuedWork(), threading.Event()
    threading.Timer(0.2, aborted.set).start()
    start = time.monotonic()
    with pytest.raises(CollectiveAborted, match="coordinator aborted"):
        finish(work, interrupted=aborted.is_set, timeout_s=30.0)
    assert time.monotonic() - start < 1.0 and not work.waited


def test_finish_gives_up_at_the_collective_timeout(nccl_waits):
    with pytest.raises(CollectiveAborted, match="collective timeout"):
        finish(EnqueuedWork(), interrupted=lambda: False, timeout_s=0.2)


def test_gloo_backend_and_device_choice():
    assert pick_backend("auto", None) == ("gloo", torch.device("cpu"))
    assert pick_backend("gloo", 3) == ("gloo", torch.device("cpu"))  # gloo was asked for: the GPU is not used
    with pytest.raises(ConfigError, match="no GPU"):
        pick_backend("nccl", None)


def test_no_sync_turns_the_reduction_off_and_back_on():
    model = DataParallel(torch.nn.Linear(2, 2))
    with model.no_sync():
        assert model.require_backward_grad_sync is False
    assert model.require_backward_grad_sync is True
    model.require_backward_grad_sync = False  # as DDP scripts set it before the last micro-step
    with pytest.raises(KeyError), model.no_sync():
        raise KeyError("the flag is restored even when the body raises")
    assert model.require_backward_grad_sync is False


def _blocked_in_barrier(rank: int, port: int, out: "mp.Queue[str]", ours: bool, shutdown: bool = True) -> None:
    """Rank 1 waits in a synchronous barrier (or, `ours`, in DeadPool's own all-reduce) that rank 0 never
    enters; its watch-like thread abandons the group (`shutdown`), or else the abort is only seen."""
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=30))
    join_group(store, "g0/", "gloo", rank, 2, timeout_s=60.0)
    if rank == 0:
        time.sleep(20)  # alive, connected, never in the collective
        return
    start = time.monotonic()
    if shutdown:
        threading.Timer(0.5, abandon_group, args=(torch.device("cpu"),)).start()
    try:
        if ours:
            flags = torch.zeros(3, dtype=torch.int64)
            collective(lambda: dist.all_reduce(flags, async_op=True), timeout_s=60.0, what="the stop agreement",
                       interrupted=lambda: not shutdown and time.monotonic() - start > 0.5)
        else:
            dist.barrier()
        out.put("returned")
    except PeerFailure as error:
        expected = "collective abandoned" if not shutdown else "the stop agreement failed"
        out.put(f"{time.monotonic() - start:.2f} {str(error).startswith(expected)}")
    except RuntimeError as error:
        out.put(f"{time.monotonic() - start:.2f} {raised_in_torch_distributed(error)}")
    out.close()
    out.join_thread()  # put() hands the message to a feeder thread: os._exit would lose it on a busy machine
    os._exit(0)  # the abandoned group must not be destroyed at exit


@pytest.mark.parametrize("ours, shutdown", [(False, True), (True, True), (True, False)],
                         ids=["script_barrier", "deadpools_collective", "deadpools_collective_abort_only"])
def test_abandon_group_releases_a_synchronous_gloo_collective(ours, shutdown):
    """gloo cannot abort: the group's connections are shut down, and the blocked call fails at once with an
    error raised inside torch.distributed (judged a failure once the abort is seen), long before the 60 s
    collective timeout. DeadPool's own collectives block in the work's wait on gloo (comms.finish): the same
    shutdown releases them, as a PeerFailure; and should a shutdown miss, the wait still sees the abort
    within a slice (CollectiveAborted)."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    procs = [ctx.Process(target=_blocked_in_barrier, args=(rank, port, out, ours, shutdown)) for rank in (0, 1)]
    for proc in procs:
        proc.start()
    try:
        seconds, placed = out.get(timeout=30).split()
        assert float(seconds) < 5 and placed == "True"
    finally:
        for proc in procs:
            proc.kill()
            proc.join(10)


def _left_mid_collective(rank: int, port: int, out: "mp.Queue[str]") -> None:
    """Rank 1's collective is abandoned while rank 0, alive and connected, never joins it, so gloo's worker
    thread stays blocked in its receive; rank 1 leaves the group anyway, then both join the next one."""
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=30))
    join_group(store, "g0/", "gloo", rank, 2, timeout_s=60.0)
    if rank == 0:
        store.wait(["left"], timedelta(seconds=30))  # rank 0's connections stay open until rank 1 has left
        left = leave_group(deadline_s=1.0)  # nothing in flight here: freed at once
    else:
        start = time.monotonic()
        with pytest.raises(CollectiveAborted):
            collective(lambda: dist.all_reduce(torch.zeros(3), async_op=True), timeout_s=60.0, what="a step",
                       interrupted=lambda: time.monotonic() - start > 0.5)
        begun = time.monotonic()
        left = leave_group(deadline_s=1.0)
        out.put(f"leave {time.monotonic() - begun:.2f} {left}")
        store.set("left", "1")
    join_group(store, "g1/", "gloo", rank, 2, timeout_s=60.0)
    total = torch.tensor([rank + 1.0])
    dist.all_reduce(total)
    out.put(f"rank {rank} {left} {total.item():g}")
    out.close()
    out.join_thread()
    os._exit(0)


def test_leaving_a_group_blocked_on_a_live_peer_takes_at_most_the_deadline():
    """Freeing a gloo group joins its worker threads; one blocked in an abandoned collective's receive would
    hold the rank there until the peer hangs up (18.8 s measured; a CI run's recovery once failed so). The
    group is left behind after the deadline instead, and the next generation's group works."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    procs = [ctx.Process(target=_left_mid_collective, args=(rank, port, out)) for rank in (0, 1)]
    for proc in procs:
        proc.start()
    try:
        _, seconds, left = out.get(timeout=30).split()
        assert left == "False" and 0.9 < float(seconds) < 3.0
        after = sorted(out.get(timeout=30) for _ in procs)
        assert after == ["rank 0 True 3", "rank 1 False 3"]
    finally:
        for proc in procs:
            proc.kill()
            proc.join(10)


class _GivenUp(dist.Store):
    """A rendezvous store whose every wait gives up at once, as comms' Interruptible does on an abort."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = dist.HashStore()

    def set(self, key, value):
        self.inner.set(key, value)

    def get(self, key):
        raise InterruptedError(f"stopped while waiting for {key}")

    def wait(self, keys, timeout=None):
        raise InterruptedError(f"stopped while waiting for {keys}")

    def add(self, key, value):
        return self.inner.add(key, value)

    def check(self, keys):
        return self.inner.check(keys)


def test_a_join_given_up_leaves_the_default_groups_name_for_the_next_join():
    """torch names the default group by a counter that keys its rendezvous; a join that failed must not move
    it, or the process would wait for its peers under another name in the next generation (a worker whose
    generation 0 was aborted in start-up did: the job hung)."""
    world = dist.distributed_c10d._world
    count = world.group_count
    with pytest.raises(InterruptedError):  # torch lets a Python store's own error through as it is
        join_group(_GivenUp(), "g0/", "gloo", 0, 2, 5.0)
    assert world.group_count == count and not dist.is_initialized()
