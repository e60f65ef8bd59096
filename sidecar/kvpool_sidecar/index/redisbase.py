"""What every part of the Redis index shares: its client, its keys, the scripts it runs, what
it knows of the live and dead nodes, this client's life, and its round trips.

A round trip is one command (:meth:`RedisIndexBase._one`) or pipelines of ``batch``
commands, each one trip per shard (:meth:`RedisIndexBase._pipeline`), each within the
deadline; a large set (an inventory) is read a page at a time, in a script that sends only
members of the form the pool writes (:meth:`RedisIndexBase._member_pages`). The parts, each
a class of its own over this one: the node registry (:mod:`~kvpool_sidecar.index.redisnodes`),
the sweep of dead nodes (:mod:`~kvpool_sidecar.index.redissweep`), publishing
(:mod:`~kvpool_sidecar.index.redispublish`) and lookups
(:mod:`~kvpool_sidecar.index.redislookup`); :class:`~kvpool_sidecar.index.redis.RedisIndex`
is all of them.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Sequence
from importlib import metadata
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from kvpool_sidecar.errors import ConfigError
from kvpool_sidecar.index.redisbounds import page_command
from kvpool_sidecar.index.redisconn import Command, RedisIndexSettings, chunks, connect
from kvpool_sidecar.index.redisheld import HEX_DIGITS, HolderCommands
from kvpool_sidecar.index.rediskeys import PoolKeys
from kvpool_sidecar.index.redispack import use_hiredis_packing
from kvpool_sidecar.index.redisreplies import use_bounded_replies
from kvpool_sidecar.index.redisrecords import NODE_NAME, malformed, strings
from kvpool_sidecar.index.redisscripts import NodeScripts
from kvpool_sidecar.index.redisshards import ShardSentinels, slot_tags

#: The tiers a holder ``node@tier`` may name (the schema's list; sweeping relies on it).
TIERS = ("gpu", "dram", "disk")


def _check_name(what: str, name: str) -> str:
    if not NODE_NAME.fullmatch(name):
        raise ConfigError(f"{what} {name!r}: use letters, digits, '.', '_' and '-' only")
    return name


def _version() -> str:
    try:
        return metadata.version("kvpool")
    except metadata.PackageNotFoundError:
        return "0"


class RedisIndexBase:
    """The state and the round trips of :class:`~kvpool_sidecar.index.redis.RedisIndex`."""

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
        self._scripts = NodeScripts(self._r)
        #: The node hash's TTL each node last heartbeated with (re-publishes refresh it).
        self._ttl_ms: dict[str, int] = {}
        #: Nodes a re-publish of is under way (their heartbeats meanwhile find it owed: not logged).
        self._republishing: set[str] = set()
        #: This client's life: a node hash whose ``published`` field differs (or is gone)
        #: does not hold what this life published, and a re-publish is owed.
        self._epoch = os.urandom(8).hex()
        #: On a cluster, each node's sentinel on each shard (and those its last re-publish wrote).
        self._sentinels = ShardSentinels(self._r, self._keys, s.deadline_s, self._epoch)

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
