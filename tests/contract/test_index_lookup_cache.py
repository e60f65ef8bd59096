"""The lookup cache of RedisIndex on one redis-server (sidecar/kvpool_sidecar/index/redislookup.py):
a lookup of a chain read lately is one HMGET of ``kvp:P:lookup``, and must answer exactly
what the block sets and the node records say: no dead node, no stale holder after a
write, the same prefix, gaps and runs as the script."""

from __future__ import annotations

import hashlib
import random
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
import redis as redis_py

from kvpool_sidecar.events import IndexEvent
from kvpool_sidecar.index.redis import IndexUnavailableError, RedisIndex, RedisIndexSettings
from tests.contract.conftest import RedisServer
from tests.integration.support import wait_until

pytestmark = pytest.mark.redis

TIERS = ("gpu", "dram", "disk")


def chain(n: int) -> list[bytes]:
    seed = uuid.uuid4().hex
    return [hashlib.sha384(f"{seed}:{i}".encode()).digest() for i in range(n)]


class CountedScript:
    """Wraps an index's lookup script and counts its calls: a lookup that adds none was
    answered by the lookup hash alone."""

    def __init__(self, index: RedisIndex) -> None:
        self.real: Callable[..., Awaitable[Any]] = index._lookup_script
        self.calls = 0
        index._lookup_script = self  # type: ignore[assignment]

    async def __call__(self, *args: Any, **kw: Any) -> Any:
        self.calls += 1
        return await self.real(*args, **kw)


async def twice(index: RedisIndex, keys: list[bytes]) -> list[list[str]]:
    """Look a chain up twice: the first lookup runs the script alone, the second runs it
    and fills the lookup hash (a chain looked up once is not cached). Both answers agree."""
    first = await index.lookup(keys)
    assert await index.lookup(keys) == first
    return first


def new_index(server: RedisServer, **kw: Any) -> RedisIndex:
    kw.setdefault("pool", "lc" + uuid.uuid4().hex[:12])
    return RedisIndex(server.url, RedisIndexSettings(**kw))


@pytest.fixture
async def idx(redis_server: RedisServer) -> AsyncIterator[RedisIndex]:
    index = new_index(redis_server, lookup_cache_s=30)  # no expiry of the hash mid-test
    yield index
    await index.purge_pool()
    await index.close()


@pytest.fixture
def raw(redis_server: RedisServer) -> redis_py.Redis:
    return redis_py.Redis.from_url(redis_server.url)


def expected(layout: list[dict[str, list[str]]], live: set[str]) -> list[list[str]]:
    """What a lookup must answer: each key's holders on live nodes, up to the first with none."""
    out = []
    for held in layout:
        holders = sorted(f"{n}@{t}" for n, tiers in held.items() if n in live for t in tiers)
        if not holders:
            break
        out.append(holders)
    return out


async def publish(index: RedisIndex, keys: list[bytes], layout: list[dict[str, list[str]]],
                  publish: bool = True) -> None:
    for node in sorted({n for held in layout for n in held}):
        await index.apply(node, [IndexEvent(publish, t, k) for k, held in zip(keys, layout)
                                 for t in held.get(node, [])])


def random_layout(rng: random.Random, n: int) -> list[dict[str, list[str]]]:
    """Holders of ``n`` keys: runs of one holder set, mixes, gaps, dead and live nodes."""
    layout: list[dict[str, list[str]]] = []
    held: dict[str, list[str]] = {}
    for _ in range(n):
        if not layout or rng.random() < 0.3:  # a new run
            held = {node: rng.sample(TIERS, rng.randint(1, 2))
                    for node in rng.sample(["a", "b", "c", "dead"], rng.randint(0, 3))}
        layout.append(held)
    return layout


