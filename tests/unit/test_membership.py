"""Keeping the index true: queued events and re-publishing never undo each other."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any, cast

from kvpool_sidecar.config import IndexSettings, SidecarSettings
from kvpool_sidecar.errors import IndexUnavailableError
from kvpool_sidecar.events import IndexEvent, IndexQueue
from kvpool_sidecar.membership import Membership
from kvpool_sidecar.store import TieredStore

K = b"\x05" * 48


class Store:
    """The part of the store membership uses: its index events and its reports."""

    def __init__(self) -> None:
        self.index_events = IndexQueue()
        self.held: dict[bytes, list[str]] = {}
        self.report = self

    async def inventory_soon(self) -> dict[bytes, list[str]]:
        return dict(self.held)


class Index:
    """The first apply hangs until released and then fails, as with Redis unreachable."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.calls = 0
        self.advertised: set[bytes] = set()

    async def apply(self, node: str, events: Sequence[IndexEvent]) -> None:
        self.calls += 1
        if self.calls == 1:
            await self.release.wait()
            raise IndexUnavailableError("no answer within the deadline")
        for ev in events:
            if ev.publish:
                self.advertised.add(ev.key)
            else:
                self.advertised.discard(ev.key)

    async def republish(self, node: str, holdings: Mapping[bytes, Any]) -> None:
        self.advertised = set(holdings)


async def test_a_failed_flush_does_not_undo_a_republish() -> None:
    store, index = Store(), Index()
    m = Membership(SidecarSettings(node_name="a"), cast(TieredStore, store))
    m.redis = m.index = index  # type: ignore[assignment]
    store.held[K] = ["dram"]
    store.index_events.put(IndexEvent(True, "dram", K))  # K written
    flushing = asyncio.create_task(m.flush())  # its apply hangs: Redis is unreachable
    await asyncio.sleep(0)
    del store.held[K]
    store.index_events.put(IndexEvent(False, "dram", K))  # K evicted
    republishing = asyncio.create_task(m.republish())  # Redis came back empty
    await asyncio.sleep(0.05)
    index.release.set()  # the stuck apply fails; its events go back in the queue
    await flushing
    await republishing
    await m.flush()
    assert index.advertised == set()  # K is gone, and the index says so
    assert store.index_events.items == []


class Registry:
    """Heartbeats as Redis answers them: the hash vanished once; a sweep may be running."""

    def __init__(self) -> None:
        self.vanished = [True]
        self.sweeping = False
        self.fail_republish = 0
        self.republished = 0

    async def heartbeat(self, *args: Any, **kw: Any) -> bool:
        return self.vanished.pop() if self.vanished else False

    async def being_swept(self, node: str) -> bool:
        return self.sweeping

    async def republish(self, node: str, holdings: Mapping[bytes, Any]) -> None:
        if self.fail_republish:
            self.fail_republish -= 1
            raise IndexUnavailableError("no answer within the deadline")
        self.republished += 1


class CountingStore(Store):
    class metrics:  # noqa: N801 - stands in for the store's metrics attribute
        counts = {"get_hit": 0, "get_miss": 0}

    def tier_usage(self) -> dict[str, tuple[int, int, int]]:
        return {}


async def settled(m: Membership) -> None:
    """Wait for the re-publish a heartbeat started, if any (heartbeats do not wait for it)."""
    task = m._republishing
    if task is not None:
        await asyncio.wait([task])


async def test_a_lost_node_republishes_after_a_sweep_and_after_a_failed_try(caplog: Any) -> None:
    store, reg = CountingStore(), Registry()
    m = Membership(SidecarSettings(node_name="a"), cast(TieredStore, store))
    m.redis = m.index = reg  # type: ignore[assignment]
    m._republish = False  # the start-up re-publish is done
    reg.sweeping = True  # another sidecar is still removing this node's old entries
    await m.heartbeat_once()  # the hash had vanished: a re-publish is owed, not done yet
    assert m._republishing is None and reg.republished == 0
    reg.sweeping, reg.fail_republish = False, 1
    await m.heartbeat_once()  # the sweep ended; this try fails (in its own task: logged, not raised)
    await settled(m)
    assert reg.republished == 0 and "re-publishing to the index failed" in caplog.text
    await m.heartbeat_once()  # the hash is back (not vanished), but the debt is kept
    await settled(m)
    assert reg.republished == 1
    await m.heartbeat_once()
    assert m._republishing is None and reg.republished == 1


