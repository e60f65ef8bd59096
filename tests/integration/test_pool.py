"""A pool of three real sidecar processes sharing a real redis-server over loopback.

Each sidecar binds its peer port to its own loopback address (127.0.0.11, .12, .13), so
the nodes are told apart by address as separate hosts would be.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvpool_bench.services import RedisServer
from kvpool_client.client import PoolClient
from kvpool_client.keys import ModelFingerprint, block_keys
from kvpool_client.protocol import Op
from kvpool_sidecar.process import SidecarProcess
from tests.integration.poolfixtures import pool, redis  # noqa: F401 - fixtures
from tests.integration.support import RawConn

pytestmark = [pytest.mark.integration, pytest.mark.redis]

FP = ModelFingerprint("pool/test", "bf16", 8, "bytes")


def wait_for(pred: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.05)
    return pred()


def blobs(keys: list[Any], size: int = 100_000) -> list[bytes]:
    return [os.urandom(size - i) for i in range(len(keys))]


def test_a_block_put_on_a_is_a_hit_on_b_and_c(pool: Callable[..., SidecarProcess]) -> None:
    a, b, c = pool("a", "127.0.0.11"), pool("b", "127.0.0.12"), pool("c", "127.0.0.13")
    keys = block_keys(FP, list(range(8 * 12)))
    data = blobs(keys)
    with PoolClient(a.socket_path) as ca:
        assert all(s.name == "STORED" for s in ca.put(keys, data, chain=True))
    for node in (b, c):
        with PoolClient(node.socket_path) as cl:
            assert wait_for(lambda: cl.lookup(keys).prefix == len(keys))
            assert cl.lookup(keys).tiers == ["peer"] * len(keys)
            got = cl.get(keys)
            assert [bytes(g) if g is not None else None for g in got] == data
            # now local: served from this node's own DRAM
            assert cl.lookup(keys).tiers == ["dram"] * len(keys)
            counters = cl.stats()["counters"]
            assert counters["fetch_ok"] == len(keys)
            assert counters["fetch_bytes"] == sum(map(len, data))
            assert counters.get("fetch_failed", 0) == 0


def test_tenants_key_spaces_hold_across_nodes(pool: Callable[..., SidecarProcess]) -> None:
    tenants = [{"name": "default"}, {"name": "a"}, {"name": "b"}]
    a, b = pool("a", "127.0.0.11", tenants=tenants), pool("b", "127.0.0.12", tenants=tenants)
    keys = block_keys(FP, list(range(8 * 5)))
    data = blobs(keys)
    with PoolClient(a.socket_path, tenant="a") as on_a:
        assert all(s.name == "STORED" for s in on_a.put(keys, data, chain=True))
    with PoolClient(b.socket_path, tenant="a") as same, PoolClient(b.socket_path, tenant="b") as other:
        # both nodes map tenant a's keys alike, so the index and the peer fetch find them;
        # the fetched blocks land in a's own arena, read zero-copy
        assert same.shm and other.shm
        assert wait_for(lambda: same.lookup(keys).prefix == len(keys))
        assert [bytes(g) if g is not None else None for g in same.get(keys)] == data
        # tenant b sends the same keys and finds nothing, locally or in the pool
        assert other.lookup(keys).prefix == 0
        assert other.get(keys) == [None] * len(keys)


def test_a_dead_holder_is_a_clean_miss_and_is_swept(pool: Callable[..., SidecarProcess]) -> None:
    a, b = pool("a", "127.0.0.11"), pool("b", "127.0.0.12")
    keys = block_keys(FP, list(range(8 * 6)))
    with PoolClient(a.socket_path) as ca:
        ca.put(keys, blobs(keys), chain=True)
    with PoolClient(b.socket_path) as cb:
        assert wait_for(lambda: cb.lookup(keys).prefix == len(keys))
        os.kill(a.pid, signal.SIGKILL)  # no drain, no unpublish
        a.proc.wait()  # type: ignore[union-attr]
        got = cb.get(keys)  # the peer port is gone: misses within the fetch deadline
        assert got == [None] * len(keys)
        # its heartbeat expires and the sweeper removes its entries
        assert wait_for(lambda: cb.lookup(keys).prefix == 0, timeout=15)


def test_a_read_that_meets_a_dead_holder_gets_its_blocks_from_a_live_one(redis: RedisServer,
                                                                      pool: Callable[..., SidecarProcess]) -> None:
    """b and c hold the same blocks; b is chosen (the lower load, and the first name on a tie).
    Killed, b refuses connections while its record is still believed (its heartbeat is slow):
    that cost no time, so every read went to b again, each a miss, though c held the blocks.
    Now b is skipped, and the read that met it asks c within its deadline."""
    a = pool("a", "127.0.0.11")
    b = pool("b", "127.0.0.12", dram={"size_bytes": "256Mi"},
             index={"backend": "redis", "url": redis.url, "heartbeat_s": 5.0, "sweep_s": 0.5})
    c = pool("c", "127.0.0.13")
    keys = block_keys(FP, list(range(8 * 6)))
    data = blobs(keys)
    for holder in (b, c):
        with PoolClient(holder.socket_path) as ch:
            assert all(s.name == "STORED" for s in ch.put(keys, data, chain=True))
    with PoolClient(a.socket_path) as ca:
        assert wait_for(lambda: ca.lookup(keys).prefix == len(keys))
        os.kill(b.pid, signal.SIGKILL)  # no drain, no unpublish
        b.proc.wait()  # type: ignore[union-attr]
        # b is chosen, refuses at once, and is skipped: the read asks c instead
        assert [bytes(g) if g is not None else None for g in ca.get(keys)] == data
        counters = ca.stats()["counters"]
        assert counters["fetch_ok"] == len(keys) and counters.get("fetch_failed", 0) == 0


def test_a_holder_that_stalls_is_a_miss_within_the_deadline(pool: Callable[..., SidecarProcess]) -> None:
    a, b = pool("a", "127.0.0.11"), pool("b", "127.0.0.12")
    keys = block_keys(FP, list(range(8 * 4)))
    with PoolClient(a.socket_path) as ca:
        ca.put(keys, blobs(keys, 1 << 20), chain=True)
    with PoolClient(b.socket_path) as cb:
        assert wait_for(lambda: cb.lookup(keys).prefix == len(keys))
        os.kill(a.pid, signal.SIGSTOP)  # alive but silent: the fetch deadline must end it
        try:
            got = cb.get(keys)
        finally:
            os.kill(a.pid, signal.SIGCONT)
        assert got == [None] * len(keys)
        assert cb.stats()["pending_writes"] == 0  # reserved room was given back
        assert cb.stats()["counters"]["fetch_failed"] == len(keys)


def test_a_holder_that_dies_mid_transfer_leaves_only_whole_blocks(pool: Callable[..., SidecarProcess]) -> None:
    a = pool("a", "127.0.0.11", dram={"size_bytes": "256Mi"})
    b = pool("b", "127.0.0.12", dram={"size_bytes": "256Mi"})
    keys = block_keys(FP, list(range(8 * 48)))
    data = blobs(keys, 4 << 20)
    with PoolClient(a.socket_path) as ca:
        ca.put(keys, data, chain=True)
    results: list[Any] = []
    with PoolClient(b.socket_path) as cb, PoolClient(b.socket_path) as watcher:
        assert wait_for(lambda: cb.lookup(keys).prefix == len(keys))
        getter = threading.Thread(target=lambda: results.append(cb.get(keys)))
        getter.start()
        # kill the holder as soon as the transfer is under way (room reserved on b)
        assert wait_for(lambda: watcher.stats()["pending_writes"] > 0 or not getter.is_alive(), timeout=20)
        os.kill(a.pid, signal.SIGKILL)
        getter.join(30)
        assert not getter.is_alive()
        assert watcher.stats()["pending_writes"] == 0
    got = results[0]
    # every block served is whole and right; the rest are misses
    for g, d in zip(got, data):
        assert g is None or bytes(g) == d
    assert any(g is None for g in got)


def test_redis_restart_heals_the_index(redis: RedisServer, pool: Callable[..., SidecarProcess]) -> None:
    a, b = pool("a", "127.0.0.11"), pool("b", "127.0.0.12")
    keys = block_keys(FP, list(range(8 * 5)))
    data = blobs(keys)
    with PoolClient(a.socket_path) as ca:
        ca.put(keys, data, chain=True)
    redis.stop()
    redis.start()  # same port, empty
    with PoolClient(b.socket_path) as cb:
        assert wait_for(lambda: cb.lookup(keys).prefix == len(keys), timeout=15)
        got = cb.get(keys)
        assert [bytes(g) if g is not None else None for g in got] == data


def test_reads_skip_a_stopped_index_after_it_failed_one_and_find_peers_again_once_it_answers(
        redis: RedisServer, pool: Callable[..., SidecarProcess]) -> None:
    """With Redis stopped, every LOOKUP of a prompt not held here had asked the index and
    waited out the peers' deadline (a vLLM scheduler step stalled a second): after one read
    the index failed, reads skip it for a while, and find the peers' blocks again once it
    answers."""
    a, b = pool("a", "127.0.0.11"), pool("b", "127.0.0.12")
    keys = block_keys(FP, list(range(8 * 5)))
    data = blobs(keys)
    with PoolClient(a.socket_path) as ca:
        ca.put(keys, data, chain=True)
    assert redis.proc is not None
    with PoolClient(b.socket_path) as cb:
        assert wait_for(lambda: cb.lookup(keys).prefix == len(keys))
        before = cb.stats()["counters"].get("index_unanswered", 0)
        os.kill(redis.proc.pid, signal.SIGSTOP)
        try:
            for _ in range(10):
                assert cb.lookup(keys[1:]).prefix == 0  # (not the prefix the last lookup asked of the index)
            unanswered = cb.stats()["counters"].get("index_unanswered", 0) - before
        finally:
            os.kill(redis.proc.pid, signal.SIGCONT)
        assert 1 <= unanswered <= 2  # (a second: the back-off, 0.5 s, ended on a slow machine)
        assert wait_for(lambda: cb.lookup(keys[1:]).prefix == len(keys) - 1)
        got = cb.get(keys)
        assert [bytes(g) if g is not None else None for g in got] == data


def test_a_node_with_the_wrong_token_gets_nothing(pool: Callable[..., SidecarProcess], tmp_path: Path) -> None:
    a = pool("a", "127.0.0.11")
    bad = tmp_path / "bad-token"
    bad.write_text("this-is-not-the-pool-secret")
    m = pool("mallory", "127.0.0.14", token_file=bad)
    b = pool("b", "127.0.0.12")
    keys = block_keys(FP, list(range(8 * 3)))
    with PoolClient(a.socket_path) as ca:
        ca.put(keys, blobs(keys), chain=True)
    with PoolClient(b.socket_path) as cb:
        assert wait_for(lambda: cb.lookup(keys).prefix == len(keys))  # the index names a as their holder
    with PoolClient(m.socket_path) as cm:
        # the index is not secret, but mallory cannot verify a's node record: no hit promised, no data
        assert cm.lookup(keys).prefix == 0
        assert cm.get(keys) == [None] * len(keys)
    # with another secret, mallory cannot even verify a's node record, so it never connects
    assert wait_for(lambda: "not signed with the pool secret" in m.log_tail(50) or "rejected peer" in a.log_tail(50))


def test_kvpool_status_reads_the_pool_from_redis(redis: RedisServer, pool: Callable[..., SidecarProcess]) -> None:
    a = pool("a", "127.0.0.11")
    pool("b", "127.0.0.12")
    keys = block_keys(FP, list(range(8 * 3)))
    with PoolClient(a.socket_path) as ca:
        ca.put(keys, blobs(keys), chain=True)
        ca.get(keys)
    cmd = [sys.executable, "-m", "kvpool_sidecar.cli", "status", "--redis", redis.url, "--pool", "itest", "--json"]

    def status() -> dict[str, Any]:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=True)
        parsed: dict[str, Any] = json.loads(out.stdout)
        return parsed

    assert wait_for(lambda: status()["hits"] >= len(keys))  # heartbeats carry the figures
    st = status()
    assert sorted(n["name"] for n in st["nodes"]) == ["a", "b"]
    assert st["tiers"]["dram"]["blocks"] == len(keys)
    assert st["tiers"]["dram"]["capacity_bytes"] == 2 * 64 * 2**20
    assert 0 < st["hit_rate"] <= 1
    human = subprocess.run(cmd[:-1], capture_output=True, text=True, timeout=60, check=True).stdout
    assert "pool itest  nodes 2" in human and "node a" in human


def test_kvpool_status_takes_the_pool_names_users_type(redis: RedisServer,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """The operator's pools are <namespace>.<name> in the index. kubectl's namespace/name and a
    bare name only one namespace has find the pool; a name of no pool, or of pools in several
    namespaces, is an error that lists the pools, never an empty pool ("nodes 0")."""
    import asyncio

    from kvpool_sidecar.cli import main as cli_main
    from kvpool_sidecar.index.redis import RedisIndex

    tiers = {"dram": {"capacity_bytes": 1 << 30, "used_bytes": 0, "blocks": 0}}

    async def register(pool: str, node: str) -> None:
        index = RedisIndex.from_url(redis.url, pool=pool)
        try:
            await index.heartbeat(node, "10.0.0.1:9467", tiers, 0, 0, [], ttl_s=60)
        finally:
            await index.close()

    for pool, node in [("team-a.cache", "gpu-1"), ("team-b.cache", "gpu-2"), ("team-a.solo", "gpu-3")]:
        asyncio.run(register(pool, node))

    def status(pool: str) -> tuple[int, str, str]:
        code = cli_main(["status", "--redis", redis.url, "--pool", pool])
        out, err = capsys.readouterr()
        return code, out, err

    for typed in ("team-a.solo", "team-a/solo", "solo"):
        code, out, err = status(typed)
        assert (code, err) == (0, ""), typed
        assert out.startswith("pool team-a.solo  nodes 1") and "node gpu-3" in out, (typed, out)
    code, out, _ = status("team-b/cache")
    assert code == 0 and "node gpu-2" in out and "gpu-1" not in out
    for typed, says in [("cache", "in several namespaces: team-a.cache, team-b.cache"),
                        ("nope", "no pool 'nope' in this index (pools there: team-a.cache, team-a.solo, team-b.cache)"),
                        ("team-c/cache", "no pool 'team-c/cache'"), ("default", "no pool 'default'")]:
        code, out, err = status(typed)
        assert code == 1 and out == "" and says in err, (typed, err)
        assert "nodes 0" not in out + err


def lends(node: SidecarProcess) -> int:
    """Blocks ``node`` served (lent to peers: its own clients here only put)."""
    with PoolClient(node.socket_path) as c:
        return int(c.stats()["counters"].get("get_hit", 0))


def test_a_block_named_many_times_in_one_read_crosses_the_wire_once(pool: Callable[..., SidecarProcess]) -> None:
    """A read naming one block (held by a) 200 times had a lend it, and send it, 200 times
    (and fill its lending account): it is fetched once, and answered at every place."""
    a, b = pool("a", "127.0.0.11"), pool("b", "127.0.0.12")
    [key] = block_keys(FP, list(range(8)))
    data = os.urandom(64 << 10)
    with PoolClient(a.socket_path) as ca:
        ca.put([key], [data])
    with PoolClient(b.socket_path) as cb:
        assert wait_for(lambda: cb.lookup([key]).prefix == 1)
    with RawConn(b.socket_path) as raw:
        _, status, got = raw.call(int(Op.GET_INLINE), [key.raw] * 200)
    assert status == 0 and got == [data] * 200
    assert lends(a) == 1
    with PoolClient(b.socket_path) as cb:
        counters = cb.stats()["counters"]
        assert (counters["fetch_ok"], counters.get("fetch_failed", 0)) == (1, 0)


def test_a_tenant_whose_blocks_find_no_room_is_not_sent_them_on_every_read(
        pool: Callable[..., SidecarProcess]) -> None:
    """b's tenant has a quota smaller than one block: every read had a send every block again
    (to be dropped), and b's LOOKUP kept counting them as held by a peer, so an engine kept
    asking. After one such fetch b neither asks a for them nor counts them, for a while."""
    a = pool("a", "127.0.0.11")
    b = pool("b", "127.0.0.12", tenants=[{"name": "default", "quota_bytes": 64 << 10}])
    keys = block_keys(FP, list(range(8 * 6)))
    with PoolClient(a.socket_path) as ca:
        ca.put(keys, blobs(keys, 256 << 10), chain=True)
    with PoolClient(b.socket_path) as cb:
        assert wait_for(lambda: cb.lookup(keys).prefix == len(keys))
        for _ in range(3):
            assert cb.get(keys) == [None] * len(keys)
            assert cb.lookup(keys).prefix == 0
        assert cb.stats()["counters"].get("fetch_bytes", 0) == 0
    assert lends(a) == len(keys)  # the first read's, and no other
