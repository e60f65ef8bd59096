"""A pool of real sidecars on separate network stacks: one Linux network namespace each.

Unlike ``test_pool.py`` (loopback aliases), every sidecar here runs under ``ip netns exec``
in its own namespace, joined to the others only by veth pairs on a private bridge; the
redis-server listens on the bridge's address in the root namespace. Peer traffic therefore
crosses real links that a test can cut (``ip link set ... down``) or slow (``tc tbf``).
The test process stays in the root namespace and talks to each sidecar over its Unix
socket, which lives in the shared filesystem. See ``tests/integration/netns.py``.

Needs root (``ip netns add``); the module skips when that is not permitted.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvpool_sidecar.process import SidecarProcess
from kvpool_bench.services import RedisServer

from kvpool_client.client import PoolClient
from tests.integration.netns import NetnsUnavailable, TestNet, ip, netns_of
from tests.integration.support import DEADLINE_S, fresh_keys, payload, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.redis, pytest.mark.netns]

TOKEN = "pool-secret-0123456789abcdef"
PEER_PORT = 9467  # the same port on every host: each namespace has its own port space
FETCH_TIMEOUT_S = 2.0
#: A fetch does at most one index call and one transfer, each under the fetch deadline;
#: the client gives the sidecar that plus slack for a busy machine, then fails the test.
CUT_DEADLINE_S = 2 * FETCH_TIMEOUT_S + 4.0


@pytest.fixture(scope="module")
def net() -> Iterator[TestNet]:
    try:
        tn = TestNet(("a", "b", "c", "m")).up()
    except NetnsUnavailable as e:
        pytest.skip(str(e))
    try:
        yield tn
    finally:
        tn.close()
        assert tn.leftovers() == [], "the test network was not removed"


@pytest.fixture
def redis(net: TestNet) -> Iterator[RedisServer]:
    with RedisServer(host=net.gateway) as r:
        yield r


@pytest.fixture
def pool(net: TestNet, redis: RedisServer, tmp_path_factory: pytest.TempPathFactory
         ) -> Iterator[Callable[..., SidecarProcess]]:
    """Start the sidecar of host ``name`` in that host's namespace."""
    token = tmp_path_factory.mktemp("token") / "token"
    token.write_text(TOKEN)
    started: list[SidecarProcess] = []

    def start(name: str, token_file: Path = token, peer: dict[str, Any] | None = None,
              **extra: Any) -> SidecarProcess:
        host = net.hosts[name]
        cfg: dict[str, Any] = {
            "node_name": name,
            "pool": "netns",
            "dram": {"size_bytes": "64Mi"},
            "index": {"backend": "redis", "url": redis.url, "heartbeat_s": 0.2, "sweep_s": 0.5},
            "peer": {"enabled": True, "host": host.address, "port": PEER_PORT, "token_file": str(token_file),
                     "fetch_timeout_s": FETCH_TIMEOUT_S, **(peer or {})},
            **extra,
        }
        sp = SidecarProcess(cfg, prefix=host.exec_prefix, workdir=tmp_path_factory.mktemp(f"sidecar-{name}"))
        started.append(sp)
        return sp.start()

    yield start
    for sp in started:
        sp.stop()
    for host in net.hosts.values():  # a failed test may have left a link down or shaped
        host.shape("")
        host.link(True, side="ns")
        host.link(True, side="bridge")


def as_bytes(got: list[Any]) -> list[bytes | None]:
    return [None if g is None else bytes(g) for g in got]


