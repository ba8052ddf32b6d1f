"""Where a GPU snapshot's engine time goes, each path measured in one run (a benchmark, not a check).

    PYTHONPATH=src python scripts/gpu_snapshot_paths.py [--mb 683] [--tensors 100] [--repeats 3]

A state of `--mb` MB in `--tensors` GPU tensors (the example GPT's large model: 683 MB), copied into one
pinned slot as the snapshot engine does, timed each way (best and median of `--repeats`):

  d2h                 the copies alone, queued at once, then one synchronize (the copy engine's rate)
  serial              the copies, synchronize, then one hash over the slot (the engine before the tenth session)
  pipelined           digest.copy_hashed from the device: each 32 MB piece hashed once its copy has landed
  hash_1              one xxh3 pass over the pinned slot, one thread
  hash_T (T threads)  the slot cut in T blocks hashed at once (xxhash releases the GIL): what a block-wise
                      digest would cost; not what the engine does today
  tcp_S (S streams)   the slot sent over S loopback TCP connections at once and received into a buffer as
                      a holder does (no hash; the receiving buffer is allocated in each repeat)

Each figure is printed as it is measured, then all of them as JSON.

Then, with a GPU, how much each part of the engine slows training when it runs beside it: the example GPT's
large model (57M parameters, 64 x 256 tokens) trains 12 steps alone, then 12 steps (or those done within
10 s) while a thread repeats one activity without pause: d2h; hash_1; alloc (a fresh 683 MB buffer, its
pages faulted in); tcp_1 (both ends in this process, receiving into a fresh buffer); tcp_in_place (the same
into one buffer); tcp_to_process (to a holder process, with its ack, as a replica stream); engine (d2h,
hash_1, tcp_to_process in turn): mean step time and its ratio to the steps alone.

Without a GPU it runs the host-side paths only (hash, tcp), to check the script.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import torch

from deadpool.runtime.digest import copy_hashed, new_hasher


def timed(name: str, run: Callable[[], object], repeats: int, nbytes: int) -> dict[str, float]:
    """Times `run` `repeats` times; prints the figure at once, so a run cut short still shows what it measured."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    print(f"{name}: {nbytes / min(times) / 1e9:.1f} GB/s (best of {repeats})", flush=True)
    return {"best_s": min(times), "median_s": statistics.median(times), "gbps": nbytes / min(times) / 1e9}


def copy_to_host(slot: torch.Tensor, sources: list, side: torch.cuda.Stream) -> None:
    """The GPU tensors into their places in the pinned slot, queued at once on `side`, then synchronized."""
    with torch.cuda.stream(side):
        for source, offset, end in sources:
            slot[offset:end].copy_(source, non_blocking=True)
    side.synchronize()


