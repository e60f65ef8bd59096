"""The sweep of the index's dead nodes, and the drain of a leaving one: everything a node's
inventory lists is unpublished, then the inventory and the node's name go.

A sweep claims a dead node before it walks its inventory (the claim renewed, with its token
checked, before each pipeline: :mod:`~kvpool_sidecar.index.redisscripts`), and ends by
owing the node a re-publish if its hash came back meanwhile. The names that anyone who can
write to Redis adds to the nodes set cost a sweep little: those with no inventory leave it in
two trips, and at most :data:`MAX_SWEEPS` with one are walked a sweep.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random

from kvpool_sidecar.errors import IndexUnavailableError
from kvpool_sidecar.index.redisbase import TIERS, _check_name
from kvpool_sidecar.index.redisconn import REDIS_ERRORS, Command, chunks, translated
from kvpool_sidecar.index.redisnodes import NodeRegistry

logger = logging.getLogger(__name__)

#: Dead nodes with an inventory that one sweep claims and unpublishes at most (see sweep_dead).
MAX_SWEEPS = 64


class NodeSweeper(NodeRegistry):
    """The sweeps and drains of :class:`~kvpool_sidecar.index.redis.RedisIndex` (over its node
    registry, whose names a sweep reads)."""

    async def _forget(self, node: str, *, drop_hash: bool) -> bool:
        """Unpublish everything in ``node``'s inventory; False if another sweeper has it or
        it is alive.

        A sweep (``drop_hash`` False) first claims the node, and only then (a separate
        round trip) checks that its hash is still gone. A node that comes back while the
        claim lasts holds off re-publishing (:meth:`being_swept`). The claim is renewed, with
        its token checked, before each pipeline. However the removals end (done, failed, or
        this sweeper stalled past its claim), the sweep then bumps the node hash's ``swept``
        count if the hash is back: the node owes a re-publish, and one it ran meanwhile does
        not count (its mark is refused or removed). A failed sweep keeps its claim until it
        expires, so that removals still in flight land before the node re-publishes. A
        draining node (``drop_hash`` True) unpublishes itself without a claim.
        """
        claim = self._keys.claim(node)
        token = os.urandom(8).hex()
        claim_ms = max(1, int(self._s.sweep_claim_s * 1000))
        node_key = self._keys.node(node)
        if not drop_hash:
            if not await self._one("SET", claim, token, "NX", "PX", claim_ms) \
                    and await self._one("GET", claim) != token:  # (ours if a retried SET had landed)
                return False  # another sidecar is sweeping it
            if await self._one("EXISTS", node_key):
                await self._release(claim, token)
                return False
        sent = ended = False

        async def send(cmds: list[Command]) -> None:
            nonlocal sent
            for chunk in self._cmds.trips(cmds, self._s.batch):
                if not drop_hash and not await asyncio.wait_for(
                        self._scripts.renew(keys=[claim], args=[token, claim_ms]), self._s.deadline_s):
                    raise IndexUnavailableError(f"index: the sweep's claim on node {node} was lost")
                sent = True
                await self._pipeline(chunk)

        try:
            mine = [f"{node}@{t}" for t in TIERS]
            # page by page: an inventory of any size (a Redis writer may plant a huge one)
            # is never all in memory, nor turned into commands in one go on the loop
            async for page in self._member_pages(self._keys.inv(node)):
                await send(self._cmds.unhold(sorted(page), mine))
            cmds: list[Command] = [("DEL", self._keys.inv(node)), ("SREM", self._keys.nodes, node)]
            if drop_hash:  # a sweep leaves a dead node's sentinels to expire with their TTL
                cmds += [("DEL", k) for k in sorted(self._sentinels.written.pop(node, ()))]
            await send(cmds)
            if drop_hash:  # last, on its own: every removal has landed first, on every shard
                await self._one("DEL", node_key)
                self._ttl_ms.pop(node, None)
            ended = True
        finally:
            if not drop_hash:
                if sent:
                    with contextlib.suppress(*REDIS_ERRORS, TimeoutError):
                        await asyncio.wait_for(self._scripts.swept(keys=[node_key]), self._s.deadline_s)
                if ended or not sent:
                    await self._release(claim, token)
        self._live.discard(node)
        self._dead.add(node)
        return True

    async def _release(self, claim: str, token: str) -> None:
        """Give a claim back if it is still ours; on failure it expires by itself."""
        with contextlib.suppress(*REDIS_ERRORS, TimeoutError):
            await asyncio.wait_for(self._scripts.release(keys=[claim], args=[token]), self._s.deadline_s)

    async def drop_node(self, node: str) -> None:
        """A draining node: unpublish all it holds, delete its hash and inventory."""
        _check_name("node", node)
        with translated("drop_node"):
            await self._forget(node, drop_hash=True)

    async def sweep_dead(self) -> int:
        """Forget registered nodes whose hash is gone; returns how many.

        Anyone who can write to Redis can add names to the nodes set, up to the 4,096 a read
        takes: names with no inventory (nothing to unpublish) leave it in two trips, and at
        most :data:`MAX_SWEEPS` with one and no claim on them, chosen at random, are claimed
        and walked a sweep (the others at the next). Each dead name had cost a claim and six
        more trips: 4,096 planted names took a sidecar 2.4 s of CPU every sweep, and logged a
        line of every name."""
        with translated("sweep_dead"):
            names = await self._node_names()
            alive = await self._pipeline([("EXISTS", self._keys.node(n)) for n in names])
            gone = [n for n, a in zip(names, alive) if not a]
            # each gone name's inventory and claim, in one trip
            found = await self._pipeline([("EXISTS", key) for n in gone
                                          for key in (self._keys.inv(n), self._keys.claim(n))])
            listed, claimed = found[0::2], found[1::2]
            bare = [n for n, inv in zip(gone, listed) if not inv]
            if bare:  # (a node back meanwhile keeps its name; one that registers later adds it again)
                back = await self._pipeline([("EXISTS", self._keys.node(n)) for n in bare])
                bare = [n for n, b in zip(bare, back) if not b]
                await self._pipeline([("SREM", self._keys.nodes, *c) for c in chunks(bare, self._s.batch)])
                self._live.difference_update(bare)
                self._dead.update(bare)
            # names another sweeper has claimed are its own this sweep: they are not sampled
            # (4,000 planted names, each with a claim that never expires, had diluted the
            # sample so that a real dead node was swept at the 51st sweep, not the first)
            held = [n for n, inv, c in zip(gone, listed, claimed) if inv and not c]
            dead: list[str] = []
            failed: list[str] = []
            for n in random.sample(held, min(len(held), MAX_SWEEPS)):
                try:
                    if await self._forget(n, drop_hash=False):
                        dead.append(n)
                except (IndexUnavailableError, *REDIS_ERRORS) as e:  # the other dead nodes still get swept
                    logger.warning("index: sweeping node %s failed: %s", n[:64], e)
                    failed.append(n)
            if failed and not dead:
                raise IndexUnavailableError(f"index: sweeping {len(failed)} dead nodes failed")
        if dead or bare:
            logger.info("index: swept %d dead nodes (%s), forgot %d names with nothing published",
                        len(dead), ", ".join(n[:64] for n in dead[:8]) + (", ..." if len(dead) > 8 else ""),
                        len(bare))
        return len(dead) + len(bare)
