"""What a writer to Redis plants, and what a Redis (or a proxy) that does not answer as Redis
does sends back, against RedisIndex on a real redis-server and a real Redis Cluster: nothing
past the bounds leaves the server (measured by the server's own count of bytes sent), names
that are no node's name are never asked about, and a reply of the wrong shape is the index
unavailable, never an error of another kind."""

from __future__ import annotations

import hashlib
import logging
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import redis as redis_py
from redis.asyncio import Redis
from redis.asyncio import client as redis_client
from redis.asyncio.connection import AbstractConnection

from kvpool_sidecar.errors import IndexUnavailableError
from kvpool_sidecar.events import IndexEvent
from kvpool_sidecar.index.redis import RedisIndex, RedisIndexSettings
from kvpool_sidecar.index.redislookup import HELD_BUDGET_BASE, HELD_BUDGET_PER_KEY
from kvpool_sidecar.index.redisheld import HolderCommands
from kvpool_sidecar.index.redisrecords import MAX_HOLDERS_BYTES
from kvpool_sidecar.index.redisreplies import BoundedHiredisParser, ReplyTooLongError, _budget, bounded, use_bounded_replies
from tests.contract.conftest import RedisClusterProcs, RedisServer

pytestmark = pytest.mark.redis

#: What a lookup, a sweep or a re-publish may make the server send here, all told, where
#: the planted entries are several MiB each.
SENT_BOUND = 1 << 20


def chain(n: int) -> list[bytes]:
    seed = uuid.uuid4().hex
    return [hashlib.sha384(f"{seed}:{i}".encode()).digest() for i in range(n)]


def pub(keys: list[bytes], tier: str = "dram") -> list[IndexEvent]:
    return [IndexEvent(True, tier, k) for k in keys]


@dataclass
class Target:
    kind: str
    index: RedisIndex
    url: str
    ports: list[int]

    @property
    def prefix(self) -> str:
        return f"kvp:{self.index._s.pool}:"  # noqa: SLF001

    def raw(self) -> redis_py.Redis | redis_py.RedisCluster:
        if self.kind == "cluster":
            return redis_py.RedisCluster.from_url(self.url)
        return redis_py.Redis.from_url(self.url)

    def sent(self) -> int:
        """Bytes the server (every shard) has sent its clients so far."""
        total = 0
        for port in self.ports:
            with redis_py.Redis(host="127.0.0.1", port=port) as r:
                total += int(r.info("stats")["total_net_output_bytes"])
        return total


@pytest.fixture(params=["redis", "cluster"])
async def target(request: pytest.FixtureRequest) -> AsyncIterator[Target]:
    pool = "pl" + uuid.uuid4().hex[:12]
    if request.param == "redis":
        server: RedisServer = request.getfixturevalue("redis_server")
        url, ports = server.url, [server.port]
    else:
        procs: RedisClusterProcs = request.getfixturevalue("redis_cluster")
        url, ports = procs.url, procs.ports
    idx = RedisIndex(url, RedisIndexSettings(pool=pool, cluster=request.param == "cluster", live_cache_s=0.0))
    yield Target(request.param, idx, url, ports)
    await idx.purge_pool()
    await idx.close()


# -- R1: holders values (and a cluster's block sets) past their bound ------------------------

