"""A private test network of Linux network namespaces joined by a bridge (issue #3).

Topology (``N`` is a free /24 in 10.231.0.0/16, chosen per session)::

    root namespace:  bridge kvpt<pid>br  10.231.N.1/24   (redis-server binds here)
                       |-- veth kvpt<pid>a  <->  eth0 in netns kvpt<pid>-a  10.231.N.11/24
                       |-- veth kvpt<pid>b  <->  eth0 in netns kvpt<pid>-b  10.231.N.12/24
                       '-- ...

The namespaces have ``lo`` up and no default route, and the bridge has no uplink, so no
packet can leave the bridge and its namespaces. Names carry the pid of the test process so
concurrent sessions do not collide; :meth:`TestNet.close` removes everything even when the
setup failed half-way, and :func:`reap_stale` removes what a killed session left behind.

Processes run in a namespace through ``ip netns exec NAME``, which execs the command (the
child's pid is the daemon's pid) and shares the filesystem, so a sidecar's Unix socket is
reachable from the test process in the root namespace.
"""

from __future__ import annotations

import ipaddress
import os
import re
import shutil
import socket
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

PREFIX = "kvpt"
_OURS = re.compile(rf"^{PREFIX}(\d+)(?:-|br|[a-z])")


class NetnsUnavailable(RuntimeError):
    """``ip netns add`` is not permitted here (the tests skip)."""


def ip(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    cmd = ["ip", *(["-n", ns] if ns else []), *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr.strip()}")
    return r


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def reap_stale() -> None:
    """Remove namespaces and links of this helper whose test process is gone."""
    if shutil.which("ip") is None:
        return
    names = ip("netns", "list", check=False).stdout.split()
    links = re.findall(r"^\d+:\s+([^:@\s]+)", ip("-o", "link", "show", check=False).stdout, re.M)
    for name in names:
        m = _OURS.match(name)
        if m and int(m.group(1)) != os.getpid() and not _pid_alive(int(m.group(1))):
            ip("netns", "del", name, check=False)
    for link in links:
        m = _OURS.match(link)
        if m and int(m.group(1)) != os.getpid() and not _pid_alive(int(m.group(1))):
            ip("link", "del", link, check=False)


def _free_subnet(start: int) -> ipaddress.IPv4Network:
    used = [ipaddress.ip_interface(a).network
            for a in re.findall(r"inet (\S+)", ip("-4", "-o", "addr", "show", check=False).stdout)]
    for i in range(250):
        net = ipaddress.IPv4Network(f"10.231.{(start + i) % 250 + 1}.0/24")
        if not any(net.overlaps(u) for u in used):
            return net
    raise RuntimeError("no free /24 in 10.231.0.0/16 for the test network")


@dataclass
class Host:
    """One namespace on the test bridge."""

    name: str  # logical name: a, b, c, ...
    netns: str
    address: str
    bridge_veth: str  # the root-namespace end, enslaved to the bridge
    ns_veth: str = "eth0"  # the end inside the namespace

    @property
    def exec_prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.netns]

    def link(self, up: bool, *, side: str = "bridge") -> None:
        """Set this host's link up or down, on the bridge side or inside the namespace."""
        state = "up" if up else "down"
        if side == "bridge":
            ip("link", "set", self.bridge_veth, state)
        elif side == "ns":
            ip("link", "set", self.ns_veth, state, ns=self.netns)
        else:
            raise ValueError(f"side must be 'bridge' or 'ns', not {side!r}")

    def rx_bytes(self) -> int:
        """Bytes the bridge has delivered to this host (read in the root namespace)."""
        return int(Path(f"/sys/class/net/{self.bridge_veth}/statistics/tx_bytes").read_text())

    def tcp_queued(self, port: int) -> int:
        """Bytes waiting in this host's TCP queues (send and receive) of connections on ``port``."""
        r = subprocess.run([*self.exec_prefix, "ss", "-tnH", "state", "all"], capture_output=True, text=True,
                           timeout=30, check=True)
        total = 0
        for line in r.stdout.splitlines():
            f = line.split()
            # State Recv-Q Send-Q Local:Port Peer:Port
            if len(f) >= 5 and f[0] not in ("LISTEN", "UNCONN") and (f[3].endswith(f":{port}")
                                                                     or f[4].endswith(f":{port}")):
                total += int(f[1]) + int(f[2])
        return total

    def shape(self, rate: str) -> None:
        """Limit what this host sends (tbf on its own end); ``shape('')`` removes the limit."""
        base = ["tc", "qdisc", "del" if not rate else "replace", "dev", self.ns_veth, "root"]
        args = base if not rate else [*base, "tbf", "rate", rate, "burst", "256kb", "latency", "2s"]
        r = subprocess.run(["ip", "netns", "exec", self.netns, *args], capture_output=True, text=True, timeout=30)
        if r.returncode != 0 and rate:
            raise RuntimeError(f"tc on {self.netns} failed: {r.stderr.strip()}")


