"""The pool read path (PeerReader) with an in-memory index and a counting transport."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import pytest

from kvpool_client.integrity import checksum
from kvpool_client.keys import ModelFingerprint, block_keys
from kvpool_sidecar.errors import IndexUnavailableError
from kvpool_sidecar.fetchgate import FetchGate
from kvpool_sidecar.peers import HOLDER_BACKOFF_S, PeerReader, StoreSource
from kvpool_sidecar.store import StoreSettings, TenantLimits
from kvpool_sidecar.transfer import tcp, tcpserve, tcpwire
from kvpool_sidecar.transfer.base import BlockSink
from tests.unit.store_support import close_store, make_store, put, read, until

FP = ModelFingerprint("peers", "bf16", 4, "bytes")
TOKEN = b"0123456789abcdef-pool-secret"
KEYS = [k.raw for k in block_keys(FP, list(range(4 * 6)))]
DATA = {k: os.urandom(5000 + i) for i, k in enumerate(KEYS)}


class Index:
    def __init__(self, holders: dict[bytes, list[str]], nodes: list[dict[str, Any]]) -> None:
        self.holders = holders
        self._nodes = nodes
        self.lookups = 0
        self.down = False

    async def lookup(self, keys: Sequence[bytes]) -> list[list[str]]:
        self.lookups += 1
        if self.down:
            raise IndexUnavailableError("redis is down")
        out = []
        for k in keys:
            if not self.holders.get(k):
                break
            out.append(self.holders[k])
        return out

    async def nodes(self, believe: Callable[[Mapping[str, str]], bool] | None = None) -> list[dict[str, Any]]:
        return [n for n in self._nodes if believe is None or believe(n)]


class Transport:
    """Serves DATA to whoever asks, after a pause, counting requests per address."""

    name = "fake"
    max_keys = 4096
    connections_per_peer = 4

    def __init__(self) -> None:
        self.calls: list[tuple[str, list[bytes]]] = []
        self.kept: list[set[str]] = []

    async def start(self, source: object) -> str:
        return "me:1"

    def forget(self, keep: Collection[str]) -> int:
        self.kept.append(set(keep))
        return 0

    def failing(self, address: str) -> bool:
        return False

    async def fetch(self, address: str, keys: Sequence[bytes], sink: BlockSink, timeout: float) -> list[bool]:
        self.calls.append((address, list(keys)))
        await asyncio.sleep(0.05)
        done = []
        for k in keys:
            room = await sink.reserve(k, len(DATA[k]), "default")
            if room is None:
                done.append(False)
                continue
            lease, views = room
            pos = 0
            for v in views:
                v[:] = DATA[k][pos : pos + v.nbytes]
                pos += v.nbytes
            sink.commit(lease, checksum(memoryview(DATA[k])))
            done.append(True)
        return done

    async def close(self) -> None:
        return None


def node(name: str, used: int, cap: int = 100) -> dict[str, Any]:
    return {"name": name, "address": f"{name}:9467", "tiers": {"dram": {"capacity_bytes": cap, "used_bytes": used}}}


NODES = [node("me", 0), node("busy", 90), node("idle", 10)]


def reader(holders: dict[bytes, list[str]]) -> tuple[PeerReader, Index, Transport]:
    idx, tr = Index(holders, NODES), Transport()
    return PeerReader(make_store(), idx, tr, "me", fetch_timeout_s=5.0), idx, tr


async def test_concurrent_misses_of_the_same_blocks_fetch_once() -> None:
    pr, _, tr = reader({k: ["idle@dram"] for k in KEYS})
    got = await asyncio.gather(*(pr.fetch(KEYS) for _ in range(5)))
    assert sum(got) == len(KEYS)  # all arrived, counted once
    assert len(tr.calls) == 1 and tr.calls[0] == ("idle:9467", KEYS)
    for k in KEYS:
        assert await read(pr.store, k) == DATA[k]
    assert await pr.fetch(KEYS) == 0 and len(tr.calls) == 1  # now local: no fetch at all


async def test_a_waiter_that_goes_away_never_wedges_the_shared_fetch() -> None:
    pr, _, tr = reader({k: ["idle@dram"] for k in KEYS})
    owner = asyncio.create_task(pr.fetch(KEYS[:2]))  # owns the fetch of blocks 0 and 1
    await asyncio.sleep(0)
    gone = asyncio.create_task(pr.fetch(KEYS[:1]))  # waits on the owner's fetch of block 0
    other = asyncio.create_task(pr.fetch(KEYS[:1]))  # so does another request
    await asyncio.sleep(0.01)
    gone.cancel()  # its client disconnected
    assert await owner == 2
    assert await other == 0  # it got its block through the owner's fetch, no error
    assert gone.cancelled()
    assert not pr._inflight  # nothing left waiting on a fetch that never ends
    assert await asyncio.wait_for(pr.fetch(KEYS[1:3]), 5) == 1  # later fetches go on
    assert len(tr.calls) == 2


async def test_holder_choice_prefers_hotter_tier_then_less_loaded_never_self() -> None:
    holders = {
        KEYS[0]: ["busy@dram", "idle@disk"],   # hotter tier wins over load
        KEYS[1]: ["busy@dram", "idle@dram"],   # same tier: the less loaded node
        KEYS[2]: ["me@dram", "busy@disk"],     # never ourselves (a stale entry)
        KEYS[3]: ["ghost@dram", "busy@disk"],  # unknown (dead) nodes are skipped
    }
    pr, _, tr = reader(holders)
    assert await pr.fetch(KEYS[:4]) == 4
    asked = {k: addr for addr, ks in tr.calls for k in ks}
    assert asked == {KEYS[0]: "busy:9467", KEYS[1]: "idle:9467", KEYS[2]: "busy:9467", KEYS[3]: "busy:9467"}
    assert sorted(len(ks) for _, ks in tr.calls) == [1, 3]  # one request per holder


async def test_the_fetch_stops_where_no_other_node_holds_the_next_block() -> None:
    holders = {KEYS[0]: ["idle@dram"], KEYS[1]: ["me@dram"], KEYS[2]: ["idle@dram"]}
    pr, _, tr = reader(holders)
    assert await pr.fetch(KEYS[:3]) == 1
    assert tr.calls == [("idle:9467", [KEYS[0]])]
    assert await pr.remote_prefix(KEYS[:3]) == 1


async def test_an_unreachable_index_is_a_miss_not_an_error() -> None:
    pr, idx, tr = reader({k: ["idle@dram"] for k in KEYS})
    idx.down = True
    assert await pr.fetch(KEYS) == 0
    assert await pr.remote_prefix(KEYS) == 0
    assert tr.calls == []


async def test_a_lookup_primes_the_get_that_follows() -> None:
    pr, idx, _ = reader({k: ["idle@dram"] for k in KEYS})
    assert await pr.remote_prefix(KEYS) == len(KEYS)
    before = idx.lookups
    assert await pr.fetch(KEYS) == len(KEYS)
    assert idx.lookups == before  # holders came from the lookup, not a second index trip


class SlowIndex(Index):
    """Answers after ``pause`` seconds, and records how many keys each lookup asked about."""

    def __init__(self, holders: dict[bytes, list[str]], pause: float) -> None:
        super().__init__(holders, NODES)
        self.pause = pause
        self.asked: list[int] = []

    async def lookup(self, keys: Sequence[bytes]) -> list[list[str]]:
        self.asked.append(len(keys))
        await asyncio.sleep(self.pause)
        return await super().lookup(keys)


class Stalling(Transport):
    """Gives the first block of each request, then stalls until its budget is spent."""

    def __init__(self) -> None:
        super().__init__()
        self.budgets: list[float] = []

    async def fetch(self, address: str, keys: Sequence[bytes], sink: BlockSink, timeout: float) -> list[bool]:
        self.budgets.append(timeout)
        first = await super().fetch(address, keys[:1], sink, timeout)
        await asyncio.sleep(max(0.0, timeout - 0.05))
        return first + [False] * (len(keys) - 1)


async def test_the_index_and_the_transfer_share_one_deadline() -> None:
    """A slow index leaves the transfer only what is left of the deadline: the fetch ends by
    the deadline, not after the index's wait plus a whole deadline more."""
    idx, tr = SlowIndex({k: ["idle@dram"] for k in KEYS}, pause=0.3), Stalling()
    pr = PeerReader(make_store(), idx, tr, "me", fetch_timeout_s=0.6)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    assert await pr.fetch(KEYS[:4]) == 1
    took = loop.time() - t0
    assert tr.budgets and tr.budgets[0] <= 0.6 - 0.3 + 0.05, tr.budgets
    assert took < 0.6 + 0.25, took  # (the stalling transport spends all it is given)