def test_a_block_put_on_a_is_a_hit_on_b_and_c(net: TestNet, pool: Callable[..., SidecarProcess]) -> None:
    a, b, c = pool("a"), pool("b"), pool("c")
    # each daemon really runs in its own namespace and advertises its namespace address
    root = os.readlink("/proc/self/ns/net")
    spaces = {netns_of(sp.pid) for sp in (a, b, c)}
    assert len(spaces) == 3 and root not in spaces
    for name, sp in zip("abc", (a, b, c)):
        assert sp.ready["peer_address"] == f"{net.hosts[name].address}:{PEER_PORT}"
        assert "default" not in ip("route", "show", ns=net.hosts[name].netns).stdout  # nowhere to leak to
    keys = fresh_keys(12)
    data = [payload(k, 100_000 + i) for i, k in enumerate(keys)]
    with PoolClient(a.socket_path, timeout=DEADLINE_S) as ca:
        assert all(s.name == "STORED" for s in ca.put(keys, data, chain=True))
    for node in (b, c):
        with PoolClient(node.socket_path, timeout=DEADLINE_S) as cl:
            wait_until(lambda: cl.lookup(keys).prefix == len(keys), "the index to show a's blocks")
            assert cl.lookup(keys).tiers == ["peer"] * len(keys)
            assert as_bytes(cl.get(keys)) == data
            assert cl.lookup(keys).tiers == ["dram"] * len(keys)  # now held locally


@pytest.mark.parametrize("side", ["bridge", "ns"])
def test_a_cut_link_gives_clean_misses_then_hits_again(net: TestNet, pool: Callable[..., SidecarProcess],
                                                       side: str) -> None:
    a, b = pool("a"), pool("b")
    keys = fresh_keys(8)
    data = [payload(k, 200_000) for k in keys]
    with PoolClient(a.socket_path, timeout=DEADLINE_S) as ca:
        ca.put(keys, data, chain=True)
    # the client's timeout is the deadline: a sidecar that hangs past it fails the test
    with PoolClient(b.socket_path, timeout=CUT_DEADLINE_S) as cb:
        wait_until(lambda: cb.lookup(keys).prefix == len(keys), "b to see a's blocks")
        net.hosts["b"].link(False, side=side)
        try:
            assert cb.get(keys) == [None] * len(keys)
            cb.lookup(keys)  # still answers (whatever the index says)
            stats = cb.stats()
            assert stats["pending_writes"] == 0 and stats["blocks"] == 0
        finally:
            net.hosts["b"].link(True, side=side)
    with PoolClient(b.socket_path, timeout=DEADLINE_S) as cb:
        wait_until(lambda: as_bytes(cb.get(keys)) == data, "b to fetch a's blocks after the link came back")
        assert cb.lookup(keys).tiers == ["dram"] * len(keys)


class Getter(threading.Thread):
    """``get`` of ``keys`` on a sidecar in a thread, with its own client."""

    def __init__(self, sp: SidecarProcess, keys: list[Any], timeout: float) -> None:
        super().__init__(daemon=True)
        self.sp, self.keys, self.timeout = sp, keys, timeout
        self.result: list[bytes | None] | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with PoolClient(self.sp.socket_path, timeout=self.timeout) as c:
                self.result = as_bytes(c.get(self.keys))
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.error = e

    def outcome(self, deadline: float) -> list[bytes | None]:
        self.join(deadline)
        assert not self.is_alive(), f"the get did not end within {deadline}s"
        assert self.error is None, repr(self.error)
        assert self.result is not None
        return self.result