class SlowRegistry(Registry):
    """Redis with a re-publish that runs until released: it says one is owed until one has
    completed (the ``published`` mark), and keeps each heartbeat's signed time."""

    def __init__(self, *, release_after: int = 0) -> None:
        super().__init__()
        self.stamps: list[str] = []
        self.started = 0
        self.entered = asyncio.Event()
        self.release = asyncio.Event()
        #: Release the re-publish at this many heartbeats (0: the test does).
        self.release_after = release_after

    async def heartbeat(self, *args: Any, **kw: Any) -> bool:
        self.stamps.append(kw["stamp"])
        if len(self.stamps) == self.release_after:
            self.release.set()
        return not self.republished

    async def republish(self, node: str, holdings: Mapping[bytes, Any]) -> None:
        self.started += 1
        self.entered.set()
        await self.release.wait()
        await super().republish(node, holdings)


async def test_heartbeats_go_on_while_a_republish_runs() -> None:
    """A re-publish takes 18 µs a block on loopback; the heartbeat waited for it, and the node
    record's signed time (what peers believe) went stale for all that time: past 3 heartbeats
    plus 30 s (some 2 million blocks) peers fetched none of the node's blocks."""
    store, reg = CountingStore(), SlowRegistry()
    m = Membership(SidecarSettings(node_name="a"), cast(TieredStore, store))
    m.redis = m.index = reg  # type: ignore[assignment]
    async with asyncio.timeout(5):  # (the heartbeat had waited for the release: forever)
        await m.heartbeat_once()  # owed: starts the re-publish, does not wait for it
        await reg.entered.wait()
        for _ in range(3):
            await m.heartbeat_once()  # still owed (not marked yet): no second re-publish
        assert len(reg.stamps) == 4 and reg.stamps == sorted(reg.stamps, key=float)
        assert reg.started == 1 and reg.republished == 0
        reg.release.set()
        await settled(m)
    assert reg.republished == 1 and not m._republish
    await m.heartbeat_once()
    assert m._republishing is None and reg.started == 1


async def test_start_waits_for_its_first_republish_heart_beating_meanwhile() -> None:
    """Engines are served once the index lists what the node holds, as before; but the node
    record stays fresh meanwhile (the re-publish ends here at the third heartbeat)."""
    store, reg = CountingStore(), SlowRegistry(release_after=3)
    m = Membership(SidecarSettings(node_name="a", index=IndexSettings(heartbeat_s=0.01)), cast(TieredStore, store))
    m.redis = m.index = reg  # type: ignore[assignment]
    async with asyncio.timeout(5):
        await m.join()
    assert reg.republished == 1 and len(reg.stamps) == 3 and m._republishing is None


async def test_a_failed_first_republish_ends_the_wait_and_is_retried(caplog: Any) -> None:
    store, reg = CountingStore(), SlowRegistry()
    reg.release.set()
    reg.fail_republish = 1
    m = Membership(SidecarSettings(node_name="a", index=IndexSettings(heartbeat_s=0.01)), cast(TieredStore, store))
    m.redis = m.index = reg  # type: ignore[assignment]
    async with asyncio.timeout(5):
        await m.join()
        assert reg.started == 1 and reg.republished == 0 and m._republishing is None
        assert "re-publishing to the index failed" in caplog.text
        await m.heartbeat_once()  # the heartbeat loop's next try
        await settled(m)
    assert reg.started == 2 and reg.republished == 1


class FailingTransport:
    """An RDMA-capable transport whose engine cannot register the arena."""

    name = "mooncake"

    def __init__(self) -> None:
        self.closed = False

    async def start(self, source: object) -> str:
        from kvpool_sidecar.transfer.base import PeerError

        raise PeerError("register_memory failed: RLIMIT_MEMLOCK")

    async def close(self) -> None:
        self.closed = True