async def test_a_holder_that_sends_one_block_and_stalls_is_skipped_afterwards() -> None:
    tr = Stalling()
    pr = PeerReader(make_store(), Index({k: ["idle@dram"] for k in KEYS}, NODES), tr, "me", fetch_timeout_s=0.3)
    assert await pr.fetch(KEYS[:4]) == 1
    assert await pr.fetch(KEYS[4:8]) == 0  # backed off: not asked again while it is skipped
    assert len(tr.calls) == 1
    assert await pr.remote_prefix(KEYS[4:8]) == 0  # nor counted as held by the lookups


class Refusing(Transport):
    """Nothing listens at the ``dead`` addresses: each fetch from one fails at once."""

    def __init__(self, *dead: str) -> None:
        super().__init__()
        self.dead = set(dead)

    async def fetch(self, address: str, keys: Sequence[bytes], sink: BlockSink, timeout: float) -> list[bool]:
        if address in self.dead:
            self.calls.append((address, list(keys)))
            await asyncio.sleep(0)  # (a refused connect still takes a turn of the loop)
            return [False] * len(keys)
        return await super().fetch(address, keys, sink, timeout)

    def failing(self, address: str) -> bool:
        return address in self.dead


async def test_a_holder_whose_fetches_fail_at_once_is_skipped_for_another_holder() -> None:
    """A holder that died while its record is still believed refuses connections: that costs
    no time, so it had been chosen again (the least loaded) on every read, each a miss, though
    another holder had the blocks. Now it is skipped, and the read that met it asks the other
    holder within its deadline."""
    tr = Refusing("idle:9467")
    holders = {k: ["idle@dram", "busy@dram"] for k in KEYS[:3]} | {KEYS[3]: ["idle@dram"]}
    pr = PeerReader(make_store(), Index(holders, NODES), tr, "me", fetch_timeout_s=5.0)
    assert await pr.fetch(KEYS[:4]) == 3  # the fourth: no other holder
    assert tr.calls == [("idle:9467", KEYS[:4]), ("busy:9467", KEYS[:3])]
    assert pr._down["idle:9467"][1] == HOLDER_BACKOFF_S[0]  # noqa: SLF001
    assert pr.failed == 1 and pr.fetched == 3
    assert await pr.fetch(KEYS[4:6]) == 0 and len(tr.calls) == 2  # skipped: not asked again