@pytest.mark.parametrize("seed", range(12))
async def test_the_cached_answer_is_the_scripts_answer(idx: RedisIndex, raw: redis_py.Redis, seed: int) -> None:
    rng = random.Random(seed)
    live = {"a", "b", "c"}
    for n in sorted(live):
        await idx.register(n, f"{n}:7070", {}, 0, 0, [], 60)
    keys = chain(rng.randint(1, 70))
    layout = random_layout(rng, len(keys))
    await publish(idx, keys, layout)
    want = expected(layout, live)
    script = CountedScript(idx)
    assert await idx.lookup(keys) == want  # the script alone: a chain looked up once
    assert not raw.exists(f"kvp:{idx._s.pool}:lookup")
    assert await idx.lookup(keys) == want  # looked up again: the script fills the hash
    assert script.calls == 2
    cached = raw.hgetall(f"kvp:{idx._s.pool}:lookup")
    assert len(cached) - 1 == min(len(want) + 1, len(keys))  # every key read, and the '~' field
    assert all(b"dead@" not in v for v in cached.values())
    assert await idx.lookup(keys) == want  # HMGET alone
    assert script.calls == 2
    for i in range(len(keys)):  # every suffix (the hash knows part of it, the script the rest)
        assert await idx.lookup(keys[i:]) == expected(layout[i:], live)
    assert await idx.lookup(keys) == want
    # a write: the fields of the blocks it changed go, the others stay
    before = set(raw.hkeys(f"kvp:{idx._s.pool}:lookup"))
    changed = sorted(rng.sample(range(len(keys)), rng.randint(1, len(keys))))
    gone = [dict(layout[i]) for i in changed]
    await publish(idx, [keys[i] for i in changed], gone, publish=False)
    for i in changed:
        layout[i] = {"b": ["gpu"]} if rng.random() < 0.5 else {}
    await publish(idx, [keys[i] for i in changed], [layout[i] for i in changed])
    touched = {keys[i] for i, old in zip(changed, gone) if old or layout[i]}
    assert set(raw.hkeys(f"kvp:{idx._s.pool}:lookup")) == before - touched
    calls = script.calls
    assert await idx.lookup(keys) == expected(layout, live)
    assert await idx.lookup(keys) == expected(layout, live)
    assert script.calls <= calls + 1


async def test_a_node_whose_record_expires_goes_with_the_hash(idx: RedisIndex, raw: redis_py.Redis) -> None:
    keys = chain(8)
    await idx.register("a", "a:7070", {}, 0, 0, [], 60)
    await idx.register("d", "d:7070", {}, 0, 0, [], 1.5)  # a node about to die
    await idx.apply("a", [IndexEvent(True, "dram", k) for k in keys])
    await idx.apply("d", [IndexEvent(True, "gpu", k) for k in keys])
    assert await twice(idx, keys) == [["a@dram", "d@gpu"]] * 8
    p = f"kvp:{idx._s.pool}:"
    assert raw.hget(p + "lookup", keys[0]) == b"a@dram d@gpu"  # the hash names d ...
    assert raw.pexpiretime(p + "lookup") <= raw.pexpiretime(p + "node:d")  # ... and goes first
    wait_until(lambda: not raw.exists(p + "node:d"), "d's record to expire", timeout=5)
    assert not raw.exists(p + "lookup")  # the hash never outlives a record it names
    assert await idx.lookup(keys) == [["a@dram"]] * 8


async def test_a_draining_node_is_never_named(idx: RedisIndex, raw: redis_py.Redis) -> None:
    keys = chain(4)
    for n in ("a", "b"):
        await idx.register(n, f"{n}:7070", {}, 0, 0, [], 60)
    await idx.apply("a", [IndexEvent(True, "dram", k) for k in keys])
    await idx.apply("b", [IndexEvent(True, "disk", k) for k in keys[:2]])
    assert await twice(idx, keys) == [["a@dram", "b@disk"]] * 2 + [["a@dram"]] * 2
    assert raw.exists(f"kvp:{idx._s.pool}:lookup")
    await idx.drop_node("a")
    assert not raw.exists(f"kvp:{idx._s.pool}:lookup")
    assert await idx.lookup(keys) == [["b@disk"]] * 2


async def test_a_restart_with_a_shorter_ttl_drops_the_hash(idx: RedisIndex, raw: redis_py.Redis,
                                                           redis_server: RedisServer) -> None:
    keys = chain(3)
    await idx.register("a", "a:7070", {}, 0, 0, [], 60)
    await idx.apply("a", [IndexEvent(True, "dram", k) for k in keys])
    assert await twice(idx, keys) == [["a@dram"]] * 3
    p = f"kvp:{idx._s.pool}:"
    await idx.heartbeat("a", "a:7070", {}, 0, 0, [], 60)  # same life, same TTL: the hash stays
    assert raw.exists(p + "lookup")
    restarted = new_index(redis_server, pool=idx._s.pool)
    try:
        await restarted.heartbeat("a", "a:7070", {}, 0, 0, [], 5)
        assert not raw.exists(p + "lookup")
        assert 0 < raw.pttl(p + "node:a") <= 5000
        assert await twice(restarted, keys) == [["a@dram"]] * 3
        assert raw.pttl(p + "lookup") > 0
        assert raw.pexpiretime(p + "lookup") <= raw.pexpiretime(p + "node:a")
    finally:
        await restarted.close()


