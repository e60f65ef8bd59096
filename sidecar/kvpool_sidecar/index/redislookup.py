"""Lookups in the index: the holders, on live nodes, of each key of the longest prefix a
live node holds.

On one server a lookup reads the holders hash (one ``HMGET``: bare, its reply bounded on
this side by :mod:`~kvpool_sidecar.index.redisreplies`, or through the script of
:mod:`~kvpool_sidecar.index.redisbounds` where a bare read went past its budget or the
lookup sends other commands with it); on a cluster it reads each key's block set, within
bounds on the server. Every ``live_cache_s`` the same
trip reads the nodes set, and names this index has not seen are checked (at most
:data:`~kvpool_sidecar.index.redisrecords.MAX_CHECKS` a lookup).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterable, Sequence
from typing import Any

from kvpool_sidecar.index.redisbase import TIERS, RedisIndexBase
from kvpool_sidecar.index.redisbounds import MAX_HELD_FIELDS, held_command, names_command, set_command
from kvpool_sidecar.index.redisconn import Command, chunks, translated
from kvpool_sidecar.index.redisheld import prefix_holders
from kvpool_sidecar.index.redisreplies import ReplyTooLongError, bounded
from kvpool_sidecar.index.redisrecords import (
    MAX_CHECKS,
    MAX_HOLDERS_BYTES,
    MAX_HOLDERS_PER_KEY,
    MAX_NAME_BYTES,
    MAX_NODES,
    NODE_NAME,
    bounded_names,
    held_reply,
    held_values,
    strings,
)
from kvpool_sidecar.ratelog import warn_once

logger = logging.getLogger(__name__)

#: The most bytes a lookup's bare ``HMGET`` reply may take (redisreplies.py): one value at its
#: bound (MAX_HOLDERS_BYTES), and 2 KiB a key (some 70 holders of ``node@tier``, where a
#: pool's blocks mostly have one or two). Past that, the lookup reads through the script.
HELD_BUDGET_BASE = MAX_HOLDERS_BYTES
HELD_BUDGET_PER_KEY = 2 << 10
#: How long lookups read through the script alone once a bare read went past its budget.
SCRIPTED_S = 60


class BlockLookups(RedisIndexBase):
    """The lookups of :class:`~kvpool_sidecar.index.redis.RedisIndex`."""

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
