"""Hosts on one machine: a Linux network namespace per node, each with its own address on a bridge.

    host (root namespace)                 node k (namespace dp<id>n<k>)
    bridge dp<id>br 10.X.Y.1/24  <--veth-->  eth0 10.X.Y.(k+2)/24

Every byte between nodes (the store, the collectives, the replicas) crosses real interfaces, so a node's
link can be cut (`ip link set ... down` on its host side) as a cable would be. Made and removed with
`ip` as root; `available()` says why not where it cannot be.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from deadpool.errors import ConfigError


def available() -> str:
    """"" if namespaces can be made here, else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    probe = f"dpprobe{secrets.token_hex(3)}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode:
        return f"cannot make a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return ""


def _ip(*args: str, netns: str | None = None) -> None:
    command = ["ip", *(("netns", "exec", netns, "ip") if netns else ()), *args]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise ConfigError(f"`{' '.join(command)}` failed: {done.stderr.strip()}")


@dataclass
class Network:
    """`nodes` namespaces on one bridge; `create()` makes them, `remove()` takes them all down again."""

    nodes: int
    tag: str = field(default_factory=lambda: secrets.token_hex(2))
    subnet: str = field(default_factory=lambda: f"10.{200 + secrets.randbelow(50)}.{secrets.randbelow(250)}")

    @property
    def bridge(self) -> str:
        return f"dp{self.tag}br"

    @property
    def host_address(self) -> str:
        return f"{self.subnet}.1"

    def namespace(self, node: int) -> str:
        return f"dp{self.tag}n{node}"

    def address(self, node: int) -> str:
        return f"{self.subnet}.{node + 2}"

    def link(self, node: int) -> str:
        """The host side of node's veth pair: its cable."""
        return f"dp{self.tag}h{node}"

    def create(self) -> "Network":
        hosts = "127.0.0.1 localhost\n" + f"{self.host_address} deadpool-coordinator\n" + "".join(
            f"{self.address(n)} deadpool-node{n}\n" for n in range(self.nodes))
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.host_address}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for node in range(self.nodes):
                ns, host_side, inside = self.namespace(node), self.link(node), f"dp{self.tag}p{node}"
                _ip("netns", "add", ns)
                etc = Path("/etc/netns") / ns  # `ip netns exec` mounts it over /etc: names for every address
                etc.mkdir(parents=True, exist_ok=True)
                (etc / "hosts").write_text(hosts)
                _ip("link", "add", host_side, "type", "veth", "peer", "name", inside)
                _ip("link", "set", inside, "netns", ns)
                _ip("link", "set", inside, "name", "eth0", netns=ns)
                _ip("addr", "add", f"{self.address(node)}/24", "dev", "eth0", netns=ns)
                _ip("link", "set", "eth0", "up", netns=ns)
                _ip("link", "set", "lo", "up", netns=ns)
                _ip("link", "set", host_side, "master", self.bridge)
                _ip("link", "set", host_side, "up")
        except ConfigError:
            self.remove()
            raise
        return self

    def command(self, node: int, argv: list[str]) -> list[str]:
        """`argv` run inside node's namespace (the same process: `ip netns exec` execs it)."""
        return ["ip", "netns", "exec", self.namespace(node), *argv]

    def remove(self) -> None:
        """Removes every namespace (their veth pairs go with them) and the bridge; safe to call twice."""
        for node in range(self.nodes):
            subprocess.run(["ip", "netns", "del", self.namespace(node)], capture_output=True)
            shutil.rmtree(Path("/etc/netns") / self.namespace(node), ignore_errors=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
