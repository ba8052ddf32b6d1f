"""The copy limit: this machine's memcpy, hash and loopback bandwidths, and the every-step cost they bound.

A snapshot every step moves, per step and all ranks together: `copied` bytes into the slots (each rank's
snapshot once: under slices its piece of the replicated state and its own state), `sent` bytes to the holders
(that x holders, but none to a holder on the same machine, which maps the sender's slot: runtime/arena.py),
`hashed` bytes (the sender hashes what it copies, each holder what it receives, and under
slices every rank but one also hashes one other piece in place, the divergence check's audit: copied + sent
+ audited). The lower bound on what that costs a step is its CPU
time at this machine's one-core bandwidths, spread over every core (training keeps them all busy, so the
snapshot's CPU time is taken from it, at best evenly):

    bound = (copied / memcpy + hashed / hash + sent / loopback_cpu) / cores

`loopback_cpu` is bytes per CPU-second of a TCP stream over 127.0.0.1, the sender's and the receiver's
threads together (each end copies every byte once, in the kernel); the stream's wall-clock rate, which
runs both ends at once on two cores, is reported beside it but would understate the CPU a send takes.

A measured cost (every-step step time minus snapshots-off step time) is stated as a multiple of it, and so
is the snapshot's own CPU time (the job's CPU per step beside its training threads, every step minus
snapshots off) against the bytes' CPU time (the bound before spreading it over the cores). Step times on a
shared or frequency-scaled machine swing by more than a snapshot costs; the CPU beside training swings
less, and leaves out what the snapshot's memory traffic costs the training threads (in the first figure).
"""

from __future__ import annotations

import os
import socket
import statistics
import threading
import time
import zlib
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch

from deadpool.runtime.digest import copy_hashed, hash_name, new_hasher

MEASURE_BYTES = 256 * 2**20
REPEATS = 5  # best of: this machine's rates swing by half between runs a minute apart


@dataclass(frozen=True)
class Bandwidths:
    """Bytes per second on one core, best of a few runs (other load on the machine only lowers them)."""

    memcpy: float
    hash: float           # the hash snapshots use (`hash_name`)
    crc32: float          # zlib's, the hash before xxHash (for comparison)
    copy_and_hash: float  # digest.copy_hashed: both in one pass
    loopback: float       # TCP over 127.0.0.1, one sender and one receiver: bytes per second of wall time
    loopback_cpu: float   # the same stream: bytes per CPU-second of both ends together (what the bound uses)
    hash_name: str
    cores: int

    def of_hash(self, name: str) -> float:
        return self.crc32 if name == "crc32" else self.hash

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def line(self) -> str:
        gb = 1e9
        return (f"memcpy {self.memcpy / gb:.1f} GB/s, {self.hash_name} {self.hash / gb:.1f} GB/s, "
                f"crc32 {self.crc32 / gb:.1f} GB/s, copy+hash in one pass {self.copy_and_hash / gb:.1f} GB/s, "
                f"loopback TCP {self.loopback / gb:.1f} GB/s ({self.loopback_cpu / gb:.1f} GB per CPU-second, "
                f"both ends); {self.cores} cores")


@dataclass(frozen=True)
class Traffic:
    """Bytes a job's snapshots move per step, all ranks together, and the hash they were checked with."""

    copied: float
    hashed: float
    sent: float
    hash_name: str


def bytes_cpu_s(traffic: Traffic, bandwidths: Bandwidths) -> float:
    """The CPU time the bytes need at one-core bandwidths."""
    return (traffic.copied / bandwidths.memcpy + traffic.hashed / bandwidths.of_hash(traffic.hash_name)
            + traffic.sent / bandwidths.loopback_cpu)


def copy_limit_s(traffic: Traffic, bandwidths: Bandwidths) -> float:
    """The module docstring's bound: the bytes' CPU time spread over every core."""
    return bytes_cpu_s(traffic, bandwidths) / bandwidths.cores


