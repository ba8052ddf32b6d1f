"""Process groups per generation, DeadPool's own collectives (a failure in one is a peer's), and the data-parallel
wrapper that is rebuilt on each new group."""

from __future__ import annotations

import atexit
import gc
import logging
import os
import socket
import sys
import threading
import time
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterator

import torch
import torch.distributed as dist

from deadpool.errors import CollectiveAborted, ConfigError, PeerFailure, UsageError
from deadpool.runtime.buckets import BUCKET_BYTES, FIRST_BUCKET_BYTES, Reducer, bucket_layout
from deadpool.runtime.plane import PlaneStore
from deadpool.runtime.terminate import before_exit


def pick_backend(requested: str, device_index: int | None) -> tuple[str, torch.device]:
    """NCCL on GPU `device_index` (the launcher's placement: coordinator/policy.place_devices) when this
    process has one, else gloo on the CPU. The same code path serves both; only the device differs."""
    if requested == "gloo" or device_index is None:
        if requested == "nccl":
            raise ConfigError("--backend nccl, but this process was given no GPU (see --gpus-per-node)")
        return "gloo", torch.device("cpu")
    device = torch.device("cuda", device_index)
    torch.cuda.set_device(device)
    return "nccl", device


@contextmanager
def communicating(what: str) -> Iterator[None]:
    """Marks DeadPool's own communication (its collectives, joining a generation's group, its replica
    streams): any error torch's communication layer or a socket raises in it is a failure of some peer,
    raised as PeerFailure whatever its message says. Only communication runs inside, so no error of the
    script's can be mistaken for one. InterruptedError (this process was told to stop) passes as it is."""
    try:
        yield
    except InterruptedError:
        raise
    except (RuntimeError, OSError) as error:  # gloo raises plain RuntimeError (torch's DistError types too)
        first = str(error).splitlines()[0] if str(error) else ""
        raise PeerFailure(f"{what} failed: {type(error).__name__}: {first}") from error


def collective(issue: Callable[[], Any], interrupted: Callable[[], bool], timeout_s: float, what: str) -> None:
    """One of DeadPool's own collectives: issued (async) and waited for with `finish`, its failures PeerFailure."""
    with communicating(what):
        finish(issue(), interrupted, timeout_s)


def finish(work: Any, interrupted: Callable[[], bool], timeout_s: float) -> None:
    """Waits for a collective of the default group until it has *completed*, and gives it up as soon as the
    generation is over (the coordinator's abort) or after `timeout_s`, the backstop.

    A peer that died is noticed by gloo at once only by the ranks connected to it in the current
    algorithm step; the others would wait for the full collective timeout. The coordinator's abort
    releases them:

    - gloo: the wait blocks in the work itself (in C++, the GIL released). The abort shuts the group's
      connections (abandon_group, run by the watch thread), which fails this wait at once. Waking on a
      Python callback of the work's future and an event instead cost ~1 ms more per collective, with a
      tail of several ms, and a step waits for every gradient bucket and the stop agreement
      (docs/benchmarks.md). The wait is cut in slices of WAIT_SLICE_S, after each of which the abort is
      asked for: a CI run once saw a rank's stop agreement outlive the abort by 15 s (a whole node lost,
      FSDP), so the shutdown is not the only way out.
    - NCCL completes a work's future when the kernel is *enqueued*, so the future alone says nothing: the
      work itself is polled until it reports completion (a finished kernel, or an error), and gives up when
      `interrupted()`; the first host sync after this never blocks on a dead peer. The abandoned operation
      is never touched again (the watch aborts the communicator: abandon_group).
    """
    if _blocking_wait:
        deadline, aborted_at = time.monotonic() + timeout_s, None
        while True:
            try:
                work.wait(timedelta(seconds=max(0.001, min(WAIT_SLICE_S, deadline - time.monotonic()))))
                return
            except RuntimeError as error:  # torch's Work: the slice ran out, the work goes on
                if str(error).strip() != "Operation timed out!":
                    raise
            # the abort is seen before the watch shuts the group: give the shutdown time to fail the work,
            # so that none is left pending in gloo's threads (destroying the group would wait for it)
            if interrupted():
                aborted_at = aborted_at or time.monotonic()
                if time.monotonic() - aborted_at >= ABORT_GRACE_S:
                    raise CollectiveAborted("collective abandoned: the coordinator aborted this generation")
            if time.monotonic() > deadline:
                raise CollectiveAborted(f"collective did not complete within the collective timeout ({timeout_s:g} s)")
    enqueued = threading.Event()
    work.get_future().add_done_callback(lambda _: enqueued.set())
    deadline, pause = time.monotonic() + timeout_s, 0.0002
    while not (enqueued.wait(pause) and work.is_completed()):
        if interrupted():
            raise CollectiveAborted("collective abandoned: the coordinator aborted this generation")
        if time.monotonic() > deadline:
            raise CollectiveAborted(f"collective did not complete within the collective timeout ({timeout_s:g} s)")
        pause = min(2 * pause, 0.02) if not enqueued.is_set() else 0.0005
    work.wait()


