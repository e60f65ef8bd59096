"""The holders hash (one Redis server): a block's holders in one field, so that a lookup is
one ``HMGET`` (in a script that sends no value past its bound:
:func:`~kvpool_sidecar.index.redisbounds.held_command`).

The block sets (``kvp:P:blk:<hex>``) stay the truth. On one server every change to them goes
through :data:`HOLD_LUA`, which applies a batch of holder changes and rewrites, in the same
atomic call, each changed block's field of ``kvp:P:held``: its holders sorted and joined by
spaces, or no field when it has none. So the hash says what the sets say, whoever wrote last
and whatever failed (a script runs whole or not at all, and retrying one is harmless: adding
a holder twice or removing one twice changes nothing).

A lookup of a 64-key chain is then one ``HMGET`` (about 17 microseconds of the server's
time, and about 25 more for the script around it that keeps a planted value of any size on
the server: :mod:`~kvpool_sidecar.index.redisbounds`) instead of a walk of 64 sets (a
script: a few microseconds per key, longer than the round trip itself). Liveness is not in
the hash: the reader drops holders of nodes it does not know to be live
(:class:`~kvpool_sidecar.index.redis.RedisIndex` keeps that list, as on a cluster). Schema
and rules: docs/redis-schema.md.

On Redis Cluster there is no holders hash (a script may not touch keys of several shards):
lookups read the sets, one ``SMEMBERS`` per key (in a script that counts them first).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from kvpool_client.keys import RAW_KEY_BYTES

__all__ = ["ABOUT", "HEX_DIGITS", "HOLD_BATCH", "HOLD_LUA", "HolderCommands", "hold_record", "prefix_holders"]

#: An inventory entry: a raw block key's hex digest as ``bytes.hex`` writes it (96 lowercase
#: hex digits); anything else in an inventory was not written by the pool's code.
HEX_DIGITS = 2 * RAW_KEY_BYTES
_HEX_KEY = re.compile("[0-9a-f]{%d}" % HEX_DIGITS)

#: Records per script call: a call holds the server for about 5 microseconds a record.
HOLD_BATCH = 256

#: ARGV: the block-set key prefix, the holders hash, the raw key width, the hash's
#: description (written when the hash is new: a value longer than 64 bytes makes Redis keep
#: it a hashtable, where an ``HMGET`` does not scan), the writer's ``node@`` (or ``""``), then
#: one record per block: its hex digest, its raw key, then its changes, ``+holder`` or
#: ``-holder``, separated by spaces (:func:`hold_record`). Returns the hex digests of the
#: blocks a record removed a holder from and where the writer (``node@``) holds none any more.
HOLD_LUA = """
local blk_prefix, held, rw, about, mine = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4], ARGV[5]
local call, sub, byte = redis.call, string.sub, string.byte
local hw = 2 * rw
local gone = {}
local function failed(r) return type(r) == 'table' and r.err ~= nil end
if call('EXISTS', held) == 0 then call('HSET', held, '~', about) end
for i = 6, #ARGV do
  local rec = ARGV[i]
  local hex, raw = sub(rec, 1, hw), sub(rec, hw + 1, hw + rw)
  local set = blk_prefix .. hex
  local adds, dels = {}, {}
  for op in string.gmatch(sub(rec, hw + rw + 1), '%S+') do
    if byte(op, 1) == 43 then adds[#adds + 1] = sub(op, 2) else dels[#dels + 1] = sub(op, 2) end
  end
  -- pcall: a key of another type (written without the pool's code) fails its record alone
  local bad = false
  if #dels > 0 then bad = failed(redis.pcall('SREM', set, unpack(dels))) end
  if not bad and #adds > 0 then bad = failed(redis.pcall('SADD', set, unpack(adds))) end
  local members = {}
  if not bad then
    members = redis.pcall('SMEMBERS', set)
    if failed(members) then members = {} end
  end
  if #members == 0 then
    call('HDEL', held, raw)
  else
    table.sort(members)
    call('HSET', held, raw, table.concat(members, ' '))
  end
  if #dels > 0 and mine ~= '' then
    local still = false
    for _, m in ipairs(members) do
      if sub(m, 1, #mine) == mine then still = true; break end
    end
    if not still then gone[#gone + 1] = hex end
  end
end
return gone
"""

#: What the holders hash's ``~`` field says (longer than 64 bytes on purpose, see above).
ABOUT = "kvpool holders hash: raw block key -> its holders node@tier, sorted (docs/redis-schema.md)"


def hold_record(key: bytes, adds: Iterable[str] = (), dels: Iterable[str] = ()) -> bytes:
    """One block's changes for :data:`HOLD_LUA`: hex digest, raw key, ``+h``/``-h`` tokens."""
    ops = " ".join([*("+" + h for h in adds), *("-" + h for h in dels)])
    return key.hex().encode() + key + ops.encode()


def prefix_holders(values: Sequence[Iterable[str] | None], live: set[str]) -> list[list[str]]:
    """Each key's holders on ``live`` nodes, sorted, for the longest prefix where every key
    has one. ``values``: per key, its holders (``node@tier`` strings; anything else, written
    by someone without the pool's code, is dropped) or None for none."""
    out: list[list[str]] = []
    prev: Iterable[str] | None = None
    held: list[str] = []
    for v in values:
        if v is None:
            break
        if v is not prev:  # a chain's keys mostly share one holder list: each is read once
            prev = v
            held = sorted(h for h in v if h.rpartition("@")[0] in live)
        if not held:
            break
        out.append(held)
    return out


Command = tuple[Any, ...]
#: Arguments of a script call before its records (see :meth:`HolderCommands.changes`).
_HOLD_ARGS = 8


class HolderCommands:
    """The commands that change block holders: on one server (``held`` names the holders
    hash) calls of :data:`HOLD_LUA`; on a cluster (``held`` None) ``SADD``/``SREM`` of the
    block sets. Builds commands only; the index sends them."""

    def __init__(self, blk_prefix: str, held: str | None, batch: int) -> None:
        self.blk_prefix = blk_prefix
        self.held = held
        self.batch = batch

    def changes(self, changes: Sequence[tuple[bytes, Sequence[str], Sequence[str]]], mine: str = "") -> list[Command]:
        """Commands that apply holder changes (key, holders added, holders removed). On one
        server each script call answers the hex digests of the blocks it removed a holder
        from where ``mine`` (``node@``, or ``""``: none asked) holds none any more."""
        if self.held is None:
            cmds: list[Command] = []
            for key, adds, dels in changes:
                blk = self.blk_prefix + key.hex()
                if adds:
                    cmds.append(("SADD", blk, *adds))
                if dels:
                    cmds.append(("SREM", blk, *dels))
            return cmds
        by_width: dict[int, list[bytes]] = {}
        for key, adds, dels in changes:
            by_width.setdefault(len(key), []).append(hold_record(key, adds, dels))
        per_call = min(HOLD_BATCH, self.batch)
        return [("EVAL", HOLD_LUA, 0, self.blk_prefix, self.held, width, ABOUT, mine, *recs[i:i + per_call])
                for width, recs in by_width.items() for i in range(0, len(recs), per_call)]

    def unhold(self, hexes: Sequence[str], holders: Sequence[str]) -> list[Command]:
        """Commands that remove ``holders`` from the blocks an inventory names (hex digests;
        an entry that is not exactly :data:`HEX_DIGITS` lowercase hex digits was not written
        by the pool's code and is skipped, whatever its length: one of 200 MiB had been
        decoded, encoded again and sent back to Redis)."""
        keys = [bytes.fromhex(h) for h in hexes
                if isinstance(h, str) and len(h) == HEX_DIGITS and _HEX_KEY.fullmatch(h)]
        return self.changes([(k, (), holders) for k in keys])

    @staticmethod
    def trips(cmds: Sequence[Command], room: int) -> Iterator[Sequence[Command]]:
        """``cmds`` in trips of about ``room`` block changes each (a script call counts as
        the blocks it changes), so that a long sweep or re-publish renews what it must
        between trips of the usual size."""
        trip: list[Command] = []
        used = 0
        for c in cmds:
            weight = len(c) - _HOLD_ARGS if c[0] == "EVAL" and c[1] is HOLD_LUA else 1
            if trip and used + weight > room:
                yield trip
                trip, used = [], 0
            trip.append(c)
            used += weight
        if trip:
            yield trip
