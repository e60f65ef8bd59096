"""This node's membership of the pool: index, heartbeats, publishing, sweeping, peers.

With ``index.backend: memory`` the node is a pool of one and only publishing runs. With
``redis`` it registers itself (address, tiers, figures, GPUs) and heartbeats; whenever
the index does not hold its inventory (at start, after Redis lost its data or its hash
expired, after a sweep found it back) it re-publishes it whole, once no sweep of its old
entries is running, in a task of its own while the heartbeats go on; it sweeps dead nodes'
entries; and with ``peer.enabled`` it serves its blocks to peers and fetches theirs through
a :class:`~kvpool_sidecar.peers.PeerReader`.
Nothing here needs an operator: the index heals itself (docs/redis-schema.md says how,
and where that stops).
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import time
from typing import Any, cast

from kvpool_sidecar.config import SidecarSettings
from kvpool_sidecar.errors import SidecarError
from kvpool_sidecar.events import IndexEvent
from kvpool_sidecar.index.base import BlockIndex
from kvpool_sidecar.index.memory import MemoryIndex
from kvpool_sidecar.peers import CLOCK_SKEW_S, NodeTrust, PeerReader, StoreSource
from kvpool_sidecar.store import TieredStore
from kvpool_sidecar.gpus import gpu_inventory
from kvpool_sidecar.transfer.auth import load_token, sign_node
from kvpool_sidecar.transfer.base import PeerError, Transport
from kvpool_sidecar.transfer.tcp import TcpTransport

logger = logging.getLogger(__name__)

#: Unsent index events kept while Redis is unreachable; past this a full re-publish follows.
MAX_BACKLOG = 200_000
#: How long the publisher waits after the first event of a burst before sending it.
PUBLISH_LINGER_S = 0.01
#: Pause before sending events again after a failed send.
PUBLISH_RETRY_S = 0.5


def make_transport(settings: SidecarSettings, *, force_tcp: bool = False) -> Transport:
    """The configured transport, falling back to TCP when the RDMA-capable one is missing."""
    p = settings.peer
    token = load_token(p.token_file or "")
    if p.transport == "rdma" and not force_tcp:  # the Mooncake Transfer Engine
        try:
            module = importlib.import_module("kvpool_sidecar.transfer.mooncake")
            return cast(Transport, module.MooncakeTransport(token, p.host, p.port, advertise=p.advertise,
                                                            connections_per_peer=p.connections_per_peer,
                                                            sendfile=p.sendfile, pipelined=p.pipelined_receive))
        except ImportError as e:
            logger.warning("rdma transport (Mooncake) unavailable (%s); falling back to tcp", e)
    return TcpTransport(token, p.host, p.port, advertise=p.advertise, connections_per_peer=p.connections_per_peer,
                        sendfile=p.sendfile, pipelined=p.pipelined_receive)


class Membership:
    """Index, heartbeats and peer transfers of one sidecar."""

    def __init__(self, settings: SidecarSettings, store: TieredStore) -> None:
        self.settings = settings
        self.store = store
        self.node = settings.node_name
        self.index: BlockIndex = MemoryIndex()
        self.redis: Any = None
        self.transport: Transport | None = None
        self.peers: PeerReader | None = None
        self.address = ""
        self._republish = True
        #: The re-publish under way (one at a time), a task of its own that heartbeats start
        #: and watch: a heartbeat that waited for it left the record's signed time stale for
        #: its whole length (18 µs a block on loopback), and past 3 heartbeats plus 30 s (some
        #: 2 million blocks) peers stopped believing the node and fetched none of its blocks.
        self._republishing: asyncio.Task[None] | None = None
        self._stopping = False
        #: One index writer at a time: a republish never interleaves with a flush, whose
        #: failed events would otherwise go back in the queue after the republish had
        #: already covered them (and re-publish an evicted block).
        self._writing = asyncio.Lock()
        self.gpus = gpu_inventory()

    async def start(self) -> None:
        s = self.settings
        if s.index.backend == "redis":
            from kvpool_sidecar.index.redis import RedisIndex, RedisIndexSettings

            self.redis = RedisIndex(s.index.url or "", RedisIndexSettings(
                pool=s.pool, cluster=s.index.cluster, password_file=s.index.password_file,
                socket_timeout_s=s.index.timeout_s, connect_timeout_s=s.index.timeout_s,
                deadline_s=s.index.timeout_s * 2, live_cache_s=s.index.lookup_cache_s))
            self.index = self.redis
        if s.peer.enabled:
            self.transport = make_transport(s)
            try:
                self.address = await self.transport.start(StoreSource(self.store))
            except PeerError as e:
                if self.transport.name == "tcp":
                    raise
                # e.g. the RDMA engine cannot register the arena (RLIMIT_MEMLOCK): serve on TCP
                logger.warning("%s transport failed to start (%s); falling back to tcp", self.transport.name, e)
                await self.transport.close()
                self.transport = make_transport(s, force_tcp=True)
                self.address = await self.transport.start(StoreSource(self.store))
            if self.redis is not None:
                self.peers = PeerReader(self.store, self.redis, self.transport, self.node,
                                        fetch_timeout_s=s.peer.fetch_timeout_s,
                                        lookup_timeout_s=s.peer.lookup_timeout_s,
                                        max_lookup_keys=s.api.max_index_keys,
                                        trust=NodeTrust(load_token(s.peer.token_file or ""), s.pool,
                                                        max_age_s=s.index.heartbeat_s * 3 + CLOCK_SKEW_S))
        if self.redis is not None:
            await self.join()

    async def join(self) -> None:
        """The first heartbeat, and the re-publish it starts, heart-beating meanwhile.

        :meth:`start` still returns only once that re-publish has ended, as it did: the
        sidecar serves engines only once the index lists what the node holds (and has
        withdrawn what its previous life listed and it no longer holds). But the node record
        is signed anew every heartbeat meanwhile, so peers keep believing it. An index that
        does not answer, a sweep of the node's old entries under way, or a re-publish that
        fails ends the wait: the heartbeat loop tries again."""
        try:
            await self.heartbeat_once()
        except SidecarError as e:
            logger.warning("index unreachable at start-up (%s); will keep trying", e)
        task = self._republishing
        while task is not None and not task.done():
            await asyncio.wait([task], timeout=self.settings.index.heartbeat_s)
            if task.done():
                break
            try:
                await self._beat()
            except SidecarError as e:
                logger.warning("heartbeat failed: %s", e)
        self._reap()

    # -------------------------------------------------------------- loops
    async def publish_loop(self) -> None:
        """Send index events as they come, a batch at a time: woken by the store's queue,
        then a short linger so that the events of one burst travel together."""
        q = self.store.index_events
        if q is None:
            return
        while True:
            await q.ready.wait()
            await asyncio.sleep(PUBLISH_LINGER_S)
            await self.flush()
            if q:  # a failed send put its events back: try again after a pause, not at once
                await asyncio.sleep(PUBLISH_RETRY_S)

    async def heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.index.heartbeat_s)
            try:
                await self.heartbeat_once()
            except SidecarError as e:
                logger.warning("heartbeat failed: %s", e)

    async def sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.index.sweep_s)
            try:
                swept = await self.redis.sweep_dead()
            except SidecarError as e:
                logger.warning("sweep of dead nodes failed: %s", e)
                continue
            if swept:
                logger.info("swept the entries of %d dead nodes", swept)

    def loops(self) -> dict[str, Any]:
        out: dict[str, Any] = {"index-publisher": self.publish_loop}
        if self.redis is not None:
            out["heartbeat"] = self.heartbeat_loop
            out["dead-node-sweeper"] = self.sweep_loop
        return out

    # -------------------------------------------------------------- steps
    async def heartbeat_once(self) -> None:
        """Refresh this node's signed record; if a re-publish is owed, start one, unless one
        runs (it is not waited for: :attr:`_republishing`) or a sweep of the node's old
        entries runs. A re-publish that failed is retried by a later heartbeat."""
        await self._beat()
        self._reap()
        if not self._republish or self._republishing is not None or self._stopping:
            return
        if await self.redis.being_swept(self.node):
            # another sidecar is removing this node's old entries: re-publishing now would
            # lose to its removals; the next heartbeat tries again
            logger.info("a sweep of this node's old index entries is running; re-publishing after it")
            return
        if self._republishing is None and not self._stopping:  # (none began while the claim was read)
            self._republishing = asyncio.create_task(self._republish_task(), name="index-republish")

    async def _beat(self) -> None:
        """Write this node's record (its signed heartbeat time); note a re-publish owed."""
        counts = self.store.metrics.counts
        tiers = {t: {"capacity_bytes": c, "used_bytes": u, "blocks": n}
                 for t, (c, u, n) in self.store.report.tier_usage().items()}
        stamp = repr(time.time())
        token = getattr(self.transport, "token", None)
        sig = sign_node(token, self.settings.pool, self.node, self.address, stamp) if token else ""
        owed = await self.redis.heartbeat(self.node, self.address, tiers, counts["get_hit"], counts["get_miss"],
                                          self.gpus, self.settings.index.heartbeat_s * 3, stamp=stamp, sig=sig)
        if owed:
            self._republish = True  # owed until a re-publish succeeds

    async def _republish_task(self) -> None:
        try:
            await self.republish()
        except SidecarError as e:
            logger.warning("re-publishing to the index failed (%s); a later heartbeat tries again", e)

    def _reap(self) -> None:
        """Forget a re-publish that has ended (its failure is logged; the debt is kept)."""
        task = self._republishing
        if task is None or not task.done():
            return
        self._republishing = None
        if not task.cancelled():
            task.result()  # raises only what no re-publish should (a bug), for the loop's guard

    async def republish(self) -> None:
        """Publish everything this node holds (Redis lost it, or events were dropped)."""
        async with self._writing:
            # the events queued before are in the inventory; those after stay queued and are
            # applied after it is written (they hold the same or newer news of a block: the
            # inventory is read a slice per turn of the event loop, each block as it is then)
            if self.store.index_events is not None:
                self.store.index_events.clear()
            inventory = await self.store.report.inventory_soon()
            await self.redis.republish(self.node, inventory)
            self._republish = False
        logger.info("re-published %d blocks to the index", len(inventory))

    async def flush(self) -> None:
        async with self._writing:
            q = self.store.index_events
            if q is None or not q:
                return
            events: list[IndexEvent] = q.take()
            try:
                await self.index.apply(self.node, events)
            except SidecarError as e:
                logger.warning("index update of %d events failed: %s", len(events), e)
                if len(q) + len(events) > MAX_BACKLOG:
                    self._republish = True
                    q.clear()
                else:
                    q.put_back(events)

    async def stop(self) -> None:
        """Unpublish this node (it is draining), then stop serving peers, close connections.

        Peers are served until the index no longer names this node: the peer port had been
        closed first, and for the whole unpublishing (4 s for 300,000 blocks on loopback)
        every peer's read of this node's blocks was refused at once, a miss, with no other
        holder tried.

        A re-publish under way is cancelled first, and waited for (no trip of it is sent
        after): the unpublishing walks the inventory, which a re-publish writes before the
        block sets, so whatever part of it had landed is taken back."""
        await self._end_republish()
        try:
            await self.flush()
            await self.index.drop_node(self.node)
        except SidecarError as e:
            logger.warning("could not unpublish on shutdown (the sweeper will): %s", e)
        finally:
            if self.transport is not None:
                await self.transport.close()
        await self.index.close()

    async def leave(self) -> None:
        """Release what a membership whose start failed holds (a re-publish under way, its
        peer listener, its index connections) and leave the index as it is: the entries under
        this node's name may be another sidecar's."""
        await self._end_republish()
        try:
            if self.transport is not None:
                await self.transport.close()
        finally:
            try:
                await self.index.close()
            except SidecarError as e:
                logger.warning("could not close the index connections: %s", e)

    async def _end_republish(self) -> None:
        """Start no re-publish from now on; cancel the one under way and wait for it."""
        self._stopping = True
        task, self._republishing = self._republishing, None
        if task is not None:
            task.cancel()
            await asyncio.wait([task])
            if not task.cancelled() and task.exception() is not None:
                logger.error("the re-publish ended with an error", exc_info=task.exception())
