"""The pool-wide read path: local miss -> index -> choose a holder -> fetch -> verify -> store.

:class:`StoreSource` and :class:`StoreSink` adapt the local store to a transport (what
peers may read, where fetched bytes land). :class:`PeerReader` finds holders in the index,
prefers the hottest tier and then the least loaded node, fetches each block once from its
holder, in requests of at most the transport's ``max_keys``, and lets concurrent misses of
the same block share one fetch. Every failure — index down, peer dead, slow or lying — ends
as a miss within the fetch deadline. What one tenant's fetches may take at once, and when
they are not made at all, is :mod:`kvpool_sidecar.fetchgate`'s.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvpool_client.protocol import PutStatus
from kvpool_sidecar.errors import QuotaError, SidecarError
from kvpool_sidecar.fetchgate import FetchGate, Landing
from kvpool_sidecar.indexwatch import IndexWatch
from kvpool_sidecar.peerrounds import Answer, ReadRounds
from kvpool_sidecar.ratelog import warn_once
from kvpool_sidecar.store import ReadLease, Session, TieredStore, WriteLease
from kvpool_sidecar.store import TierKind
from kvpool_sidecar.store.lineage import Lineage
from kvpool_sidecar.transfer import auth
from kvpool_sidecar.transfer.base import OutgoingBlock, Transport

logger = logging.getLogger(__name__)

_TIER_RANK = {t.value: t.rank for t in TierKind}


class PeerIndex(Protocol):
    """What the read path needs of the index (the Redis index implements it)."""

    async def lookup(self, keys: Sequence[bytes]) -> list[list[str]]: ...

    async def nodes(self, believe: Callable[[Mapping[str, str]], bool] | None = None) -> list[dict[str, Any]]: ...


#: The account the blocks lent to peers are held under: no tenant can be named so (tenant
#: names take no ':'), so what peers hold counts against a share of DRAM of its own,
#: ``api.max_session_share`` like one tenant's, and never against a local tenant's share.
LENDING_ACCOUNT = "peers:lending"


class StoreSource:
    """Lends local blocks to the transport's server side (read leases pin them).

    What is lent in all, to every peer, is held under :data:`LENDING_ACCOUNT`: had it been
    the local ``default`` tenant's, peers' fetches would have made that tenant's puts answer
    QUOTA, and a ``default`` client holding its share would have made every fetch from this
    node a miss."""

    def __init__(self, store: TieredStore) -> None:
        self.store = store
        self.session: Session = store.open_session(LENDING_ACCOUNT)

    async def lend(self, keys: Sequence[bytes]) -> list[OutgoingBlock | None]:
        """Each block's read lease, taken one key at a time: if one of them raises, or the
        answer is cancelled part way (its deadline), the leases already taken go back before
        the error goes on (they had been held, in the lending account, for good)."""
        out: list[OutgoingBlock | None] = []
        taken: list[ReadLease] = []
        try:
            await self.store.prefetch(keys)
            for k in keys:
                lease = await self.store.acquire(self.session, k)
                if lease is None:
                    out.append(None)
                    continue
                taken.append(lease)
                e = lease.entry
                fd, offsets = self.store.host.file_extents(lease.place)
                out.append(OutgoingBlock(k, e.size, e.checksum, e.tenant, self.store.host.views(lease.place),
                                         offsets, lease, fd))
        except BaseException:
            for lease in taken:
                self.store.release(self.session, lease.id)
            raise
        return out

    def arena_views(self) -> list[memoryview]:
        """The arenas a block is lent from (for transports that register memory)."""
        return self.store.host.arena_views()

    def give_back(self, blocks: Sequence[OutgoingBlock]) -> None:
        for b in blocks:
            if isinstance(b.lease, ReadLease):
                self.store.release(self.session, b.lease.id)


def _load(tiers: object) -> float:
    """The share of a node's tiers in use, from its record (1.0, the least attractive, when
    the record's tiers are not numbers where they should be)."""
    try:
        if not isinstance(tiers, dict):
            return 1.0
        used = sum(int(t.get("used_bytes", 0)) for t in tiers.values())
        cap = sum(int(t.get("capacity_bytes", 0)) for t in tiers.values()) or 1
        share = used / cap
        return share if 0.0 <= share <= 1.0 else 1.0
    except (AttributeError, TypeError, ValueError, ArithmeticError):  # (int(inf), a quotient past a float)
        return 1.0