class FailingOnce(Transport):
    """The first request to ``dead`` fails at once; later ones (turned away by its gate, or
    answered after its death) give nothing and are no failure of their own."""

    def __init__(self, dead: str) -> None:
        super().__init__()
        self.dead, self._failed = dead, False
        self._failing = False

    async def fetch(self, address: str, keys: Sequence[bytes], sink: BlockSink, timeout: float) -> list[bool]:
        if address != self.dead:
            return await super().fetch(address, keys, sink, timeout)
        self.calls.append((address, list(keys)))
        first, self._failed = not self._failed, True
        await asyncio.sleep(0 if first else 0.01)  # (the empty answer comes after the retry began)
        self._failing = first
        return [False] * len(keys)

    def failing(self, address: str) -> bool:
        return address == self.dead and self._failing


async def test_every_key_this_read_missed_of_a_failing_holder_is_asked_of_another() -> None:
    """A read's keys for one holder go in requests of ``max_keys``: one failed at once, the
    other came back empty after it (turned away by the gate). The empty request's keys had
    been lost, though the holder was just found failing and another held them."""
    tr = FailingOnce("idle:9467")
    tr.max_keys = 2
    pr = PeerReader(make_store(), Index({k: ["idle@dram", "busy@dram"] for k in KEYS[:4]}, NODES), tr, "me",
                    fetch_timeout_s=5.0)
    assert await pr.fetch(KEYS[:4]) == 4
    assert pr.failed == 0 and sorted(k for a, ks in tr.calls if a == "busy:9467" for k in ks) == sorted(KEYS[:4])


