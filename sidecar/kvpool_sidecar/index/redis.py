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
(:mod:`~kvpool_sidecar.index.redisshards`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import random
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from importlib import metadata
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from kvpool_sidecar.errors import ConfigError, IndexUnavailableError, RequestError
from kvpool_sidecar.events import IndexEvent
from kvpool_sidecar.index.redisbounds import (
    MAX_HELD_FIELDS,
    RECORD_FIELDS,
    REFUSED,
    SIGNED_FIELDS,
    held_command,
    names_command,
    page_command,
    record_command,
    record_fields,
    set_command,
)
from kvpool_sidecar.index.redisconn import REDIS_ERRORS, Command, RedisIndexSettings, chunks, connect, translated
from kvpool_sidecar.index.redisheld import HEX_DIGITS, HolderCommands, prefix_holders
from kvpool_sidecar.index.rediskeys import PoolKeys
from kvpool_sidecar.index.redispack import use_hiredis_packing
from kvpool_sidecar.index.redisreplies import ReplyTooLongError, bounded, use_bounded_replies
from kvpool_sidecar.index.redisrecords import (
    MAX_CHECKS,
    MAX_HOLDERS_BYTES,
    MAX_HOLDERS_PER_KEY,
    MAX_NAME_BYTES,
    MAX_NODES,
    MAX_RECORD_FIELD_BYTES,
    MAX_RECORD_SCALAR_BYTES,
    NODE_NAME,
    bounded_names,
    finite,
    held_reply,
    held_values,
    malformed,
    node_record,
    strings,
)
from kvpool_sidecar.index.redisshards import ShardSentinels, slot_tags
from kvpool_sidecar.ratelog import warn_once

logger = logging.getLogger(__name__)

__all__ = ["IndexUnavailableError", "RedisIndex", "RedisIndexSettings"]

#: The tiers a holder ``node@tier`` may name (the schema's list; sweeping relies on it).
TIERS = ("gpu", "dram", "disk")
#: Blocks a re-publish turns into commands between two turns of the event loop (a node's
#: whole inventory in one go had held every other request of the sidecar for most of a second).
YIELD_EVERY = 2048
#: The most bytes a lookup's bare ``HMGET`` reply may take (redisreplies.py): one value at its
#: bound (MAX_HOLDERS_BYTES), and 2 KiB a key (some 70 holders of ``node@tier``, where a
#: pool's blocks mostly have one or two). Past that, the lookup reads through the script.
HELD_BUDGET_BASE = MAX_HOLDERS_BYTES
HELD_BUDGET_PER_KEY = 2 << 10
#: How long lookups read through the script alone once a bare read went past its budget.
SCRIPTED_S = 60
#: Dead nodes with an inventory that one sweep claims and unpublishes at most (see sweep_dead).
MAX_SWEEPS = 64

#: Delete a key only if it still holds this caller's token (one key: fine on a cluster).
_RELEASE_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

#: Extend a key's TTL only if it still holds this caller's token.
_RENEW_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""

#: A re-publish begins: the node hash, where it exists (a hash created here would have no
#: TTL), takes the run's token in ``republishing``; returns its ``swept`` count (nil: gone).
_BEGIN_LUA = """
if redis.call('EXISTS', KEYS[1]) == 0 then return false end
redis.call('HSET', KEYS[1], 'republishing', ARGV[1])
return redis.call('HGET', KEYS[1], 'swept') or '0'
"""

#: Mark a node hash as holding this life's inventory: only if it is the hash the re-publish
#: began on (it still holds the run's token: a hash Redis lost meanwhile, which the next
#: heartbeat made again, holds none) and no sweep has ended on it since (its ``swept`` count
#: is the one read then). 1 marked, 0 swept meanwhile, -1 gone (or made again).
_MARK_LUA = """
if redis.call('HGET', KEYS[1], 'republishing') ~= ARGV[3] then return -1 end
redis.call('HDEL', KEYS[1], 'republishing')
if (redis.call('HGET', KEYS[1], 'swept') or '0') ~= ARGV[2] then return 0 end
redis.call('HSET', KEYS[1], 'published', ARGV[1])
return 1
"""

#: A sweep's removals have ended: a node hash that is back owes a re-publish, and a
#: re-publish running now will not mark it.
_SWEPT_LUA = """
if redis.call('EXISTS', KEYS[1]) == 1 then
  redis.call('HINCRBY', KEYS[1], 'swept', 1)
  redis.call('HDEL', KEYS[1], 'published')
  return 1
end
return 0
"""


def _check_name(what: str, name: str) -> str:
    if not NODE_NAME.fullmatch(name):
        raise ConfigError(f"{what} {name!r}: use letters, digits, '.', '_' and '-' only")
    return name


def _version() -> str:
    try:
        return metadata.version("kvpool")
    except metadata.PackageNotFoundError:
        return "0"


class RedisIndex:
    """:class:`~kvpool_sidecar.index.base.BlockIndex` on Redis, plus the node registry."""

    def __init__(self, url: str, settings: RedisIndexSettings | None = None) -> None:
        s = self._s = settings or RedisIndexSettings()
        p = _check_name("pool", s.pool)
        self._keys = PoolKeys(p)
        self._r: Redis | RedisCluster = connect(url, s)
        if isinstance(self._r, RedisCluster):
            slot_tags()  # built once per process, here rather than in a heartbeat
        else:
            use_hiredis_packing(self._r)  # a 64-key HMGET packed in Python costs a third of a trip
        #: One server: raw block key -> its holders, written with the block sets (redisheld.py).
        self._held_key: str | None = None if isinstance(self._r, RedisCluster) else self._keys.held
        #: Whether a lookup may read the holders hash bare, its reply bounded on this side
        #: (redisreplies.py), rather than through the script; not before this time.
        self._bare_held = not isinstance(self._r, RedisCluster) and use_bounded_replies(self._r)
        self._bare_after = float("-inf")
        self._cmds = HolderCommands(self._keys.blk_prefix, self._held_key, s.batch)
        self._live: set[str] = set()
        self._dead: set[str] = set()
        self._known: list[str] = []
        self._live_at = float("-inf")
        self._version = _version()
        self._release_script = self._r.register_script(_RELEASE_LUA)
        self._renew_script = self._r.register_script(_RENEW_LUA)
        self._begin_script = self._r.register_script(_BEGIN_LUA)
        self._mark_script = self._r.register_script(_MARK_LUA)
        self._swept_script = self._r.register_script(_SWEPT_LUA)
        #: The node hash's TTL each node last heartbeated with (re-publishes refresh it).
        self._ttl_ms: dict[str, int] = {}
        #: Nodes a re-publish of is under way (their heartbeats meanwhile find it owed: not logged).
        self._republishing: set[str] = set()
        #: This client's life: a node hash whose ``published`` field differs (or is gone)
        #: does not hold what this life published, and a re-publish is owed.
        self._epoch = os.urandom(8).hex()
        #: On a cluster, each node's sentinel on each shard (and those its last re-publish wrote).
        self._sentinels = ShardSentinels(self._r, self._keys, s.deadline_s, self._epoch)

    @classmethod
    def from_url(cls, url: str, **settings: Any) -> RedisIndex:
        """``RedisIndex.from_url("redis://:pw@host:6379/0", pool="p", cluster=False)``."""
        return cls(url, RedisIndexSettings(**settings))

    # -- round trips ----------------------------------------------------------------------
    async def _pipeline(self, cmds: Sequence[Command]) -> list[Any]:
        """Run commands in pipelines of ``batch``; each pipeline is one trip per shard."""
        out: list[Any] = []
        for chunk in chunks(cmds, self._s.batch):
            pipe = self._r.pipeline() if isinstance(self._r, RedisCluster) else self._r.pipeline(transaction=False)
            for c in chunk:
                pipe.execute_command(*c)
            out.extend(await asyncio.wait_for(pipe.execute(), self._s.deadline_s))
        return out

    async def _one(self, *cmd: Any) -> Any:
        async with asyncio.timeout(self._s.deadline_s):  # no task per call, as wait_for makes
            return await self._r.execute_command(*cmd)

    async def _scan_members(self, key: str, keep_alive: tuple[str, int] | None = None) -> set[str]:
        """A large set (an inventory) page by page, each page within the deadline; with
        ``keep_alive`` (a key and a TTL in ms), each page also refreshes that key's TTL."""
        out: set[str] = set()
        async for page in self._member_pages(key, keep_alive):
            out.update(page)
        return out

    async def _member_pages(self, key: str, keep_alive: tuple[str, int] | None = None) -> AsyncIterator[list[str]]:
        """:meth:`_scan_members` one page at a time (a member may come twice). The scan runs
        in a script on the server, which sends only members of the form the pool writes (a
        raw block key's hex digits): a member of any other length never leaves it."""
        cursor = "0"
        while True:
            if keep_alive is not None:
                await self._one("PEXPIRE", *keep_alive)
            reply = await self._one(*page_command(key, cursor, self._s.batch, HEX_DIGITS))
            if not isinstance(reply, list) or len(reply) != 2 or not isinstance(reply[0], str):
                raise malformed("an inventory page")
            cursor = reply[0]
            yield strings(reply[1], "an inventory page")
            if cursor == "0":
                return

    # -- node registry --------------------------------------------------------------------
    async def heartbeat(self, node: str, address: str, tiers: dict[str, Any], hits: int, misses: int,
                        gpus: list[dict[str, Any]], ttl_s: float, *, stamp: str | None = None,
                        sig: str = "") -> bool:
        """Write ``node``'s hash with a TTL; True when a re-publish is owed.

        It is owed until :meth:`republish` has completed in this life of the hash: when the
        node first registers, when its hash expired or Redis lost its data, and when a sweep
        found it back. The check reads a field only a completed re-publish writes, so a
        heartbeat retried after a lost reply still reports the debt. Before re-publishing,
        ask :meth:`being_swept`.

        ``stamp`` (the heartbeat's time, ``repr(time.time())`` when not given) and ``sig``,
        the record's signature with the pool secret, are stored for readers to check.
        """
        _check_name("node", node)
        if ttl_s <= 0:
            raise ConfigError("heartbeat ttl_s must be positive")
        key = self._keys.node(node)
        fields = {"address": address, "heartbeat": stamp or repr(time.time()), "tiers": json.dumps(tiers),
                  "hits": str(int(hits)), "misses": str(int(misses)), "gpus": json.dumps(gpus),
                  "version": self._version, "sig": sig}
        flat = [x for kv in fields.items() for x in kv]
        ttl_ms = self._ttl_ms[node] = max(1, int(ttl_s * 1000))
        cmds: list[Command] = [("HSET", key, *flat), ("PEXPIRE", key, ttl_ms),
                               ("SADD", self._keys.nodes, node), ("HGET", key, "published")]
        with translated("heartbeat"):
            res = await self._pipeline(cmds)
            self._live.add(node)
            self._dead.discard(node)
            owed: bool = res[-1] != self._epoch \
                or await self._sentinels.lost(node, ttl_ms, self._pipeline, self._one)
        if owed and node not in self._republishing:
            logger.info("index: the index does not hold %s's inventory; it needs re-publishing", node)
        return owed

    async def being_swept(self, node: str) -> bool:
        """Whether a sweep of ``node``'s old entries is running: re-publish only after it.

        Ask after the heartbeat has returned (the two are separate round trips, so that on a
        cluster the heartbeat's write is in place before this read).
        """
        with translated("being_swept"):
            return bool(await self._one("EXISTS", self._keys.claim(node)))

    async def register(self, node: str, address: str, tiers: dict[str, Any], hits: int, misses: int,
                       gpus: list[dict[str, Any]], ttl_s: float, *, stamp: str | None = None,
                       sig: str = "") -> bool:
        """The first heartbeat; a (re)starting sidecar then calls :meth:`republish` anyway."""
        return await self.heartbeat(node, address, tiers, hits, misses, gpus, ttl_s, stamp=stamp, sig=sig)

    async def _node_names(self) -> list[str]:
        """The nodes set's names, read within bounds (:mod:`~kvpool_sidecar.index.redisbounds`)."""
        reply = await self._one(*names_command(self._keys.nodes, MAX_NODES, MAX_NAME_BYTES, sorted(self._live)))
        return bounded_names(set(strings(reply, "the nodes set")), self._live)

    async def _records(self, names: Sequence[str], fields: Sequence[str]) -> list[dict[str, str] | None]:
        """``fields`` of each of ``names``' records, read within bounds (None: gone, not a
        hash, or a field past its bound; the last two are logged once a minute)."""
        replies = await self._pipeline([record_command(self._keys.node(n), MAX_RECORD_SCALAR_BYTES,
                                                       MAX_RECORD_FIELD_BYTES, fields) for n in names])
        out = [record_fields(r, fields) for r in replies]
        for name, reply in zip(names, replies):
            if reply == REFUSED:
                # (one cause for all records: their names are a writer's, without number)
                warn_once(logger, "index-record", "index: node record of %s is past its bounds or "
                          "not a hash; skipped", name[:64])
        return out

    async def nodes(self, believe: Callable[[Mapping[str, str]], bool] | None = None) -> list[dict[str, Any]]:
        """Live nodes with their parsed fields (``name`` added), sorted by name. With
        ``believe``, each record's ``name``, ``address``, ``stamp`` and ``sig`` are read
        first, and the rest of a record only when ``believe`` takes it: a writer to Redis
        that plants thousands of records costs a small read and an HMAC each, where parsing
        their JSON had held the event loop seconds at a time. The record then keeps the
        address, stamp and signature that ``believe`` took, whatever the second read found:
        a writer flipping the address between the two reads had steered peers to a host no
        node signed."""
        with translated("nodes"):
            names = await self._node_names()
            believed: dict[str, dict[str, str]] = {}
            if believe is not None:
                signed = await self._records(names, SIGNED_FIELDS)
                for n, h in zip(names, signed):
                    fields = None if h is None else {"name": n, "address": h.get("address", ""),
                                                     "stamp": h.get("heartbeat", ""), "sig": h.get("sig", "")}
                    if fields is not None and believe(fields):
                        believed[n] = fields
                names = list(believed)
            records = await self._records(names, RECORD_FIELDS)
        out: list[dict[str, Any]] = []
        for name, h in zip(names, records):
            if not h:
                continue
            record = node_record(name, h)
            if record is None:
                warn_once(logger, "index-record", "index: node hash of %s is malformed; skipped", name[:64])
                continue
            fields = believed.get(name)
            if fields is not None and (record["address"], record["stamp"], record["sig"]) != \
                    (fields["address"], fields["stamp"], fields["sig"]):
                # changed between the two reads: the signed fields are the ones believed, not
                # what a writer to Redis may have put there since (a heartbeat in between
                # changes them too; that node is read again at the next refresh)
                record.update(address=fields["address"], stamp=fields["stamp"], sig=fields["sig"])
                try:
                    record["heartbeat"] = finite(fields["stamp"])
                except ValueError:
                    continue
            out.append(record)
        return out

    # -- publishing -----------------------------------------------------------------------
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
                swept = await asyncio.wait_for(self._begin_script(keys=[node_key], args=[run]), self._s.deadline_s)
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
                    self._mark_script(keys=[node_key], args=[self._epoch, swept, run]), self._s.deadline_s)
            if marked != 1:
                logger.warning("index: %s re-published %d blocks, but %s; it will re-publish again", node, len(held),
                               "its node hash expired meanwhile" if marked == -1 else "a sweep ended on it meanwhile")
            else:
                logger.info("index: %s re-published %d blocks, withdrew %d stale", node, len(held), gone)
            return len(held)
        finally:
            self._republishing.discard(node)

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
                        self._renew_script(keys=[claim], args=[token, claim_ms]), self._s.deadline_s):
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
                        await asyncio.wait_for(self._swept_script(keys=[node_key]), self._s.deadline_s)
                if ended or not sent:
                    await self._release(claim, token)
        self._live.discard(node)
        self._dead.add(node)
        return True

    async def _release(self, claim: str, token: str) -> None:
        """Give a claim back if it is still ours; on failure it expires by itself."""
        with contextlib.suppress(*REDIS_ERRORS, TimeoutError):
            await asyncio.wait_for(self._release_script(keys=[claim], args=[token]), self._s.deadline_s)

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

    # -- lookup ---------------------------------------------------------------------------
    async def lookup(self, keys: Sequence[bytes]) -> list[list[str]]:
        """Holders on live nodes of each key of the longest prefix held by a live node.

        One round trip: on one server a script that reads the holders hash (one ``HMGET``),
        on a cluster one per key that reads its block set,
        neither sending what is past the bounds (:mod:`~kvpool_sidecar.index.redisbounds`);
        every ``live_cache_s`` the same trip also reads the node records. A node named that
        this index has not seen costs one more trip (valid node names only)."""
        if not keys:
            return []
        refresh = time.monotonic() - self._live_at >= self._s.live_cache_s
        held = self._held_key
        parts = list(chunks(keys, min(self._s.batch, MAX_HELD_FIELDS))) if held is not None else []
        sizes = [len(c) for c in parts]
        single = len(parts) == 1 and not refresh  # the usual lookup: one command of its own
        cmds: list[Command] = []
        if held is not None and not single:
            cmds = [held_command(held, MAX_HOLDERS_BYTES, c) for c in parts]
        elif held is None:
            cmds = [set_command(self._keys.blk(k.hex()), MAX_NODES * len(TIERS), MAX_HOLDERS_BYTES) for k in keys]
        n = len(parts) if held is not None else len(keys)
        known = list(self._known) if refresh else []
        if refresh:
            cmds.append(names_command(self._keys.nodes, MAX_NODES, MAX_NAME_BYTES, sorted(self._live)))
            cmds += [("EXISTS", self._keys.node(x)) for x in known]
        with translated("lookup", answered=not refresh):  # (a refresh reads what every lookup needs)
            # one command: no pipeline (its machinery costs a fifth of a loopback trip)
            if single:
                res = [await self._held_one(keys)]
            else:
                res = [await self._one(*cmds[0])] if len(cmds) == 1 else await self._pipeline(cmds)
            if refresh:
                self._known = bounded_names(set(strings(res[n], "the nodes set")), self._live)
                self._live = {x for x, e in zip(known, res[n + 1:]) if e}
                self._dead = set(known) - self._live
                self._live_at = time.monotonic()
            got: Sequence[Iterable[str] | None]
            lists: Sequence[Iterable[str] | None]
            if self._held_key is not None:
                got, lists = held_values([held_reply(r, size) for r, size in zip(res[:n], sizes)])
            else:  # (nil: a set past the bounds, or not a set)
                got = lists = [list(itertools.islice(strings(v, "a block set"), MAX_HOLDERS_PER_KEY)) or None
                               if v is not None else None for v in res[:n]]
            # a name that is no node's name is not asked about (nor live: its holders drop)
            named = {h.rpartition("@")[0] for v in lists if v for h in v}
            unknown = {x for x in named if NODE_NAME.fullmatch(x)} - self._live - self._dead
            if unknown:  # at most MAX_CHECKS a lookup: the others are not live for this one
                await self._check(sorted(unknown)[:MAX_CHECKS])
        if len(lists) == 1 and lists[0] and all(got):  # one holder list for every key (None: falsy)
            every = sorted(h for h in lists[0] if h.rpartition("@")[0] in self._live)
            return [every] * len(got) if every else []
        return prefix_holders(got, self._live)

    async def _held_one(self, keys: Sequence[bytes]) -> Any:
        """The reply to a lookup of ``keys`` (at most :data:`MAX_HELD_FIELDS`) in the holders
        hash: of a bare ``HMGET``, which may take :data:`HELD_BUDGET_BASE` bytes and
        :data:`HELD_BUDGET_PER_KEY` a key (redisreplies.py); past that (someone wrote values
        that long), of the bounded script, and of it alone for :data:`SCRIPTED_S` (a bare read
        past its budget cost a new connection). A bare reply within the budget holds what the
        script would send, but for values past :data:`MAX_HOLDERS_BYTES`, which the reader
        drops alike (redisrecords.py)."""
        held = self._held_key
        if held is None:
            raise RuntimeError("a holders hash is read on one server only")
        if self._bare_held and time.monotonic() >= self._bare_after:
            try:
                with bounded(HELD_BUDGET_BASE + HELD_BUDGET_PER_KEY * len(keys)):
                    return await self._one("HMGET", held, *keys)
            except ReplyTooLongError:
                warn_once(logger, "index-held-budget", "index: a holders reply went past its budget (is someone "
                          "writing long values to Redis?): lookups read through the bounded script for %d s",
                          SCRIPTED_S)
                self._bare_after = time.monotonic() + SCRIPTED_S
        return await self._one(*held_command(held, MAX_HOLDERS_BYTES, keys))

    async def _check(self, names: list[str]) -> None:
        found = await self._pipeline([("EXISTS", self._keys.node(x)) for x in names])
        for x, e in zip(names, found):
            (self._live if e else self._dead).add(x)

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
