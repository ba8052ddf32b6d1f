"""Which network interface holds an address: the one a job's process groups may listen on."""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct

SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address


def interface_of(address: str) -> str:
    """The name of the interface that holds `address` ("lo" for a loopback one), or "" when none here does
    (a host name, or an address of another machine): gloo then chooses, as it always did."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return ""
    if ip.is_loopback:
        return "lo"
    if ip.version == 4:
        for _, name in socket.if_nameindex():
            if _ipv4_of(name) == address:
                return name
        return ""
    return _ipv6_interface(ip)


def _ipv4_of(name: str) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            raw = fcntl.ioctl(sock.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError:  # no IPv4 address on it
            return None
    return socket.inet_ntoa(raw[20:24])


def _ipv6_interface(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str:
    try:
        lines = open("/proc/net/if_inet6").read().splitlines()
    except OSError:
        return ""
    for line in lines:
        fields = line.split()
        if len(fields) >= 6 and ipaddress.ip_address(bytes.fromhex(fields[0])) == ip:
            return fields[5]
    return ""


def listen_address() -> str:
    """Where this process's replica streams listen (runtime/stream.py): on the interface its process groups
    use (GLOO_SOCKET_IFNAME's first, which the launcher sets to the one holding the job's address: loopback
    on one machine, the node's own in a network namespace), else on the host name's address, as gloo does."""
    names = [name for name in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if name]
    if names:
        address = _ipv4_of(names[0]) or _ipv6_of(names[0])
        if address:
            return address
    return socket.gethostbyname(socket.gethostname())


def _ipv6_of(name: str) -> str | None:
    try:
        lines = open("/proc/net/if_inet6").read().splitlines()
    except OSError:
        return None
    ours = [ipaddress.ip_address(bytes.fromhex(f[0])) for f in map(str.split, lines) if len(f) >= 6 and f[5] == name]
    routable = [ip for ip in ours if not ip.is_link_local]  # a link-local one would need its scope named
    return str(routable[0]) if routable else None
