"""The Redis index: the pool's shared ``block -> holders`` map (schema: docs/redis-schema.md).

Every sidecar writes its own node hash (with a TTL refreshed by heartbeats), its block
holders and its inventory; every sidecar reads holders, ignoring nodes whose hash is gone.
Works on one Redis or on Redis Cluster (no hash tags but for the per-shard sentinels: keys
spread over all slots; redis-py splits each pipeline per shard and sends the parts
concurrently, so a batch costs one round trip per shard). Retries back off exponentially on connection errors and timeouts,
every round trip has a deadline, and every Redis failure reaches the caller as
:class:`IndexUnavailableError`. On one server, writers keep each block's holders in one
field of a holders hash as well, so that a lookup is one ``HMGET``, in a script that sends
no value past its bound (:mod:`kvpool_sidecar.index.redisheld`).

Its parts: the client, its settings and its failures (:mod:`~kvpool_sidecar.index.redisconn`),
what a read takes in within bounds (:mod:`~kvpool_sidecar.index.redisrecords`, and on the
server :mod:`~kvpool_sidecar.index.redisbounds`), and the per-shard sentinels of a cluster
(:mod:`~kvpool_sidecar.index.redisshards`). :class:`RedisIndex` is one class per concern,
over the state and the round trips they share (:mod:`~kvpool_sidecar.index.redisbase`): the
node registry (:mod:`~kvpool_sidecar.index.redisnodes`), the sweep of dead nodes
(:mod:`~kvpool_sidecar.index.redissweep`; the Lua scripts of a node's sweeps and re-publishes
are in :mod:`~kvpool_sidecar.index.redisscripts`), publishing
(:mod:`~kvpool_sidecar.index.redispublish`) and lookups
(:mod:`~kvpool_sidecar.index.redislookup`); here, the pool's lifecycle: purging it, listing
the pools, pinging Redis and closing.
"""

from __future__ import annotations

import asyncio
from typing import Any

from kvpool_sidecar.errors import IndexUnavailableError
from kvpool_sidecar.index.redisconn import RedisIndexSettings, chunks, translated
from kvpool_sidecar.index.redislookup import BlockLookups
from kvpool_sidecar.index.redispublish import BlockPublisher
from kvpool_sidecar.index.redisrecords import NODE_NAME
from kvpool_sidecar.index.redissweep import NodeSweeper

__all__ = ["IndexUnavailableError", "RedisIndex", "RedisIndexSettings"]


class RedisIndex(NodeSweeper, BlockPublisher, BlockLookups):
    """:class:`~kvpool_sidecar.index.base.BlockIndex` on Redis, plus the node registry."""

    @classmethod
    def from_url(cls, url: str, **settings: Any) -> RedisIndex:
        """``RedisIndex.from_url("redis://:pw@host:6379/0", pool="p", cluster=False)``."""
        return cls(url, RedisIndexSettings(**settings))

    # -- pool lifecycle -------------------------------------------------------------------
    async def purge_pool(self) -> int:
        """Delete every ``kvp:<pool>:*`` key (SCAN on every shard); returns how many."""
        it = self._r.scan_iter(match=self._keys.prefix + "*", count=1000)
        doomed: list[str] = []
        total = 0
        with translated("purge_pool"):
            while True:
                try:
                    doomed.append(await asyncio.wait_for(it.__anext__(), self._s.deadline_s))
                except StopAsyncIteration:
                    break
            for chunk in chunks(doomed, self._s.batch):
                total += sum(x for x in await self._pipeline([("UNLINK", k) for k in chunk]) if isinstance(x, int))
        self._live, self._dead, self._known = set(), set(), []
        self._live_at = float("-inf")
        return total

    async def pools(self) -> list[str]:
        """Every pool with a node registry in this Redis (``kvp:<pool>:nodes``; SCAN on every
        shard), sorted: what ``kvpool status`` offers when asked about a pool that is not there."""
        it = self._r.scan_iter(match="kvp:*:nodes", count=1000)
        found: set[str] = set()
        with translated("pools"):
            while True:
                try:
                    key = await asyncio.wait_for(it.__anext__(), self._s.deadline_s)
                except StopAsyncIteration:
                    break
                name = key[len("kvp:"):-len(":nodes")] if isinstance(key, str) else ""
                if NODE_NAME.fullmatch(name):  # not kvp:P:inv:nodes, the inventory of a node named "nodes"
                    found.add(name)
        return sorted(found)

    async def ping(self) -> bool:
        """True when Redis answers within the deadline (for ``IndexReachable``)."""
        with translated("ping"):
            return bool(await self._one("PING"))

    async def close(self) -> None:
        with translated("close"):
            await self._r.aclose()
