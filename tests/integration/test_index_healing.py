"""The Redis index heals itself: a redis-server is killed and restarted empty on the same
port; a sidecar-like client that keeps heart-beating notices its node hash is gone and
re-publishes its inventory. The convergence time is printed, not asserted."""

from __future__ import annotations

import asyncio
import hashlib
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, cast

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from kvpool_sidecar.config import IndexSettings, SidecarSettings
from kvpool_sidecar.events import IndexEvent, IndexQueue
from kvpool_sidecar.index.redis import IndexUnavailableError, RedisIndex, RedisIndexSettings
from kvpool_sidecar.index.redisconn import Command
from kvpool_sidecar.membership import Membership
from kvpool_sidecar.peers import NodeTrust
from kvpool_sidecar.store import TieredStore
from tests.contract.conftest import RedisServer, slow_pipelines

pytestmark = [pytest.mark.integration, pytest.mark.redis]

CONVERGE_LIMIT_S = 30.0


@pytest.fixture
def redis_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., RedisServer]]:
    """Real redis-server processes (restartable on their port), stopped after the test."""
    started: list[RedisServer] = []

    def start(*args: str) -> RedisServer:
        started.append(RedisServer(tmp_path_factory.mktemp("redis-heal"), *args).start())
        return started[-1]

    yield start
    for s in started:
        s.stop()


def settings(pool: str) -> RedisIndexSettings:
    return RedisIndexSettings(pool=pool, deadline_s=1.0, socket_timeout_s=0.5, connect_timeout_s=0.5,
                              retries=1, live_cache_s=0.0)


@dataclass
class FakeSidecar:
    """What the sidecar's heartbeat task does: heartbeat; on loss, re-publish everything."""

    node: str
    index: RedisIndex
    holdings: dict[bytes, list[str]]
    interval_s: float = 0.1
    ttl_s: float = 3.0
    republished_at: list[float] = field(default_factory=list)
    failures: int = 0

    async def run(self) -> None:
        while True:
            try:
                if await self.index.heartbeat(self.node, f"{self.node}:7070", {}, 0, 0, [], self.ttl_s):
                    await self.index.republish(self.node, self.holdings)
                    self.republished_at.append(time.monotonic())
            except IndexUnavailableError:
                self.failures += 1
            await asyncio.sleep(self.interval_s)


@dataclass
class MidSweep:
    """Patches a sweeper's pipelines: runs ``action`` before its ``at``-th pipeline of block
    removals, and fails its ``fail_at``-th one (a cut connection)."""

    sweeper: RedisIndex
    action: Callable[[], Awaitable[None]]
    at: int = 2
    fail_at: int | None = None
    removals: int = 0

    def __post_init__(self) -> None:
        self.real = self.sweeper._pipeline
        self.sweeper._pipeline = self._pipeline  # type: ignore[method-assign]

    async def _pipeline(self, cmds: Sequence[Command]) -> list[Any]:
        if any(c[0] == "SREM" and ":blk:" in c[1] or c[0] == "EVAL" and ":blk:" in c[3] for c in cmds):
            self.removals += 1
            if self.removals == self.at:
                await self.action()
            if self.removals == self.fail_at:
                raise RedisConnectionError("connection cut mid-sweep")
        return await self.real(cmds)

    def undo(self) -> None:
        self.sweeper._pipeline = self.real  # type: ignore[method-assign]


def before_each_trip(index: RedisIndex, hook: Callable[[int], Awaitable[None]]) -> Callable[[], None]:
    """Run ``hook(n)`` before the index sends its n-th pipeline from now (it may raise, as a
    process killed there would stop); returns what puts the index's pipelines back."""
    real = index._pipeline
    trips = 0

    async def pipeline(cmds: Sequence[Command]) -> list[Any]:
        nonlocal trips
        trips += 1
        await hook(trips)
        return await real(cmds)

    index._pipeline = pipeline  # type: ignore[method-assign]

    def restore() -> None:
        index._pipeline = real  # type: ignore[method-assign]

    return restore