class DeadBesideSlow(Refusing):
    """``idle`` refuses at once; ``slow`` answers whole, after ``pause`` seconds."""

    def __init__(self, pause: float) -> None:
        super().__init__("idle:9467")
        self.pause = pause

    async def fetch(self, address: str, keys: Sequence[bytes], sink: BlockSink, timeout: float) -> list[bool]:
        if address == "slow:9467":
            await asyncio.sleep(self.pause)
        return await super().fetch(address, keys, sink, timeout)


async def test_a_holder_that_fails_at_once_has_its_keys_asked_again_without_waiting_for_a_slow_one() -> None:
    """The read's keys lie with a dead holder and a slow one. Its retry had waited for the slow
    holder's answer, which left less than a quarter of the deadline: the dead holder's blocks
    missed, though a third node held them. Now they are asked of it as soon as the dead
    holder fails."""
    nodes = NODES + [node("slow", 50)]
    holders = {k: ["idle@dram", "busy@dram"] for k in KEYS[:2]} | {k: ["slow@dram"] for k in KEYS[2:4]}
    tr = DeadBesideSlow(pause=0.85)
    pr = PeerReader(make_store(), Index(holders, nodes), tr, "me", fetch_timeout_s=1.0)
    assert await pr.fetch(KEYS[:4]) == 4
    assert [a for a, _ in tr.calls].count("busy:9467") == 1 and pr.failed == 0


class SlowUnwind(Transport):
    """Each fetch takes a second; cancelled, it runs 0.3 s more (as a transfer waits for the
    worker that may still write into its rooms)."""

    def __init__(self) -> None:
        super().__init__()
        self.running = 0

    async def fetch(self, address: str, keys: Sequence[bytes], sink: BlockSink, timeout: float) -> list[bool]:
        self.calls.append((address, list(keys)))
        self.running += 1
        try:
            await asyncio.sleep(1.0)
            return [False] * len(keys)
        except asyncio.CancelledError:
            await asyncio.shield(asyncio.sleep(0.3))
            raise
        finally:
            self.running -= 1


async def test_a_cancelled_read_returns_only_once_its_transfers_have_ended() -> None:
    """Else the read's in-flight entries go while its transfer still runs, and another read of
    the same keys starts a second transfer beside it."""
    tr = SlowUnwind()
    pr = PeerReader(make_store(), Index({k: ["idle@dram"] for k in KEYS[:2]}, NODES), tr, "me", fetch_timeout_s=5.0)
    read = asyncio.create_task(pr.fetch(KEYS[:2]))
    assert await until(lambda: tr.running == 1)
    read.cancel()
    await asyncio.gather(read, return_exceptions=True)
    assert read.cancelled() and tr.running == 0


class TwoRaise(Transport):
    async def fetch(self, address: str, keys: Sequence[bytes], sink: BlockSink, timeout: float) -> list[bool]:
        self.calls.append((address, list(keys)))
        await asyncio.sleep(0)
        raise RuntimeError(f"a bug in the fetch from {address}")


async def test_requests_that_raise_together_leave_no_error_unretrieved() -> None:
    seen: list[str] = []
    asyncio.get_running_loop().set_exception_handler(lambda _loop, ctx: seen.append(ctx["message"]))
    pr = PeerReader(make_store(), Index({KEYS[0]: ["idle@dram"], KEYS[1]: ["busy@dram"]}, NODES), TwoRaise(), "me",
                    fetch_timeout_s=5.0)
    with pytest.raises(RuntimeError):
        await pr.fetch(KEYS[:2])
    await asyncio.sleep(0.01)
    gc.collect()
    assert not seen


class DeadAndLate(Refusing):
    """``idle`` and ``late`` refuse, ``late`` 0.2 s after it is asked."""

    async def fetch(self, address: str, keys: Sequence[bytes], sink: BlockSink, timeout: float) -> list[bool]:
        if address == "late:9467":
            await asyncio.sleep(0.2)
        return await super().fetch(address, keys, sink, timeout)


