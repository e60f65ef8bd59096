"""One behaviour suite for every BlockIndex: MemoryIndex, RedisIndex on a redis-server and
RedisIndex on a 3-shard Redis Cluster (real processes, see conftest.py). Redis-only
behaviours (node registry, liveness, sweeping, healing, AUTH, deadlines) run on the two
Redis backends only."""

from __future__ import annotations

import asyncio
import hashlib
import socket
import statistics
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.crc import key_slot

from kvpool_sidecar.errors import ConfigError, RequestError
from kvpool_sidecar.events import IndexEvent
from kvpool_sidecar.index.base import BlockIndex
from kvpool_sidecar.index.memory import MemoryIndex
from kvpool_sidecar.index.redis import IndexUnavailableError, RedisIndex, RedisIndexSettings
from kvpool_sidecar.index.redisconn import Command
from tests.conftest import LoopTurns
from tests.contract.conftest import RedisClusterProcs, RedisServer, self_signed_cert, slow_pipelines

REDIS = pytest.mark.redis


def chain(n: int, seed: str = "") -> list[bytes]:
    """``n`` distinct 48-byte raw block keys."""
    seed = seed or uuid.uuid4().hex
    return [hashlib.sha384(f"{seed}:{i}".encode()).digest() for i in range(n)]


def pub(keys: list[bytes], tier: str = "dram", publish: bool = True) -> list[IndexEvent]:
    return [IndexEvent(publish, tier, k) for k in keys]


@dataclass
class Backend:
    kind: str
    index: BlockIndex
    url: str = ""
    ports: list[int] = field(default_factory=list)
    pool: str = ""

    @property
    def redis(self) -> RedisIndex:
        if not isinstance(self.index, RedisIndex):
            raise TypeError("not a Redis backend")
        return self.index

    async def live(self, *nodes: str, ttl_s: float = 60.0) -> None:
        """Make nodes live (Redis filters holders of unregistered nodes; memory has no liveness)."""
        if isinstance(self.index, RedisIndex):
            for n in nodes:
                await self.index.register(n, f"{n}.local:7070", {}, 0, 0, [], ttl_s)

    def raw(self) -> Redis | RedisCluster:
        if self.kind == "cluster":
            return RedisCluster.from_url(self.url, decode_responses=True)
        return Redis.from_url(self.url, decode_responses=True)

    async def flushall(self) -> None:
        for p in self.ports:
            r = Redis(host="127.0.0.1", port=p)
            await r.flushall()
            await r.aclose()


def new_redis_index(url: str, cluster: bool, **kw: Any) -> RedisIndex:
    kw.setdefault("pool", "t" + uuid.uuid4().hex[:12])
    kw.setdefault("live_cache_s", 0.0)
    return RedisIndex(url, RedisIndexSettings(cluster=cluster, **kw))


async def make_backend(request: pytest.FixtureRequest, kind: str) -> Backend:
    if kind == "memory":
        return Backend(kind, MemoryIndex())
    if kind == "redis":
        server: RedisServer = request.getfixturevalue("redis_server")
        idx = new_redis_index(server.url, False)
        return Backend(kind, idx, server.url, [server.port], idx._s.pool)
    procs: RedisClusterProcs = request.getfixturevalue("redis_cluster")
    idx = new_redis_index(procs.url, True)
    return Backend(kind, idx, procs.url, procs.ports, idx._s.pool)


@pytest.fixture(params=["memory", pytest.param("redis", marks=REDIS), pytest.param("cluster", marks=REDIS)])
async def backend(request: pytest.FixtureRequest) -> AsyncIterator[Backend]:
    b = await make_backend(request, request.param)
    yield b
    if isinstance(b.index, RedisIndex):
        await b.index.purge_pool()
    await b.index.close()


@pytest.fixture(params=[pytest.param("redis", marks=REDIS), pytest.param("cluster", marks=REDIS)])
async def rb(request: pytest.FixtureRequest) -> AsyncIterator[Backend]:
    """Redis backends only."""
    b = await make_backend(request, request.param)
    yield b
    await b.redis.purge_pool()
    await b.index.close()


# -- the common BlockIndex contract -----------------------------------------------------------

async def test_lookup_of_nothing(backend: Backend) -> None:
    assert await backend.index.lookup([]) == []
    assert await backend.index.lookup(chain(3)) == []


async def test_longest_prefix(backend: Backend) -> None:
    await backend.live("a")
    keys = chain(5)
    await backend.index.apply("a", pub(keys[:3]))
    assert await backend.index.lookup(keys) == [["a@dram"]] * 3
    assert await backend.index.lookup(keys[1:]) == [["a@dram"]] * 2
    assert await backend.index.lookup(keys[3:]) == []