async def purged_and_closed(first: RedisIndex, *others: RedisIndex) -> None:
    """A test's end: the pool's keys deleted (through ``first``), then every index closed."""
    await first.purge_pool()
    for idx in (first, *others):
        await idx.close()


def two_indexes(server: RedisServer, pool: str, **kw: Any) -> tuple[RedisIndex, RedisIndex]:
    """A node's index client and a sweeper's, with small pipelines (sweeps take several)."""
    return (RedisIndex(server.url, replace(settings(pool), batch=100)),
            RedisIndex(server.url, replace(settings(pool), batch=100, **kw)))


async def wait_until_visible(observer: RedisIndex, keys: list[bytes], expected: list[list[str]]) -> float:
    deadline = time.monotonic() + CONVERGE_LIMIT_S
    while time.monotonic() < deadline:
        try:
            if await observer.lookup(keys) == expected:
                return time.monotonic()
        except IndexUnavailableError:
            pass
        await asyncio.sleep(0.01)
    raise AssertionError(f"index did not converge within {CONVERGE_LIMIT_S}s")


async def test_redis_restart_empty_heals(redis_factory: Callable[..., RedisServer]) -> None:
    server = redis_factory()
    keys = [hashlib.sha384(b"heal:%d" % i).digest() for i in range(3000)]
    holdings = {k: (["dram", "disk"] if i < 1000 else ["dram"]) for i, k in enumerate(keys)}
    expected = [sorted(f"a@{t}" for t in holdings[k]) for k in keys]
    writer = RedisIndex(server.url, settings("heal"))
    observer = RedisIndex(server.url, settings("heal"))  # another sidecar, reading
    side = FakeSidecar("a", writer, holdings)
    assert await writer.register("a", "a:7070", {}, 0, 0, [], side.ttl_s) is True
    await writer.republish("a", holdings)  # what a starting sidecar does
    assert await observer.lookup(keys) == expected
    task = asyncio.get_running_loop().create_task(side.run())
    try:
        await asyncio.sleep(0.3)
        assert side.republished_at == []  # nothing lost yet: no re-publish
        server.kill()
        t0 = time.monotonic()
        with pytest.raises(IndexUnavailableError):
            await observer.lookup(keys)
        assert time.monotonic() - t0 < 5.0
        await asyncio.sleep(0.5)
        server.start()  # same port, empty
        up = time.monotonic()
        visible = await wait_until_visible(observer, keys, expected)
        for _ in range(300):  # its re-publish ends with one more round trip (the mark)
            if side.republished_at:
                break
            await asyncio.sleep(0.01)
        assert len(side.republished_at) == 1 and side.failures > 0
        print(f"\nconvergence after restart: {(visible - up) * 1e3:.0f} ms for {len(keys)} blocks "
              f"(re-published {(side.republished_at[0] - up) * 1e3:.0f} ms after Redis was back; "
              f"heartbeat every {side.interval_s * 1e3:.0f} ms, {side.failures} failed heartbeats)")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await purged_and_closed(writer, observer)


async def test_swept_node_comes_back_and_republishes(redis_factory: Callable[..., RedisServer]) -> None:
    """A paused sidecar outlives its TTL, a peer sweeps it; its next heartbeat heals it."""
    server = redis_factory()
    keys = [hashlib.sha384(b"sweep:%d" % i).digest() for i in range(500)]
    a = RedisIndex(server.url, settings("sweep"))
    b = RedisIndex(server.url, settings("sweep"))
    try:
        await a.register("a", "a:1", {}, 0, 0, [], 0.2)
        await a.apply("a", [IndexEvent(True, "dram", k) for k in keys])
        await asyncio.sleep(0.4)  # "paused" past its TTL
        assert await b.lookup(keys) == []
        assert await b.sweep_dead() == 1
        assert await a.heartbeat("a", "a:1", {}, 0, 0, [], 30) is True
        await a.republish("a", {k: ["dram"] for k in keys})
        assert await b.lookup(keys) == [["a@dram"]] * 500
    finally:
        await purged_and_closed(a, b)