#: Chains a node's fetches follow at once (:attr:`StoreSink._lineages`), the oldest forgotten,
#: and the blocks one follows before it starts again (from the blocks committed by then).
_FETCH_LINEAGES = 256
_FETCH_LINEAGE_BLOCKS = 256


class StoreSink:
    """Receives fetched blocks into the local store (two-phase, like a local put)."""

    def __init__(self, store: TieredStore) -> None:
        self.store = store
        self.session: Session = store.open_session(expiring=False)
        #: The block before each key being fetched in the request that wants it (a transport
        #: knows only the order of the keys it fetches, not what precedes the first).
        self._before: dict[bytes, bytes] = {}
        #: One lineage per chain being fetched, under the key it reserved last, so that a
        #: fetch's room spares the chain's blocks held here and those already fetched.
        self._lineages: dict[bytes, Lineage] = {}

    def expect(self, keys: Sequence[bytes], fetching: Sequence[bytes]) -> list[bytes]:
        """Note, for each of ``fetching``, the block before its first place in ``keys`` (a
        chain, in order; never itself, where a key repeats); the keys noted, to :meth:`forget`
        when the fetch is over."""
        wanted = set(fetching)
        noted: list[bytes] = []
        seen: set[bytes] = set()
        for i, k in enumerate(keys):
            if k in seen:
                continue
            seen.add(k)
            if i and k in wanted:
                self._before[k] = keys[i - 1]
                noted.append(k)
        return noted

    def forget(self, keys: Sequence[bytes]) -> None:
        for k in keys:
            self._before.pop(k, None)

    def _lineage(self, key: bytes, parent: bytes | None) -> Lineage:
        lineage = self._lineages.pop(parent, None) if parent is not None else None
        if lineage is None or lineage.blocks >= _FETCH_LINEAGE_BLOCKS:
            lineage = self.store.lineage()
        self._lineages[key] = lineage
        if len(self._lineages) > _FETCH_LINEAGES:
            del self._lineages[next(iter(self._lineages))]
        return lineage

    async def reserve(self, key: bytes, size: int, tenant: str, *, depth: int = -1,
                      parent: bytes | None = None) -> tuple[object, list[memoryview]] | None:
        return (await self.place(key, size, tenant, depth=depth, parent=parent))[1]

    async def place(self, key: bytes, size: int, tenant: str, *, depth: int = -1,
                    parent: bytes | None = None) -> tuple[PutStatus, tuple[object, list[memoryview]] | None]:
        """:meth:`reserve`, and why there is no room when there is none (a writer no key space
        here names is REJECTED, a refusal of the store's FULL)."""
        parent = self._before.get(key, parent)
        if not self.store.knows_tenant(tenant):
            if self.store.host.arena_count > 1:  # no key space here to put it in: not in another's arena
                logger.info("fetched block %s names tenant %r, in no key space of this node; not kept",
                            key.hex(), tenant)
                return PutStatus.REJECTED, None
            tenant = self.session.tenant  # one arena for all: count it as the default's
        try:
            # (a fetch serves a read: it waits for room a disk write makes, as a promotion does;
            # a refusal would pause the tenant's peer reads, see fetchgate)
            status, lease = await self.store.allocate(self.session, key, size, tenant=tenant, depth=depth,
                                                      parent=parent, lineage=self._lineage(key, parent), waits=True)
        except QuotaError as e:  # (its writer's quota: not the node's room, see fetchgate)
            logger.info("no room for fetched block %s in its tenant's quota: %s", key.hex(), e)
            return PutStatus.QUOTA, None
        except SidecarError as e:
            logger.info("no room for fetched block %s: %s", key.hex(), e)
            return PutStatus.FULL, None
        if status != PutStatus.ALLOCATED or lease is None:
            return status, None
        return status, (lease, self.store.host.views(lease.place))

    def arena_views(self) -> list[memoryview]:
        """The arenas a fetched block lands in (for transports that register memory)."""
        return self.store.host.arena_views()

    def commit(self, lease: object, checksum: int) -> None:
        if isinstance(lease, WriteLease):
            self.store.commit(self.session, lease.id, checksum)
            self.store.metrics.fetched_bytes(lease.meta.size)

    def abort(self, lease: object) -> None:
        if isinstance(lease, WriteLease):
            self.store.abort(self.session, lease.id)


