"""The sidecar daemon: wiring, signals, guarded background tasks and a graceful drain.

``python -m kvpool_sidecar [--config FILE]`` or ``kvpool sidecar``. Start-up builds the
tiers, adopts what the disk tier still holds, opens the KV-event sockets (when on), takes
the local API's socket and port and the HTTP port, joins the pool (the peer port, the
index), starts accepting clients and prints one ``ready`` line of JSON on stdout. A start
that fails (a port or path it cannot have, named with its setting on one line; exit 1)
releases what it took and never unpublishes the node: only one that joined does. SIGTERM
or SIGINT drains: stop accepting, close client connections (which releases their leases),
stop the background tasks, unpublish this node's blocks, say ``AllBlocksCleared`` to
KV-event subscribers, close the arena and remove the socket.
"""

from __future__ import annotations

import asyncio
import ctypes
import dataclasses
import json
import logging
import os
import resource
import signal
import sys
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry

from kvpool_sidecar.api.http import GUARD_KEY, make_http_app
from kvpool_sidecar.api.local import LocalLimits, LocalServer
from kvpool_sidecar.collector import Collector, suits
from kvpool_sidecar.config import SidecarSettings, load_settings, tenant_connection_cap, tenant_connection_reserve
from kvpool_sidecar.errors import SidecarError, os_reason
from kvpool_sidecar.events import EngineEventQueue
from kvpool_sidecar.kvevents import KvEventPublisher
from kvpool_sidecar.membership import Membership
from kvpool_sidecar.metrics import StoreMetrics
from kvpool_sidecar.policy import make_policy
from kvpool_sidecar.store import StoreSettings, TenantLimits, TieredStore
from kvpool_sidecar.tenancy import KeySpaces, TenantAccess
from kvpool_sidecar.tiers.base import Tier
from kvpool_sidecar.tiers.disk import DiskTier
from kvpool_sidecar.tiers.segments import SegmentDiskTier
from kvpool_sidecar.tiers.dram import DramTier, SharedArena
from kvpool_sidecar.tiers.gpu import GpuTier
from kvpool_sidecar.transfer.base import PeerError

logger = logging.getLogger("kvpool_sidecar")

#: How long a stopping sidecar waits for its background tasks to end once cancelled (a
#: write-ahead batch that a thread is writing lands first), and then for the copies between
#: tiers still under way (each runs in a thread, from memory the tiers free when they close).
STOP_SETTLE_S = 10.0


def arena_spaces(settings: SidecarSettings) -> dict[str, int]:
    """Tenant -> the index of its arena: one per key space (``api.shared_arena: per-space``),
    in the order the tenants are listed, else one for all."""
    if settings.api.shared_arena != "per-space":
        return {t.name: 0 for t in settings.tenants}
    order: dict[str, int] = {}
    for t in settings.tenants:
        order.setdefault(t.space, len(order))
    return {t.name: order[t.space] for t in settings.tenants}


def build_tiers(settings: SidecarSettings, *, arena: bool = True) -> list[Tier]:
    """The tiers a sidecar with these settings runs, hottest first (``arena=False``: DRAM
    keeps accounts only, and no GPU memory is taken)."""
    spaces = arena_spaces(settings)
    count = len(set(spaces.values())) if arena else 0
    arenas = [SharedArena(settings.dram.size_bytes, name=f"kvpool-arena-{i}", populate=settings.dram.populate and i == 0)
              for i in range(count)]
    tiers: list[Tier] = []
    gpu = GpuTier.create(settings.gpu, settings.dram.page_bytes) if arena else None
    if gpu is not None:
        tiers.append(gpu)
    tiers.append(DramTier(settings.dram.size_bytes, settings.dram.page_bytes, arenas or None,
                          spaces if arenas else None))
    if settings.disk.path:
        disk = settings.disk
        if disk.min_block_bytes is None:  # a block takes at least a DRAM page on disk too
            disk = dataclasses.replace(disk, min_block_bytes=min(settings.dram.page_bytes, disk.size_bytes))
        tiers.append(SegmentDiskTier(disk) if disk.layout == "segments" else DiskTier(disk))
    return tiers