async def test_a_node_back_during_a_failing_sweep_keeps_its_entries(
        redis_factory: Callable[..., RedisServer]) -> None:
    """The sweep is cut short by a failure after the node came back: its entries survive.

    The node heartbeats while the sweep is half way; it must not re-publish then (the rest of
    the sweep would remove what it wrote). The failed sweep keeps its claim until it expires
    (a removal may still be in flight); then the node's next heartbeat re-publishes.
    """
    server = redis_factory()
    keys = [hashlib.sha384(b"race:%d" % i).digest() for i in range(500)]
    holdings = {k: ["dram"] for k in keys}
    a, b = two_indexes(server, "race", sweep_claim_s=0.5)
    owed = False

    async def sidecar_heartbeat() -> None:  # what Membership.heartbeat_once does
        nonlocal owed
        owed = await a.heartbeat("a", "a:1", {}, 0, 0, [], 30) or owed
        if owed and not await a.being_swept("a"):
            await a.republish("a", holdings)
            owed = False

    async def wakes_up() -> None:  # the paused node wakes up mid-sweep
        await sidecar_heartbeat()
        assert owed and await a.being_swept("a")

    try:
        await a.register("a", "a:1", {}, 0, 0, [], 0.2)
        await a.apply("a", [IndexEvent(True, "dram", k) for k in keys])
        await asyncio.sleep(0.4)  # paused past its TTL
        mid = MidSweep(b, wakes_up, at=2, fail_at=4)
        with pytest.raises(IndexUnavailableError):
            await b.sweep_dead()
        assert mid.removals == 4
        await sidecar_heartbeat()  # the failed sweep keeps its claim: removals may still land
        assert owed
        await asyncio.sleep(0.6)  # the claim expires
        await sidecar_heartbeat()  # re-publish now
        assert not owed
        assert await b.lookup(keys) == [["a@dram"]] * 500
        mid.undo()
        assert await b.sweep_dead() == 0  # nothing is dead any more
    finally:
        await purged_and_closed(a, b)


async def test_a_node_another_sweeper_claimed_is_left_to_it(redis_factory: Callable[..., RedisServer]) -> None:
    server = redis_factory()
    keys = [hashlib.sha384(b"claim:%d" % i).digest() for i in range(10)]
    a = RedisIndex(server.url, settings("claim"))
    b = RedisIndex(server.url, replace(settings("claim"), sweep_claim_s=0.3))
    c = RedisIndex(server.url, settings("claim"))
    try:
        await a.register("a", "a:1", {}, 0, 0, [], 0.2)
        await a.apply("a", [IndexEvent(True, "dram", k) for k in keys])
        await asyncio.sleep(0.4)
        # b claims the dead node, then stalls (its claim is left to expire)
        assert await b._pipeline([("SET", b._keys.claim("a"), "b", "NX", "PX", 300)]) == [True]
        assert await c.sweep_dead() == 0  # claimed by b: c keeps off
        assert await a.heartbeat("a", "a:1", {}, 0, 0, [], 0.2) is True and await a.being_swept("a")
        await asyncio.sleep(0.5)  # b's claim and a's hash both expire
        assert await c.sweep_dead() == 1
        assert await c.lookup(keys) == []
        assert await a.heartbeat("a", "a:1", {}, 0, 0, [], 30) is True and not await a.being_swept("a")
    finally:
        await purged_and_closed(a, b, c)


async def test_a_node_that_republished_under_a_sweep_is_told_to_again(
        redis_factory: Callable[..., RedisServer]) -> None:
    """A node that ignores the claim (an older version, or a sweeper stalled past it) and
    re-publishes mid-sweep: the sweep's end removes its mark, so it re-publishes again."""
    server = redis_factory()
    keys = [hashlib.sha384(b"late:%d" % i).digest() for i in range(300)]
    holdings = {k: ["dram"] for k in keys}
    a, b = two_indexes(server, "late")

    async def republishes_anyway() -> None:
        assert await a.heartbeat("a", "a:1", {}, 0, 0, [], 30) is True
        await a.republish("a", holdings)  # without asking being_swept

    try:
        await a.register("a", "a:1", {}, 0, 0, [], 0.2)
        await a.republish("a", holdings)
        await asyncio.sleep(0.4)
        MidSweep(b, republishes_anyway)
        assert await b.sweep_dead() == 1
        assert len(await b.lookup(keys)) < 300  # the sweep removed part of what it re-published
        assert await a.heartbeat("a", "a:1", {}, 0, 0, [], 30) is True  # and so it is owed again
        assert not await a.being_swept("a")
        await a.republish("a", holdings)
        assert await b.lookup(keys) == [["a@dram"]] * 300
        assert await a.heartbeat("a", "a:1", {}, 0, 0, [], 30) is False
    finally:
        await purged_and_closed(a, b)