def abandon_group(device: torch.device) -> None:
    """Called from the watch thread when the generation is aborted: releases a training thread blocked in
    the default group, in DeadPool's collectives or in the script's own (a metric all_reduce, a barrier),
    without waiting for that thread.

    NCCL: aborting the communicator ends its kernels, so a host sync blocked on them (`loss.item()`)
    returns and the next use of the group raises; the launcher turns NCCL's own error handling off
    (TORCH_NCCL_ASYNC_ERROR_HANDLING=0, as torch asks of callers of abort), so its watchdog neither aborts
    first nor kills the process. The communicator is not shrunk (ncclCommShrink): a generation replaces
    dead ranks with spares, which a shrink cannot add, so each generation builds a fresh one.

    gloo cannot abort (its abort is a no-op), and a synchronous gloo call cannot be interrupted, so the
    group's TCP connections are shut down instead: every pending and later operation of this group, here
    and at the peers connected to this process, fails at once with a connection error, as if a peer had
    died. The group is never used
    again; the next generation joins a fresh one.
    """
    group: Any = dist.group.WORLD
    if not dist.is_initialized() or group is None:
        return
    if dist.get_backend() == "nccl":
        torch.cuda.set_device(device)  # this thread's first CUDA call: never a stray context on GPU 0
        group.abort()
        return
    sockets = _socket_fds()
    for inode in _group_sockets:
        if inode in sockets:
            try:
                with socket.socket(fileno=os.dup(sockets[inode])) as conn:
                    conn.shutdown(socket.SHUT_RDWR)
            except OSError:  # already closed
                pass


_group_sockets: set[int] = set()  # inodes of the default group's TCP connections (gloo), found at join
_blocking_wait = False  # finish blocks in the work's own wait: the default group is gloo's (set at join)
WAIT_SLICE_S = 0.25  # a blocking wait asks whether the generation was aborted this often
ABORT_GRACE_S = 1.0  # and gives the abort's shutdown of the group this long to fail the work first


def _socket_fds() -> dict[int, int]:
    """This process's sockets: inode -> file descriptor."""
    found = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if link.startswith("socket:["):
            found[int(link[8:-1])] = int(fd)
    return found


def _tcp_ports() -> dict[int, tuple[int, int]]:
    """This process's TCP sockets: inode -> (local port, remote port; 0 when listening), from /proc/self/net/tcp{,6}."""
    ports = {}
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, remote, inode = fields[1], fields[2], int(fields[9])
            ports[inode] = (int(local.rsplit(":", 1)[1], 16), int(remote.rsplit(":", 1)[1], 16))
    return ports


def guard_exit() -> None:
    """Makes this process end with os._exit once it has left a group behind in a failure.

    A gloo group whose operation was abandoned (or that saw a peer die) aborts the whole process
    (std::terminate on a gloo::IoException) when it is destroyed at interpreter exit. So after a
    recovery the process skips those destructors: stdio is flushed and the exit code kept (1 if an
    exception escaped the script, else 0; a SystemExit code is not seen here and becomes 0).
    """
    global _exit_guarded
    if _exit_guarded:
        return
    _exit_guarded = True
    crashed = []
    previous_hook = sys.excepthook

    def excepthook(*info: Any) -> None:
        crashed.append(True)
        previous_hook(*info)

    def leave() -> None:
        before_exit()  # last words if the launcher is gone, and what must run at any exit (terminate.py)
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1 if crashed else 0)

    sys.excepthook = excepthook
    atexit.register(leave)


_exit_guarded = False


def join_group(store: PlaneStore | dist.TCPStore, prefix: str, backend: str, rank: int, world_size: int,
               timeout_s: float) -> None:
    """Makes this process rank `rank` of a fresh default group; the prefix keeps generations apart. The
    TCP connections the group opens (any new one not to the store) are noted for abandon_group."""
    global _blocking_wait
    before = set(_socket_fds())
    # torch names the default group by a process-wide counter, which keys its rendezvous in the store and is reset
    # only when a group is destroyed: an attempt that failed (a peer died before joining) must not shift it, or
    # this process would wait for its peers under another name in the next generation's rendezvous.
    world: Any = dist.distributed_c10d._world
    count = world.group_count
    try:
        dist.init_process_group(backend, store=dist.PrefixStore(prefix, store), rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s))
    except BaseException:
        world.group_count = count
        raise
    _blocking_wait = backend == "gloo"
    if backend == "gloo":
        ports = _tcp_ports()
        _group_sockets.clear()
        _group_sockets.update(inode for inode in set(_socket_fds()) - before  # connections to peers: not the
                              if inode in ports and ports[inode][1] and store.port not in ports[inode])  # listener


LEAVE_DEADLINE_S = 2.0  # how long dropping a group may take before it is left behind (a healthy one: milliseconds)