async def test_a_retry_asks_nothing_past_a_key_no_other_node_holds() -> None:
    """The read's prefix ends at the first key whose only holder failed: a later retry of keys
    past it (another holder failing later) would move blocks the read cannot use."""
    holders = {KEYS[0]: ["idle@dram"], KEYS[1]: ["idle@dram"], KEYS[2]: ["late@dram", "busy@dram"],
               KEYS[3]: ["late@dram", "busy@dram"]}
    tr = DeadAndLate("idle:9467", "late:9467")
    pr = PeerReader(make_store(), Index(holders, NODES + [node("late", 5)]), tr, "me", fetch_timeout_s=5.0)
    assert await pr.fetch(KEYS[:4]) == 0
    assert "busy:9467" not in [a for a, _ in tr.calls]


async def test_blocks_of_a_holder_that_failed_at_once_are_asked_again_only_once() -> None:
    """Both holders refuse: the read asks each once, and misses within its deadline."""
    tr = Refusing("idle:9467", "busy:9467")
    pr = PeerReader(make_store(), Index({k: ["idle@dram", "busy@dram"] for k in KEYS[:3]}, NODES), tr, "me",
                    fetch_timeout_s=5.0)
    assert await pr.fetch(KEYS[:3]) == 0
    assert tr.calls == [("idle:9467", KEYS[:3]), ("busy:9467", KEYS[:3])]
    assert pr.failed == 3 and set(pr._down) == {"idle:9467", "busy:9467"}  # noqa: SLF001


async def test_a_holder_is_judged_by_this_reads_fetch_not_by_another_reads_that_failed() -> None:
    """A read the gate turned away (its holder's turns all taken, no room to wait) had read the
    transport's word on the holder's last fetch, another read's that had failed, and backed the
    healthy, busy holder off (doubling the back-off each time)."""
    tr = Refusing()
    tr.failing = lambda address: True  # type: ignore[method-assign]  # (another read's fetch failed)
    pr = PeerReader(make_store(), Index({k: ["idle@dram"] for k in KEYS}, NODES), tr, "me", fetch_timeout_s=5.0)
    pr.gate = FetchGate(transfers=1, per_holder=1, waiting=0)
    loop = asyncio.get_running_loop()
    async with pr.gate.transfer("default", "idle:9467", loop.time() + 5) as ok:  # the holder's one turn
        assert ok
        assert await pr.fetch(KEYS[:2]) == 0
    assert tr.calls == [] and not pr._down  # noqa: SLF001


async def test_reads_that_failed_together_back_their_holder_off_once() -> None:
    """Reads of one stalling holder that fail in one episode skip it for the first back-off,
    not for one doubling per read (two had made it 4 s, four 16 s)."""
    tr = Stalling()
    pr = PeerReader(make_store(), Index({k: ["idle@dram"] for k in KEYS}, NODES), tr, "me", fetch_timeout_s=0.3)
    got = await asyncio.gather(*(pr.fetch(KEYS[i : i + 4]) for i in range(0, 16, 4)))
    assert got.count(1) >= 2 and len(tr.calls) >= 2  # (the holder's turns: the others ran out of time)
    assert pr._down["idle:9467"][1] == HOLDER_BACKOFF_S[0]  # noqa: SLF001


async def test_the_index_is_asked_a_bounded_number_of_keys_at_a_time_until_the_prefix_ends() -> None:
    assert len(KEYS) == 6
    idx = SlowIndex({k: ["idle@dram"] for k in KEYS[:3]}, pause=0)
    pr = PeerReader(make_store(), idx, Transport(), "me", fetch_timeout_s=5.0, max_lookup_keys=2)
    assert await pr.fetch(KEYS) == 3
    assert idx.asked == [2, 2]  # 0-1, then 2-3 holds the prefix's end: not asked about 4-5


async def test_lookups_count_only_holders_a_fetch_would_contact() -> None:
    holders = {KEYS[0]: ["idle@dram"], KEYS[1]: ["ghost@dram", "me@disk"], KEYS[2]: ["idle@dram"]}
    pr, _, _ = reader(holders)
    assert await pr.remote_prefix(KEYS[:3]) == 1  # an unknown node's copy (and our own) is no hit


class Partial(Transport):
    """Gives every block but the last, at once (the last one is gone from the holder)."""

    async def fetch(self, address: str, keys: Sequence[bytes], sink: BlockSink, timeout: float) -> list[bool]:
        return await super().fetch(address, keys[:-1], sink, timeout) + [False]


