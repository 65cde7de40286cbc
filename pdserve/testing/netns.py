"""Several "hosts" on one machine: Linux network namespaces joined by a bridge.

Each host is a network namespace with its own stack (loopback, one veth
interface, an address in a private /24 of the 198.18.0.0/15 benchmarking
range); the bridge sits in the caller's namespace with the .1 address, so the
caller reaches every host and every host reaches the others. Traffic never
leaves the machine. Needs root (CAP_NET_ADMIN) and `ip` from iproute2.

    with Hosts(3) as hosts:
        hosts[0].popen(["python", "-m", "pdserve.cli", "router", "--host", hosts[0].address, ...])
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
from dataclasses import dataclass


class NetnsUnavailable(RuntimeError):
    """Namespaces cannot be made here (not root, no `ip`, or the kernel refuses)."""


def _ip(*args: str, ns: str | None = None) -> None:
    cmd = (["ip", "netns", "exec", ns] if ns else []) + ["ip", *args]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise NetnsUnavailable(f"`{' '.join(cmd)}` failed: {r.stderr.strip()}")


@dataclass
class Host:
    name: str  # the namespace
    address: str

    def popen(self, cmd: list[str], **kw) -> subprocess.Popen:
        """Start a process inside this host's network namespace."""
        return subprocess.Popen(["ip", "netns", "exec", self.name, *cmd], **kw)

    def run(self, cmd: list[str], **kw) -> subprocess.CompletedProcess:
        return subprocess.run(["ip", "netns", "exec", self.name, *cmd], **kw)


class Hosts:
    """`n` namespaces on one bridge; everything made is removed on exit, whatever happened."""

    def __init__(self, n: int):
        if os.geteuid() != 0 or shutil.which("ip") is None:
            raise NetnsUnavailable("network namespaces need root and iproute2's `ip`")
        self.tag = secrets.token_hex(3)
        self.subnet = f"198.18.{secrets.randbelow(250) + 2}"  # one /24 per instance: parallel runs do not collide
        self.bridge = f"pdbr{self.tag}"
        self.gateway = f"{self.subnet}.1"
        self.hosts: list[Host] = []
        self._links: list[str] = []
        self._made_bridge = False
        try:
            self._build(n)
        except BaseException:
            self.close()
            raise

    def _build(self, n: int) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        self._made_bridge = True
        _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for i in range(n):
            host = Host(f"pd{self.tag}h{i}", f"{self.subnet}.{10 + i}")
            subprocess.run(["ip", "netns", "add", host.name], check=True, capture_output=True)
            self.hosts.append(host)
            outer, inner = f"pd{self.tag}v{i}", f"pd{self.tag}p{i}"
            _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
            self._links.append(outer)
            _ip("link", "set", outer, "master", self.bridge)
            _ip("link", "set", outer, "up")
            _ip("link", "set", inner, "netns", host.name)
            _ip("link", "set", "lo", "up", ns=host.name)
            _ip("link", "set", inner, "name", "eth0", ns=host.name)
            _ip("addr", "add", f"{host.address}/24", "dev", "eth0", ns=host.name)
            _ip("link", "set", "eth0", "up", ns=host.name)

    def close(self) -> None:
        for host in self.hosts:
            _kill_all_in(host.name)
            subprocess.run(["ip", "netns", "del", host.name], capture_output=True)
        for link in self._links:  # usually gone with its namespace's peer
            subprocess.run(["ip", "link", "del", link], capture_output=True)
        if self._made_bridge:
            subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
        self.hosts, self._links, self._made_bridge = [], [], False

    def __getitem__(self, i: int) -> Host:
        return self.hosts[i]

    def __len__(self) -> int:
        return len(self.hosts)

    def __enter__(self) -> Hosts:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _kill_all_in(ns: str) -> None:
    """Kill what still runs in a namespace (a process left there would keep it alive)."""
    r = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
    for pid in r.stdout.split():
        try:
            os.kill(int(pid), 9)
        except (ProcessLookupError, ValueError):
            pass
