"""The holders hash of RedisIndex on one redis-server (sidecar/kvpool_sidecar/index/redisheld.py):
every write keeps ``kvp:P:held`` equal to the block sets, whoever writes and whatever
fails, and a lookup is one ``HMGET`` that answers what the sets and the node records say."""

from __future__ import annotations

import asyncio
import hashlib
import random
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import redis as redis_py

from kvpool_sidecar.errors import IndexDataError
from kvpool_sidecar.events import IndexEvent
from kvpool_sidecar.index.redis import IndexUnavailableError, RedisIndex, RedisIndexSettings
from kvpool_sidecar.index.redisbounds import held_command
from tests.contract.conftest import RedisServer

pytestmark = pytest.mark.redis

TIERS = ("gpu", "dram", "disk")


def chain(n: int) -> list[bytes]:
    seed = uuid.uuid4().hex
    return [hashlib.sha384(f"{seed}:{i}".encode()).digest() for i in range(n)]


def new_index(server: RedisServer, **kw: Any) -> RedisIndex:
    kw.setdefault("pool", "hd" + uuid.uuid4().hex[:12])
    kw.setdefault("live_cache_s", 0.0)
    return RedisIndex(server.url, RedisIndexSettings(**kw))


@pytest.fixture
async def idx(redis_server: RedisServer) -> AsyncIterator[RedisIndex]:
    index = new_index(redis_server)
    yield index
    await index.purge_pool()
    await index.close()


@pytest.fixture
def raw(redis_server: RedisServer) -> redis_py.Redis:
    return redis_py.Redis.from_url(redis_server.url)


def check_hash(raw: redis_py.Redis, pool: str, keys: list[bytes]) -> list[set[str]]:
    """Assert that the holders hash says what the block sets say; the sets, per key."""
    sets = []
    for k in keys:
        members = {m.decode() for m in raw.smembers(f"kvp:{pool}:blk:{k.hex()}")}
        value = raw.hget(f"kvp:{pool}:held", k)
        assert value == (" ".join(sorted(members)).encode() if members else None), k.hex()
        sets.append(members)
    return sets


def expected(sets: list[set[str]], live: set[str]) -> list[list[str]]:
    out = []
    for members in sets:
        holders = sorted(h for h in members if h.partition("@")[0] in live)
        if not holders:
            break
        out.append(holders)
    return out


@pytest.mark.parametrize("seed", range(8))
async def test_the_hash_says_what_the_sets_say(idx: RedisIndex, raw: redis_py.Redis, seed: int) -> None:
    """Random publishes, withdrawals, re-publishes, drains and sweeps by several nodes: after
    each, every block's field is its set, and lookups of every suffix agree with the sets."""
    rng = random.Random(seed)
    pool = idx._s.pool
    nodes = ["a", "b", "c", "d"]
    live = set(nodes)
    for n in nodes:
        await idx.register(n, f"{n}:7070", {}, 0, 0, [], 60)
    keys = chain(rng.randint(8, 40))
    for _ in range(25):
        op = rng.random()
        node = rng.choice(sorted(live)) if live else "a"
        if op < 0.6 and live:
            events = [IndexEvent(rng.random() < 0.7, rng.choice(TIERS), k) for k in rng.sample(keys, rng.randint(1, min(10, len(keys))))]
            await idx.apply(node, events)
        elif op < 0.8 and live:
            await idx.republish(node, {k: rng.sample(TIERS, rng.randint(0, 2)) for k in rng.sample(keys, rng.randint(0, min(12, len(keys))))})
        elif op < 0.9 and live:
            await idx.drop_node(node)
            live.discard(node)
        else:
            dead = rng.choice(nodes)
            if dead in live:
                raw.delete(f"kvp:{pool}:node:{dead}")  # its record expired
                live.discard(dead)
            await idx.sweep_dead()
        sets = check_hash(raw, pool, keys)
        start = rng.randrange(len(keys))
        assert await idx.lookup(keys[start:]) == expected(sets[start:], live)