async def test_a_peer_is_judged_by_its_own_time_not_by_what_the_read_spent_before_it() -> None:
    """The index took most of the deadline; the holder then answers at once with all but one
    block (the last is gone from it): it is not backed off. With less than a quarter of the
    deadline left no transfer starts at all."""
    idx, tr = SlowIndex({k: ["idle@dram"] for k in KEYS}, pause=0.35), Partial()
    pr = PeerReader(make_store(), idx, tr, "me", fetch_timeout_s=0.6)
    assert await pr.fetch(KEYS[:3]) == 2
    assert not pr._down
    assert await pr.fetch(KEYS[3:5]) == 1 and len(tr.calls) == 2  # asked again: not skipped
    idx.pause = 0.5  # a sixth of the deadline left after the index
    assert await pr.fetch(KEYS[5:]) == 0 and len(tr.calls) == 2


async def test_a_peer_that_left_the_pool_is_forgotten_with_its_back_off_and_connections() -> None:
    """Each peer that left (a rescheduled pod: a new address) had kept its back-off and, in
    the transport, its sockets, until its address came back."""
    tr = Stalling()
    idx = Index({k: ["idle@dram"] for k in KEYS}, list(NODES))
    pr = PeerReader(make_store(), idx, tr, "me", fetch_timeout_s=0.3, nodes_ttl_s=0.0)
    assert await pr.fetch(KEYS[:4]) == 1
    assert "idle:9467" in pr._down  # noqa: SLF001
    assert tr.kept[-1] == {"me:9467", "busy:9467", "idle:9467"}
    idx._nodes = [n for n in NODES if n["name"] != "idle"]  # noqa: SLF001 - it left
    assert await pr.remote_prefix(KEYS[4:]) == 0
    assert tr.kept[-1] == {"me:9467", "busy:9467"} and not pr._down  # noqa: SLF001


async def test_a_key_repeated_in_a_read_is_asked_of_its_holder_once() -> None:
    """A read naming one block many times (4,096 times, from a local tenant) had its holder
    lend and send it once per copy; each block is asked for once, and found in the store at
    each of its places afterwards."""
    pr, _, tr = reader({k: ["idle@dram"] for k in KEYS})
    keys = [KEYS[0]] * 50 + [KEYS[1], KEYS[0], KEYS[1]]
    assert await pr.fetch(keys) == 2
    assert tr.calls == [("idle:9467", [KEYS[0], KEYS[1]])]
    assert [await read(pr.store, k) for k in keys] == [DATA[k] for k in keys]


async def test_a_holders_keys_go_in_requests_of_at_most_what_its_transport_takes() -> None:
    """A holder's keys past the transport's ``max_keys`` (a peer refuses a longer request
    whole, at once) go in several requests: every block arrives."""
    pr, _, tr = reader({k: ["idle@dram"] for k in KEYS})
    tr.max_keys = 4
    assert await pr.fetch(KEYS) == len(KEYS)
    assert [len(ks) for _, ks in tr.calls] == [4, 2]
    assert [k for _, ks in tr.calls for k in ks] == KEYS
    assert {addr for addr, _ in tr.calls} == {"idle:9467"}


async def test_the_index_turn_is_given_back_before_any_block_moves() -> None:
    pr, _, tr = reader({k: ["idle@dram"] for k in KEYS})
    given_back: list[int] = []
    assert await pr.fetch(KEYS[:3], indexed=lambda: given_back.append(len(tr.calls))) == 3
    assert given_back == [0]  # once, before the transfer was asked for
    # also when the blocks come by another request's fetch: not held while waiting for it
    owner = asyncio.create_task(pr.fetch(KEYS[3:5]))
    await asyncio.sleep(0)  # (the owner's fetch is under way)
    assert await pr.fetch(KEYS[3:5], indexed=lambda: given_back.append(len(tr.calls))) == 0
    assert await owner == 2 and given_back == [0, 1]


class Gated(Transport):
    """Holds every fetch until :attr:`go` is set; each one is put on :attr:`started` first."""

    def __init__(self) -> None:
        super().__init__()
        self.started: asyncio.Queue[list[bytes]] = asyncio.Queue()
        self.go = asyncio.Event()

    async def fetch(self, address: str, keys: Sequence[bytes], sink: BlockSink, timeout: float) -> list[bool]:
        self.started.put_nowait(list(keys))
        await self.go.wait()
        return await super().fetch(address, keys, sink, timeout)


