"""The copy limit: this machine's memcpy, hash and loopback bandwidths, and the every-step cost they bound.

A snapshot every step moves, per step and all ranks together: `copied` bytes into the slots (each rank's
snapshot once: under slices its piece of the replicated state and its own state), `sent` bytes to the holders
(that x holders), `hashed` bytes (the sender hashes what it copies, each holder what it receives, and under
slices every rank but one also hashes one other piece in place, the divergence check's audit: copied + sent
+ audited). The lower bound on what that costs a step is its CPU
time at this machine's one-core bandwidths, spread over every core (training keeps them all busy, so the
snapshot's CPU time is taken from it, at best evenly):

    bound = (copied / memcpy + hashed / hash + sent / loopback) / cores

A measured cost (every-step step time minus snapshots-off step time) is stated as a multiple of it.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import zlib
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch

from deadpool.runtime.digest import copy_hashed, hash_name, new_hasher

MEASURE_BYTES = 256 * 2**20


@dataclass(frozen=True)
class Bandwidths:
    """Bytes per second on one core, best of a few runs (other load on the machine only lowers them)."""

    memcpy: float
    hash: float           # the hash snapshots use (`hash_name`)
    crc32: float          # zlib's, the fallback (and the hash before xxHash)
    copy_and_hash: float  # digest.copy_hashed: both in one pass
    loopback: float       # TCP over 127.0.0.1, one sender and one receiver
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
                f"loopback TCP {self.loopback / gb:.1f} GB/s; {self.cores} cores")


@dataclass(frozen=True)
class Traffic:
    """Bytes a job's snapshots move per step, all ranks together, and the hash they were checked with."""

    copied: float
    hashed: float
    sent: float
    hash_name: str


def copy_limit_s(traffic: Traffic, bandwidths: Bandwidths) -> float:
    """The module docstring's bound: the snapshot's CPU time at one-core bandwidths, over every core."""
    cpu_s = (traffic.copied / bandwidths.memcpy + traffic.hashed / bandwidths.of_hash(traffic.hash_name)
             + traffic.sent / bandwidths.loopback)
    return cpu_s / bandwidths.cores


def traffic(events: list[dict[str, Any]], first_step: int, last_step: int) -> Traffic:
    """Per measured step, from the `snapshot` events whose cost falls in steps first_step..last_step
    (a step's snapshot runs during the next step). Events from before `hash` was recorded used CRC-32."""
    snapshots = [e for e in events if e["event"] == "snapshot" and first_step - 1 <= e["step"] < last_step]
    steps = last_step - first_step + 1
    copied = sum(e.get("held", e["bytes"]) for e in snapshots) / steps  # sliced: a rank's piece and its own state
    sent = sum(e.get("held", e["bytes"]) * len(e["holders"]) for e in snapshots) / steps
    audited = sum(e.get("audited", 0) for e in snapshots) / steps  # sliced: another piece, hashed in place
    name = snapshots[0].get("hash", "crc32") if snapshots else hash_name()
    return Traffic(copied=copied, hashed=copied + sent + audited, sent=sent, hash_name=name)


def _best(run: Callable[[], object], nbytes: int, repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return nbytes / best


def loopback_bandwidth(nbytes: int) -> float:
    """One TCP stream over 127.0.0.1 (what gloo's pair groups use between local processes)."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        sender = socket.create_connection(server.getsockname())
        receiver, _ = server.accept()
    chunk = memoryview(bytes(4 * 2**20))

    def send() -> None:
        for start in range(0, nbytes, len(chunk)):
            sender.sendall(chunk[: min(len(chunk), nbytes - start)])

    def transfer() -> None:
        thread = threading.Thread(target=send, name="deadpool-bench-loopback")
        thread.start()
        into, got = memoryview(bytearray(len(chunk))), 0
        while got < nbytes:
            got += receiver.recv_into(into)
        thread.join()

    with sender, receiver:
        return _best(transfer, nbytes)


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
    return Bandwidths(memcpy=memcpy, hash=hashed, crc32=crc32, copy_and_hash=fused,
                      loopback=loopback_bandwidth(nbytes), hash_name=hash_name(), cores=len(os.sched_getaffinity(0)))