async def test_a_transport_that_cannot_start_falls_back_to_tcp(tmp_path: Any, monkeypatch: Any) -> None:
    import kvpool_sidecar.membership as membership
    from kvpool_sidecar.config import settings_from_mapping
    from tests.unit.store_support import make_store

    token = tmp_path / "token"
    token.write_text("0123456789abcdef-pool-secret")
    settings = settings_from_mapping({
        "node_name": "a",
        "index": {"backend": "redis", "url": "redis://127.0.0.1:1/0", "timeout_s": 0.2},  # nobody there
        "peer": {"enabled": True, "transport": "rdma", "port": 0, "token_file": str(token)}})
    failing = FailingTransport()
    real = membership.make_transport

    def fake_make(s: SidecarSettings, *, force_tcp: bool = False) -> Any:
        return real(s, force_tcp=True) if force_tcp else failing

    monkeypatch.setattr(membership, "make_transport", fake_make)
    m = Membership(settings, make_store())
    await m.start()
    try:
        assert failing.closed
        assert m.transport is not None and m.transport.name == "tcp" and m.address.startswith("127.0.0.1:")
    finally:
        await m.stop()


class Drain:
    """An index or a peer transport that writes down, in ``steps`` (shared), what a drain does to it."""

    def __init__(self, name: str, steps: list[str]) -> None:
        self.name = name
        self.steps = steps

    async def apply(self, node: str, events: Sequence[IndexEvent]) -> None:
        self.steps.append(f"{self.name} flushed")

    async def drop_node(self, node: str) -> None:
        self.steps.append(f"{self.name} unpublished")

    async def close(self) -> None:
        self.steps.append(f"{self.name} closed")


class Republishing(Drain):
    """A Redis index whose node owes a re-publish, which runs until cancelled."""

    def __init__(self, name: str, steps: list[str]) -> None:
        super().__init__(name, steps)
        self.entered = asyncio.Event()

    async def heartbeat(self, *args: Any, **kw: Any) -> bool:
        return True

    async def being_swept(self, node: str) -> bool:
        return False

    async def republish(self, node: str, holdings: Mapping[bytes, Any]) -> None:
        self.steps.append(f"{self.name} re-publishing")
        self.entered.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.steps.append(f"{self.name} re-publish cancelled")
            raise


async def test_a_draining_node_cancels_its_republish_before_it_unpublishes() -> None:
    """Whatever part of the re-publish had landed is taken back by the unpublishing (the
    inventory goes first), and none of it lands after; no re-publish starts once stopping."""
    steps: list[str] = []
    store = CountingStore()
    m = Membership(SidecarSettings(node_name="a"), cast(TieredStore, store))
    m.redis = m.index = index = Republishing("index", steps)  # type: ignore[assignment]
    m.transport = Drain("peer port", steps)  # type: ignore[assignment]
    async with asyncio.timeout(5):
        await m.heartbeat_once()
        await index.entered.wait()
        store.index_events.put(IndexEvent(True, "dram", K))  # stored meanwhile: queued
        await m.stop()
        await m.heartbeat_once()  # (a heartbeat that comes late)
    assert m._republishing is None
    assert steps == ["index re-publishing", "index re-publish cancelled", "index flushed", "index unpublished",
                     "peer port closed", "index closed"]


async def test_a_draining_node_serves_its_peers_until_it_is_unpublished() -> None:
    """The peer port had closed before the index stopped naming the node: every peer's read
    of its blocks was refused for the whole unpublishing (4 s for 300,000 blocks)."""
    steps: list[str] = []
    store = Store()
    m = Membership(SidecarSettings(node_name="a"), cast(TieredStore, store))
    m.index = Drain("index", steps)  # type: ignore[assignment]
    m.transport = Drain("peer port", steps)  # type: ignore[assignment]
    store.index_events.put(IndexEvent(True, "dram", K))
    await m.stop()
    assert steps == ["index flushed", "index unpublished", "peer port closed", "index closed"]