def build_store(settings: SidecarSettings, registry: CollectorRegistry | None, *, arena: bool = True) -> TieredStore:
    """The store a sidecar with these settings runs (``arena=False``: accounts only)."""
    store_settings = StoreSettings(
        tenants={t.name: TenantLimits(t.priority, t.quota(settings.dram.size_bytes)) for t in settings.tenants},
        block_max_bytes=settings.max_block_bytes,
        demote=settings.policy.demote,
        lease_timeout_s=settings.api.lease_timeout_s,
        session_share=settings.api.max_session_share,
        clean_share=settings.dram.clean_share,
        put_waits_for_disk=settings.dram.put_waits_for_disk,
        promote_hits=settings.gpu.promote_after_hits,
    )
    metrics = StoreMetrics(registry)
    kv = settings.kv_events
    engine_events = EngineEventQueue(kv.queue_size, metrics.counts, frozenset(kv.tenants) or None) \
        if kv.enabled else None
    return TieredStore(build_tiers(settings, arena=arena), make_policy(settings.policy.name), store_settings,
                       metrics=metrics, engine_events=engine_events)


@dataclass
class Sidecar:
    """One running daemon."""

    settings: SidecarSettings
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    store: TieredStore | None = None
    membership: Membership | None = None
    #: Whether this sidecar joined the pool (its membership started, its node published):
    #: only then does it unpublish the node when it stops. One that failed to start leaves
    #: the index alone: the entries under its node's name may be another sidecar's.
    joined: bool = False
    local: LocalServer | None = None
    http: web.AppRunner | None = None
    http_port: int | None = None
    http_server: asyncio.Server | None = None
    kv_events: KvEventPublisher | None = None
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    ready: asyncio.Event = field(default_factory=asyncio.Event)

    async def start(self) -> None:
        s = self.settings
        self.store = store = build_store(s, self.registry)
        adopted = await store.open()
        store.metrics.track_tiers(store.report.tier_usage)
        store.metrics.track_io(store.report.io_seconds)
        if store.engine_events is not None:  # before any client: sequence 0 says the pool starts empty
            self.kv_events = KvEventPublisher(s.kv_events, store.engine_events, store.report.engine_inventory_soon,
                                              s.node_name)
            await self.kv_events.start()
        # every resource only one sidecar may have (the socket's path, the ports) is taken
        # before this one joins the pool: one that cannot have them (another sidecar of this
        # node runs, a pod being replaced still drains) fails without touching the index,
        # where the entries under this node's name are the other one's
        limits = LocalLimits(s.api.max_frame_bytes, s.api.max_batch, s.node_name,
                             KeySpaces({t.name: t.space for t in s.tenants}), s.api.max_inflight,
                             s.api.max_connections, max_unread_bytes=s.api.max_unread_bytes,
                             tenant_connections=tenant_connection_cap(s),
                             tenant_reserve=tenant_connection_reserve(s), tenants=tuple(t.name for t in s.tenants),
                             hello_timeout_s=s.api.hello_timeout_s,
                             frame_timeout_s=s.api.frame_timeout_s, max_index_keys=s.api.max_index_keys,
                             index_concurrency=s.api.index_concurrency, index_keys_per_s=s.api.index_keys_per_s,
                             access=TenantAccess.from_settings(s.tenants, s.api.shared_arena))
        tcp = (s.api.tcp_host, s.api.tcp_port) if s.api.tcp_port is not None else None
        self.local = LocalServer(store, limits, socket_path=s.api.socket_path or None,
                                 socket_mode=s.api.socket_mode, tcp=tcp, drain_s=s.api.drain_s)
        await self.local.bind()  # (clients that connect now wait in the backlog)
        if s.api.http_port is not None:
            await self._start_http()
        self.membership = member = Membership(s, store)
        try:
            await member.start()  # its first heartbeat, which publishes this node, is its last step
        except PeerError as e:
            raise SidecarError(f"peer: cannot start the transport on {s.peer.host}:{s.peer.port}: {e}") from e
        except OSError as e:
            raise SidecarError(f"peer.host/peer.port: cannot listen on {s.peer.host}:{s.peer.port}: "
                               f"{os_reason(e)}") from e
        self.joined = True
        self.local.peers = member.peers  # (read as each client connects)
        await self.local.start()
        self.tasks = [_guarded("lease-expiry", self._expire_leases)]
        if store.writes_ahead:
            self.tasks.append(_guarded("write-ahead", self._write_ahead))
        self.tasks += [_guarded(name, loop) for name, loop in member.loops().items()]
        if self.kv_events is not None:
            self.tasks += [_guarded(name, loop) for name, loop in self.kv_events.loops().items()]
        self.ready.set()
        logger.info("sidecar %s ready: %d blocks adopted from disk", s.node_name, adopted)

    async def _start_http(self) -> None:
        s, store = self.settings, self.store
        if store is None:
            raise SidecarError("the HTTP app needs the store")
        app = make_http_app(store, self.registry, self.health, max_connections=s.api.http_max_connections,
                            deadline_s=s.api.http_deadline_s)
        self.http = web.AppRunner(app, access_log=None)
        await self.http.setup()
        if self.http.server is None:
            raise SidecarError("the HTTP app did not set up")
        guard = app[GUARD_KEY]  # aiohttp's handlers behind a bound on connections
        guard.serve(self.http.server)
        try:
            self.http_server = await asyncio.get_running_loop().create_server(
                guard.protocol, s.api.http_host, s.api.http_port, reuse_address=True)
        except OSError as e:
            raise SidecarError(f"api.http_host/api.http_port: cannot listen on {s.api.http_host}:{s.api.http_port}: "
                               f"{os_reason(e)}") from e
        self.http_port = self.http_server.sockets[0].getsockname()[1]

    def health(self) -> dict[str, object]:
        ok = self.ready.is_set() and self.store is not None and all(not t.done() for t in self.tasks)
        return {"ok": ok, "node": self.settings.node_name}

    async def _expire_leases(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            n = self.store.expire_leases() if self.store is not None else 0
            if n:
                logger.warning("expired %d leases held past their deadline", n)

    async def _write_ahead(self) -> None:
        """Keep ``dram.clean_share`` of DRAM free or on disk, woken when it falls short."""
        store = self.store
        while store is not None:
            await store.room_wanted.wait()
            store.room_wanted.clear()
            while await store.write_ahead():
                await asyncio.sleep(0)  # let waiting puts run between rounds

    async def stop(self) -> None:
        """Drain and release everything; safe to call on a half-started sidecar."""
        if self.local is not None:
            await self.local.stop(keep_path=True)
        for t in self.tasks:
            t.cancel()
        if self.tasks:
            # a cancelled write-ahead lands the batch a thread is writing first: a bounded wait
            _, late = await asyncio.wait(self.tasks, timeout=STOP_SETTLE_S)
            if late:
                logger.warning("%d background tasks still running after %.0f s; stopping anyway", len(late),
                               STOP_SETTLE_S)
        if self.http_server is not None:
            self.http_server.close()
        if self.http is not None:
            await self.http.cleanup()
        if self.membership is not None:
            if self.joined:
                await self.membership.stop()
            else:
                await self.membership.leave()
        if self.local is not None:
            self.local.release()  # (held through the unpublishing: see LocalServer.stop)
        if self.kv_events is not None:
            await self.kv_events.stop()
        if self.store is not None:
            # copies between tiers (up to the GPU tier, a write-ahead to disk) run in threads: the tiers
            # stay open until they are done
            try:
                await asyncio.wait_for(self.store.settle(), STOP_SETTLE_S)
            except TimeoutError:
                logger.warning("copies between tiers still under way after %.0f s; stopping anyway", STOP_SETTLE_S)
            self.store.close()
        logger.info("sidecar %s stopped", self.settings.node_name)


def _guarded(name: str, fn: Callable[[], Awaitable[None]]) -> asyncio.Task[None]:
    """Run a background loop; log and restart it after an unexpected error."""

    async def guard() -> None:
        while True:
            try:
                await fn()
                return
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - task guard
                logger.exception("background task %s failed; restarting it", name)
                await asyncio.sleep(1.0)

    return asyncio.get_running_loop().create_task(guard(), name=name)


async def serve(settings: SidecarSettings) -> None:
    """Run until SIGTERM or SIGINT."""
    sidecar = Sidecar(settings)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    collector = Collector(settings.gc_reclaim_interval_s) if settings.gc_freeze and suits(loop) else None
    if settings.gc_freeze and collector is None:
        logger.warning("gc_freeze is on but the event loop is asyncio's own (uvloop is not installed), whose "
                       "connections leave reference cycles behind: Python's garbage collector runs as it is")
    collecting: asyncio.Task[None] | None = None
    try:
        await sidecar.start()
        if collector is not None:  # the objects of a started sidecar (blocks adopted from disk too) are frozen
            collector.start()
            collecting = _guarded("garbage-collection", collector.run)
        print(json.dumps({
            "event": "ready", "node": settings.node_name, "socket": settings.api.socket_path,
            "tcp_port": sidecar.local.tcp_port if sidecar.local else None, "http_port": sidecar.http_port,
            "peer_address": sidecar.membership.address if sidecar.membership else "",
            **({"kv_events": {"endpoint": sidecar.kv_events.endpoint,
                              "replay_endpoint": sidecar.kv_events.replay_endpoint}} if sidecar.kv_events else {}),
        }), flush=True)
        await stop.wait()
        logger.info("signal received: draining")
    finally:
        if collecting is not None:
            collecting.cancel()
        if collector is not None:
            collector.stop()
        await sidecar.stop()


def raise_fd_limit() -> int:
    """Raise the soft limit on open descriptors to the hard one; the new soft limit.

    The local API alone may hold ``api.max_connections`` (1,024 by default) clients, and
    peers, HTTP, the disk tier and the KV-event sockets need theirs beside them: a runtime's
    soft limit of 1,024 would run out before the configured limits apply.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as e:
            logger.warning("could not raise the open-descriptor limit from %d: %s", soft, e)
            return soft
        return target
    return soft


#: ``prctl``'s option that sets whether a process may be dumped (and inspected).
PR_SET_DUMPABLE = 4


def forbid_inspection() -> bool:
    """Make this process undumpable; whether it is now. A dumpable process's ``/proc`` entries
    belong to its user: any process of that user could open ``/proc/<sidecar>/fd/<n>`` and
    map every tenant's arena (a client given the sidecar's uid did, on a bare-metal install),
    read ``/proc/<sidecar>/mem`` or attach with ptrace. Undumpable, they belong to root, and
    the process writes no core file (which would hold the arenas). Off Linux, nothing."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    except (OSError, AttributeError) as e:
        logger.warning("could not make the sidecar undumpable (processes of its user may read its memory): %s", e)
        return False
    return True


