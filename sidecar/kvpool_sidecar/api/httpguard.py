"""Bounds on the HTTP port's connections: how many are open, and how long each may go
without a response.

aiohttp keeps a connection whose request never completes (headers sent a byte at a time, or
not at all) open for as long as the client likes, and takes as many as come: 4,200 such
connections from one pod held 4,200 descriptors of the sidecar's, which the local API, the
peer port and the disk tier draw on too. Probes and scrapers need a few connections and
get their answer in milliseconds, so here at most ``api.http_max_connections`` are open (a
new one past it closes the oldest, so that a flood never keeps the kubelet's probe out),
and one that has not started a response within ``api.http_deadline_s`` of opening (or of
its last response: a keep-alive connection left idle) is closed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import cast

from aiohttp import web

from kvpool_sidecar.ratelog import warn_once

logger = logging.getLogger(__name__)



class ConnectionGuard:
    """Wraps the aiohttp server's connection handlers (:meth:`protocol` is the factory to
    serve with, once :meth:`serve` named aiohttp's); :meth:`on_response_prepare` goes in the
    app's ``on_response_prepare`` signal to restart a connection's deadline."""

    def __init__(self, limit: int, deadline_s: float) -> None:
        self.limit = limit
        self.deadline_s = deadline_s
        self._handlers: Callable[[], asyncio.Protocol] | None = None
        self._open: dict[asyncio.BaseTransport, _Guarded] = {}

    def serve(self, handlers: Callable[[], asyncio.Protocol]) -> None:
        """Name the factory of aiohttp's handlers (the runner's ``server``)."""
        self._handlers = handlers

    def protocol(self) -> asyncio.Protocol:
        return _Guarded(self)

    async def on_response_prepare(self, request: web.Request, response: web.StreamResponse) -> None:
        guarded = self._open.get(request.transport) if request.transport is not None else None
        if guarded is not None:
            guarded.arm()


class _Guarded(asyncio.Protocol):
    """One connection: aiohttp's handler behind the guard's limits."""

    def __init__(self, guard: ConnectionGuard) -> None:
        self.guard = guard
        self.inner: asyncio.Protocol | None = None
        self.transport: asyncio.BaseTransport | None = None
        self.timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        g = self.guard
        if g._handlers is None:
            cast(asyncio.Transport, transport).abort()
            return
        if len(g._open) >= g.limit:
            warn_once(logger, "http-connections", "HTTP port: %d connections open (api.http_max_connections): "
                      "closing the oldest for each new one", g.limit)
            oldest = next(iter(g._open))
            g._open.pop(oldest)
            cast(asyncio.Transport, oldest).abort()
        self.transport = transport
        g._open[transport] = self
        self.inner = g._handlers()
        self.arm()
        self.inner.connection_made(transport)

    def arm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.timer = asyncio.get_running_loop().call_later(self.guard.deadline_s, self._expire)

    def _expire(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        if self.inner is not None:
            self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received() if self.inner is not None else None

    def pause_writing(self) -> None:
        if self.inner is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.inner is not None:
            self.inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.timer is not None:
            self.timer.cancel()
        if self.transport is not None:
            self.guard._open.pop(self.transport, None)
        if self.inner is not None:
            self.inner.connection_lost(exc)
