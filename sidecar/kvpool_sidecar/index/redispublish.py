"""Publishing to the index: the blocks a node holds, as changes (:meth:`BlockPublisher.apply`)
and whole (:meth:`BlockPublisher.republish`, which makes the index say exactly what the node
holds and marks its hash as holding this life's inventory).

A node's inventory lists every block it has published: it is written before the holders,
so that a write cut short leaves keys listed that no block set names (the sweep and a
re-publish clean those), never a holder the inventory forgot. The holders commands are
:mod:`~kvpool_sidecar.index.redisheld`'s.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Sequence

from kvpool_sidecar.errors import RequestError
from kvpool_sidecar.events import IndexEvent
from kvpool_sidecar.index.redisbase import TIERS, RedisIndexBase, _check_name
from kvpool_sidecar.index.redisbounds import set_command
from kvpool_sidecar.index.redisconn import Command, chunks, translated
from kvpool_sidecar.index.redisrecords import MAX_HOLDERS_BYTES, MAX_NODES, strings

logger = logging.getLogger(__name__)

#: Blocks a re-publish turns into commands between two turns of the event loop (a node's
#: whole inventory in one go had held every other request of the sidecar for most of a second).
YIELD_EVERY = 2048


class BlockPublisher(RedisIndexBase):
    """The publishing of :class:`~kvpool_sidecar.index.redis.RedisIndex`."""

    async def apply(self, node: str, events: Sequence[IndexEvent]) -> None:
        """Publish and unpublish in pipelines; the inventory keeps keys ``node`` still holds."""
        _check_name("node", node)
        final: dict[tuple[bytes, str], bool] = {}
        for ev in events:
            if ev.tier not in TIERS:
                raise RequestError(f"index: unknown tier {ev.tier!r}")
            final[(ev.key, ev.tier)] = ev.publish  # the last event of a (key, tier) wins
        added: dict[bytes, list[str]] = {}
        removed: dict[bytes, list[str]] = {}
        for (key, tier), publish in final.items():
            (added if publish else removed).setdefault(key, []).append(f"{node}@{tier}")
        inv = self._keys.inv(node)
        # the inventory first: a trip cut short may leave keys listed that no block set names
        # (the sweep and a republish clean those), never a holder the inventory forgot
        cmds: list[Command] = [("SADD", inv, *c) for c in chunks([k.hex() for k in added], self._s.batch)]
        if self._held_key is not None:
            listed = len(cmds)
            changed = [*added, *(k for k in removed if k not in added)]
            cmds += self._cmds.changes([(k, added.get(k, ()), removed.get(k, ())) for k in changed], mine=node + "@")
            with translated("apply"):
                res = await self._pipeline(cmds)
                gone = [h for r in res[listed:] for h in strings(r, "the holders script")]
                await self._pipeline([("SREM", inv, *c) for c in chunks(gone, self._s.batch)])
            return
        cmds += self._cmds.changes([(k, h, ()) for k, h in added.items()])
        probes: list[tuple[int, str]] = []
        for key, holders in removed.items():
            blk = self._keys.blk(key.hex())
            cmds.append(("SREM", blk, *holders))
            if key not in added:  # (a set past the bounds is not read: the key stays listed)
                probes.append((len(cmds), key.hex()))
                cmds.append(set_command(blk, MAX_NODES * len(TIERS), MAX_HOLDERS_BYTES))
        if not cmds:
            return
        mine = node + "@"
        with translated("apply"):
            res = await self._pipeline(cmds)
            gone = [h for i, h in probes
                    if res[i] is not None and not any(m.startswith(mine) for m in strings(res[i], "a block set"))]
            await self._pipeline([("SREM", inv, *c) for c in chunks(gone, self._s.batch)])

    async def republish(self, node: str, holdings: dict[bytes, list[str]]) -> int:
        """Make the index say exactly ``holdings`` (key -> tiers) for ``node``; returns blocks.

        Ends by marking the node hash (see :meth:`heartbeat`), unless the hash is gone or a
        sweep ended on it meanwhile: then the re-publish stays owed. Once the node has
        heartbeated, every pipeline also refreshes the hash's TTL, so a long re-publish does
        not outlive it. Heartbeats may run meanwhile (they find it owed until it is marked).
        """
        _check_name("node", node)
        self._republishing.add(node)
        try:
            mine = [f"{node}@{t}" for t in TIERS]
            inv = self._keys.inv(node)
            node_key = self._keys.node(node)
            with translated("republish"):
                run = os.urandom(8).hex()
                swept = await asyncio.wait_for(self._scripts.begin(keys=[node_key], args=[run]), self._s.deadline_s)
                ttl_ms = self._ttl_ms.get(node)
                keep_alive = None if ttl_ms is None else (node_key, ttl_ms)
                changes: list[tuple[bytes, list[str], list[str]]] = []
                held: list[str] = []
                holders: dict[tuple[str, ...], tuple[list[str], list[str]]] = {}  # tiers -> (holders, stale)
                for n, (key, tiers) in enumerate(holdings.items(), 1):
                    if not tiers:
                        continue
                    named = holders.get(tuple(tiers))
                    if named is None:
                        bad = [t for t in tiers if t not in TIERS]
                        if bad:
                            raise RequestError(f"index: unknown tier {bad[0]!r}")
                        named = holders[tuple(tiers)] = ([f"{node}@{t}" for t in tiers],
                                                         [f"{node}@{t}" for t in TIERS if t not in tiers])
                    held.append(key.hex())
                    changes.append((key, named[0], named[1]))  # (a tier it no longer holds the block in: withdrawn)
                    if n % YIELD_EVERY == 0:
                        await asyncio.sleep(0)  # (300,000 blocks in one go held the loop 0.6 s)
                # what the inventory lists and the node no longer holds, a page at a time: a writer
                # to Redis can list millions of entries there, which were all read into memory first
                kept = set(held)
                gone = 0
                async for page in self._member_pages(inv, keep_alive):
                    stale = sorted({h for h in page if h not in kept})
                    if stale:
                        gone += len(stale)
                        await self._pipeline([*self._cmds.unhold(stale, mine),
                                              *(("SREM", inv, *c) for c in chunks(stale, self._s.batch))])
                    await asyncio.sleep(0)
                cmds = []
                for i in range(0, len(changes), YIELD_EVERY):
                    cmds += self._cmds.changes(changes[i : i + YIELD_EVERY])
                    await asyncio.sleep(0)
                # the inventory before the holders, in trips of its own (a cluster sends a pipeline's
                # shards at once), as apply() does: a re-publish cut short (the node killed) leaves
                # keys listed that no block set names, never a holder the inventory forgot, which no
                # sweep removes (the holders had gone last: 768 of 3,000 outlived the sweep, and
                # were named again once the node came back under its name holding none of them)
                listed: list[Command] = [("SADD", inv, *c) for c in chunks(held, self._s.batch)]
                sentinels = sorted((await self._sentinels.keys_of(node)).values()) if ttl_ms is not None else []
                if sentinels:  # before the blocks: a shard that loses its data after this loses them too
                    await self._pipeline([("PEXPIRE", node_key, ttl_ms),
                                          *(("SET", k, self._epoch, "PX", ttl_ms) for k in sentinels)])
                    self._sentinels.written[node] = set(sentinels)
                for step in (listed, cmds):
                    if ttl_ms is None:
                        await self._pipeline(step)
                    else:  # each pipeline first keeps the hash and the sentinels alive
                        keep = [("PEXPIRE", k, ttl_ms) for k in (node_key, *sentinels)]
                        for part in self._cmds.trips(step, max(1, self._s.batch - len(keep))):
                            await self._pipeline([*keep, *part])
                marked = -1 if swept is None else await asyncio.wait_for(
                    self._scripts.mark(keys=[node_key], args=[self._epoch, swept, run]), self._s.deadline_s)
            if marked != 1:
                logger.warning("index: %s re-published %d blocks, but %s; it will re-publish again", node, len(held),
                               "its node hash expired meanwhile" if marked == -1 else "a sweep ended on it meanwhile")
            else:
                logger.info("index: %s re-published %d blocks, withdrew %d stale", node, len(held), gone)
            return len(held)
        finally:
            self._republishing.discard(node)