async def test_a_republish_counts_only_while_the_node_hash_lives(redis_factory: Callable[..., RedisServer]) -> None:
    server = redis_factory()
    a = RedisIndex(server.url, settings("mark"))
    try:
        assert await a.register("a", "a:1", {}, 0, 0, [], 0.2) is True
        await asyncio.sleep(0.3)  # the hash expires before the re-publish ends
        await a.republish("a", {b"\x01" * 48: ["dram"]})
        assert await a.heartbeat("a", "a:1", {}, 0, 0, [], 30) is True  # still owed
        await a.republish("a", {b"\x01" * 48: ["dram"]})
        assert await a.heartbeat("a", "a:1", {}, 0, 0, [], 30) is False
        other = RedisIndex(server.url, settings("mark"))  # a new life of the same node
        try:
            assert await other.heartbeat("a", "a:1", {}, 0, 0, [], 30) is True
        finally:
            await other.close()
    finally:
        await purged_and_closed(a)


async def test_a_sweeper_stalled_past_its_claim_still_leaves_the_node_owing(
        redis_factory: Callable[..., RedisServer]) -> None:
    """The claim expires while a removal is in flight; the node re-publishes meanwhile; the
    stale removal lands. The sweep's end marks the node swept, so it re-publishes again."""
    server = redis_factory()
    keys = [hashlib.sha384(b"stall:%d" % i).digest() for i in range(300)]
    holdings = {k: ["dram"] for k in keys}
    a, b = two_indexes(server, "stall")

    async def claim_expires_and_node_republishes() -> None:  # b stalls; its removal lands late
        await b._one("DEL", b._keys.claim("a"))  # (the claim expiring)
        assert await a.heartbeat("a", "a:1", {}, 0, 0, [], 30) is True
        assert not await a.being_swept("a")
        await a.republish("a", holdings)
        assert await a.heartbeat("a", "a:1", {}, 0, 0, [], 30) is False  # marked

    try:
        await a.register("a", "a:1", {}, 0, 0, [], 0.2)
        await a.republish("a", holdings)
        await asyncio.sleep(0.4)
        MidSweep(b, claim_expires_and_node_republishes)
        with pytest.raises(IndexUnavailableError, match="sweeping 1 dead nodes failed"):
            await b.sweep_dead()
        assert len(await b.lookup(keys)) < 300  # the late removal hit re-published entries
        assert await a.heartbeat("a", "a:1", {}, 0, 0, [], 30) is True  # but a re-publish is owed
        await a.republish("a", holdings)
        assert await b.lookup(keys) == [["a@dram"]] * 300
    finally:
        await purged_and_closed(a, b)


async def test_a_sweep_ending_during_a_republish_refuses_its_mark(redis_factory: Callable[..., RedisServer]) -> None:
    server = redis_factory()
    keys = [hashlib.sha384(b"fence:%d" % i).digest() for i in range(300)]
    holdings = {k: ["dram"] for k in keys}
    a = RedisIndex(server.url, replace(settings("fence"), batch=100))
    b = RedisIndex(server.url, settings("fence"))
    real_pipeline = a._pipeline

    async def swept_midway(cmds: Sequence[Command]) -> list[Any]:
        out = await real_pipeline(cmds)
        await b._scripts.swept(keys=[b._keys.node("a")])  # a sweep's end lands now
        return out

    try:
        assert await a.register("a", "a:1", {}, 0, 0, [], 30) is True
        a._pipeline = swept_midway  # type: ignore[method-assign]
        await a.republish("a", holdings)
        a._pipeline = real_pipeline  # type: ignore[method-assign]
        assert await a.heartbeat("a", "a:1", {}, 0, 0, [], 30) is True  # the mark was refused
        await a.republish("a", holdings)
        assert await a.heartbeat("a", "a:1", {}, 0, 0, [], 30) is False
    finally:
        await purged_and_closed(a, b)


