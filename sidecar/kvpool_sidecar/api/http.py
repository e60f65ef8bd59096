"""HTTP on 127.0.0.1: ``/healthz`` for probes, ``/metrics`` for Prometheus (at most a second
old: :class:`RenderedMetrics`), ``/stats``.

None of them takes a body: a request that carries one (a length, or chunks) is answered 413
and its connection closed at once. aiohttp had read and dropped what such a client sent
until the connection's deadline (:mod:`~kvpool_sidecar.api.httpguard`), gigabytes a
second of the sidecar's CPU on loopback.
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from kvpool_sidecar.api.httpguard import ConnectionGuard
from kvpool_sidecar.store import TieredStore

STORE_KEY = web.AppKey("store", TieredStore)
#: The bounds on the app's connections: serve with ``app[GUARD_KEY].protocol`` (see
#: :mod:`kvpool_sidecar.api.httpguard`).
GUARD_KEY = web.AppKey("guard", ConnectionGuard)
REGISTRY_KEY = web.AppKey("registry", CollectorRegistry)
HealthCheck = Callable[[], dict[str, object]]
HEALTH_KEY: web.AppKey[HealthCheck] = web.AppKey("health")


@web.middleware
async def refuse_bodies(request: web.Request,
                        handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    """413 and a closed connection for a request with a body (see the module)."""
    if request.body_exists:
        response = web.Response(status=413, text="these endpoints take no request body\n")
        response.force_close()  # (and with no lingering: closed once answered)
        return response
    return await handler(request)


async def healthz(request: web.Request) -> web.Response:
    health = request.app[HEALTH_KEY]()
    return web.json_response(health, status=200 if health.get("ok") else 503)


#: How old a ``/metrics`` answer may be: the page is rendered at most once in this long and
#: served again meanwhile. Rendering it takes milliseconds of the event loop the local
#: clients share, and anyone who reaches the port may ask: 60 connections asking over and
#: over had added 75 ms to every local call (Prometheus scrapes every 15 s or so).
METRICS_MAX_AGE_S = 1.0


class RenderedMetrics:
    """The ``/metrics`` page of a registry, rendered again once it is older than ``max_age_s``."""

    def __init__(self, registry: CollectorRegistry, max_age_s: float = METRICS_MAX_AGE_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.registry = registry
        self.max_age_s = max_age_s
        self._clock = clock
        self._body = b""
        self._at = -math.inf

    def body(self) -> bytes:
        now = self._clock()
        if now - self._at >= self.max_age_s:
            self._body = generate_latest(self.registry)
            self._at = now
        return self._body


METRICS_KEY = web.AppKey("metrics", RenderedMetrics)


async def metrics(request: web.Request) -> web.Response:
    return web.Response(body=request.app[METRICS_KEY].body(), headers={"Content-Type": CONTENT_TYPE_LATEST})


async def stats(request: web.Request) -> web.Response:
    return web.json_response(request.app[STORE_KEY].report.stats())


def make_http_app(store: TieredStore, registry: CollectorRegistry, health: Callable[[], dict[str, object]],
                  *, max_connections: int = 64, deadline_s: float = 10.0) -> web.Application:
    """The app factory: probes, metrics and stats of one sidecar; ``max_connections`` and
    ``deadline_s`` bound its connections (:mod:`kvpool_sidecar.api.httpguard`)."""
    # lingering_time 0: a request's body left unread is not read after the answer either
    app = web.Application(middlewares=[refuse_bodies], handler_args={"lingering_time": 0.0})
    app[STORE_KEY] = store
    app[REGISTRY_KEY] = registry
    app[METRICS_KEY] = RenderedMetrics(registry)
    app[HEALTH_KEY] = health
    app[GUARD_KEY] = guard = ConnectionGuard(max_connections, deadline_s)
    app.on_response_prepare.append(guard.on_response_prepare)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/stats", stats)
    return app