def copy_limit(runs: list[dict[str, Any]], cost_s: float, cpu_cost_s: float | None,
               bandwidths: Bandwidths | None) -> dict[str, Any] | None:
    """A DeadPool row's bytes per step (median over rounds), the bound they imply on this machine, and the
    measured costs as multiples of it: in step time (`cost_s`, over snapshots off) and in CPU time beside
    the training threads (`cpu_cost_s`, against the bytes' CPU time)."""
    moved = [r["traffic"] for r in runs if r.get("traffic") is not None]
    if not moved or not any(t.copied for t in moved):
        return None
    per_step = Traffic(copied=statistics.median(t.copied for t in moved),
                       hashed=statistics.median(t.hashed for t in moved),
                       sent=statistics.median(t.sent for t in moved), hash_name=moved[0].hash_name)
    bound = copy_limit_s(per_step, bandwidths) if bandwidths else None
    bound_cpu = bytes_cpu_s(per_step, bandwidths) if bandwidths else None
    busy = [r["snapshot_busy_s"] for r in runs if r.get("snapshot_busy_s") is not None]
    busy_cpu = [r["snapshot_cpu_s"] for r in runs if r.get("snapshot_cpu_s") is not None]
    return {"copied_bytes": per_step.copied, "hashed_bytes": per_step.hashed, "sent_bytes": per_step.sent,
            "hash": per_step.hash_name, "cost_s": cost_s, "bound_s": bound,
            "multiple": cost_s / bound if bound else None,
            "cpu_cost_s": cpu_cost_s, "bound_cpu_s": bound_cpu,
            "cpu_multiple": cpu_cost_s / bound_cpu if bound_cpu and cpu_cost_s is not None else None,
            "snapshot_busy_s": statistics.median(busy) if busy else None,
            "snapshot_cpu_s": statistics.median(busy_cpu) if busy_cpu else None}


def traffic(events: list[dict[str, Any]], first_step: int, last_step: int) -> Traffic:
    """Per measured step, from the `snapshot` events whose cost falls in steps first_step..last_step
    (a step's snapshot runs during the next step). Events from before `hash` was recorded used CRC-32."""
    snapshots = [e for e in events if e["event"] == "snapshot" and first_step - 1 <= e["step"] < last_step]
    steps = last_step - first_step + 1
    copied = sum(e.get("held", e["bytes"]) for e in snapshots) / steps  # sliced: a rank's piece and its own state
    # what crossed a stream (a holder on the same machine maps the sender's arena: nothing is sent or hashed
    # again); events from before `sent` was recorded streamed every held byte to every holder
    sent = sum(e.get("sent", e.get("held", e["bytes"]) * len(e["holders"])) for e in snapshots) / steps
    audited = sum(e.get("audited", 0) for e in snapshots) / steps  # sliced: another piece, hashed in place
    name = snapshots[0].get("hash", "crc32") if snapshots else hash_name()
    return Traffic(copied=copied, hashed=copied + sent + audited, sent=sent, hash_name=name)


def _best(run: Callable[[], object], nbytes: int, repeats: int = REPEATS) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return nbytes / best


def loopback_rates(nbytes: int, repeats: int = REPEATS) -> tuple[float, float]:
    """One TCP stream over 127.0.0.1 (what a replica stream is between local processes), received into
    a buffer of all `nbytes` as a holder's arena is: (bytes per second of wall time, bytes per CPU-second
    of the sending and receiving threads together), each the best of `repeats`."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        sender = socket.create_connection(server.getsockname())
        receiver, _ = server.accept()
    chunk = memoryview(bytes(4 * 2**20))
    into = memoryview(bytearray(nbytes))  # zero-filled, so its pages are touched before the runs
    send_cpu_s = [0.0]

    def send() -> None:
        start = time.thread_time()
        for offset in range(0, nbytes, len(chunk)):
            sender.sendall(chunk[: min(len(chunk), nbytes - offset)])
        send_cpu_s[0] = time.thread_time() - start

    best_wall, best_cpu = float("inf"), float("inf")
    with sender, receiver:
        for _ in range(repeats):
            started, receive_started = time.perf_counter(), time.thread_time()
            thread = threading.Thread(target=send, name="deadpool-bench-loopback")
            thread.start()
            got = 0
            while got < nbytes:
                got += receiver.recv_into(into[got:])
            receive_cpu_s = time.thread_time() - receive_started
            thread.join()
            best_wall = min(best_wall, time.perf_counter() - started)
            best_cpu = min(best_cpu, receive_cpu_s + send_cpu_s[0])
    return nbytes / best_wall, nbytes / max(best_cpu, 1e-9)


def measure_bandwidths(nbytes: int = MEASURE_BYTES) -> Bandwidths:
    """One-off measurement over `nbytes` (0.5-1 s); torch's copy on one thread, as one core's figure."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        source = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
        target = torch.empty_like(source)
        raw = source.numpy().data
        memcpy = _best(lambda: target.copy_(source), nbytes)
        hashed = _best(lambda: new_hasher().update(raw), nbytes)
        crc32 = _best(lambda: zlib.crc32(raw), nbytes)
        fused = _best(lambda: copy_hashed([(source, 0, nbytes)], target, [(0, nbytes)], 0).finish(b""), nbytes)
    finally:
        torch.set_num_threads(threads)
    loopback, loopback_cpu = loopback_rates(nbytes)
    return Bandwidths(memcpy=memcpy, hash=hashed, crc32=crc32, copy_and_hash=fused, loopback=loopback,
                      loopback_cpu=loopback_cpu, hash_name=hash_name(), cores=len(os.sched_getaffinity(0)))
