"""A running job's control plane, probed from outside: where it listens, and what a stranger can do to it."""

from __future__ import annotations

import io
import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

from deadpool.config import Fault
from deadpool.protocol.secret import read_secret
from deadpool.protocol.store import StoreClient

from .conftest import SCRIPTS, Background
from .test_hot_swap import assert_same_training


def listening_sockets(pids: list[int]) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket in LISTEN state that one of `pids` holds, from /proc."""
    inodes: set[str] = set()
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                target = os.readlink(fd)
            except OSError:  # closed meanwhile
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    found = []
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                address, port = fields[1].split(":")
                raw = bytes.fromhex(address)
                # /proc prints each 32-bit word in host (little-endian) order
                words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                family = socket.AF_INET if width == 8 else socket.AF_INET6
                found.append((socket.inet_ntop(family, words), int(port, 16)))
    return found


def leaks(secret: bytes, data: bytes) -> bool:
    """Whether `data` holds the secret, raw or in hex (as its file and DEADPOOL_SECRET hold it)."""
    return secret in data or secret.hex().encode() in data.lower()


def capture_a_legitimate_request(port: int, secret: bytes) -> bytes:
    """What a man in the middle records of a legitimate client: its proof for the server's nonce, then one
    request (it writes `legit/key`)."""
    relay = socket.create_server(("127.0.0.1", 0))
    sent = bytearray()

    def forward() -> None:
        client, _ = relay.accept()
        with client, socket.create_connection(("127.0.0.1", port)) as upstream:
            threading.Thread(target=lambda: [client.sendall(d) for d in iter(lambda: upstream.recv(65536), b"")],
                             daemon=True).start()
            while data := client.recv(65536):
                sent.extend(data)
                upstream.sendall(data)

    thread = threading.Thread(target=forward, daemon=True)
    thread.start()
    store = StoreClient("127.0.0.1", relay.getsockname()[1], secret, timeout_s=10)
    store.set("legit/key", "1")
    store.close()
    thread.join(10)
    relay.close()
    return bytes(sent)


def test_a_running_job_listens_on_loopback_only_and_refuses_strangers(tmp_path, reference):
    """The reference job (4 workers, 1 spare), attacked while it trains: every listener of the launcher and its
    processes is on loopback; the secret is in no process's command line or environment and in no file of
    the run directory but its own (mode 600); torch's client, a wrong secret and a replayed capture are
    refused and logged, can read and write nothing; the job ends bit for bit as the reference."""
    attacked = tmp_path / "attacked"  # steps paused 1 s until then: time to attack
    printed = io.StringIO()  # what `deadpool run` prints: the processes' output, the launcher's last lines
    job = Background(tmp_path / "run", script=SCRIPTS / "slow_steps.py", echo=printed,
                     script_prefix=("1.0", "--until", str(attacked)),
                     faults=(Fault(kind="kill", rank=1, step=99),))  # never fires: reported, disturbs nothing
    events = job.wait_for(lambda e: e["event"] == "step" and e["step"] >= 2)
    pids = [os.getpid()] + [e["pid"] for e in events if e["event"] == "process_spawned"]
    port = next(e["port"] for e in events if e["event"] == "job_start")
    listeners = listening_sockets(pids)
    assert ("127.0.0.1", port) in listeners
    # the store and each worker's gloo listener at least (the spare listens nowhere: it connects to the
    # replica streams, whose listeners close once their holder is in)
    assert len({p for _, p in listeners}) >= 1 + 4
    assert {address for address, _ in listeners} <= {"127.0.0.1", "::1"}, listeners

    secret = read_secret(tmp_path / "run" / "secret")
    assert (tmp_path / "run" / "secret").stat().st_mode & 0o777 == 0o600
    for pid in pids[1:]:  # what `ps` (and, for the same user, /proc) shows of each process the job started
        for shown in ("cmdline", "environ"):
            assert not leaks(secret, Path(f"/proc/{pid}/{shown}").read_bytes()), f"/proc/{pid}/{shown}"
    captured = tmp_path / "captured"
    captured.write_bytes(capture_a_legitimate_request(port, secret))
    rogue = subprocess.run([sys.executable, str(SCRIPTS / "rogue_client.py"), str(port), str(captured)],
                           capture_output=True, text=True, timeout=60)
    assert rogue.returncode == 0, rogue.stderr
    achieved = json.loads(rogue.stdout.splitlines()[-1])
    assert achieved == {"tcpstore_error": "DistNetworkError", "wrong_secret_error": "AuthenticationError",
                        "replay_answer": ""}
    checker = StoreClient("127.0.0.1", port, secret, timeout_s=10)
    assert checker.check(["legit/key"]) and not checker.check(["rogue/key"])
    checker.close()
    attacked.touch()

    done = job.join()
    assert_same_training(done, reference)
    for path in (tmp_path / "run").rglob("*"):  # config.json, events.jsonl, the workers' logs: all 644
        if path.is_file() and path.name != "secret":
            assert not leaks(secret, path.read_bytes()), path
    assert done.summary["faults_not_fired"] == ["fault kill:1:99:backward never fired: the run ended at step 10"]
    assert "\n[deadpool] fault kill:1:99:backward never fired: the run ended at step 10\n" in printed.getvalue()
    refusals = [e["reason"] for e in done.named("control_plane_refused")]
    assert refusals[:2] == ["the client does not hold the job's secret"] * 2  # the wrong secret, the replay
    assert refusals[2:] and all(r.startswith("no valid handshake") for r in refusals[2:])  # torch's client retries