async def _wait_for_others(waits: Sequence[asyncio.Future[None]], deadline: float) -> None:
    """Wait for fetches other requests own, until ``deadline`` (loop time) at the latest;
    being cancelled here never cancels theirs."""
    if waits:
        await asyncio.wait(waits, timeout=max(0.0, deadline - asyncio.get_running_loop().time()))


@dataclass
class _NodeView:
    address: str
    load: float


#: Wall clocks of two nodes may disagree by this much when a record's age is judged.
CLOCK_SKEW_S = 30.0
#: Refused node records remembered (so that each is logged once) before the memory is cleared.
MAX_REFUSED = 1024
#: Characters of a refused node's name that go in the log.
MAX_NAME_LOGGED = 64
#: A holder whose fetch failed is skipped for this long, doubled at each failure in a row.
HOLDER_BACKOFF_S = (2.0, 60.0)


@dataclass(frozen=True)
class NodeTrust:
    """Which node records to believe: signed with the pool secret, and recent."""

    token: bytes
    pool: str
    max_age_s: float

    def believes(self, record: Mapping[str, Any]) -> bool:
        stamp, sig = str(record.get("stamp", "")), str(record.get("sig", ""))
        if not sig or not auth.check_node(self.token, self.pool, str(record.get("name", "")),
                                          str(record.get("address", "")), stamp, sig):
            return False
        try:
            age = time.time() - float(stamp)
        except ValueError:
            return False
        return -CLOCK_SKEW_S <= age <= self.max_age_s