async def test_prefix_stops_at_a_gap(backend: Backend) -> None:
    await backend.live("a")
    keys = chain(4)
    await backend.index.apply("a", pub([keys[0], keys[1], keys[3]]))
    assert await backend.index.lookup(keys) == [["a@dram"]] * 2


async def test_multiple_holders_and_tiers(backend: Backend) -> None:
    await backend.live("a", "b")
    k = chain(2)
    await backend.index.apply("a", pub(k, "dram") + pub(k[:1], "disk"))
    await backend.index.apply("b", pub(k[:1], "gpu"))
    assert await backend.index.lookup(k) == [["a@disk", "a@dram", "b@gpu"], ["a@dram"]]


async def test_unpublish(backend: Backend) -> None:
    await backend.live("a")
    k = chain(2)
    await backend.index.apply("a", pub(k, "dram") + pub(k, "disk"))
    await backend.index.apply("a", pub(k[:1], "dram", publish=False))
    assert await backend.index.lookup(k) == [["a@disk"], ["a@disk", "a@dram"]]
    await backend.index.apply("a", pub(k[:1], "disk", publish=False))
    assert await backend.index.lookup(k) == []
    assert await backend.index.lookup(k[1:]) == [["a@disk", "a@dram"]]
    await backend.index.apply("a", pub(chain(2), "dram", publish=False))  # never published: no-op


async def test_last_event_of_a_batch_wins(backend: Backend) -> None:
    await backend.live("a")
    k = chain(2)
    await backend.index.apply("a", [IndexEvent(True, "dram", k[0]), IndexEvent(False, "dram", k[0]),
                                    IndexEvent(True, "disk", k[0]), IndexEvent(False, "dram", k[1]),
                                    IndexEvent(True, "dram", k[1])])
    assert await backend.index.lookup(k) == [["a@disk"], ["a@dram"]]
    await backend.index.apply("a", pub(k, "dram") + pub(k, "dram"))  # idempotent
    assert await backend.index.lookup(k) == [["a@disk", "a@dram"], ["a@dram"]]


async def test_drop_node(backend: Backend) -> None:
    await backend.live("a", "b")
    k = chain(3)
    await backend.index.apply("a", pub(k, "dram") + pub(k, "disk"))
    await backend.index.apply("b", pub(k[:2], "gpu"))
    await backend.index.drop_node("a")
    assert await backend.index.lookup(k) == [["b@gpu"], ["b@gpu"]]
    await backend.index.drop_node("a")
    await backend.index.drop_node("never-seen")
    await backend.index.drop_node("b")
    assert await backend.index.lookup(k) == []


async def test_batches_of_thousands(backend: Backend) -> None:
    await backend.live("a")
    k = chain(5000)
    await backend.index.apply("a", pub(k, "dram"))
    assert await backend.index.lookup(k) == [["a@dram"]] * 5000
    await backend.index.apply("a", pub(k[2500:2501], "dram", publish=False))
    assert len(await backend.index.lookup(k)) == 2500
    await backend.index.apply("a", pub(k, "dram", publish=False))
    assert await backend.index.lookup(k) == []


# -- Redis only: schema, registry, liveness, sweeping, healing ----------------------------------

async def test_schema_layout(rb: Backend) -> None:
    """What the operator and ``kvpool status`` read: docs/redis-schema.md, key by key."""
    k = chain(2)
    idx = rb.redis
    assert await idx.register("a", "10.0.0.1:7070", {"dram": {"capacity_bytes": 8, "used_bytes": 2, "blocks": 1}},
                              5, 3, [{"index": 0, "name": "H200", "total_bytes": 9, "free_bytes": 4}], 30) is True
    await idx.apply("a", pub(k, "dram") + pub(k[:1], "disk"))
    await idx.apply("a", pub(k[:1], "dram", publish=False))
    p = f"kvp:{rb.pool}:"
    r = rb.raw()
    try:
        assert await r.smembers(p + "nodes") == {"a"}
        h = await r.hgetall(p + "node:a")
        assert set(h) == {"address", "heartbeat", "tiers", "hits", "misses", "gpus", "version", "sig"}
        assert h["address"] == "10.0.0.1:7070" and h["hits"] == "5" and h["misses"] == "3"
        assert 0 < await r.pttl(p + "node:a") <= 30_000
        assert await r.smembers(p + "blk:" + k[0].hex()) == {"a@disk"}
        assert await r.smembers(p + "blk:" + k[1].hex()) == {"a@dram"}
        assert await r.smembers(p + "inv:a") == {k[0].hex(), k[1].hex()}
        if rb.kind == "redis":  # one server: each block's holders in one field, sorted
            assert await r.hget(p + "held", k[0]) == "a@disk"
            assert await r.hget(p + "held", k[1]) == "a@dram"
        await idx.apply("a", pub(k[:1], "disk", publish=False))
        assert await r.smembers(p + "inv:a") == {k[1].hex()}  # held in no tier any more
        assert await r.exists(p + "blk:" + k[0].hex()) == 0
        if rb.kind == "redis":
            assert await r.hget(p + "held", k[0]) is None
        else:
            assert await r.exists(p + "held") == 0
    finally:
        await r.aclose()
    (node,) = await idx.nodes()
    assert node["name"] == "a" and node["tiers"]["dram"]["blocks"] == 1 and node["gpus"][0]["name"] == "H200"
    assert node["hits"] == 5 and abs(node["heartbeat"] - time.time()) < 60


