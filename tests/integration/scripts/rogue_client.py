"""A stranger on the machine attacks a running job's control plane; prints what it achieved as JSON.

    python rogue_client.py PORT CAPTURED_FILE
Tries, in order: DeadPool's client with a wrong secret; bytes captured from a legitimate connection, played on
a new one; torch's own TCPStore client (no secret) writing a key and reading the job's config.
"""

from __future__ import annotations

import json
import socket
import sys
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from deadpool.protocol import wire
from deadpool.protocol.store import StoreClient

port, captured = int(sys.argv[1]), Path(sys.argv[2]).read_bytes()
achieved: dict[str, object] = {}
try:
    StoreClient("127.0.0.1", port, b"wrong secret, long enough", timeout_s=5).set("rogue/key", "1")
    achieved["wrong_secret"] = "wrote rogue/key"
except Exception as error:  # noqa: BLE001 - any failure is the outcome we report
    achieved["wrong_secret_error"] = type(error).__name__
with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
    sock.recv(len(wire.HELLO) + wire.NONCE)
    sock.sendall(captured)  # a legitimate client's proof and request, recorded on another connection
    try:
        achieved["replay_answer"] = sock.recv(4096).hex()
    except ConnectionResetError:
        achieved["replay_answer"] = ""
try:
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=1))
    store.set("rogue/key", "1")
    achieved["tcpstore"] = store.get("deadpool/job").decode()
except Exception as error:  # noqa: BLE001 - any failure is the outcome we report
    achieved["tcpstore_error"] = type(error).__name__
print(json.dumps(achieved))