def leave_group(deadline_s: float = LEAVE_DEADLINE_S) -> bool:
    """Drops the default group (and aborts it first on NCCL, where that cancels in-flight work); False if
    the group could not be freed within `deadline_s` and was left behind.

    For gloo this does not reliably close the group's sockets at once (measured on torch 2.13: after
    a failed step they stayed open), so peers blocked on this process are released by the
    coordinator's abort instead (finish, and abandon_group, which every member runs on the abort).
    Freeing a gloo group joins its worker threads, and one still blocked in an abandoned collective's
    receive stays there until the peer closes the connection or the collective timeout passes (measured:
    18.8 s, until the peer exited). The last reference is therefore dropped on a helper thread (torch frees a
    group without holding the GIL): past the deadline the group is left to that thread, and this process
    goes on to the next generation's fresh group.
    """
    _group_sockets.clear()
    if not dist.is_initialized():
        return True
    group: Any = dist.group.WORLD
    device = None
    if dist.get_backend(group) == "nccl":
        group.abort()  # NCCL can abort in-flight collectives; gloo cannot
        device = torch.cuda.current_device()
    dist.destroy_process_group()
    last = [group]
    del group

    def drop() -> None:
        if device is not None:
            torch.cuda.set_device(device)  # this thread's first CUDA call: never a stray context on GPU 0
        last.clear()
        gc.collect()

    dropping = threading.Thread(target=drop, name="deadpool-leave-group", daemon=True)
    dropping.start()
    dropping.join(deadline_s)
    return not dropping.is_alive()


class DataParallel(torch.nn.Module):
    """Data parallelism that survives a change of process group: what DistributedDataParallel does
    for the user (start from rank 0's weights, average gradients in buckets while backward runs, skip that
    inside `no_sync()` or while `require_backward_grad_sync` is False), without it.

    torch's DDP keeps its process group alive after the DDP object is deleted (its sockets stay
    open), so a survivor blocked on a dead group would not be released by its peers; its bucket
    rebuild also changes the reduction layout after the first step, so a fresh DDP would not
    reproduce a replayed step bit for bit. Here the layout is fixed at construction (runtime/buckets.py).
    `bucket_cap_mb` is DDP's: without it the first bucket holds 1 MiB and the others 25 MiB.
    """

    def __init__(self, module: torch.nn.Module, bucket_cap_mb: float | None = None) -> None:
        super().__init__()
        self.module = module
        self.attached = False
        self.interrupted: Callable[[], bool] = lambda: False  # this generation's abort check (attach sets it)
        self.timeout_s = 60.0  # the collective timeout (attach sets it)
        self.waiting: Callable[[str], ContextManager[None]] = lambda _: nullcontext()
        self.require_backward_grad_sync = True  # DDP's switch for gradient accumulation, which scripts set
        params = [p for p in module.parameters() if p.requires_grad]
        cap = BUCKET_BYTES if bucket_cap_mb is None else int(bucket_cap_mb * 1024 * 1024)
        layout = bucket_layout([(p.numel() * p.element_size(), p.dtype) for p in params],
                               FIRST_BUCKET_BYTES if bucket_cap_mb is None else cap, cap)
        self.reducer = Reducer(params, layout, self._all_reduce, self._wait)
        for index, p in enumerate(params):
            p.register_post_accumulate_grad_hook(partial(self._on_grad, index))

    def attach(self, sync: bool, interrupted: Callable[[], bool],
               waiting: Callable[[str], ContextManager[None]], timeout_s: float) -> None:
        """Starts averaging over the current default group, given up when `interrupted()` (or after
        `timeout_s`); `waiting` marks the waits on peers. `sync` first copies rank 0's weights and buffers
        everywhere (job start only: after a recovery every rank restored the same state)."""
        self.attached, self.interrupted, self.waiting, self.timeout_s = True, interrupted, waiting, timeout_s
        self.reducer.world_size = dist.get_world_size()
        if sync:
            with waiting("broadcast"):
                for t in (*self.module.parameters(), *self.module.buffers()):
                    collective(partial(dist.broadcast, t.data, src=0, async_op=True), self.interrupted,
                               self.timeout_s, "the initial broadcast of rank 0's weights")

    def detach(self) -> None:
        self.attached = False
        self.reducer.forget()

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """As DDP's: backward passes inside accumulate gradients locally; the first one outside averages them."""
        before, self.require_backward_grad_sync = self.require_backward_grad_sync, False
        try:
            yield
        finally:
            self.require_backward_grad_sync = before

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not self.attached:
            raise UsageError("the model was used outside session.run(): call it only in the step function you "
                             "give session.run() (a `while`/`for` loop around the model becomes that function), "
                             "where DeadPool attaches it to the process group")
        return self.module(*args, **kwargs)

    def _on_grad(self, index: int, _param: torch.Tensor) -> None:
        # A micro-step under no_sync (or with require_backward_grad_sync False) only accumulates: the hooks of
        # the pass that follows it see the accumulated gradients and reduce them.
        if self.attached and self.require_backward_grad_sync:
            self.reducer.ready(index)

    def _all_reduce(self, flat: torch.Tensor) -> Any:
        with communicating("the gradient all-reduce"):
            return dist.all_reduce(flat, async_op=True)

    def _wait(self, works: list[Any]) -> None:
        with self.waiting("all_reduce"), communicating("the gradient all-reduce"):
            for work in works:
                finish(work, self.interrupted, self.timeout_s)
