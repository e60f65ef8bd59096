"""The fetching side of the TCP transport: one GET of many blocks from a peer, on a pooled
connection (:mod:`kvpool_sidecar.transfer.tcppool`), its blocks received straight into the
arena.

The client receives with ``recv_into`` straight into the DRAM extents the store reserved,
verifies each block's checksum and only then commits it; the blocks after the last one it
has room for are not taken off the wire (the connection is closed instead, and not reused).
A deadline bounds every fetch: a slow or dead peer yields misses, and its connection is
dropped.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvpool_sidecar.ratelog import warn_once
from kvpool_sidecar.transfer import auth, tcpserve
from kvpool_sidecar.transfer.base import BlockSink, PeerError, blames_peer
from kvpool_sidecar.transfer.tcpio import _bulk, blocking_recv
from kvpool_sidecar.transfer.tcppool import TcpConnections, _Conn
from kvpool_sidecar.transfer.tcpwire import OP_GET, _PeerClosed, _recv_sealed

logger = logging.getLogger(__name__)


class _StaleConnection(PeerError):
    """A pooled connection that had served a fetch was found closed before any of the next
    fetch's answer came: its peer closed it meanwhile (its idleness, a restart). Nothing of
    the fetch was taken, so it goes again on a new connection."""


class TcpFetcher(TcpConnections):
    """The fetching side of :class:`~kvpool_sidecar.transfer.tcp.TcpTransport`: it reads
    blocks from its peers into a :class:`~kvpool_sidecar.transfer.base.BlockSink`."""

    def __init__(self, token: bytes, connections_per_peer: int, *, recv_workers: ThreadPoolExecutor,
                 hash_workers: ThreadPoolExecutor | None) -> None:
        super().__init__(token, connections_per_peer)
        #: Answers whose remaining blocks had no room here: their connection was closed
        #: instead of taking the rest off the wire (see :meth:`_fetch_on`).
        self.cut_short = 0
        #: Fetches that found their pooled connection closed and went again on a new one.
        self.stale_retries = 0
        self.recv_timeout_s = tcpserve.SEND_TIMEOUT_S
        #: The bulk receives' workers, and the threads that hash what they take (the
        #: transport's own: see its ``__init__``).
        self._recv_workers = recv_workers
        self._hash_workers = hash_workers
        #: The addresses whose last fetch failed before its time ran out (:meth:`failing`).
        self._failing: set[str] = set()

    def failing(self, address: str) -> bool:
        """Whether the last fetch from ``address`` failed before its time ran out (refused,
        reset, a failed handshake, an answer malformed or not authenticated)."""
        return address in self._failing

    def forget(self, keep: Collection[str]) -> int:
        self._failing.intersection_update(keep)
        return super().forget(keep)

    async def fetch(self, address: str, keys: Sequence[bytes], sink: BlockSink, timeout: float) -> list[bool]:
        """Fetch ``keys`` from ``address`` within ``timeout``: which arrived (a failure, a
        dead or slow peer, is a miss). A pooled connection found closed before any of the
        answer came (:class:`_StaleConnection`) is dropped and the fetch goes once more, on a
        new connection, within the same deadline."""
        done = [False] * len(keys)
        used: _Conn | None = None  # the connection this fetch talked on
        clean = False
        failed = False  # (before its time ran out: see failing())
        self._fetching[address] += 1  # (forget() leaves the address alone meanwhile)
        try:
            async with asyncio.timeout(timeout):
                for again in (False, True):
                    conn = await self._lease_conn(address)
                    async with conn.busy:
                        used = conn
                        try:
                            clean = await self._fetch_on(conn, keys, sink, done)
                        except _StaleConnection as e:
                            if again:
                                raise
                            logger.debug("a pooled connection to %s was closed under a fetch (%s); "
                                         "fetching again on a new one", address, e.__cause__ or e)
                            # its idle siblings most likely went with it (the peer restarted,
                            # or closed them for their idleness too): the retry opens a new one
                            for c in [c for c in self._pools.get(address, []) if c is conn or not c.busy.locked()]:
                                self._drop(address, c)
                            used = None
                            self.stale_retries += 1
                            continue
                        if clean:
                            conn.served += 1
                        else:
                            self.cut_short += 1
                    break
        except (PeerError, OSError, TimeoutError) as e:
            failed = blames_peer(e)
            logger.info("fetch of %d blocks from %s failed: %s", len(keys), address, e or type(e).__name__)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - task guard: whatever a peer's answer does, its blocks miss
            failed = True
            warn_once(logger, "peer-fetch-failed", "fetch of %d blocks from %s failed: %r", len(keys), address, e)
        finally:
            # Failed, timed out or cancelled (the requester went away) part way through an
            # answer, or the rest of it left unread: it may still be in the socket, so the
            # connection is never used again.
            if used is not None and not clean:
                self._drop(address, used)
            self._fetching[address] -= 1
            if not self._fetching[address]:
                del self._fetching[address]
        if failed:
            self._failing.add(address)
        else:
            self._failing.discard(address)
        return done

    async def _fetch_on(self, conn: _Conn, keys: Sequence[bytes], sink: BlockSink, done: list[bool]) -> bool:
        """One GET of ``keys`` on ``conn``; whether its answer was taken whole (False: the
        connection is left mid-answer and must be closed).

        The blocks after the last one there is room for are not taken off the wire: a node
        that keeps none of them (its tenant over quota, the node full of blocks in use, a
        writer no key space here names) had read every byte into scratch and dropped it, on
        every read. The connection is closed instead; the holder's send fails and it gives
        its leases back."""
        loop = asyncio.get_running_loop()
        conn.rid = auth.new_request_id()
        try:
            await loop.sock_sendall(conn.sock, conn.frames.seal([OP_GET, conn.rid, list(keys)]))
            header = await _recv_sealed(loop, conn.sock, conn.frames)
        except (ConnectionError, _PeerClosed) as e:
            if conn.served:  # (nothing of this fetch was taken yet: no room reserved, no byte kept)
                raise _StaleConnection(f"connection to {conn.address} closed before its answer") from e
            raise
        if len(header) != 3 or header[0] != conn.rid or header[1] != 0 or not isinstance(header[2], list) \
                or len(header[2]) != len(keys):
            raise PeerError("malformed peer answer")
        plan: list[tuple[int, object | None, int]] = []  # (index, lease, checksum)
        incoming: list[tuple[list[memoryview] | None, int, Callable[[bytes], Any]]] = []
        sums: list[int | None] = []
        try:
            for i, (key, item) in enumerate(zip(keys, header[2])):
                if item is None:
                    continue
                if not isinstance(item, list) or len(item) != 3:
                    raise PeerError("malformed block header from peer")
                size, csum, tenant = item
                if not isinstance(size, int) or not isinstance(csum, int) or not isinstance(tenant, str) or size <= 0:
                    raise PeerError("malformed block header from peer")
                room = await sink.reserve(key, size, tenant, depth=i, parent=keys[i - 1] if i else None)
                plan.append((i, None if room is None else room[0], csum))
                mac = functools.partial(auth.block_mac, conn.key, conn.rid, i, key, size, csum, tenant)
                incoming.append((None if room is None else room[1], size, mac))
            wanted = max((n + 1 for n, (views, _, _) in enumerate(incoming) if views is not None), default=0)
            if wanted:
                await _bulk(self._recv_workers, conn.sock, blocking_recv, incoming[:wanted], self.recv_timeout_s,
                            sums, self._hash_workers)
            if wanted < len(incoming):
                logger.debug("no room here for the last %d blocks of an answer from %s; its connection is closed "
                             "instead of drained", len(incoming) - wanted, conn.address)
                return False
            return True
        finally:
            # whole, verified blocks are kept even when the transfer was cut short
            for n, (i, lease, csum) in enumerate(plan):
                if lease is None:
                    continue
                if n < len(sums) and sums[n] == csum:
                    sink.commit(lease, csum)
                    done[i] = True
                else:
                    if n < len(sums):
                        logger.warning("peer sent block %s with a wrong checksum or MAC; dropped", keys[i].hex())
                    sink.abort(lease)