class TestNet:
    """The bridge and one namespace per host; a context manager that always cleans up."""

    __test__ = False  # not a pytest class

    def __init__(self, hosts: Sequence[str] = ("a", "b", "c", "m")) -> None:
        pid = os.getpid()
        self.tag = f"{PREFIX}{pid}"
        self.bridge = f"{self.tag}br"
        self.subnet: ipaddress.IPv4Network | None = None
        self.hosts: dict[str, Host] = {}
        self._names = list(hosts)
        self._made_ns: list[str] = []
        self._made_links: list[str] = []

    @property
    def gateway(self) -> str:
        """The bridge's address in the root namespace."""
        assert self.subnet is not None
        return str(self.subnet.network_address + 1)

    def up(self) -> TestNet:
        if shutil.which("ip") is None:
            raise RuntimeError("iproute2 (ip) is not installed")
        reap_stale()
        try:
            self._probe_permission()
            self.subnet = _free_subnet(os.getpid() % 250)
            plen = self.subnet.prefixlen
            ip("link", "add", self.bridge, "type", "bridge", "forward_delay", "0", "stp_state", "0")
            self._made_links.append(self.bridge)
            ip("addr", "add", f"{self.gateway}/{plen}", "dev", self.bridge)
            ip("link", "set", self.bridge, "up")
            for i, name in enumerate(self._names):
                host = Host(name, f"{self.tag}-{name}", str(self.subnet.network_address + 11 + i),
                            f"{self.tag}{name}")
                ip("netns", "add", host.netns)
                self._made_ns.append(host.netns)
                ip("link", "set", "lo", "up", ns=host.netns)
                ip("link", "add", host.bridge_veth, "type", "veth", "peer", "name", host.ns_veth,
                   "netns", host.netns)
                self._made_links.append(host.bridge_veth)
                ip("link", "set", host.bridge_veth, "master", self.bridge)
                ip("link", "set", host.bridge_veth, "up")
                ip("addr", "add", f"{host.address}/{plen}", "dev", host.ns_veth, ns=host.netns)
                ip("link", "set", host.ns_veth, "up", ns=host.netns)
                self.hosts[name] = host
            self._wait_reachable()
        except BaseException:
            self.close()
            raise
        return self

    def _probe_permission(self) -> None:
        probe = f"{self.tag}-probe"
        r = ip("netns", "add", probe, check=False)
        if r.returncode != 0:
            err = r.stderr.strip()
            if "not permitted" in err or "Permission denied" in err:
                raise NetnsUnavailable(f"ip netns add is not permitted here: {err}")
            raise RuntimeError(f"ip netns add {probe} failed: {err}")
        ip("netns", "del", probe, check=False)

    def _wait_reachable(self, timeout: float = 10.0) -> None:
        """Every namespace can open a TCP connection to the bridge address (a listener here)."""
        with socket.socket() as srv:
            srv.bind((self.gateway, 0))
            srv.listen(16)
            port = srv.getsockname()[1]
            for host in self.hosts.values():
                code = ("import socket,sys,time\n"
                        f"d=time.monotonic()+{timeout}\n"
                        "while True:\n"
                        f" try: socket.create_connection(('{self.gateway}',{port}),timeout=0.5).close(); break\n"
                        " except OSError:\n"
                        "  if time.monotonic()>d: sys.exit(1)\n"
                        "  time.sleep(0.05)\n")
                r = subprocess.run([*host.exec_prefix, sys.executable, "-c", code], capture_output=True,
                                   text=True, timeout=timeout + 20)
                if r.returncode != 0:
                    raise RuntimeError(f"{host.netns} cannot reach {self.gateway}: {r.stderr.strip()}")

    def close(self) -> None:
        """Delete the namespaces, the veths and the bridge (best effort; never raises)."""
        for ns in reversed(self._made_ns):
            ip("netns", "del", ns, check=False)
        for link in reversed(self._made_links):  # deleting one end of a veth deletes both
            if ip("link", "show", link, check=False).returncode == 0:
                ip("link", "del", link, check=False)
        self._made_ns.clear()
        self._made_links.clear()
        self.hosts.clear()

    def leftovers(self) -> list[str]:
        """Our namespaces and links that still exist (for a test of the cleanup)."""
        names = ip("netns", "list", check=False).stdout.split()
        links = re.findall(r"^\d+:\s+([^:@\s]+)", ip("-o", "link", "show", check=False).stdout, re.M)
        return [n for n in names + links if n.startswith(self.tag) and _OURS.match(n)]

    def __enter__(self) -> TestNet:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.close()


def netns_of(pid: int) -> str:
    """The network namespace inode of a process (to check a daemon runs where it should)."""
    return os.readlink(f"/proc/{pid}/ns/net")


__all__ = ["Host", "NetnsUnavailable", "TestNet", "netns_of", "reap_stale"]