async def test_a_long_republish_keeps_the_node_hash_alive(redis_factory: Callable[..., RedisServer]) -> None:
    server = redis_factory()
    keys = [hashlib.sha384(b"long:%d" % i).digest() for i in range(400)]
    a = RedisIndex(server.url, replace(settings("long"), batch=100))
    try:
        assert await a.register("a", "a:1", {}, 0, 0, [], 0.3) is True
        undo = slow_pipelines(a, 0.15)  # five of these (one per 100 commands) outlast the 0.3 s TTL
        await a.republish("a", {k: ["dram"] for k in keys})
        undo()
        assert await a.heartbeat("a", "a:1", {}, 0, 0, [], 30) is False  # marked: the hash never expired
    finally:
        await purged_and_closed(a)


async def test_one_failing_sweep_does_not_stop_the_others(redis_factory: Callable[..., RedisServer]) -> None:
    server = redis_factory()
    keys = [hashlib.sha384(b"two:%d" % i).digest() for i in range(20)]
    a = RedisIndex(server.url, settings("two"))
    sweeper = RedisIndex(server.url, settings("two"))
    real_pages = sweeper._member_pages

    async def cut() -> AsyncIterator[list[str]]:
        raise RedisConnectionError("inventory read cut")
        yield []  # (an async generator, as the sweep reads the inventory page by page)

    def inventory_fails_for_a(key: str, keep_alive: tuple[str, int] | None = None) -> AsyncIterator[list[str]]:
        return cut() if key.endswith(":inv:a") else real_pages(key, keep_alive)

    try:
        for node in ("a", "b"):
            await a.register(node, f"{node}:1", {}, 0, 0, [], 0.2)
            await a.apply(node, [IndexEvent(True, "dram", k) for k in keys])
        await asyncio.sleep(0.4)
        sweeper._member_pages = inventory_fails_for_a  # type: ignore[method-assign]
        assert await sweeper.sweep_dead() == 1  # b is swept although a's sweep failed
        raw = sweeper._r
        assert not await raw.exists(sweeper._keys.claim("a"))  # nothing was sent: its claim is released
        assert await raw.smembers(sweeper._keys.blk(keys[0].hex())) == {"a@dram"}
        sweeper._member_pages = real_pages  # type: ignore[method-assign]
        assert await sweeper.sweep_dead() == 1  # a, next round
        assert await sweeper.lookup(keys) == []
        for node in ("a", "b"):  # the sweep never re-creates a dead node's hash
            assert not await raw.exists(sweeper._keys.node(node))
    finally:
        await purged_and_closed(a, sweeper)


async def test_a_node_killed_during_its_republish_leaves_nothing_the_sweep_misses(
        redis_factory: Callable[..., RedisServer]) -> None:
    """A re-publish cut short by the node's death (its start re-publishes everything) had
    written holders its inventory did not list yet: the sweep, which walks the inventory,
    left them (768 of 3,000 in a review's ``republish_crash.py``), and once the node came back
    under its name holding none of them, lookups named it their holder again."""
    server = redis_factory()
    keys = [hashlib.sha384(b"killed:%d" % i).digest() for i in range(3000)]
    a, sweeper = two_indexes(server, "killed")

    async def killed_after_three_trips(trip: int) -> None:
        if trip > 3:
            raise asyncio.CancelledError  # (the process is gone: nothing after this is sent)

    back = RedisIndex(server.url, settings("killed"))
    try:
        await a.register("a", "a:1", {}, 0, 0, [], 0.3)
        before_each_trip(a, killed_after_three_trips)
        with pytest.raises(asyncio.CancelledError):
            await a.republish("a", {k: ["dram"] for k in keys})
        await asyncio.sleep(0.5)  # its hash expires
        assert await sweeper.sweep_dead() == 1
        assert not [v for v in await sweeper._r.hmget(sweeper._keys.held, keys) if v]
        assert await back.heartbeat("a", "a:1", {}, 0, 0, [], 30) is True  # back, holding nothing
        await back.republish("a", {})
        assert await sweeper.lookup(keys) == []
    finally:
        await purged_and_closed(sweeper, a, back)


