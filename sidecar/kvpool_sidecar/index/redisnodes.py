"""The index's node registry: each node's hash, written with a TTL by its heartbeats (which
also tell the node when the index does not hold its inventory, and a re-publish is owed),
and the nodes set and the node records, read within bounds (:mod:`~kvpool_sidecar.index.redisbounds`
on the server, :mod:`~kvpool_sidecar.index.redisrecords` here).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kvpool_sidecar.errors import ConfigError
from kvpool_sidecar.index.redisbase import RedisIndexBase, _check_name
from kvpool_sidecar.index.redisbounds import (
    RECORD_FIELDS,
    REFUSED,
    SIGNED_FIELDS,
    names_command,
    record_command,
    record_fields,
)
from kvpool_sidecar.index.redisconn import Command, translated
from kvpool_sidecar.index.redisrecords import (
    MAX_NAME_BYTES,
    MAX_NODES,
    MAX_RECORD_FIELD_BYTES,
    MAX_RECORD_SCALAR_BYTES,
    bounded_names,
    finite,
    node_record,
    strings,
)
from kvpool_sidecar.ratelog import warn_once

logger = logging.getLogger(__name__)


class NodeRegistry(RedisIndexBase):
    """The node registry of :class:`~kvpool_sidecar.index.redis.RedisIndex`."""

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
