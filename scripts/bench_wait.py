"""How long DeadPool's wait for a gloo collective takes to return once the collective is done: polled (a
callback on the work's future sets an event the training thread waits on, and the work is polled; how
NCCL's works are waited for, and gloo's were) against blocking in the work's own wait (how gloo's are now).

Two processes on loopback; rank 1 arrives `--skew-ms` late, as a step's later rank does, so the time
measured is from its call to its return. Prints the median and 90th percentile of each, interleaved in
blocks so that the machine's drift falls on both.

    python scripts/bench_wait.py --reps 150 --blocks 2
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from deadpool.runtime import comms

SIZES = {"3 int64 (the stop agreement)": (3, torch.int64), "10 MB (a gradient bucket)": (2_500_000, torch.float32)}


def _timed(rank: int, tensor: torch.Tensor, blocking: bool, reps: int, skew_s: float) -> list[float]:
    comms._blocking_wait = blocking
    times = []
    for _ in range(reps):
        dist.barrier()
        if rank == 1:
            time.sleep(skew_s)
        start = time.perf_counter()
        comms.finish(dist.all_reduce(tensor, async_op=True), lambda: False, 60.0)
        times.append(time.perf_counter() - start)
    return times


def _worker(rank: int, port: int, args: argparse.Namespace, out: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    results: dict[str, dict[str, list[float]]] = {}
    for name, (numel, dtype) in SIZES.items():
        tensor = torch.zeros(numel, dtype=dtype)
        for _ in range(args.blocks):
            for mode, blocking in (("polled", False), ("blocking", True)):
                times = _timed(rank, tensor, blocking, args.reps, args.skew_ms / 1e3)
                results.setdefault(name, {}).setdefault(mode, []).extend(times)
    if rank == 1:
        out.put(results)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=150, help="collectives per block")
    parser.add_argument("--blocks", type=int, default=2, help="blocks of each mode, interleaved")
    parser.add_argument("--skew-ms", type=float, default=2.0, help="how late rank 1 arrives")
    args = parser.parse_args()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(rank, port, args, out)) for rank in (0, 1)]
    for proc in procs:
        proc.start()
    results = out.get(timeout=600)
    for proc in procs:
        proc.join(60)
    for name, modes in results.items():
        line = []
        for mode, times in modes.items():
            ms = sorted(t * 1e3 for t in times)
            line.append(f"{mode} median {statistics.median(ms):.2f} ms, p90 {ms[int(0.9 * len(ms))]:.2f} ms")
        print(f"{name}: {'; '.join(line)}")


if __name__ == "__main__":
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    main()