class PeerReader:
    """Fetches blocks this node misses from the peers that hold them."""

    def __init__(self, store: TieredStore, index: PeerIndex, transport: Transport, node: str,
                 *, fetch_timeout_s: float, nodes_ttl_s: float = 1.0, trust: NodeTrust | None = None,
                 max_lookup_keys: int = 512, lookup_timeout_s: float = 0.25) -> None:
        self.store = store
        self.index = index
        self.transport = transport
        self.node = node
        self.fetch_timeout_s = fetch_timeout_s
        #: The deadline of the peers' part of a LOOKUP (``peer.lookup_timeout_s``).
        self.lookup_timeout_s = min(lookup_timeout_s, fetch_timeout_s)
        #: Keys asked of the index in one lookup (``api.max_index_keys``).
        self.max_lookup_keys = max_lookup_keys
        self.nodes_ttl_s = nodes_ttl_s
        self.sink = StoreSink(store)
        self._inflight: dict[bytes, asyncio.Future[None]] = {}
        self._nodes: dict[str, _NodeView] = {}
        self._nodes_at = 0.0
        #: Holders learnt by the latest lookups, so the get that follows skips the index.
        self._holders: dict[bytes, tuple[float, list[str]]] = {}
        self.holders_ttl_s = nodes_ttl_s
        self.fetched = 0
        self.failed = 0
        #: None believes every node record (tests of the read path alone).
        self.trust = trust
        #: Node records refused (unsigned, forged, stale), by node name, for the logs.
        self.refused: dict[str, str] = {}
        #: Holders (addresses) whose last fetch failed: skipped until, and the next back-off.
        self._down: dict[str, tuple[float, float]] = {}
        self._refreshing = asyncio.Lock()
        #: Each tenant's turns to move blocks, and its pause while its blocks find no room.
        self.gate = FetchGate(per_holder=transport.connections_per_peer)
        #: Reads skip the index for a while after it failed one (it had cost every read its
        #: deadline while Redis was down).
        self.index_watch = IndexWatch(slow_s=0.8 * self.lookup_timeout_s)

    def deadline(self) -> float:
        """The loop time by which a read that starts now must have its answer."""
        return asyncio.get_running_loop().time() + self.fetch_timeout_s

    def lookup_deadline(self) -> float:
        """The loop time by which the peers' part of a LOOKUP that starts now must be done."""
        return asyncio.get_running_loop().time() + self.lookup_timeout_s

    def takes(self, tenant: str) -> bool:
        """Whether a read of ``tenant``'s may fetch from peers now: not while the blocks its
        fetches brought found no room here (:class:`~kvpool_sidecar.fetchgate.FetchGate`);
        never for a tenant of no key space here where each space has an arena of its own; and
        not while the index is backed off (:class:`~kvpool_sidecar.indexwatch.IndexWatch`)."""
        if self.store.host.arena_count > 1 and not self.store.knows_tenant(tenant):
            return False
        return self.gate.takes(tenant) and not self.index_watch.skipping()

    async def remote_prefix(self, keys: Sequence[bytes], deadline: float | None = None,
                            tenant: str = "default") -> int:
        """How many leading ``keys`` some other live node holds that a fetch would contact:
        signed, recent and not backed off (0 if the index is down or ``deadline`` passes, and
        while ``tenant``'s fetches are not made: :meth:`takes`)."""
        if not keys:
            return 0
        if not self.takes(tenant):
            return 0
        try:
            with self.index_watch.asking():
                async with asyncio.timeout_at(self.deadline() if deadline is None else deadline):
                    holders = await self.index.lookup(keys)
                    nodes = await self._node_views()
        except (SidecarError, TimeoutError) as e:
            logger.info("index lookup failed: %r", e)
            self.store.metrics.index_unanswered()
            return 0
        n = 0
        now = time.monotonic()
        if len(self._holders) > 100_000:
            self._holders.clear()
        for k, h, _ in self._choices(keys, holders, nodes):
            self._holders[k] = (now, h)
            n += 1
        return n

    async def _node_views(self) -> Mapping[str, _NodeView]:
        if time.monotonic() - self._nodes_at <= self.nodes_ttl_s:
            return self._nodes
        async with self._refreshing:  # one refresh at a time: the reads that wait take its result
            if time.monotonic() - self._nodes_at > self.nodes_ttl_s:
                await self._refresh_nodes()
        return self._nodes

    async def _refresh_nodes(self) -> None:
        """Read the node records again: the signed and recent ones, by name."""
        now = time.monotonic()
        views: dict[str, _NodeView] = {}
        for n in await self.index.nodes(self._believes):
            if n.get("address"):
                views[str(n["name"])] = _NodeView(str(n["address"]), _load(n.get("tiers")))
        self._nodes, self._nodes_at = views, now
        addresses = {v.address for v in views.values()}
        self.transport.forget(addresses)  # peers gone from the pool: their sockets and back-offs
        self._down = {a: d for a, d in self._down.items() if a in addresses}

    def _believes(self, record: Mapping[str, str]) -> bool:
        """Whether to contact the node of ``record`` (its name, address, stamp and signature,
        before the index parses the rest of it): signed with the pool secret, and recent."""
        if self.trust is None or self.trust.believes(record):
            return True
        name = str(record.get("name", ""))
        sig = str(record.get("sig"))[: auth.SIG_HEX_LEN]
        if self.refused.get(name) != sig:  # counted once per record, not per read
            if len(self.refused) >= MAX_REFUSED:  # fake records may be without number
                self.refused.clear()
            # one line a minute, the others counted in the next: a writer to Redis planting
            # thousands of records had made each reading node log thousands of lines a second
            warn_once(logger, "refused-node-record", "index: node record of %r is not signed with the pool "
                      "secret or is stale; it is not contacted", name[:MAX_NAME_LOGGED])
        self.refused[name] = sig
        return False

    def _choices(self, keys: Sequence[bytes], holders: Sequence[list[str]], nodes: Mapping[str, _NodeView],
                 avoid: Collection[str] = ()) -> Iterator[tuple[bytes, list[str], str]]:
        """Each leading key with its holders and the one chosen, until a key has none to
        choose: the prefix ends there (later blocks are useless without it). A chain's keys
        mostly share one holders list: it is chosen from once."""
        prev: list[str] | None = None
        chosen: str | None = None
        for k, h in zip(keys, holders):
            if h is not prev:
                prev, chosen = h, self._choose(h, nodes, avoid)
            if chosen is None:
                return
            yield k, h, chosen

    def _choose(self, holders: list[str], nodes: Mapping[str, _NodeView], avoid: Collection[str] = ()) -> str | None:
        """The holder on the hottest tier, then the least loaded node; never ourselves, nor
        one backed off or at an address in ``avoid``."""
        best: tuple[int, float, str] | None = None
        now = time.monotonic()
        for h in holders:
            name, _, tier = h.rpartition("@")
            view = nodes.get(name)
            if name == self.node or view is None or self._down.get(view.address, (0.0, 0.0))[0] > now \
                    or view.address in avoid:
                continue
            cand = (_TIER_RANK.get(tier, 9), view.load, name)
            if best is None or cand < best:
                best = cand
        return best[2] if best is not None else None

    async def fetch(self, keys: Sequence[bytes], deadline: float | None = None, *, tenant: str = "default",
                    indexed: Callable[[], None] | None = None) -> int:
        """Bring the leading ``keys`` this node lacks from peers, for a read of ``tenant``'s;
        returns how many blocks arrived. A key repeated in ``keys`` is fetched once (the
        reader finds it in the store at each of its places). It returns by ``deadline``
        (loop time; default: the fetch timeout from now), whatever the index and the peers
        do: what has not come by then is a miss. ``indexed`` is called once, as soon as the
        index's part is done, before any block moves or any wait for others' fetches (the
        caller gives back its index turn there)."""
        if deadline is None:
            deadline = self.deadline()
        called = False

        def index_done() -> None:
            nonlocal called
            if not called and indexed is not None:
                called = True
                indexed()

        try:
            if not self.takes(tenant):
                return 0
            missing = list(dict.fromkeys(k for k in keys if not self.store.contains(k)))
            waits = [self._inflight[k] for k in missing if k in self._inflight]
            mine = [k for k in missing if k not in self._inflight]
            if not mine:
                index_done()
                await _wait_for_others(waits, deadline)
                return 0
            loop = asyncio.get_running_loop()
            futs = {k: loop.create_future() for k in mine}
            self._inflight.update(futs)
            noted = self.sink.expect(keys, mine)
            try:
                got = await self._fetch(mine, deadline, tenant, index_done)
            finally:
                self.sink.forget(noted)
                for k, f in futs.items():
                    if self._inflight.get(k) is f:
                        del self._inflight[k]
                    if not f.done():
                        f.set_result(None)
            await _wait_for_others(waits, deadline)
            return got
        finally:
            index_done()

    async def _timed_fetch(self, address: str, keys: list[bytes], landing: Landing, deadline: float,
                           tenant: str) -> Answer:
        """One request to a holder, in a turn of the holder's and one of ``tenant``'s: its
        answer, the time it took (from when the turns came: a holder is judged by its own
        time) and whether it failed before its time ran out."""
        loop = asyncio.get_running_loop()
        async with self.gate.transfer(tenant, address, deadline) as ok:
            budget = deadline - loop.time()
            if not ok or budget < self.fetch_timeout_s / 4:  # (a miss: too little left to move blocks)
                return Answer([False] * len(keys), 0.0, False)
            t0 = time.monotonic()
            r = await self.transport.fetch(address, keys, landing, budget)
            # (read at once, nothing awaited since: this fetch's own outcome, not another's to
            # the same holder since)
            return Answer(r, time.monotonic() - t0, self.transport.failing(address))

    def _cached_holders(self, keys: list[bytes]) -> list[list[str]] | None:
        now = time.monotonic()
        out = []
        for k in keys:
            hit = self._holders.pop(k, None)
            if hit is None or now - hit[0] > self.holders_ttl_s:
                return None
            out.append(hit[1])
        return out

    async def _holders_of(self, keys: list[bytes]) -> list[list[str]]:
        """The holders of the leading ``keys`` that some live node holds, asked of the index
        :attr:`max_lookup_keys` at a time (what one answer may weigh stays bounded), until a
        chunk's prefix ends."""
        cached = self._cached_holders(keys)
        if cached is not None:
            return cached
        out: list[list[str]] = []
        for i in range(0, len(keys), self.max_lookup_keys):
            chunk = keys[i : i + self.max_lookup_keys]
            got = await self.index.lookup(chunk)
            out += got[: len(chunk)]
            if len(got) < len(chunk):
                break
        return out

    async def _fetch(self, keys: list[bytes], deadline: float, tenant: str, indexed: Callable[[], None]) -> int:
        loop = asyncio.get_running_loop()
        try:
            with self.index_watch.asking():
                async with asyncio.timeout_at(deadline):
                    holders = await self._holders_of(keys)
                    nodes = await self._node_views()
        except (SidecarError, TimeoutError) as e:
            logger.info("index unavailable for a fetch: %r", e)
            self.store.metrics.index_unanswered()
            self.failed += len(keys)
            return 0
        finally:
            indexed()
        groups = self._groups(keys, holders, nodes)
        if deadline - loop.time() < self.fetch_timeout_s / 4 or not groups:
            # too little left to move blocks (the turn or the index took it): a miss, and no
            # transfer started that would only run out of time
            self.failed += sum(len(ks) for ks in groups.values())
            return 0
        started = time.perf_counter()
        landing = Landing(self.sink, tenant)
        rounds = ReadRounds(
            keys, holders, most=self.transport.max_keys, judge=self._judge,
            ask=lambda addr, ks: self._timed_fetch(addr, ks, landing, deadline, tenant),
            regroup=lambda ks, hs, avoid: self._groups(ks, hs, nodes, avoid),
            time_left=lambda: deadline - loop.time() >= self.fetch_timeout_s / 4)
        got = await rounds.run(groups)
        # (what did not arrive of what was asked: no other holder to ask again, no time left,
        # or missed again; a key is asked at most twice and counted once)
        lost = sum(len(ks) for ks in groups.values()) - got
        self.gate.landed(tenant, landing, got)
        self.fetched += got
        self.failed += lost
        self.store.metrics.fetched(got, lost, time.perf_counter() - started)
        return got

    def _groups(self, keys: Sequence[bytes], holders: Sequence[list[str]], nodes: Mapping[str, _NodeView],
                avoid: Collection[str] = ()) -> dict[str, list[bytes]]:
        """The leading ``keys`` that have a holder to choose (never one at an address in
        ``avoid``), by the address of the one chosen."""
        groups: dict[str, list[bytes]] = {}
        for k, _, chosen in self._choices(keys, holders, nodes, avoid):
            groups.setdefault(nodes[chosen].address, []).append(k)
        return groups

    def _judge(self, requests: list[tuple[str, list[bytes]]], answers: list[Answer]) -> None:
        """Back off the holders that did not give every block asked and either cost half the
        deadline or failed before their time ran out; clear the back-off of those that gave
        some."""
        timed: dict[str, Answer] = {}
        for (addr, _), a in zip(requests, answers):
            before = timed.get(addr, Answer([], 0.0, False))
            timed[addr] = Answer(before.got + a.got, max(before.took, a.took), before.failed or a.failed)
        now = time.monotonic()
        for addr, (r, took, failed) in timed.items():
            slow = took >= self.fetch_timeout_s / 2
            if r and not all(r) and (slow or failed):
                # not everything came and it cost the deadline (a stalled or fake holder, or one
                # that sends a block and then stalls), or the fetch failed (a holder that died,
                # whose record is believed until it is stale: a refused connection costs no
                # time, so it had been chosen again on every read, each a miss, though another
                # holder had the blocks): skip it for a while, longer each time in a row,
                # instead of paying again on every read
                # (reads that failed together, each begun before the first of them backed it
                # off, are one failure: the back-off doubles once per failure in a row)
                until, last = self._down.get(addr, (0.0, HOLDER_BACKOFF_S[0] / 2))
                if until <= now:
                    backoff = min(HOLDER_BACKOFF_S[1], max(HOLDER_BACKOFF_S[0], last * 2))
                    self._down[addr] = (now + backoff, backoff)
                    logger.info("peer %s gave %d of %d blocks %s; skipped for %.0f s", addr, sum(r), len(r),
                                "within the deadline" if slow else "before its fetch failed", backoff)
            elif any(r):
                self._down.pop(addr, None)
