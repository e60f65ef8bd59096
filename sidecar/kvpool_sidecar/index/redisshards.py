"""Per-shard sentinels: how a node notices that a shard of Redis Cluster lost its data.

On a cluster, a shard that restarts empty takes with it the block entries it held, while
the node hash (on another shard) lives on: the node would never learn that its re-publish
is owed again. So each re-publish first writes the node a sentinel key on every shard
(``kvp:P:alive:N:{sI}``, the hash tag picked to land in the shard's lowest slot), with the
node hash's TTL, and each heartbeat refreshes them: a sentinel gone is a shard's data gone,
and a re-publish is owed (:meth:`ShardSentinels.lost`). A shard that holds none of the
node's sentinels (one just added, or seen anew after a failover: slots move with their
keys, nothing was lost) gets one, and no re-publish. On one server there are none: the node
hash shares the server with the blocks. Schema and rules: docs/redis-schema.md.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot

from kvpool_sidecar.index.redisconn import REDIS_ERRORS, Command
from kvpool_sidecar.index.rediskeys import PoolKeys

logger = logging.getLogger(__name__)

__all__ = ["ShardSentinels", "slot_tags"]

_SLOTS = 16384

#: The index's round trips (``RedisIndex._pipeline`` and ``RedisIndex._one``), as of each call.
Pipeline = Callable[[Sequence[Command]], Awaitable[list[Any]]]
One = Callable[..., Awaitable[Any]]


@functools.cache
def slot_tags() -> list[int]:
    """For each Redis Cluster slot, the smallest ``I`` whose hash tag ``{sI}`` lands in it."""
    tags = [-1] * _SLOTS
    left, i = _SLOTS, 0
    while left:
        slot = key_slot(b"s%d" % i)
        if tags[slot] < 0:
            tags[slot] = i
            left -= 1
        i += 1
    return tags


class ShardSentinels:
    """The sentinels of the nodes this index re-publishes (see the module docstring)."""

    def __init__(self, r: Redis | RedisCluster, keys: PoolKeys, deadline_s: float, epoch: str) -> None:
        self._r = r
        self._keys = keys
        self._deadline_s = deadline_s
        #: The index client's life (the mark of its re-publishes): what its sentinels hold.
        self._epoch = epoch
        #: On a cluster, the sentinel keys each node's last re-publish wrote.
        self.written: dict[str, set[str]] = {}

    async def keys_of(self, node: str) -> dict[str, str]:
        """On a cluster, ``node``'s sentinel key for each shard: ``kvp:P:alive:N:{sI}``, the
        tag picked to land in the shard's lowest slot (stable while that slot stays put).
        Empty on one server, where the node hash shares the server with the blocks."""
        r = self._r
        if not isinstance(r, RedisCluster):
            return {}
        await asyncio.wait_for(r.initialize(), self._deadline_s)
        lowest: dict[str, int] = {}
        for slot, nodes in r.nodes_manager.slots_cache.items():
            if nodes and slot < lowest.get(nodes[0].name, _SLOTS):
                lowest[nodes[0].name] = slot
        tags = slot_tags()
        return {shard: self._keys.sentinel(node, tags[slot]) for shard, slot in lowest.items()}

    async def lost(self, node: str, ttl_ms: int, pipeline: Pipeline, one: One) -> bool:
        """Whether a shard lost its data since ``node``'s last re-publish: a sentinel it
        wrote is gone. Refreshes the sentinels' TTL, and gives a shard that holds none (one
        just added, or seen anew after a failover: slots and their keys moved, nothing was
        lost) a sentinel of its own. A loss is also written down (``published`` removed),
        so the debt outlives this process. Bounded by half a heartbeat; a shard that does
        not answer counts as not lost (the heartbeat itself succeeded). ``pipeline`` and
        ``one``: the index's round trips."""
        if not isinstance(self._r, RedisCluster):
            return False
        written = self.written.get(node)
        if not written:
            return True  # none written in this life yet
        try:
            return await asyncio.wait_for(self._check(node, written, ttl_ms, pipeline, one),
                                          max(0.1, ttl_ms / 6000))
        except (asyncio.TimeoutError, *REDIS_ERRORS) as e:
            logger.warning("index: could not check the shards' sentinels of %s: %s", node, str(e) or type(e).__name__)
            return False

    async def _check(self, node: str, written: set[str], ttl_ms: int, pipeline: Pipeline, one: One) -> bool:
        r = self._r
        if not isinstance(r, RedisCluster):
            return False
        keys = sorted(written)
        alive = await pipeline([("PEXPIRE", k, ttl_ms) for k in keys])
        if not all(alive):
            logger.warning("index: a shard lost %s's sentinel (its data); %s re-publishes", node, node)
            await one("HDEL", self._keys.node(node), "published")
            return True
        shards = await self.keys_of(node)
        covered = {o.name for o in map(r.get_node_from_key, keys) if o is not None}
        if any(shard not in covered for shard in shards):
            await r.nodes_manager.initialize()  # the slot cache may be half updated after a MOVED
            shards = await self.keys_of(node)
            covered = {o.name for o in map(r.get_node_from_key, keys) if o is not None}
            new = [key for shard, key in shards.items() if shard not in covered]
            if new:
                await pipeline([("SET", k, self._epoch, "PX", ttl_ms) for k in new])
                written.update(new)
        return False