async def test_names_planted_in_the_nodes_set_cost_a_sweep_a_few_trips(
        redis_factory: Callable[..., RedisServer]) -> None:
    """A writer to Redis adds 4,096 names to the nodes set, 100 of them with an inventory: each
    had cost every sidecar's sweep a claim and six more trips (2.4 s of its CPU a sweep, a
    review's ``sweep_fakes.py``). Names with nothing published go in a few trips; at most
    64 (MAX_SWEEPS) with an inventory are walked a sweep; a real dead node is swept all the same."""
    server = redis_factory()
    keys = [hashlib.sha384(b"planted:%d" % i).digest() for i in range(10)]
    a, sweeper = two_indexes(server, "planted")
    trips = 0
    real_one, real_pipeline = sweeper._one, sweeper._pipeline

    async def one(*cmd: Any) -> Any:
        nonlocal trips
        trips += 1
        return await real_one(*cmd)

    async def pipeline(cmds: Sequence[Command]) -> list[Any]:
        nonlocal trips
        trips += 1
        return await real_pipeline(cmds)

    try:
        await a.register("a", "a:1", {}, 0, 0, [], 0.2)
        await a.apply("a", [IndexEvent(True, "dram", k) for k in keys])
        await a.register("live", "live:1", {}, 0, 0, [], 30)
        raw = sweeper._r
        planted = [f"fake{i}" for i in range(4094)]
        await raw.sadd(sweeper._keys.nodes, *planted)
        for name in planted[:100]:
            await raw.sadd(sweeper._keys.inv(name), "ab" * 48)
        await asyncio.sleep(0.3)  # a's hash expires
        sweeper._one, sweeper._pipeline = one, pipeline  # type: ignore[method-assign]
        assert await sweeper.sweep_dead() == 3994 + 64
        assert trips < 640  # (about 7 a walked name, 64 of them; it had been 7 a name, 28,000)
        assert await raw.scard(sweeper._keys.nodes) == 100 + 1 - 64 + 1  # those with an inventory and a, live
        for _ in range(5):  # the rest, a among them, at the next sweeps
            await sweeper.sweep_dead()
        assert await raw.smembers(sweeper._keys.nodes) == {"live"}
        assert await sweeper.lookup(keys) == []
        assert not [v for v in await raw.hmget(sweeper._keys.held, keys) if v]
    finally:
        await purged_and_closed(sweeper, a)


class HeldStore:
    """The part of the store membership uses: index events, reports, what it holds."""

    class metrics:  # noqa: N801 - stands in for the store's metrics attribute
        counts = {"get_hit": 0, "get_miss": 0}

    def __init__(self, held: dict[bytes, list[str]]) -> None:
        self.index_events = IndexQueue()
        self.held = held
        self.report = self

    async def inventory_soon(self) -> dict[bytes, list[str]]:
        return dict(self.held)

    def tier_usage(self) -> dict[str, tuple[int, int, int]]:
        return {}


@dataclass
class SigningTransport:
    """What membership takes of a peer transport to sign its node record: the pool secret."""

    token: bytes = b"0123456789abcdef-pool-secret"
    name: str = "tcp"

    async def close(self) -> None:
        return None


@dataclass
class Gate:
    """Holds a re-publish at its ``at``-th pipeline that names ``what`` until released."""

    index: RedisIndex
    what: str
    at: int = 2
    seen: int = 0
    entered: asyncio.Event = field(default_factory=asyncio.Event)
    release: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.real = self.index._pipeline
        self.index._pipeline = self._pipeline  # type: ignore[method-assign]

    async def _pipeline(self, cmds: Sequence[Command]) -> list[Any]:
        if any(self.what in str(c) for c in cmds):
            self.seen += 1
            if self.seen == self.at:
                self.entered.set()
                await self.release.wait()
        return await self.real(cmds)