async def test_a_tenants_transfers_are_bounded_and_another_tenants_go_on() -> None:
    """The transfers of a tenant's reads no longer hold its index turns; they have a bound of
    their own per tenant, so one tenant still cannot take every receive thread, and another
    tenant's fetch goes on meanwhile."""
    tr = Gated()
    pr = PeerReader(make_store(), Index({k: ["idle@dram"] for k in KEYS}, NODES), tr, "me", fetch_timeout_s=5.0)
    pr.gate.transfers = 2
    greedy = [asyncio.create_task(pr.fetch([k], tenant="greedy")) for k in KEYS[:5]]
    assert {tuple(await tr.started.get()), tuple(await tr.started.get())} == {(KEYS[0],), (KEYS[1],)}
    other = asyncio.create_task(pr.fetch([KEYS[5]], tenant="other"))
    assert await tr.started.get() == [KEYS[5]]  # not one of greedy's three waiting for a turn
    assert tr.started.empty()
    tr.go.set()
    assert await asyncio.gather(*greedy) == [1] * 5 and await other == 1


async def test_reads_queued_for_a_busy_holder_leave_the_tenant_its_other_holders() -> None:
    """As many transfers run from one holder as the transport keeps connections to it; the
    reads past that wait without taking the turns of their tenant, whose reads from another
    holder go on."""
    tr = Gated()
    holders = {k: ["busy@dram"] for k in KEYS[:5]} | {KEYS[5]: ["idle@dram"]}
    pr = PeerReader(make_store(), Index(holders, NODES), tr, "me", fetch_timeout_s=5.0)
    pr.gate.transfers, pr.gate.per_holder = 3, 2
    queued = [asyncio.create_task(pr.fetch([k], tenant="t")) for k in KEYS[:5]]
    assert {tuple(await tr.started.get()), tuple(await tr.started.get())} == {(KEYS[0],), (KEYS[1],)}
    elsewhere = asyncio.create_task(pr.fetch([KEYS[5]], tenant="t"))
    assert await tr.started.get() == [KEYS[5]] and tr.started.empty()
    tr.go.set()
    assert await asyncio.gather(*queued) == [1] * 5 and await elsewhere == 1
    assert {addr for addr, ks in tr.calls if ks != [KEYS[5]]} == {"busy:9467"}


async def test_a_tenant_whose_fetched_blocks_find_no_room_is_not_sent_them_again() -> None:
    """A tenant whose quota is smaller than a block had every read fetch the blocks again, to
    drop them, and its lookups kept counting them as held by peers: after a fetch whose
    blocks all found no room, its reads ask no peer and its lookups count none for a while."""
    store = make_store(settings=StoreSettings(tenants={"default": TenantLimits(quota_bytes=4096)}))
    tr = Transport()
    pr = PeerReader(store, Index({k: ["idle@dram"] for k in KEYS}, NODES), tr, "me", fetch_timeout_s=5.0)
    assert await pr.remote_prefix(KEYS[:3]) == 3
    assert await pr.fetch(KEYS[:3]) == 0  # (every block is larger than the quota)
    for _ in range(3):
        assert await pr.fetch(KEYS[:3]) == 0
        assert await pr.remote_prefix(KEYS[:3]) == 0
    assert len(tr.calls) == 1