def hash_blocks(raw: memoryview, threads: int, pool: ThreadPoolExecutor) -> list[int]:
    block = -(-len(raw) // threads)
    parts = [raw[i: i + block] for i in range(0, len(raw), block)]

    def one(part: memoryview) -> int:
        hasher = new_hasher()
        hasher.update(part)
        return hasher.intdigest()

    return list(pool.map(one, parts))


HOLDER = """
import socket, sys
into = memoryview(bytearray(int(sys.argv[2])))
with socket.create_connection(("127.0.0.1", int(sys.argv[1]))) as sock:
    while True:
        got = 0
        while got < len(into):
            n = sock.recv_into(into[got:])
            if not n:
                sys.exit(0)
            got += n
        sock.sendall(b"k")
"""  # a holder in a process of its own, receiving into one buffer allocated once, as a spare does


def tcp(slot: torch.Tensor, streams: int, into: memoryview | None = None) -> None:
    """Sends the slot over `streams` loopback connections at once, each a contiguous share, received into
    `into` (else a buffer allocated now) by threads of this process."""
    raw, into = slot.numpy().data, into if into is not None else memoryview(bytearray(slot.numel()))
    share = -(-len(raw) // streams)
    with socket.create_server(("127.0.0.1", 0)) as server:
        pairs = []
        for _ in range(streams):
            sender = socket.create_connection(server.getsockname())
            pairs.append((sender, server.accept()[0]))

    def send(i: int) -> None:
        pairs[i][0].sendall(raw[i * share: (i + 1) * share])

    def receive(i: int) -> None:
        view, got = into[i * share: (i + 1) * share], 0
        while got < len(view):
            got += pairs[i][1].recv_into(view[got:])

    workers = [threading.Thread(target=f, args=(i,)) for i in range(streams) for f in (send, receive)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    for a, b in pairs:
        a.close()
        b.close()


def interference(slot: torch.Tensor, sources: list, side: torch.cuda.Stream, steps: int = 12) -> dict:
    """Step time of the example GPT alone and beside each engine activity, repeated in a thread."""
    from examples.gpt.model import GPT, GPTConfig

    model = GPT(GPTConfig(vocab_size=96, block_size=256, n_layer=8, n_head=12, n_embd=768, dropout=0.0)).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, 96, (64, 256), device="cuda")

    def train(limit_s: float = 10.0) -> float:
        """Mean step time over `steps` steps, or over those done within `limit_s` (an activity that slows
        training tenfold still leaves time for the others)."""
        start, done = time.perf_counter(), 0
        while done < steps and (done == 0 or time.perf_counter() - start < limit_s):
            _, loss = model(x, x)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            loss.item()
            done += 1
        return (time.perf_counter() - start) / done

    def d2h() -> None:
        copy_to_host(slot, sources, side)

    def hash_1() -> None:
        new_hasher().update(slot.numpy().data)

    into = memoryview(bytearray(slot.numel()))
    with socket.create_server(("127.0.0.1", 0)) as server:
        holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(server.getsockname()[1]), str(slot.numel())])
        to_holder = server.accept()[0]

    def send_to_holder() -> None:  # as the engine streams a snapshot to its holder: all of it, then an ack
        to_holder.sendall(slot.numpy().data)
        to_holder.recv(1)

    activities = {"d2h": d2h, "hash_1": hash_1, "alloc": lambda: bytearray(slot.numel()),
                  "tcp_1": lambda: tcp(slot, 1), "tcp_in_place": lambda: tcp(slot, 1, into),
                  "tcp_to_process": send_to_holder, "engine": lambda: (d2h(), hash_1(), send_to_holder())}
    train()  # warm-up
    alone = train()
    print(f"training alone: {alone * 1e3:.0f} ms a step", flush=True)
    result = {"alone_s": alone}
    for name, activity in activities.items():
        stop = threading.Event()

        def repeat(run: Callable[[], object] = activity, stop: threading.Event = stop) -> None:
            while not stop.is_set():
                run()

        worker = threading.Thread(target=repeat)
        worker.start()
        time.sleep(0.05)
        beside = train()
        stop.set()
        worker.join()
        result[name] = {"step_s": beside, "ratio": beside / alone}
        print(f"training beside {name}: {beside * 1e3:.0f} ms a step, x{beside / alone:.3f}", flush=True)
    to_holder.close()
    holder.wait(10)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=float, default=683.8)
    parser.add_argument("--tensors", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    nbytes = int(args.mb * 1e6) // args.tensors * args.tensors
    cuda = torch.cuda.is_available()
    slot = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    slot.random_(0, 256)
    report: dict[str, object] = {"bytes": nbytes, "tensors": args.tensors, "gpu": cuda,
                                 "cores": len(os.sched_getaffinity(0))}
    if cuda:
        each = nbytes // args.tensors
        state = [torch.randint(0, 256, (each,), dtype=torch.uint8, device="cuda") for _ in range(args.tensors)]
        sources = [(t, i * each, (i + 1) * each) for i, t in enumerate(state)]
        side = torch.cuda.Stream()

        def d2h() -> None:
            copy_to_host(slot, sources, side)

        def serial() -> int:
            d2h()
            hasher = new_hasher()
            hasher.update(slot.numpy().data)
            return hasher.intdigest()

        def pipelined() -> tuple[int, int]:
            with torch.cuda.stream(side):
                return copy_hashed(sources, slot, [(0, nbytes)], 0, device=True, settle=side.synchronize).finish(b"")

        report["d2h"] = timed("d2h", d2h, args.repeats, nbytes)
        report["serial"] = timed("serial", serial, args.repeats, nbytes)
        report["pipelined"] = timed("pipelined", pipelined, args.repeats, nbytes)
    raw = slot.numpy().data
    with ThreadPoolExecutor(16) as pool:
        for threads in (1, 2, 4, 8, 16):
            report[f"hash_{threads}"] = timed(f"hash_{threads}", lambda t=threads: hash_blocks(raw, t, pool),
                                              args.repeats, nbytes)
    for streams in (1, 2, 4):
        report[f"tcp_{streams}"] = timed(f"tcp_{streams}", lambda s=streams: tcp(slot, s), args.repeats, nbytes)
    if cuda:
        report["interference"] = interference(slot, sources, side)
    print(json.dumps(report, indent=1))
    print("  ".join(f"{name} {value['gbps']:.1f} GB/s" for name, value in report.items()
                    if isinstance(value, dict) and "gbps" in value))
    if cuda:
        print("training beside: " + "  ".join(f"{name} x{value['ratio']:.3f}" for name, value in
                                              report["interference"].items() if isinstance(value, dict)))


if __name__ == "__main__":
    main()