def member(server: RedisServer, pool: str, held: dict[bytes, list[str]], heartbeat_s: float) -> Membership:
    """A node's membership on ``server``, its record signed, as after start() but for its
    first heartbeat (which the test makes)."""
    conf = SidecarSettings(node_name="a", pool=pool, index=IndexSettings(backend="redis", heartbeat_s=heartbeat_s))
    m = Membership(conf, cast(TieredStore, HeldStore(held)))
    m.redis = m.index = RedisIndex(server.url, replace(settings(pool), batch=100))
    m.transport = SigningTransport()  # type: ignore[assignment]
    m.address = "127.0.0.1:7070"
    return m


async def test_a_node_stays_believed_while_it_republishes(redis_factory: Callable[..., RedisServer]) -> None:
    """A re-publish takes 18 µs a block on loopback (1.4 s per 100,000 blocks). The heartbeat
    waited for it: the record's TTL was kept alive, but not its signed time, and peers stop
    believing a record older than 3 heartbeats plus 30 s of skew: from some 2 million blocks
    (sooner on a slower Redis), none of the node's blocks could be fetched until it ended.
    Here the re-publish is held mid-way, and a peer that takes records up to 3 heartbeats
    old still believes the node's well past that."""
    server = redis_factory()
    keys = [hashlib.sha384(b"believed:%d" % i).digest() for i in range(1000)]
    heartbeat_s = 0.05
    m = member(server, "believed", {k: ["dram"] for k in keys}, heartbeat_s)
    assert m.redis is not None and isinstance(m.transport, SigningTransport)
    trust = NodeTrust(m.transport.token, "believed", max_age_s=3 * heartbeat_s)
    observer = RedisIndex(server.url, settings("believed"))
    gate = Gate(m.redis, ":inv:a", at=1)  # its inventory's trip (one: 99 commands of 100 keys)
    real_heartbeat = m.redis.heartbeat
    late = asyncio.Event()
    held_since = float("inf")

    async def heartbeat(*args: Any, **kw: Any) -> bool:
        owed = await real_heartbeat(*args, **kw)
        if float(kw["stamp"]) > held_since + 2 * trust.max_age_s:
            late.set()
        return owed

    m.redis.heartbeat = heartbeat
    beating = asyncio.create_task(m.heartbeat_loop())
    try:
        async with asyncio.timeout(10):  # (the heartbeats had waited for the release: forever)
            await m.heartbeat_once()  # registers; the re-publish it starts runs on its own
            await gate.entered.wait()
            held_since = time.time()
            await late.wait()  # a heartbeat well past 3 heartbeats after the re-publish was held
            assert [n["name"] for n in await observer.nodes(trust.believes)] == ["a"]
            assert m._republishing is not None and not m._republishing.done()
            assert await observer.lookup(keys[:1]) == []  # (none of its holders written yet)
            gate.release.set()
            await asyncio.wait([m._republishing])
        assert await observer.lookup(keys) == [["a@dram"]] * len(keys)
        assert await real_heartbeat("a", "127.0.0.1:7070", {}, 0, 0, [], 30) is False  # marked
    finally:
        gate.release.set()
        beating.cancel()
        await asyncio.gather(beating, return_exceptions=True)
        await observer.purge_pool()
        await m.stop()
        await observer.close()