async def test_a_read_of_more_keys_than_a_peer_request_holds_arrives_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """Over the TCP transport: a holder refuses a request of more than ``MAX_KEYS`` keys (and
    closes the connection), at once, so the holder was never backed off and every such read
    (``api.max_batch`` may be larger) missed every block. The reader asks in requests the
    transport takes."""
    monkeypatch.setattr(tcpserve, "MAX_KEYS", 4)  # (4,096: the holder's check reads its module's)
    monkeypatch.setattr(tcpwire, "MAX_KEYS", 4)  # (and so does the decoding of a frame)
    a, b = make_store(), make_store()
    ta, tb = tcp.TcpTransport(TOKEN), tcp.TcpTransport(TOKEN)
    tb.max_keys = 4
    keys = [k.raw for k in block_keys(FP, list(range(10**6, 10**6 + 4 * 10)))]
    data = [os.urandom(3000 + i) for i in range(len(keys))]
    try:
        address = await ta.start(StoreSource(a))
        for k, d in zip(keys, data):
            await put(a, k, d)
        holder = {"name": "idle", "address": address, "tiers": {}}
        pr = PeerReader(b, Index({k: ["idle@dram"] for k in keys}, [holder]), tb, "me", fetch_timeout_s=5.0)
        assert await pr.fetch(keys) == 10
        assert [await read(b, k) for k in keys] == data
    finally:
        await ta.close()
        await tb.close()
        close_store(a)
        close_store(b)


@pytest.mark.parametrize("cut", ["raises", "cancelled"])
async def test_a_lend_cut_short_gives_back_the_leases_it_took(monkeypatch: pytest.MonkeyPatch, cut: str) -> None:
    """The source lends a request's blocks one key at a time: when a key's acquire raises, or
    the answer is cancelled part way (its deadline), the read leases taken for the keys
    before it had stayed in the lending account for good. They go back, and the error goes on."""
    store = make_store()
    for k in KEYS:
        await put(store, k, DATA[k])
    source = StoreSource(store)
    real = store.acquire
    reached = asyncio.Event()
    lent: list[int] = []

    async def acquire(session: Any, key: bytes) -> Any:
        if key == KEYS[3]:
            lent.append(sum(e.readers for e in store._entries.values()))  # noqa: SLF001
            reached.set()
            if cut == "raises":
                raise OSError("the disk tier failed")
            await asyncio.Event().wait()  # never set: cancelled here
        return await real(session, key)

    monkeypatch.setattr(store, "acquire", acquire)
    lending = asyncio.get_running_loop().create_task(source.lend(KEYS))
    await reached.wait()
    assert lent == [3]  # the first three were lent when the fourth failed
    if cut == "cancelled":
        lending.cancel()
    with pytest.raises(OSError if cut == "raises" else asyncio.CancelledError):
        await lending
    assert [e.readers for e in store._entries.values()] == [0] * len(KEYS)  # noqa: SLF001
    close_store(store)


async def test_a_tenant_of_no_key_space_here_fetches_nothing() -> None:
    """Where each key space has an arena of its own, a read for a tenant no space here names
    asks no peer (its blocks would find no arena here)."""
    tr = Transport()
    store = make_store(spaces=["default", "team"])
    pr = PeerReader(store, Index({k: ["idle@dram"] for k in KEYS}, NODES), tr, "me", fetch_timeout_s=5.0)
    assert await pr.fetch(KEYS[:2], tenant="stranger") == 0
    assert await pr.remote_prefix(KEYS[:2], tenant="stranger") == 0
    assert tr.calls == []
    assert await pr.fetch(KEYS[:2], tenant="team") == 2 and len(tr.calls) == 1
    close_store(store)


def test_records_a_reader_refuses_are_logged_a_line_a_minute(caplog: pytest.LogCaptureFixture,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A node record not signed with the pool secret is not contacted, and said in the log.
    A writer to Redis planting thousands of them had made every reading node log each one
    again at each refresh, once they outnumbered what it remembers (2,000 records: 1,998
    lines a second, 25 GiB a day; a review). One line a minute now, counting the others."""
    from kvpool_sidecar import ratelog
    from kvpool_sidecar.peers import MAX_REFUSED, NodeTrust

    monkeypatch.setattr(ratelog, "_last", {})
    monkeypatch.setattr(ratelog, "_skipped", {})
    pr, _, _ = reader({})
    pr.trust = NodeTrust(b"s" * 32, "pool", 30.0)
    records = [{"name": f"fake-{i}", "address": "10.0.0.1:7070", "stamp": "1", "sig": "0" * 64}
               for i in range(2 * MAX_REFUSED)]
    with caplog.at_level(logging.WARNING, logger="kvpool_sidecar.peers"):
        for _ in range(3):  # three refreshes
            assert not any(pr._believes(r) for r in records)
    lines = [r for r in caplog.records if "not signed with the pool secret" in r.getMessage()]
    assert len(lines) == 1, len(lines)
