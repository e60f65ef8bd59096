"""The built-in TCP transport: asyncio, many blocks per request, straight into the arena.

Every connection is authenticated both ways by the pool secret, and every frame and block on
it is MACed under the connection's key. Its parts: the wire format, and the taking of frames
off a socket (:mod:`kvpool_sidecar.transfer.tcpwire`); the serving side, which answers from
the shared arena within its bounds (:mod:`kvpool_sidecar.transfer.tcpserve`); the fetching
side (:mod:`kvpool_sidecar.transfer.tcpfetch`) and its pooled connections to each peer
(:mod:`kvpool_sidecar.transfer.tcppool`); and the blocking socket I/O of the bulk sends and
receives, run in worker threads, with the checks of what a receive takes
(:mod:`kvpool_sidecar.transfer.tcpio`). :class:`TcpTransport` puts the two sides together,
with the worker threads they run their bulk transfers in.
"""

from __future__ import annotations

import asyncio
import contextlib
from concurrent.futures import ThreadPoolExecutor

from kvpool_sidecar.transfer.tcpfetch import TcpFetcher
from kvpool_sidecar.transfer.tcpio import pipelined_default
from kvpool_sidecar.transfer.tcpserve import TcpServer
from kvpool_sidecar.transfer.tcpwire import MAX_KEYS

#: Worker threads per transport for bulk receives, and as many for bulk sends. A transfer
#: waits for a free worker; its deadline still holds while it waits.
BULK_WORKERS = 32


class TcpTransport(TcpServer, TcpFetcher):
    """Peer transfers over TCP with zero-copy sends and receives into the arena."""

    name = "tcp"
    max_keys = MAX_KEYS

    def __init__(self, token: bytes, host: str = "127.0.0.1", port: int = 0, *, advertise: str | None = None,
                 connections_per_peer: int = 4, sendfile: bool = False, pipelined: bool | None = None) -> None:
        # Own workers, apart from each other and from the loop's default executor (disk
        # I/O): a slow peer's sends never hold up this node's fetches.
        recv_workers = ThreadPoolExecutor(BULK_WORKERS, thread_name_prefix="kvpool-peer-recv")
        send_workers = ThreadPoolExecutor(BULK_WORKERS, thread_name_prefix="kvpool-peer-send")
        # Threads that hash what the receive workers take (pipelined receives; None: each
        # receive hashes as it goes, on its own thread). As many as receive workers, and
        # nothing else submits to them: a receive waits for its verifier's job, which must
        # always find a thread.
        if pipelined is None:
            pipelined = pipelined_default()
        hash_workers = ThreadPoolExecutor(BULK_WORKERS, thread_name_prefix="kvpool-peer-hash") \
            if pipelined else None
        TcpServer.__init__(self, token, host, port, advertise=advertise, connections_per_peer=connections_per_peer,
                           sendfile=sendfile, send_workers=send_workers)
        TcpFetcher.__init__(self, token, connections_per_peer, recv_workers=recv_workers, hash_workers=hash_workers)

    async def close(self) -> None:
        if self._accept is not None:
            self._accept.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._accept
        for t in list(self._serving):
            t.cancel()
        for t in list(self._serving):
            with contextlib.suppress(asyncio.CancelledError):
                await t
        if self._listener is not None:
            self._listener.close()
        for pool in self._pools.values():
            for c in pool:
                c.close()
        self._pools.clear()
        self._recv_workers.shutdown(wait=False, cancel_futures=True)
        self._send_workers.shutdown(wait=False, cancel_futures=True)
        if self._hash_workers is not None:
            self._hash_workers.shutdown(wait=False)  # a receive still running waits for its checks