async def test_a_lookup_is_one_hmget(redis_server: RedisServer, raw: redis_py.Redis) -> None:
    """With the list of live nodes fresh, a 64-key lookup sends the server one bare HMGET (its
    reply bounded on the client, test_index_planted.py), and nothing else: no script, no block
    set read, no liveness check."""
    index = new_index(redis_server, live_cache_s=60.0)
    try:
        keys = chain(64)
        await index.register("a", "a:7070", {}, 0, 0, [], 60)
        await index.apply("a", [IndexEvent(True, "dram", k) for k in keys])
        assert await index.lookup(keys) == [["a@dram"]] * 64  # reads the node records too
        raw.config_resetstat()
        for _ in range(3):
            assert await index.lookup(keys) == [["a@dram"]] * 64
            assert await index.lookup(chain(64)) == []
        stats = raw.info("commandstats")
        assert stats["cmdstat_hmget"]["calls"] == 6
        assert not {"cmdstat_eval", "cmdstat_smembers", "cmdstat_evalsha", "cmdstat_exists", "cmdstat_hget",
                    "cmdstat_hstrlen"} & set(stats)
    finally:
        await index.purge_pool()
        await index.close()


def test_the_holders_script_never_reads_a_value_past_its_bound(raw: redis_py.Redis, redis_server: RedisServer) -> None:
    """The script measures each field before its ``HMGET``, which names only those within the
    bound: a planted value past it is never copied into the script (one of 300 MB had held
    the server 0.8 s a lookup), as the server's own log of the calls shows."""
    key = "kvp:held-script-" + uuid.uuid4().hex
    a, b, d = (bytes([c]) * 48 for c in b"abd")
    raw.hset(key, mapping={a: "x@dram", b: "y@dram", d: "z" * 100})
    try:
        with raw.monitor() as seen:
            with redis_py.Redis(port=redis_server.port) as other:
                assert other.execute_command(*held_command(key, 64, [a, d, b])) == [b"x@dram", None, b"y@dram"]
            reads = []
            while not reads or not reads[-1].startswith(("HMGET", "HGET ")):
                reads.append(seen.next_command()["command"])
        assert [c.split()[0] for c in reads if c.startswith(("HSTRLEN", "HMGET", "HGET "))] == ["HSTRLEN"] * 3 + ["HMGET"]
        assert reads[-1].split() == ["HMGET", key, a.decode(), b.decode()]
    finally:
        raw.delete(key)


def test_the_holders_script_answers_each_field_within_its_bound_whatever_their_lengths(raw: redis_py.Redis) -> None:
    """The lookup's script: the fields joined in one argument where they are of one length,
    each its own argument where not; each value, nil for a value past the bound (never sent)
    or a field missing, and one value where every field has it."""
    key = "kvp:held-script-" + uuid.uuid4().hex
    a, b, d, e = (bytes([c]) * 48 for c in b"abde")
    raw.hset(key, mapping={a: "x@dram", b: "x@dram", b"cc": "y@disk", d: "z" * 100})
    run: Callable[..., Any] = raw.execute_command
    try:
        assert run(*held_command(key, 64, [a, b])) == b"x@dram"  # joined, one value
        assert run(*held_command(key, 64, [a, d, b, e])) == [b"x@dram", None, b"x@dram", None]
        assert run(*held_command(key, 64, [a, b"cc", d])) == [b"x@dram", b"y@disk", None]
        assert run(*held_command(key, 64, [d, d])) == [None, None]  # (past the bound: no one value)
        assert run(*held_command(key, 100, [d])) == b"z" * 100
    finally:
        raw.delete(key)


async def test_concurrent_writers_leave_the_hash_right(redis_server: RedisServer, raw: redis_py.Redis) -> None:
    """Two sidecars (two clients) add and withdraw holders of the same blocks at once (each
    sidecar's own writes are in order, as its membership sends them)."""
    a = new_index(redis_server)
    b = new_index(redis_server, pool=a._s.pool)
    try:
        keys = chain(32)
        for index, n in ((a, "a"), (b, "b")):
            await index.register(n, f"{n}:7070", {}, 0, 0, [], 60)
        async def churn(index: RedisIndex, node: str) -> None:
            rng = random.Random(node)
            for _ in range(60):
                await index.apply(node, [IndexEvent(rng.random() < 0.6, rng.choice(TIERS), k)
                                         for k in rng.sample(keys, 8)])

        await asyncio.gather(churn(a, "a"), churn(b, "b"))
        sets = check_hash(raw, a._s.pool, keys)
        assert await b.lookup(keys) == expected(sets, {"a", "b"})
        for n in ("a", "b"):
            inv = {m.decode() for m in raw.smembers(f"kvp:{a._s.pool}:inv:{n}")}
            assert inv == {k.hex() for k, s in zip(keys, sets) if any(h.startswith(n + "@") for h in s)}
    finally:
        await a.purge_pool()
        for index in (a, b):
            await index.close()