def _run(coro: Coroutine[Any, Any, None]) -> None:
    """Run on uvloop when it is installed (lower per-request overhead), else asyncio."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(coro)
        return
    uvloop.run(coro)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="kvpool sidecar", description="Run the kvpool sidecar daemon.")
    parser.add_argument("--config", help="YAML settings file (the pool's ConfigMap)")
    args = parser.parse_args(argv)
    try:
        settings = load_settings(args.config)
    except SidecarError as e:
        print(f"kvpool sidecar: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s")
    if settings.gpu.enabled and "expandable_segments:true" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "").lower():
        # an engine opens a GPU-tier block of an expandable segment through pidfd_getfd on
        # the sidecar, which an undumpable process refuses to processes that are not root
        logger.warning("the sidecar stays dumpable (PYTORCH_CUDA_ALLOC_CONF has expandable_segments): "
                       "processes of its user may read its memory; see docs/security.md")
    else:
        forbid_inspection()  # before any tenant's bytes are in its memory
    fds = raise_fd_limit()
    if fds < settings.api.max_connections + 256:
        logger.warning("open descriptors are limited to %d: fewer than api.max_connections (%d) and the "
                       "sidecar's own; raise the hard limit (ulimit -Hn)", fds, settings.api.max_connections)
    try:
        _run(serve(settings))
    except SidecarError as e:
        logger.error("sidecar failed: %s", e)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