def start_transfer(net: TestNet, b: SidecarProcess, keys: list[Any], total: int, timeout: float) -> Getter:
    """Start b's get of a's blocks and return once part (not all) of them crossed the bridge."""
    host = net.hosts["b"]
    with PoolClient(b.socket_path, timeout=DEADLINE_S) as cb:
        wait_until(lambda: cb.lookup(keys).prefix == len(keys), "b to see a's blocks")
    before = host.rx_bytes()
    getter = Getter(b, keys, timeout)
    getter.start()
    wait_until(lambda: host.rx_bytes() - before >= total // 8 or not getter.is_alive(), "the transfer to start")
    assert getter.is_alive() and host.rx_bytes() - before < total, "the transfer ended before the fault"
    return getter


def test_killing_a_mid_transfer_leaves_only_whole_blocks(net: TestNet, pool: Callable[..., SidecarProcess]) -> None:
    a = pool("a")
    # a long fetch deadline: only a's death may end the transfer
    b = pool("b", peer={"fetch_timeout_s": 120.0})
    keys = fresh_keys(32)
    data = [payload(k, 1 << 20) for k in keys]
    with PoolClient(a.socket_path, timeout=DEADLINE_S) as ca:
        assert all(s.name == "STORED" for s in ca.put(keys, data, chain=True))
    net.hosts["a"].shape("80mbit")  # a sends slowly: the kill lands mid-transfer
    getter = start_transfer(net, b, keys, 32 << 20, timeout=120.0)
    os.kill(a.pid, signal.SIGKILL)
    a.proc.wait()  # type: ignore[union-attr]
    got = getter.outcome(DEADLINE_S)
    assert all(g is None or g == d for g, d in zip(got, data)), "a block b kept is not whole"
    hits = sum(g is not None for g in got)
    assert hits < len(keys), "every block arrived although a died mid-transfer"
    with PoolClient(b.socket_path, timeout=CUT_DEADLINE_S) as cb:
        stats = cb.stats()
        assert stats["pending_writes"] == 0  # the room of the blocks in flight was given back
        assert stats["blocks"] == hits
        assert as_bytes(cb.get(keys)) == got  # what b kept reads back the same


def test_a_link_cut_mid_transfer_spares_bs_other_blocks(net: TestNet, pool: Callable[..., SidecarProcess]) -> None:
    """The cut fetch ends at its deadline; what arrives late must not land in reused room."""
    a = pool("a")
    # small: b's next blocks reuse the fetch's room (and one batch of them is most of its DRAM)
    b = pool("b", dram={"size_bytes": "24Mi"}, api={"max_session_share": 1.0})
    keys = fresh_keys(16)
    data = [payload(k, 1 << 20) for k in keys]
    with PoolClient(a.socket_path, timeout=DEADLINE_S) as ca:
        assert all(s.name == "STORED" for s in ca.put(keys, data, chain=True))
    net.hosts["a"].shape("40mbit")
    getter = start_transfer(net, b, keys, 16 << 20, timeout=CUT_DEADLINE_S)
    net.hosts["b"].link(False, side="bridge")
    try:
        got = getter.outcome(CUT_DEADLINE_S)
        assert all(g is None or g == d for g, d in zip(got, data)), "a block b kept is not whole"
        mine = fresh_keys(16)
        own = [payload(k, 1 << 20) for k in mine]
        with PoolClient(b.socket_path, timeout=DEADLINE_S) as cb:
            assert cb.stats()["pending_writes"] == 0
            assert all(s.name == "STORED" for s in cb.put(mine, own, chain=True))
    finally:
        net.hosts["a"].shape("")
        net.hosts["b"].link(True, side="bridge")
    # the cut connection's remaining bytes now flow; wait until a has nothing left to send
    wait_until(lambda: net.hosts["a"].tcp_queued(PEER_PORT) == 0 and net.hosts["b"].tcp_queued(PEER_PORT) == 0,
               "the cut connection to drain or close", timeout=60)
    with PoolClient(b.socket_path, timeout=DEADLINE_S) as cb:
        assert as_bytes(cb.get(mine)) == own, "b's own blocks changed after the cut link came back"
        wait_until(lambda: as_bytes(cb.get(keys)) == data, "b to fetch a's blocks after the link came back")


def test_a_node_with_the_wrong_token_gets_nothing(pool: Callable[..., SidecarProcess], tmp_path: Path) -> None:
    a = pool("a")
    bad = tmp_path / "bad-token"
    bad.write_text("this-is-not-the-pool-secret")
    m = pool("m", token_file=bad)
    b = pool("b")
    keys = fresh_keys(3)
    with PoolClient(a.socket_path, timeout=DEADLINE_S) as ca:
        ca.put(keys, [payload(k, 100_000) for k in keys], chain=True)
    with PoolClient(b.socket_path, timeout=DEADLINE_S) as cb:
        wait_until(lambda: cb.lookup(keys).prefix == len(keys), "the index to name a as their holder")
    with PoolClient(m.socket_path, timeout=DEADLINE_S) as cm:
        # the index is not secret, but m cannot verify a's node record: no hit promised, no data
        assert cm.lookup(keys).prefix == 0
        assert cm.get(keys) == [None] * len(keys)
        assert cm.stats()["blocks"] == 0
    # with another secret, mallory cannot even verify a's node record, so it never connects
    assert "not signed with the pool secret" in m.log_tail(50) or "rejected peer" in a.log_tail(50)