async def test_republish_withdraws_cached_holders_at_once(idx: RedisIndex) -> None:
    keys = chain(4)
    await idx.register("a", "a:7070", {}, 0, 0, [], 60)
    await idx.republish("a", {k: ["dram"] for k in keys})
    assert await twice(idx, keys) == [["a@dram"]] * 4
    await idx.republish("a", {keys[0]: ["disk"], keys[1]: ["dram"]})
    assert await idx.lookup(keys) == [["a@disk"], ["a@dram"]]


async def test_a_write_that_skips_the_hash_shows_within_the_cap(redis_server: RedisServer,
                                                                raw: redis_py.Redis) -> None:
    """A sidecar of an older version publishes without touching the hash: misses, bounded."""
    index = new_index(redis_server, lookup_cache_s=1.0)
    try:
        keys = chain(3)
        await index.register("a", "a:7070", {}, 0, 0, [], 60)
        await index.apply("a", [IndexEvent(True, "dram", k) for k in keys[:1]])
        assert await twice(index, keys) == [["a@dram"]]
        for k in keys[1:]:
            raw.sadd(f"kvp:{index._s.pool}:blk:{k.hex()}", "a@dram")
        assert raw.pttl(f"kvp:{index._s.pool}:lookup") <= 1000  # (the hash may read stale till then)
        wait_until(lambda: not raw.exists(f"kvp:{index._s.pool}:lookup"), "the hash to expire", timeout=5)
        assert await index.lookup(keys) == [["a@dram"]] * 3
    finally:
        await index.purge_pool()
        await index.close()


async def test_no_cache_when_it_is_off_or_redis_refuses_writes(redis_factory: Callable[..., RedisServer]) -> None:
    server = redis_factory()
    raw = redis_py.Redis.from_url(server.url)
    off = new_index(server, lookup_cache_s=0)
    on = new_index(server, pool=off._s.pool)
    try:
        keys = chain(5)
        await on.register("a", "a:7070", {}, 0, 0, [], 60)
        await on.apply("a", [IndexEvent(True, "dram", k) for k in keys])
        assert await twice(off, keys) == [["a@dram"]] * 5
        assert await off.lookup(keys) == [["a@dram"]] * 5
        assert not raw.exists(f"kvp:{off._s.pool}:lookup")
        raw.config_set("maxmemory-policy", "noeviction")
        raw.config_set("maxmemory", raw.info("memory")["used_memory"])
        with pytest.raises(redis_py.exceptions.ResponseError, match="maxmemory"):
            raw.set("junk", "x" * 100_000)
        assert await twice(on, keys) == [["a@dram"]] * 5  # answered, not cached
        assert await on.lookup(keys) == [["a@dram"]] * 5
        assert not raw.exists(f"kvp:{off._s.pool}:lookup")
    finally:
        raw.config_set("maxmemory", 0)
        for index in (off, on):
            await index.purge_pool()
            await index.close()


async def test_what_a_writer_without_the_code_puts_in_the_hash(idx: RedisIndex, raw: redis_py.Redis) -> None:
    """Entries that are not ``node@tier`` end the prefix; bytes that are not UTF-8 make the
    lookup fail cleanly (a miss for the caller), and the next chain still works."""
    keys = chain(3)
    await idx.register("a", "a:7070", {}, 0, 0, [], 60)
    await idx.apply("a", [IndexEvent(True, "dram", k) for k in keys])
    assert await twice(idx, keys) == [["a@dram"]] * 3
    raw.hset(f"kvp:{idx._s.pool}:lookup", keys[1], "garbage")
    assert await idx.lookup(keys) == [["a@dram"]]
    raw.hset(f"kvp:{idx._s.pool}:lookup", keys[1], b"\xff@dram")
    with pytest.raises(IndexUnavailableError, match="UTF-8"):
        await idx.lookup(keys)
    other = chain(2)
    await idx.apply("a", [IndexEvent(True, "disk", k) for k in other])
    assert await idx.lookup(other) == [["a@disk"]] * 2
