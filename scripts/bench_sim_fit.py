"""Measures what `deadpool simulate` prices per swap: whole-node SIGKILLs at 2, 4, 8 and 16 nodes, each node a
network namespace of its own (`deadpool run --netns`, one rank per node, two spare nodes), with a tiny GPT,
and the state size varied at 4 nodes; fits the report, rebuild, transfer and restore terms (sim/fit.py) and
writes them, with every run's point and the load average during the runs, to DIR/sim_fit.json.

    python scripts/bench_sim_fit.py --out DIR [--nodes 2 4 8 16] [--reps 2] [--embd 256 512]
    python scripts/bench_sim_fit.py --refit DIR/sim_fit.json   # fit its points again (sim/fit.py changed)

A benchmark, not a test; it needs root (network namespaces). The figures are loopback through veth pairs on
one machine whose cores every process shares: they measure our protocol's fixed costs and how they grow
with ranks here, not a datacenter network.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from datetime import date
from pathlib import Path
from typing import Any

from deadpool.events import read_events
from deadpool.protocol.keys import Keys
from deadpool.protocol.plane import ControlPlane
from deadpool.protocol.records import Ready
from deadpool.protocol.secret import new_secret
from deadpool.protocol.store import StoreClient, StoreServer
from deadpool.sim.fit import fit_points

REPO = Path(__file__).resolve().parents[1]
TRAIN = REPO / "examples" / "gpt" / "train.py"
CLI = "import sys; from deadpool.launcher.cli import main; sys.exit(main())"
TINY = ("--n-layer", "2", "--n-head", "2", "--batch-size", "4")
NOTE = ("loopback through veth pairs between network namespaces on one machine of {cores} cores shared by every "
        "process (load average {load}): the fixed costs and the growth with ranks of our protocol here, not a "
        "datacenter network; the per-rank slopes include the CPU time the ranks take from each other")


class LoadSampler(threading.Thread):
    """Samples the 1-minute load average every `every_s` while the runs go on."""

    def __init__(self, every_s: float = 5.0) -> None:
        super().__init__(daemon=True)
        self.every_s, self.done = every_s, threading.Event()
        self.samples: list[float] = []

    def run(self) -> None:
        while not self.done.wait(self.every_s):
            self.samples.append(os.getloadavg()[0])


# One "rank" process of the store benchmark: connects, waits for the go, puts its share of Ready records.
REPORTER = r"""
import sys, time
from deadpool.protocol.keys import Keys
from deadpool.protocol.plane import ControlPlane
from deadpool.protocol.records import Ready
from deadpool.protocol.store import StoreClient
port, secret, first, count = int(sys.argv[1]), bytes.fromhex(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
client = StoreClient("127.0.0.1", port, secret, 60)
plane, keys = ControlPlane(client), Keys("bench")
client.get("go")
start = time.monotonic()
for rank in range(first, first + count):
    plane.put(keys.ready(1, rank), Ready(1, rank, (8, 9)))
print(start, time.monotonic())
"""


def coordinator_per_rank(ranks: int, clients: int) -> dict[str, float]:
    """The coordinator's serial share of a report, per rank: `clients` processes put `ranks` Ready records into
    one store server (in this process: its CPU time while they put is the server's), then one poll reads them
    all back, as the coordinator does. Per rank: the server's CPU time per put plus the poll's time per key.
    (The puts' wall time is also recorded; on 2 cores it is the clients' own Python, which real ranks pay in
    parallel on their own machines.)"""
    secret = new_secret()
    server = StoreServer("127.0.0.1", 0, secret)
    try:
        share = ranks // clients
        procs = [subprocess.Popen([sys.executable, "-c", REPORTER, str(server.port), secret.hex(), str(i * share),
                                   str(share)], stdout=subprocess.PIPE, text=True) for i in range(clients)]
        client = StoreClient("127.0.0.1", server.port, secret, 60)
        while len(server.connections) < clients + 1:  # every reporter connected (they wait for the go)
            time.sleep(0.05)
        cpu = time.process_time()
        client.set("go", "1")
        spans = [tuple(map(float, p.communicate(timeout=300)[0].split())) for p in procs]
        put_s = max(end for _, end in spans) - min(start for start, _ in spans)
        server_cpu_s = time.process_time() - cpu
        keys = Keys("bench")
        t = time.monotonic()
        got = ControlPlane(client).poll_all([keys.ready(1, r) for r in range(share * clients)], Ready)
        poll_s = time.monotonic() - t
        assert all(g is not None for g in got)
        client.close()
    finally:
        server.close()
    n = share * clients
    return {"ranks": n, "clients": clients, "put_s": put_s, "server_cpu_s": server_cpu_s, "poll_s": poll_s,
            "per_rank_s": (server_cpu_s + poll_s) / n}


def job(out: Path, nodes: int, embd: int, steps: int, kill_step: int) -> Path:
    """One kill -> recover run: node 1 (rank 1) SIGKILLed in the backward pass of kill_step."""
    cmd = [sys.executable, "-c", CLI, "run", "--nnodes", str(nodes), "--nproc-per-node", "1", "--spare-nodes", "2",
           "--netns", "--fault", f"kill_node:1:{kill_step}:backward", "--out", str(out), str(TRAIN),
           "--steps", str(steps), "--log-every", "1000", "--n-embd", str(embd), *TINY]
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "bench.log", "wb") as log:
        subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=300, check=True)
    return out


def point(run_dir: Path) -> dict[str, Any]:
    """The run's one recovery, as sim/fit.py takes it."""
    events = list(read_events(run_dir / "events.jsonl"))
    recovery = json.loads((run_dir / "summary.json").read_text())["recoveries"][0]
    gen = recovery["generation"]
    resent = [e for e in events if e["event"] == "snapshot_resent" and e["gen"] == gen]
    recovered = [e for e in events if e["event"] == "recovered" and e["gen"] == gen]
    quiet = [e["rebuild_s"] for e in recovered if e["proc"] not in {r["proc"] for r in resent}]
    start = next(e for e in events if e["event"] == "job_start")
    return {"run": run_dir.name, "ranks": start["workers"],
            "snapshot_bytes": max(e["bytes"] for e in events if e["event"] == "snapshot"),
            "detect_s": recovery["detect_s"], "decide_s": recovery["decide_s"], "report_s": recovery["report_s"],
            "rebuild_s": max(quiet), "rebuild_s_all": max(e["rebuild_s"] for e in recovered),
            "restore_s": recovery["restore_s"],
            "restore_bytes": max(e["bytes"] for e in events if e["event"] == "snapshot"),
            "resends": [(e.get("held", e["bytes"]), e["send_s"]) for e in resent],  # sliced: the piece is sent
            "fault_to_next_step_s": recovery["fault_to_next_step_s"], "steps_replayed": recovery["steps_replayed"]}


def coefficients(points: list[dict[str, Any]], store: dict[str, float]) -> dict[str, float]:
    """The fit of the points, with the store benchmark's cost per rank."""
    return fit_points(points) | {"coordinator_per_rank_s": store["per_rank_s"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--refit", type=Path, default=None, help="fit the points of this sim_fit.json again, in place")
    parser.add_argument("--nodes", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--embd", type=int, nargs="+", default=[256, 512],
                        help="n_embd of the extra runs at 4 nodes that vary the state size (the others: 64)")
    parser.add_argument("--store-ranks", type=int, default=20000,
                        help="Ready records put into one store server to time the coordinator's cost per rank")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--kill-step", type=int, default=8)
    args = parser.parse_args()
    if args.refit:
        result = json.loads(args.refit.read_text())
        result["coefficients"] = coefficients(result["points"], result["store"])
        args.refit.write_text(json.dumps(result, indent=2))
        print(json.dumps(result["coefficients"], indent=2))
        return
    if args.out is None:
        parser.error("--out is required (or --refit)")
    cases = [(n, 64) for n in args.nodes] + [(4, e) for e in args.embd]
    sampler, began = LoadSampler(), time.monotonic()
    sampler.start()
    points = []
    for rep in range(args.reps):
        for nodes, embd in cases:
            t = time.monotonic()
            p = point(job(args.out / f"n{nodes}-e{embd}-{rep}", nodes, embd, args.steps, args.kill_step))
            points.append({**p, "nodes": nodes, "n_embd": embd, "load_1m_after": os.getloadavg()[0]})
            print(f"{nodes:>2} nodes, n_embd {embd}: report {p['report_s']:.3f} s, rebuild {p['rebuild_s']:.3f} s, "
                  f"resends {[(b, round(s, 4)) for b, s in p['resends']]}, kill -> next step "
                  f"{p['fault_to_next_step_s']:.2f} s ({time.monotonic() - t:.0f} s)", flush=True)
    store = coordinator_per_rank(args.store_ranks, clients=4)
    print(f"store: {store['ranks']} Ready records put by 4 processes in {store['put_s']:.2f} s (the server's CPU: "
          f"{store['server_cpu_s']:.2f} s), polled back in {store['poll_s']:.3f} s: {store['per_rank_s'] * 1e6:.0f} µs "
          "per rank", flush=True)
    sampler.done.set()
    load = sampler.samples or [os.getloadavg()[0]]
    fitted = coefficients(points, store)
    result = {"date": date.today().isoformat(), "command": " ".join(["python", *sys.argv]),
              "note": NOTE.format(cores=os.cpu_count(), load=f"{statistics.mean(load):.2f} mean, {max(load):.2f} "
                                                                f"max"),
              "load_1m": {"mean": statistics.mean(load), "max": max(load), "samples": load},
              "seconds": time.monotonic() - began, "coefficients": fitted, "store": store, "points": points}
    (args.out / "sim_fit.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(fitted, indent=2))
    print(f"written: {args.out / 'sim_fit.json'}")


if __name__ == "__main__":
    main()