async def test_what_a_writer_to_redis_plants_is_bounded_before_redis_sends_it(
        rb: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    """A writer to Redis plants more names than a pool has, a name and a field far past their
    bounds, a node key of another type and records it did not sign: none of it is sent past
    its bound, the live node is still found, and no refused record's JSON is parsed."""
    from kvpool_sidecar.index import redisbounds, redisrecords
    from kvpool_sidecar.index.redisrecords import MAX_NODES, MAX_RECORD_FIELD_BYTES

    idx = rb.redis
    await idx.register("real", "10.0.0.1:7070", {"dram": {"capacity_bytes": 8, "used_bytes": 2}}, 0, 0, [], 30)
    assert [n["name"] for n in await idx.nodes()] == ["real"]  # seen live once
    p = f"kvp:{rb.pool}:"
    r = rb.raw()
    try:
        fakes = [f"fake{i}" for i in range(MAX_NODES + 500)]
        for i in range(0, len(fakes), 1000):
            await r.sadd(p + "nodes", *fakes[i:i + 1000])
        await r.sadd(p + "nodes", "x" * (1 << 20))  # one name of a MiB
        for name in fakes[:40]:  # records that parse, but are not signed
            await r.hset(p + "node:" + name, mapping={"address": "10.6.6.6:1", "heartbeat": "1", "sig": "00",
                                                      "tiers": "{}", "gpus": "[]"})
        await r.hset(p + "node:" + fakes[40], mapping={"address": "10.6.6.6:1", "tiers": "{" * (2 << 20)})
        await r.set(p + "node:" + fakes[41], "not a hash")
    finally:
        await r.aclose()
    huge = await idx._one(*redisbounds.record_command(p + "node:" + fakes[40], 256, MAX_RECORD_FIELD_BYTES))
    assert huge == redisbounds.REFUSED  # measured on the server: the 2 MiB field never left it
    assert await idx._one(*redisbounds.record_command(p + "node:" + fakes[41], 256,
                                                    MAX_RECORD_FIELD_BYTES)) == redisbounds.REFUSED
    names = await idx._node_names()
    assert "real" in names and len(names) <= MAX_NODES + 1 and all(len(n) <= 253 for n in names)
    parsed: list[str] = []
    real_loads = redisrecords.json.loads
    monkeypatch.setattr(redisrecords.json, "loads", lambda text, **kw: parsed.append(text) or real_loads(text, **kw))
    seen: list[str] = []

    def believe(record: Any) -> bool:
        seen.append(record["name"])
        return bool(record["name"] == "real")

    for _ in range(3):  # samples differ: the live node is in each
        assert [n["name"] for n in await idx.nodes(believe)] == ["real"]
    assert len(parsed) == 3 * 2  # the real record's tiers and gpus, three times; nothing else
    assert fakes[41] not in seen  # not a hash: nothing of it sent, so never judged
    # a node without a peer address (peers off) is still a node, for `kvpool status`
    await idx.register("quiet", "", {"dram": {"capacity_bytes": 8, "used_bytes": 0}}, 0, 0, [], 30)
    assert "quiet" in [n["name"] for n in await idx.nodes() if n["address"] == ""]


async def test_a_node_keeps_the_address_that_was_believed_when_a_writer_changes_it_meanwhile(
        rb: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    """The signed fields are read, judged, then the whole record: a writer to Redis that puts
    another address in between must not have it used under the first read's signature."""
    idx = rb.redis
    await idx.register("real", "10.0.0.1:7070", {"dram": {"capacity_bytes": 8, "used_bytes": 2}}, 0, 0, [], 30)
    key = f"kvp:{rb.pool}:node:real"
    reads = idx._records
    calls = 0

    async def racing(names: Any, fields: Any) -> Any:
        nonlocal calls
        calls += 1
        out = await reads(names, fields)
        if calls == 1:  # between the signed read and the full one
            r = rb.raw()
            try:
                await r.hset(key, "address", "10.6.6.6:1")
            finally:
                await r.aclose()
        return out

    monkeypatch.setattr(idx, "_records", racing)
    believed: list[str] = []
    got = await idx.nodes(lambda record: believed.append(record["address"]) or record["address"] == "10.0.0.1:7070")
    assert calls == 2 and believed == ["10.0.0.1:7070"]
    assert [(n["name"], n["address"]) for n in got] == [("real", "10.0.0.1:7070")]
    assert got[0]["tiers"]["dram"]["used_bytes"] == 2


async def test_dead_nodes_are_ignored_then_swept(rb: Backend) -> None:
    idx = rb.redis
    k = chain(4)
    await rb.live("a")
    await rb.live("d", ttl_s=0.3)
    await idx.apply("a", pub(k[:3]))
    await idx.apply("d", pub(k, "gpu"))
    assert await idx.lookup(k) == [["a@dram", "d@gpu"]] * 3 + [["d@gpu"]]
    await asyncio.sleep(0.5)
    assert await idx.lookup(k) == [["a@dram"]] * 3
    assert [n["name"] for n in await idx.nodes()] == ["a"]
    assert await idx.sweep_dead() == 1
    assert await idx.sweep_dead() == 0
    p = f"kvp:{rb.pool}:"
    r = rb.raw()
    try:
        assert await r.smembers(p + "blk:" + k[0].hex()) == {"a@dram"}
        assert await r.exists(p + "blk:" + k[3].hex()) == 0
        assert await r.exists(p + "inv:d") == 0
        assert await r.smembers(p + "nodes") == {"a"}
    finally:
        await r.aclose()


async def test_a_dead_nodes_inventory_is_swept_a_page_at_a_time(rb: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    """The sweep never holds a dead node's whole inventory, nor turns it into commands in one
    go (a Redis writer may plant a node with an inventory of any size): page by page, and
    every block still loses the dead holder."""
    idx = new_redis_index(rb.url, rb.kind == "cluster", pool=rb.pool, batch=200)
    k = chain(1200)
    try:
        await rb.live("a", "d")
        await idx.apply("a", pub(k[:5]))
        await idx.apply("d", pub(k))
        pages: list[int] = []
        unhold = idx._cmds.unhold

        def counted(hexes: Sequence[str], holders: Sequence[str]) -> list[Command]:
            pages.append(len(hexes))
            return unhold(hexes, holders)

        monkeypatch.setattr(idx._cmds, "unhold", counted)
        r = rb.raw()
        try:
            await r.delete(idx._keys.node("d"))  # d died
        finally:
            await r.aclose()
        assert await idx.sweep_dead() == 1
        assert sum(pages) >= len(k) and max(pages) <= len(k) // 2
        p = f"kvp:{rb.pool}:"
        r = rb.raw()
        try:
            assert await r.smembers(p + "blk:" + k[0].hex()) == {"a@dram"}
            assert not any([await r.exists(p + "blk:" + key.hex()) for key in k[5:]])
            assert await r.exists(p + "inv:d") == 0
        finally:
            await r.aclose()
    finally:
        await idx.close()


async def test_heartbeat_reports_loss_and_republish_heals(rb: Backend) -> None:
    idx = rb.redis
    k = chain(300)
    assert await idx.register("a", "a:1", {}, 0, 0, [], 30) is True
    assert await idx.heartbeat("a", "a:1", {}, 1, 0, [], 30) is True  # owed until re-published
    assert await idx.republish("a", {}) == 0
    assert await idx.heartbeat("a", "a:1", {}, 1, 0, [], 30) is False
    await idx.apply("a", pub(k))
    await rb.flushall()
    assert await idx.lookup(k) == []
    assert await idx.heartbeat("a", "a:1", {}, 2, 0, [], 30) is True
    assert await idx.heartbeat("a", "a:1", {}, 2, 0, [], 30) is True  # e.g. a retry: still owed
    assert await idx.republish("a", {key: ["dram"] for key in k}) == 300
    assert await idx.lookup(k) == [["a@dram"]] * 300
    assert await idx.heartbeat("a", "a:1", {}, 3, 0, [], 30) is False


async def wipe_a_shard(rb: Backend, spare: str) -> int:
    """Delete this pool's keys on one shard that does not hold key ``spare`` (a shard that
    restarted without persistence); returns how many."""
    raw = rb.raw()
    try:
        assert isinstance(raw, RedisCluster)
        await raw.initialize()
        home = raw.get_node_from_key(spare)
        assert home is not None
        lost = next(p for p in rb.ports if p != home.port)
    finally:
        await raw.aclose()
    shard = Redis(host="127.0.0.1", port=lost, decode_responses=True)
    try:
        doomed = [key async for key in shard.scan_iter(match=f"kvp:{rb.pool}:*")]
        for key in doomed:  # (one slot per DEL on a cluster node)
            assert await shard.delete(key) == 1
        return len(doomed)
    finally:
        await shard.aclose()


async def test_a_shard_that_lost_its_data_makes_nodes_republish(rb: Backend) -> None:
    """One shard restarts empty while the node hash's shard keeps it (a cluster only): the
    node's sentinel on the lost shard is gone, so its next heartbeat owes a re-publish."""
    if rb.kind != "cluster":
        pytest.skip("one server holds the node hash and the blocks alike")
    idx = rb.redis
    k = chain(300)
    holdings = {key: ["dram"] for key in k}
    assert await idx.register("a", "a:1", {}, 0, 0, [], 30) is True
    assert await idx.republish("a", holdings) == 300
    assert await idx.heartbeat("a", "a:1", {}, 0, 0, [], 30) is False
    sentinels = sorted((await idx._sentinels.keys_of("a")).values())
    assert len(sentinels) == len(rb.ports) and idx._sentinels.written["a"] == set(sentinels)  # one per shard
    assert await wipe_a_shard(rb, idx._keys.node("a")) > 0
    assert len(await idx.lookup(k)) < 300  # entries on the lost shard are gone
    assert await idx.heartbeat("a", "a:1", {}, 0, 0, [], 30) is True  # noticed
    assert await idx.republish("a", holdings) == 300
    assert await idx.lookup(k) == [["a@dram"]] * 300
    assert await idx.heartbeat("a", "a:1", {}, 0, 0, [], 30) is False
    # a shard lost during a re-publish (after its sentinel was written) is noticed as well
    real = idx._pipeline

    async def wipes_after_the_blocks(cmds: Any) -> list[Any]:
        out = await real(cmds)
        if any(c[0] == "SADD" and ":blk:" in c[1] for c in cmds):
            await wipe_a_shard(rb, idx._keys.node("a"))
        return out

    idx._pipeline = wipes_after_the_blocks  # type: ignore[method-assign]
    try:
        assert await idx.republish("a", holdings) == 300
    finally:
        idx._pipeline = real  # type: ignore[method-assign]
    assert await idx.heartbeat("a", "a:1", {}, 0, 0, [], 30) is True
    # sentinels live as long as the node hash; a drain deletes them
    raw = rb.raw()
    try:
        assert await idx.republish("a", holdings) == 300
        ttls = [await raw.pttl(key) for key in sentinels]
        assert all(0 < t <= 30_000 for t in ttls), ttls
        await idx.drop_node("a")
        assert [await raw.exists(key) for key in sentinels] == [0] * len(sentinels)
    finally:
        await raw.aclose()


async def test_an_unreachable_shard_does_not_fail_the_heartbeat(rb: Backend) -> None:
    if rb.kind != "cluster":
        pytest.skip("sentinels exist on a cluster only")
    idx = rb.redis
    assert await idx.register("a", "a:1", {}, 0, 0, [], 30) is True
    await idx.republish("a", {key: ["dram"] for key in chain(50)})
    real = idx._pipeline
    probes = 0

    async def sentinel_shard_down(cmds: Any) -> list[Any]:
        nonlocal probes
        if any(c[0] == "PEXPIRE" and ":alive:" in c[1] for c in cmds):
            probes += 1
            raise RedisConnectionError("shard down")
        return await real(cmds)

    idx._pipeline = sentinel_shard_down  # type: ignore[method-assign]
    try:
        assert await idx.heartbeat("a", "a:1", {}, 0, 0, [], 30) is False  # not owed, not failed
    finally:
        idx._pipeline = real  # type: ignore[method-assign]
    assert probes == 1
    assert await wipe_a_shard(rb, idx._keys.node("a")) > 0  # the check still works afterwards
    assert await idx.heartbeat("a", "a:1", {}, 0, 0, [], 30) is True
    raw = rb.raw()
    try:
        assert await raw.hget(idx._keys.node("a"), "published") is None  # the debt is written in Redis
    finally:
        await raw.aclose()


async def test_a_shard_without_a_sentinel_gets_one_without_a_republish(rb: Backend) -> None:
    """A shard added, or seen anew after a failover, holds none of the node's sentinels;
    slots carry their keys, so nothing was lost: it gets a sentinel, not a re-publish."""
    if rb.kind != "cluster":
        pytest.skip("sentinels exist on a cluster only")
    idx = rb.redis
    assert await idx.register("a", "a:1", {}, 0, 0, [], 30) is True
    await idx.republish("a", {key: ["dram"] for key in chain(20)})
    written = idx._sentinels.written["a"]
    dropped = sorted(written)[0]
    written.discard(dropped)  # as if that shard were new to this node
    raw = rb.raw()
    try:
        assert await raw.delete(dropped) == 1
        assert await idx.heartbeat("a", "a:1", {}, 0, 0, [], 30) is False
        assert dropped in idx._sentinels.written["a"] and len(idx._sentinels.written["a"]) == len(rb.ports)
        assert 0 < await raw.pttl(dropped) <= 30_000  # written, with the node's TTL
        assert await raw.hget(idx._keys.node("a"), "published") is not None  # no re-publish owed
    finally:
        await raw.aclose()


async def test_a_long_republish_keeps_the_sentinels_alive(rb: Backend) -> None:
    if rb.kind != "cluster":
        pytest.skip("sentinels exist on a cluster only")
    idx = new_redis_index(rb.url, True, pool=rb.pool, batch=100)
    try:
        # a 1 s TTL and pipelines slowed to 0.3 s: five of them outlast the TTL, while the
        # 0.7 s left between two refreshes absorbs a loaded machine's stalls
        assert await idx.register("a", "a:1", {}, 0, 0, [], 1.0) is True
        undo = slow_pipelines(idx, 0.3)
        await idx.republish("a", {key: ["dram"] for key in chain(400)})
        undo()
        assert await idx.heartbeat("a", "a:1", {}, 0, 0, [], 30) is False  # hash and sentinels lived
    finally:
        await idx.close()


def test_the_sentinel_tags_land_in_their_slots() -> None:
    from kvpool_sidecar.index.redisshards import slot_tags

    tags = slot_tags()
    assert len(tags) == 16384 and min(tags) >= 0
    for slot in (0, 1, 5000, 16383):
        assert key_slot(f"kvp:p:alive:node-1:{{s{tags[slot]}}}".encode()) == slot


async def test_republish_withdraws_what_is_gone(rb: Backend) -> None:
    """A warm restart: the index must say exactly what the node holds now."""
    idx = rb.redis
    k = chain(4)
    await rb.live("a")
    await idx.apply("a", pub(k, "dram"))
    assert await idx.republish("a", {k[0]: ["disk"], k[1]: ["dram", "gpu"], k[3]: []}) == 2
    assert await idx.lookup(k) == [["a@disk"], ["a@dram", "a@gpu"]]
    assert await idx.lookup(k[2:]) == []
    await idx.drop_node("a")
    assert await idx.lookup(k) == []


async def test_keys_spread_over_all_shards(rb: Backend) -> None:
    k = chain(300)
    await rb.live("a")
    await rb.redis.apply("a", pub(k))
    slots = {key_slot(f"kvp:{rb.pool}:blk:{x.hex()}".encode()) for x in k}
    assert len(slots) > 250
    for port in rb.ports:
        r = Redis(host="127.0.0.1", port=port)
        try:
            assert await r.dbsize() > 50  # every shard holds part of the pool
        finally:
            await r.aclose()


async def test_purge_pool_deletes_only_its_pool(rb: Backend) -> None:
    other = new_redis_index(rb.url, rb.kind == "cluster")
    try:
        await rb.live("a")
        await other.register("a", "a:1", {}, 0, 0, [], 30)
        k = chain(500)
        await rb.redis.apply("a", pub(k))
        await other.apply("a", pub(k))
        # blocks, inventory, node hash, nodes set (and on one server the holders hash)
        assert await rb.redis.purge_pool() == 500 + 3 + (rb.kind == "redis")
        assert await rb.redis.lookup(k) == []
        assert await other.lookup(k) == [["a@dram"]] * 500
    finally:
        await other.purge_pool()
        await other.close()


async def test_bad_names_and_tiers_are_refused(rb: Backend) -> None:
    with pytest.raises(RequestError):
        await rb.redis.apply("a", pub(chain(1), "tape"))
    with pytest.raises(ConfigError):
        await rb.redis.apply("a@b", pub(chain(1)))
    with pytest.raises(ConfigError):
        RedisIndex(rb.url, RedisIndexSettings(pool="p:*"))
    with pytest.raises(ConfigError):
        RedisIndex("http://127.0.0.1:1", RedisIndexSettings())


@pytest.mark.parametrize("secret", ["s3cr/et", "p#ss", "a?b=c", "Zm9v/YmFy+"])
def test_a_bad_url_never_shows_its_password(secret: str) -> None:
    with pytest.raises(ConfigError) as info:
        RedisIndex(f"redis://user:{secret}@host:6379/0", RedisIndexSettings())
    text = str(info.value)
    assert secret not in text and secret.split("/")[0] not in text and "user" not in text


async def test_lookup_latency_64_keys(rb: Backend) -> None:
    """Printed, not asserted (timings belong in bench/): 64-key lookups, cached liveness."""
    idx = new_redis_index(rb.url, rb.kind == "cluster", live_cache_s=1.0)
    try:
        for n in ("a", "b", "c"):
            await idx.register(n, n, {}, 0, 0, [], 30)
        k = chain(64)
        await idx.apply("a", pub(k))
        await idx.apply("b", pub(k[:32], "disk"))
        assert len(await idx.lookup(k)) == 64
        samples = []
        for _ in range(200):
            t0 = time.perf_counter()
            res = await idx.lookup(k)
            samples.append(time.perf_counter() - t0)
        assert res[0] == ["a@dram", "b@disk"] and res[63] == ["a@dram"]
        q = statistics.quantiles(samples, n=100)
        print(f"\n[{rb.kind}] 64-key lookup: median {statistics.median(samples) * 1e3:.2f} ms, "
              f"p99 {q[98] * 1e3:.2f} ms over {len(samples)}")
    finally:
        await idx.purge_pool()
        await idx.close()


# -- Redis only: AUTH and failures --------------------------------------------------------------

@REDIS
async def test_auth(redis_factory: Callable[..., RedisServer], tmp_path: Path) -> None:
    server = redis_factory("--requirepass", "s3cret", "--user", "alice", "on", ">alicepw", "~*", "&*", "+@all")
    pwfile = tmp_path / "pw"
    pwfile.write_text("s3cret\n")
    good = [RedisIndex(f"redis://:s3cret@127.0.0.1:{server.port}/0", RedisIndexSettings(pool="x")),
            RedisIndex(server.url, RedisIndexSettings(pool="x", password="s3cret")),
            RedisIndex(server.url, RedisIndexSettings(pool="x", password_file=str(pwfile))),
            RedisIndex(f"redis://alice:alicepw@127.0.0.1:{server.port}", RedisIndexSettings(pool="x"))]
    k = chain(2)
    for idx in good:
        await idx.register("a", "a:1", {}, 0, 0, [], 30)
        await idx.apply("a", pub(k))
        assert await idx.lookup(k) == [["a@dram"]] * 2
        await idx.close()
    for url in (f"redis://:wrong@127.0.0.1:{server.port}", server.url):
        bad = RedisIndex(url, RedisIndexSettings(pool="x", retries=0))
        with pytest.raises(IndexUnavailableError) as e:
            await bad.lookup(k)
        assert "wrong" not in str(e.value) and e.value.code == "index"
        await bad.close()
    with pytest.raises(ConfigError):
        RedisIndex(server.url, RedisIndexSettings(password_file=str(tmp_path / "missing")))


@REDIS
async def test_tls(redis_factory: Callable[..., RedisServer], tmp_path: Path) -> None:
    cert, key = self_signed_cert(tmp_path)
    server = redis_factory("--requirepass", "s3cret", tls=(cert, key))
    assert server.url.startswith("rediss://")
    idx = RedisIndex(server.url, RedisIndexSettings(pool="x", password="s3cret", ssl_ca_certs=str(cert)))
    k = chain(3)
    await idx.register("a", "a:1", {}, 0, 0, [], 30)
    await idx.apply("a", pub(k))
    assert await idx.lookup(k) == [["a@dram"]] * 3
    await idx.close()
    untrusted = RedisIndex(server.url, RedisIndexSettings(pool="x", password="s3cret", retries=0))
    with pytest.raises(IndexUnavailableError):
        await untrusted.lookup(k)  # the server's certificate is not signed by a trusted CA
    await untrusted.close()
    plain = RedisIndex(server.url.replace("rediss", "redis"), RedisIndexSettings(pool="x", retries=0, deadline_s=1.0))
    with pytest.raises(IndexUnavailableError):
        await plain.lookup(k)
    await plain.close()


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port whose listener accepts connections (kernel backlog) and never answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(16)
        yield s.getsockname()[1]


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


@REDIS
@pytest.mark.parametrize("cluster", [False, True])
@pytest.mark.parametrize("where", ["closed", "silent"])
async def test_unreachable_redis_fails_fast(where: str, cluster: bool, silent_port: int) -> None:
    port = closed_port() if where == "closed" else silent_port
    idx = RedisIndex(f"redis://127.0.0.1:{port}", RedisIndexSettings(
        cluster=cluster, deadline_s=1.0, socket_timeout_s=0.3, connect_timeout_s=0.3, retries=2))
    calls: list[Callable[[], Awaitable[object]]] = [
        lambda: idx.lookup(chain(2)), lambda: idx.apply("a", pub(chain(2))), idx.sweep_dead, idx.nodes,
        lambda: idx.heartbeat("a", "a", {}, 0, 0, [], 3), idx.ping]
    for call in calls:
        t0 = time.monotonic()
        with pytest.raises(IndexUnavailableError):
            await asyncio.wait_for(call(), 10)  # the outer limit only catches a hang
        assert time.monotonic() - t0 < 5.0
    await idx.close()


async def test_a_republish_withdraws_what_a_writer_planted_in_its_inventory_a_page_at_a_time(
        rb: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    """A writer to Redis lists millions of entries in a live node's inventory (here 12,000) and makes it owe
    a re-publish: the re-publish had read them all into one set (1.3 GiB for 3 million, the
    loop held seconds, no heartbeat meanwhile: the node was swept). It withdraws them a page
    of the scan at a time, and the index then says exactly what the node holds."""
    idx = rb.redis
    await rb.live("a")
    k = chain(50)
    assert await idx.republish("a", {key: ["dram"] for key in k}) == 50
    inv = idx._keys.inv("a")  # noqa: SLF001
    planted = [hashlib.sha384(b"%d" % i).hexdigest() for i in range(12_000)]
    r = rb.raw()
    try:
        for i in range(0, len(planted), 500):
            await r.sadd(inv, *planted[i : i + 500])
    finally:
        await r.aclose()
    events: list[str] = []
    one, pipe = idx._one, idx._pipeline  # noqa: SLF001

    async def noting_one(*cmd: Any, **kw: Any) -> Any:
        if cmd[0] == "EVAL" and "'SSCAN'" in cmd[1]:  # a page of the scan (a script: redisbounds.py)
            events.append("scan")
        return await one(*cmd, **kw)

    async def noting_pipe(cmds: Any, *args: Any, **kw: Any) -> Any:
        if any(c[0] == "SREM" and c[1] == inv for c in cmds):
            events.append("withdraw")
        return await pipe(cmds, *args, **kw)

    monkeypatch.setattr(idx, "_one", noting_one)
    monkeypatch.setattr(idx, "_pipeline", noting_pipe)
    assert await idx.republish("a", {key: ["dram"] for key in k[:40]}) == 40
    scans = [i for i, e in enumerate(events) if e == "scan"]
    withdrawals = [i for i, e in enumerate(events) if e == "withdraw"]
    assert len(scans) > 2 and withdrawals and withdrawals[0] < scans[-1]  # withdrawn between pages
    r = rb.raw()
    try:
        assert {m.decode() if isinstance(m, bytes) else m for m in await r.smembers(inv)} == {x.hex() for x in k[:40]}
    finally:
        await r.aclose()
    assert await idx.lookup(k) == [["a@dram"]] * 40  # (the prefix held: 10 withdrawn)


async def test_a_republish_lets_other_tasks_run_while_it_builds_its_commands(
        rb: Backend, monkeypatch: pytest.MonkeyPatch, loop_turns: LoopTurns) -> None:
    """Before it sends anything, a re-publish turns the node's inventory into commands a
    slice at a time (300,000 blocks in one go had held the sidecar's loop 0.9 s)."""
    from kvpool_sidecar.index import redispublish

    monkeypatch.setattr(redispublish, "YIELD_EVERY", 100)
    idx = rb.redis
    await rb.live("a")
    k = chain(2000)
    seen: list[int] = []
    sends = idx._pipeline  # noqa: SLF001 - the first pipeline of block changes marks the end of the building

    async def noting(cmds: Any, *args: Any, **kw: Any) -> Any:
        if any(c[0] in ("EVAL", "SADD") for c in cmds) and not seen:
            seen.append(loop_turns.count)
        return await sends(cmds, *args, **kw)

    monkeypatch.setattr(idx, "_pipeline", noting)
    pages = idx._member_pages  # noqa: SLF001 - the holders are built before the old inventory is read
    marks: list[int] = []

    async def paging(*args: Any, **kw: Any) -> Any:
        marks.append(loop_turns.count)
        async for page in pages(*args, **kw):
            yield page
        marks.append(loop_turns.count)

    monkeypatch.setattr(idx, "_member_pages", paging)
    started = loop_turns.count
    assert await idx.republish("a", {key: ["dram"] for key in k}) == 2000
    # 2,000 blocks in slices of 100, twice over: the holders before the inventory is read (one
    # round trip before them), then their commands after it (none between)
    assert len(marks) == 2 and marks[0] - started >= 2000 // 100 - 1
    assert seen and seen[0] - marks[1] >= 2000 // 100 - 2
    assert await idx.lookup(k) == [["a@dram"]] * 2000