async def test_the_hash_is_a_hashtable_from_its_first_block(idx: RedisIndex, raw: redis_py.Redis) -> None:
    """A small hash would be a listpack, where each field of an HMGET is a linear scan."""
    (k,) = chain(1)
    await idx.register("a", "a:7070", {}, 0, 0, [], 60)
    await idx.apply("a", [IndexEvent(True, "dram", k)])
    assert raw.object("encoding", f"kvp:{idx._s.pool}:held") == b"hashtable"
    await idx.apply("a", [IndexEvent(False, "dram", k)])
    assert raw.hkeys(f"kvp:{idx._s.pool}:held") == [b"~"]


async def test_what_a_writer_without_the_code_puts_in_redis(idx: RedisIndex, raw: redis_py.Redis,
                                                             redis_server: RedisServer) -> None:
    """Entries that are not ``node@tier`` of a live node end the prefix; bytes that are not
    UTF-8 make the lookup fail cleanly (a miss for the caller); a block key of another type
    fails that block's publish alone; the next chain still works."""
    pool = idx._s.pool
    keys = chain(3)
    await idx.register("a", "a:7070", {}, 0, 0, [], 60)
    await idx.apply("a", [IndexEvent(True, "dram", k) for k in keys])
    raw.hset(f"kvp:{pool}:held", keys[1], "garbage nobody@dram")
    assert await idx.lookup(keys) == [["a@dram"]]
    raw.hset(f"kvp:{pool}:held", keys[1], b"\xff@dram")
    with pytest.raises(IndexUnavailableError, match="UTF-8"):
        await idx.lookup(keys)
    assert await idx.lookup(keys[:1]) == [["a@dram"]]  # the next lookup is answered
    # a lookup that does not also read the node records (this index reads them at each one):
    # the value fails it alone, an answer, not the index down (IndexWatch)
    cached = new_index(redis_server, pool=pool, live_cache_s=60.0)
    try:
        assert await cached.lookup(keys[:1]) == [["a@dram"]]
        with pytest.raises(IndexDataError, match="UTF-8"):
            await cached.lookup(keys)
    finally:
        await cached.close()
    other = chain(3)
    raw.set(f"kvp:{pool}:blk:{other[1].hex()}", "not a set")
    await idx.apply("a", [IndexEvent(True, "disk", k) for k in other])
    assert await idx.lookup(other) == [["a@disk"]]
    assert await idx.lookup(other[2:]) == [["a@disk"]]
    assert raw.hget(f"kvp:{pool}:held", other[1]) is None


async def test_an_older_writer_is_seen_after_its_republish(idx: RedisIndex, raw: redis_py.Redis) -> None:
    """A sidecar of a version without the hash writes the sets alone: lookups miss its blocks
    (never name a wrong holder) until its re-publish, at its upgrade, writes the hash."""
    pool = idx._s.pool
    keys = chain(3)
    await idx.register("old", "old:7070", {}, 0, 0, [], 60)
    for k in keys:
        raw.sadd(f"kvp:{pool}:blk:{k.hex()}", "old@dram")
        raw.sadd(f"kvp:{pool}:inv:old", k.hex())
    assert await idx.lookup(keys) == []
    await idx.republish("old", {k: ["dram"] for k in keys})
    assert await idx.lookup(keys) == [["old@dram"]] * 3
    check_hash(raw, pool, keys)


async def test_refused_writes_change_nothing(redis_factory: Callable[..., RedisServer]) -> None:
    """Redis out of memory (noeviction): a publish fails whole, with a clear error, and the
    hash still says what the sets say."""
    server = redis_factory()
    raw = redis_py.Redis.from_url(server.url)
    index = new_index(server)
    try:
        keys = chain(6)
        await index.register("a", "a:7070", {}, 0, 0, [], 60)
        await index.apply("a", [IndexEvent(True, "dram", k) for k in keys[:3]])
        raw.config_set("maxmemory-policy", "noeviction")
        raw.config_set("maxmemory", raw.info("memory")["used_memory"])
        with pytest.raises(redis_py.exceptions.ResponseError, match="maxmemory"):
            raw.set("junk", "x" * 100_000)
        with pytest.raises(IndexUnavailableError):
            await index.apply("a", [IndexEvent(True, "dram", k) for k in keys[3:]])
        assert await index.lookup(keys) == [["a@dram"]] * 3
        check_hash(raw, index._s.pool, keys)
    finally:
        raw.config_set("maxmemory", 0)
        await index.purge_pool()
        await index.close()
