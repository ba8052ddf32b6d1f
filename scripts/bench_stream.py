"""A replica stream's transport, both ways in one run: a two-process gloo group against DeadPool's socket.

    python scripts/bench_stream.py [--mb 9.6] [--messages 200] [--rounds 3]

Two processes on loopback; the sender sends `--mb` MB and waits for a 24-byte acknowledgement, `--messages`
times, as a snapshot goes to its holder. Each round runs both transports, one after the other; the figures
are each side's CPU per message (the process's, every thread: gloo's device loop included) and the wall
rate, medians over the rounds. The gloo side is what runtime/replica.py used until the ninth session (a
ProcessGroupGloo of two on a device of its own); the socket side is runtime/stream.py as the job runs it.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from deadpool.protocol.plane import ControlPlane
from deadpool.protocol.secret import new_secret
from deadpool.protocol.store import StoreClient, StoreServer
from deadpool.runtime import stream


def cpu_s() -> float:
    times = os.times()
    return times.user + times.system


def gloo_side(role: int, port: int, nbytes: int, messages: int, out: mp.Queue) -> None:
    store = dist.TCPStore("127.0.0.1", port, 2, False, timeout=timedelta(seconds=60))
    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    options._devices = [dist.ProcessGroupGloo.create_device(interface="lo")]
    options._timeout = timedelta(seconds=60)
    group = dist.ProcessGroupGloo(dist.PrefixStore(f"bench{port}/", store), role, 2, options)
    data, ack = torch.ones(nbytes, dtype=torch.uint8), torch.zeros(3, dtype=torch.int64)
    group.barrier().wait()
    start, wall = cpu_s(), time.perf_counter()
    for _ in range(messages):
        if role == 0:
            group.send([data], 1, 0).wait()
            group.recv([ack], 1, 1).wait()
        else:
            group.recv([data], 0, 0).wait()
            group.send([ack], 0, 1).wait()
    out.put((role, cpu_s() - start, time.perf_counter() - wall))


def socket_side(role: int, port: int, secret: bytes, nbytes: int, messages: int, out: mp.Queue) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    plane = ControlPlane(StoreClient("127.0.0.1", port, secret, timeout_s=60))
    end = (stream.offer(plane, "bench/", secret, 0, 60) if role == 0
           else stream.join(plane, "bench/", secret, 0, 60))
    data = torch.ones(nbytes, dtype=torch.uint8)
    start, wall = cpu_s(), time.perf_counter()
    for _ in range(messages):
        if role == 0:
            end.send_bytes(data)
            end.recv_frame()
        else:
            end.recv_bytes(data)
            end.send_frame(b"x" * 24)
    out.put((role, cpu_s() - start, time.perf_counter() - wall))


def one(transport: str, nbytes: int, messages: int, round_: int) -> tuple[float, float, float]:
    """(sender CPU, receiver CPU, wall) per message, in seconds."""
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()
    if transport == "gloo":
        port = 29700 + round_
        server = dist.TCPStore("127.0.0.1", port, 2, True, timeout=timedelta(seconds=60), wait_for_workers=False)
        procs = [ctx.Process(target=gloo_side, args=(r, port, nbytes, messages, out)) for r in (0, 1)]
    else:
        secret = new_secret()
        server = StoreServer("127.0.0.1", 0, secret)
        procs = [ctx.Process(target=socket_side, args=(r, server.port, secret, nbytes, messages, out)) for r in (0, 1)]
    for proc in procs:
        proc.start()
    results = dict((role, (cpu, wall)) for role, cpu, wall in (out.get(timeout=300) for _ in procs))
    for proc in procs:
        proc.join(60)
    if transport != "gloo":
        server.close()
    del server
    return results[0][0] / messages, results[1][0] / messages, results[0][1] / messages


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=9.6, help="MB per message (9.6: a 3M x 4 snapshot's piece)")
    parser.add_argument("--messages", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    nbytes = int(args.mb * 1e6)
    runs: dict[str, list[tuple[float, float, float]]] = {"gloo": [], "socket": []}
    for round_ in range(args.rounds):
        for transport in runs:
            send, receive, wall = one(transport, nbytes, args.messages, round_)
            runs[transport].append((send, receive, wall))
            print(f"round {round_ + 1} {transport:6s}: CPU per message {1e3 * send:.2f} ms sending, "
                  f"{1e3 * receive:.2f} ms receiving; {nbytes / wall / 1e9:.2f} GB/s", flush=True)
    medians = {t: [statistics.median(r[i] for r in rows) for i in range(3)] for t, rows in runs.items()}
    for transport, (send, receive, wall) in medians.items():
        print(f"median {transport:6s}: {1e3 * (send + receive):.2f} ms of CPU per {args.mb:g} MB message "
              f"({1e3 * send:.2f} + {1e3 * receive:.2f}), {nbytes / wall / 1e9:.2f} GB/s")
    gloo, sock = medians["gloo"], medians["socket"]
    print(f"socket / gloo: CPU x{(sock[0] + sock[1]) / (gloo[0] + gloo[1]):.2f}, wall x{sock[2] / gloo[2]:.2f}")


if __name__ == "__main__":
    main()