async def test_a_holders_value_past_its_bound_never_leaves_redis(target: Target) -> None:
    """A writer plants, under one key of a chain, holders of 8 MiB (on one server a field of
    the holders hash; on a cluster a member of the block set, and under another key 20,000
    members): that key is no holders, its neighbours are found, and the server sends none of
    it (read whole, it had cost the reader the memory and the transfer, past its deadline)."""
    idx = target.index
    await idx.register("a", "a:7070", {}, 0, 0, [], 60)
    k = chain(5)
    await idx.apply("a", pub(k))
    huge = "a@dram " + "x" * (8 << 20)
    r = target.raw()
    try:
        if target.kind == "cluster":
            r.sadd(target.prefix + "blk:" + k[2].hex(), *huge.split(" "))
            r.sadd(target.prefix + "blk:" + k[3].hex(), *("n%05d@dram%s" % (i, "-" * 90) for i in range(20_000)))
        else:
            r.hset(target.prefix + "held", k[2], huge)
            r.hset(target.prefix + "held", k[3], " ".join("n%05d@dram" % i for i in range(MAX_HOLDERS_BYTES // 5)))
    finally:
        r.close()
    before = target.sent()
    assert await idx.lookup(k) == [["a@dram"]] * 2
    assert await idx.lookup(k[2:3]) == []
    assert await idx.lookup(k[3:4]) == []
    assert await idx.lookup(k[4:]) == [["a@dram"]]
    assert target.sent() - before < SENT_BOUND


def held_calls(url: str) -> tuple[int, int]:
    """How many ``HMGET`` and ``EVAL`` calls the server has run so far (a script's own
    ``HMGET`` counted as one)."""
    with redis_py.Redis.from_url(url) as r:
        stats = r.info("commandstats")
    return (int(stats.get("cmdstat_hmget", {}).get("calls", 0)), int(stats.get("cmdstat_eval", {}).get("calls", 0)))


def held_reads(url: str, since: tuple[int, int]) -> tuple[int, int]:
    """Bare ``HMGET`` calls and scripts since ``since`` (:func:`held_calls`), where only
    lookups ran (each script of a lookup runs one ``HMGET``)."""
    hmget, evals = held_calls(url)
    return hmget - since[0] - (evals - since[1]), evals - since[1]


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The bytes each bounded reply had taken from its socket after each read (or its
    failure) while a budget held."""
    taken: list[int] = []
    parser = BoundedHiredisParser
    read = parser.read_from_socket

    async def noting(self: Any) -> bool:
        try:
            return bool(await read(self))
        finally:
            if _budget.get() is not None:
                taken.append(self._taken)  # noqa: SLF001

    monkeypatch.setattr(parser, "read_from_socket", noting)
    return taken


async def test_a_lookup_reads_holders_bare_and_a_value_past_its_budget_goes_through_the_script(
        redis_server: RedisServer, reads: list[int], caplog: pytest.LogCaptureFixture) -> None:
    """A lookup's holders come from a bare ``HMGET`` (the script costs Redis twice its time),
    its reply bounded on this side: a planted value past the bound but within the budget is
    dropped as the script drops it, and one of 8 MiB is read no further than the budget; its
    connection is closed, that lookup asks again through the script, and so do the next."""
    idx = RedisIndex(redis_server.url, RedisIndexSettings(pool="pl" + uuid.uuid4().hex[:12], live_cache_s=60.0))
    try:
        await idx.register("a", "a:7070", {}, 0, 0, [], 60)
        k = chain(8)
        await idx.apply("a", pub(k))
        assert await idx.lookup(k) == [["a@dram"]] * 8  # (reads the node records too)
        since = held_calls(redis_server.url)
        assert await idx.lookup(k) == [["a@dram"]] * 8
        assert held_reads(redis_server.url, since) == (1, 0)
        with redis_py.Redis.from_url(redis_server.url) as r:
            r.hset(f"kvp:{idx._s.pool}:held", k[3], "a@dram " + "x" * (MAX_HOLDERS_BYTES + 100))  # noqa: SLF001
        assert await idx.lookup(k) == [["a@dram"]] * 3
        assert held_reads(redis_server.url, since) == (2, 0)
        with redis_py.Redis.from_url(redis_server.url) as r:
            r.hset(f"kvp:{idx._s.pool}:held", k[6], "a@dram " + "x" * (8 << 20))  # noqa: SLF001
        del reads[:]
        with caplog.at_level(logging.WARNING, logger="kvpool_sidecar.index.redislookup"):
            assert await idx.lookup(k[4:]) == [["a@dram"]] * 2
        assert "past its budget" in caplog.text
        assert reads and max(reads) <= HELD_BUDGET_BASE + HELD_BUDGET_PER_KEY * 4 + (64 << 10)
        assert held_reads(redis_server.url, since) == (3, 1)
        assert await idx.lookup(k[4:]) == [["a@dram"]] * 2
        assert held_reads(redis_server.url, since) == (3, 2)
    finally:
        await idx.purge_pool()
        await idx.close()


async def test_a_bounded_reply_takes_no_more_than_its_budget_and_ends_its_connection(
        redis_server: RedisServer, reads: list[int]) -> None:
    """Within :func:`bounded`, a reply of 4 MiB stops being read past the budget, its
    connection is closed, and the client goes on with a new one; outside, it comes whole."""
    r = Redis.from_url(redis_server.url)
    try:
        assert use_bounded_replies(r)
        await r.set("big", b"y" * (4 << 20))
        await r.set("small", b"z")
        with bounded(100_000):
            with pytest.raises(ReplyTooLongError):
                await r.get("big")
            assert max(reads) <= 100_000 + (64 << 10)
            assert await r.get("small") == b"z"
        assert len(await r.get("big")) == 4 << 20
        with redis_py.Redis.from_url(redis_server.url) as raw:
            raw.delete("big", "small")
    finally:
        await r.aclose()


# -- R2: inventory members of any other form --------------------------------------------------

async def test_an_inventory_member_that_is_no_block_key_never_leaves_redis(target: Target) -> None:
    """A writer adds a member of 4 MiB of valid hex (and others of the wrong length or case) to
    a dead node's inventory and to a live one's: the sweep and the re-publish read pages the
    server filtered, never that member (it had been sent whole, decoded, and sent back inside
    a holders script), and they still do their work on the real entries."""
    idx = target.index
    k = chain(6)
    await idx.register("a", "a:7070", {}, 0, 0, [], 60)
    await idx.register("ghost", "ghost:7070", {}, 0, 0, [], 60)
    await idx.apply("a", pub(k[:4]))
    await idx.apply("ghost", pub(k, "disk"))
    junk = ["ab" * (2 << 20), "AB" * 48, "0" * 95, "0" * 97, " " + "0" * 96, "0" * 95 + "g"]
    r = target.raw()
    try:
        r.delete(target.prefix + "node:ghost")  # ghost died
        r.sadd(target.prefix + "inv:ghost", *junk)
        r.sadd(target.prefix + "inv:a", *junk)
    finally:
        r.close()
    before = target.sent()
    assert await idx.sweep_dead() == 1
    assert await idx.republish("a", {key: ["dram"] for key in k[:3]}) == 3  # k[3] withdrawn
    assert target.sent() - before < SENT_BOUND
    assert await idx.lookup(k) == [["a@dram"]] * 3
    r = target.raw()
    try:
        assert not r.exists(target.prefix + "inv:ghost")
        assert b"ghost" not in r.smembers(target.prefix + "nodes")
        assert not any(r.exists(target.prefix + "blk:" + key.hex()) for key in k[3:])
    finally:
        r.close()


def test_unhold_skips_every_entry_that_is_not_a_block_keys_hex_digits() -> None:
    """``bytes.fromhex`` takes any even length, capitals and spaces: only exactly 96 lowercase
    hex digits name a block."""
    good = "0f" * 48
    cmds = HolderCommands("kvp:p:blk:", None, 100).unhold(
        ["ab" * (1 << 20), "0" * 94, "0" * 98, "AB" * 48, "0f " * 32, " " + "0" * 96, good, "0" * 95 + "\n"],
        ["a@dram"])
    assert cmds == [("SREM", "kvp:p:blk:" + good, "a@dram")]


# -- R5: names that are no node's name --------------------------------------------------------

async def test_a_holder_whose_name_is_no_node_name_is_never_asked_about(
        target: Target, monkeypatch: pytest.MonkeyPatch) -> None:
    """Only a valid node name seen in a holders value costs an ``EXISTS``: a name of 300
    bytes or with a tab in it is no node's (and was sent to Redis as a key to check)."""
    idx = target.index
    await idx.register("a", "a:7070", {}, 0, 0, [], 60)
    k = chain(1)
    await idx.apply("a", pub(k))
    assert await idx.lookup(k) == [["a@dram"]]  # (a is known from now on)
    holders = ["a@dram", "bad\tname@dram", "x" * 300 + "@disk", "-lead@gpu", "unseen-1@dram"]
    r = target.raw()
    try:
        if target.kind == "cluster":
            r.sadd(target.prefix + "blk:" + k[0].hex(), *holders)
        else:
            r.hset(target.prefix + "held", k[0], " ".join(sorted(holders)))
    finally:
        r.close()
    checked: list[str] = []
    check = idx._check  # noqa: SLF001

    async def noting(names: list[str]) -> None:
        checked.extend(names)
        await check(names)

    monkeypatch.setattr(idx, "_check", noting)
    assert await idx.lookup(k) == [["a@dram"]]
    assert checked == ["unseen-1"]


# -- R4: replies of a shape Redis never gives -------------------------------------------------

@pytest.fixture
def garbled(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """Replies to replace, by command name, as a proxy on the path (or a broken Redis) would:
    ``garbled["EVAL"] = 7``. ``"HELLO"`` replaces the answer to the connection's handshake."""
    replies: dict[str, Any] = {}
    parse = redis_client.Redis.parse_response
    send, read = AbstractConnection.send_command, AbstractConnection.read_response

    async def parse_response(self: Any, connection: Any, command_name: Any, **options: Any) -> Any:
        reply = await parse(self, connection, command_name, **options)
        name = command_name.decode() if isinstance(command_name, bytes) else str(command_name)
        return replies.get(name.upper(), reply)

    async def send_command(self: Any, *args: Any, **kw: Any) -> None:
        self.garble_next = bool(args) and str(args[0]).upper() == "HELLO" and "HELLO" in replies
        await send(self, *args, **kw)

    async def read_response(self: Any, *args: Any, **kw: Any) -> Any:
        reply = await read(self, *args, **kw)
        if getattr(self, "garble_next", False):
            self.garble_next = False
            return replies["HELLO"]
        return reply

    monkeypatch.setattr(redis_client.Redis, "parse_response", parse_response)
    monkeypatch.setattr(AbstractConnection, "send_command", send_command)
    monkeypatch.setattr(AbstractConnection, "read_response", read_response)
    yield replies


async def test_a_reply_of_the_wrong_shape_is_the_index_unavailable(
        redis_server: RedisServer, garbled: dict[str, Any]) -> None:
    """An integer where a script, an ``HMGET`` or a scan answers a list: every call of the
    index that reads one fails with the index's own error (it had raised ``TypeError``, which
    the local API answered as the client's bad request, and the index back-off never
    engaged); the same calls work once the replies are Redis's again."""
    idx = RedisIndex(redis_server.url, RedisIndexSettings(pool="pl" + uuid.uuid4().hex[:12], live_cache_s=60.0))
    try:
        k = chain(3)
        await idx.register("a", "a:7070", {}, 0, 0, [], 60)
        await idx.apply("a", pub(k))
        assert await idx.lookup(k) == [["a@dram"]] * 3
        garbled.update(EVAL=7, HMGET=7, SSCAN=7)
        with pytest.raises(IndexUnavailableError):
            await idx.lookup(k)  # the holders only (the live nodes are fresh)
        with pytest.raises(IndexUnavailableError):
            await idx.nodes()
        with pytest.raises(IndexUnavailableError):
            await idx.sweep_dead()
        with pytest.raises(IndexUnavailableError):
            await idx.apply("a", pub(chain(2)))
        with pytest.raises(IndexUnavailableError):
            await idx.republish("a", {key: ["dram"] for key in k})
        garbled.clear()
        garbled.update(EVAL=["a@dram"], HMGET=["a@dram"])  # one value for a read of three
        with pytest.raises(IndexUnavailableError):
            await idx.lookup(k)
        garbled.clear()
        assert await idx.lookup(k) == [["a@dram"]] * 3
        assert [n["name"] for n in await idx.nodes()] == ["a"]
    finally:
        garbled.clear()
        await idx.purge_pool()
        await idx.close()


async def test_a_sidecar_whose_redis_answers_hello_with_garbage_starts_and_keeps_trying(
        redis_server: RedisServer, garbled: dict[str, Any], tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    """The handshake answered with an integer (redis-py then raises ``AttributeError``) is the
    index unavailable at start, as a dead Redis is: the sidecar starts (it had died), and
    registers once Redis answers as Redis does."""
    from kvpool_sidecar.config import settings_from_mapping
    from kvpool_sidecar.membership import Membership
    from tests.unit.store_support import make_store

    pool = "pl" + uuid.uuid4().hex[:12]
    settings = settings_from_mapping({"node_name": "a", "pool": pool,
                                      "index": {"backend": "redis", "url": redis_server.url, "timeout_s": 0.5}})
    garbled["HELLO"] = 1
    m = Membership(settings, make_store())
    with caplog.at_level(logging.WARNING, logger="kvpool_sidecar.membership"):
        await m.start()
    try:
        assert "will keep trying" in caplog.text
        garbled.clear()
        await m.heartbeat_once()
        assert [n["name"] for n in await m.redis.nodes()] == ["a"]
    finally:
        garbled.clear()
        await m.redis.purge_pool()
        await m.stop()
