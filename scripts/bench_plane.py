"""The control plane's cost per call, side by side: torch's TCPStore against DeadPool's authenticated store.

    python scripts/bench_plane.py [--calls N] [--rounds R]

Both servers run in this process, as the coordinator hosts its store; the client is a second process, as a
rank is. Prints the median latency of each call (set, check, get) per store and the ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from datetime import timedelta

import torch.distributed as dist

from deadpool.protocol.secret import new_secret
from deadpool.protocol.store import StoreClient, StoreServer

CLIENT = r"""
import json, sys, time
from datetime import timedelta
kind, port, secret, calls = sys.argv[1], int(sys.argv[2]), bytes.fromhex(sys.argv[3]), int(sys.argv[4])
if kind == "tcpstore":
    import torch.distributed as dist
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
else:
    from deadpool.protocol.store import StoreClient
    store = StoreClient("127.0.0.1", port, secret, 30)
store.set("k", "0")
out = {}
for name, call in (("set", lambda: store.set("hb/w0", '{"beat": 1, "step": 7}')),
                   ("check", lambda: store.check(["g0/committed"])), ("get", lambda: store.get("k"))):
    t = time.perf_counter()
    for _ in range(calls):
        call()
    out[name] = (time.perf_counter() - t) / calls
print(json.dumps(out))
"""


def measure(kind: str, port: int, secret: bytes, calls: int) -> dict[str, float]:
    out = subprocess.run([sys.executable, "-c", CLIENT, kind, str(port), secret.hex(), str(calls)],
                         capture_output=True, text=True, timeout=300, check=True)
    return json.loads(out.stdout.splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    secret = new_secret()
    tcp = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    ours = StoreServer("127.0.0.1", 0, secret)
    results: dict[str, list[dict[str, float]]] = {"tcpstore": [], "deadpool": []}
    for _ in range(args.rounds):  # interleaved, so both see the same machine
        results["tcpstore"].append(measure("tcpstore", tcp.port, secret, args.calls))
        results["deadpool"].append(measure("deadpool", ours.port, secret, args.calls))
    started = time.perf_counter()
    handshakes = 50
    for _ in range(handshakes):
        StoreClient("127.0.0.1", ours.port, secret, 30).close()
    connect_s = (time.perf_counter() - started) / handshakes
    ours.close()
    print(f"{'call':<6} {'TCPStore µs':>12} {'DeadPool µs':>12} {'ratio':>6}   (median of {args.rounds} rounds of "
          f"{args.calls} calls, loopback)")
    for call in ("set", "check", "get"):
        a = statistics.median(r[call] for r in results["tcpstore"]) * 1e6
        b = statistics.median(r[call] for r in results["deadpool"]) * 1e6
        print(f"{call:<6} {a:>12.1f} {b:>12.1f} {b / a:>6.2f}")
    print(f"connect + mutual handshake: {connect_s * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