async def test_a_republish_cut_short_by_a_drain_leaves_nothing_published(
        redis_factory: Callable[..., RedisServer]) -> None:
    """stop() cancels a re-publish under way, waits for it, then unpublishes: the part of it
    that landed (the whole inventory, and some block sets) is taken back, none lands after."""
    server = redis_factory()
    keys = [hashlib.sha384(b"drained:%d" % i).digest() for i in range(1000)]
    m = member(server, "drained", {k: ["dram"] for k in keys}, 0.05)
    assert m.redis is not None
    redis = m.redis
    observer = RedisIndex(server.url, settings("drained"))
    gate = Gate(redis, "EVAL", at=3)  # the inventory written, two trips of block sets too
    try:
        async with asyncio.timeout(10):
            await m.heartbeat_once()
            await gate.entered.wait()
            assert len(await observer.lookup(keys)) >= 100  # half published
            await m.stop()  # (the gate is never released: the cancel ends the trip it holds)
        raw = observer._r
        assert not [v for v in await raw.hmget(observer._keys.held, keys) if v]
        assert await raw.scard(observer._keys.blk(keys[0].hex())) == 0
        assert not await raw.exists(observer._keys.inv("a"), observer._keys.node("a"))
        assert await observer.lookup(keys) == []
    finally:
        await purged_and_closed(observer)


async def test_a_republish_over_which_redis_lost_its_data_stays_owed(
        redis_factory: Callable[..., RedisServer]) -> None:
    """Redis loses its data in the middle of a re-publish, and a heartbeat (they go on during
    one) makes the node hash again: the re-publish must not mark that hash as holding the
    inventory, of which the index now lists only the part written after the loss (the mark
    had landed, the debt was gone for good, and the holders written after the loss had no
    inventory behind them that a drain or a sweep would walk: a review's
    ``repro_loss_mid_republish.py``)."""
    server = redis_factory()
    keys = [hashlib.sha384(b"lost:%d" % i).digest() for i in range(3000)]
    a, _ = two_indexes(server, "lost")
    trips: list[int] = []

    async def losing_data_midway(trip: int) -> None:
        trips.append(trip)
        if trip == 10:
            await a._one("FLUSHALL")  # a Redis restarted without persistence
            assert await a.heartbeat("a", "a:1", {}, 0, 0, [], 30) is True  # owed: the hash is new

    try:
        assert await a.heartbeat("a", "a:1", {}, 0, 0, [], 30) is True
        restore = before_each_trip(a, losing_data_midway)
        await a.republish("a", {k: ["dram"] for k in keys})
        restore()
        assert len(trips) > 10  # (the loss came in the middle)
        assert await a.heartbeat("a", "a:1", {}, 0, 0, [], 30) is True  # still owed
        await a.republish("a", {k: ["dram"] for k in keys})
        assert await a.heartbeat("a", "a:1", {}, 0, 0, [], 30) is False
        await a.drop_node("a")
        assert not [v for v in await a._r.hmget(a._keys.held, keys) if v]
    finally:
        await purged_and_closed(a)


async def test_names_planted_with_a_claim_do_not_delay_the_sweep_of_a_dead_node(
        redis_factory: Callable[..., RedisServer]) -> None:
    """A writer to Redis plants 4,000 names, each with an inventory and a claim that never
    expires: a sweep had sampled its 64 among them all, and swept a real dead node at the
    51st sweep (a review's ``repro_sweep_starve.py``). Claimed names are not sampled."""
    server = redis_factory()
    keys = [hashlib.sha384(b"starved:%d" % i).digest() for i in range(10)]
    a, sweeper = two_indexes(server, "starved")
    random.seed(52)  # (the sample is random: this run's is the same every time)
    try:
        await a.register("a", "a:1", {}, 0, 0, [], 0.2)
        await a.apply("a", [IndexEvent(True, "dram", k) for k in keys])
        raw = sweeper._r
        planted = [f"fake{i}" for i in range(4000)]
        await raw.sadd(sweeper._keys.nodes, *planted)
        async with raw.pipeline(transaction=False) as pipe:
            for name in planted:
                pipe.sadd(sweeper._keys.inv(name), "ab" * 48)
                pipe.set(sweeper._keys.claim(name), "someone")
            await pipe.execute()
        await asyncio.sleep(0.3)  # a's hash expires
        assert await sweeper.sweep_dead() == 1
        assert await sweeper.lookup(keys) == []
        assert not [v for v in await raw.hmget(sweeper._keys.held, keys) if v]
    finally:
        await purged_and_closed(sweeper, a)
