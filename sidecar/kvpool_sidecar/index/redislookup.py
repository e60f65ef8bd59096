"""Prefix lookups on one Redis server: the lookup script and the lookup cache it fills.

A lookup walks the chain block by block (``SMEMBERS`` of each block set, ``PTTL`` of each
node record named) in one script, which costs the server a few microseconds per key (a
64-key walk takes longer than the loopback round trip itself). The script also writes what it found into ``kvp:P:lookup``, a hash from each raw block
key to its holders on live nodes (``""``: none), so that the next lookup of those blocks is
one ``HMGET``, with no script, no liveness check and the reply read in C
(schema and rules: docs/redis-schema.md):

- The hash never outlives a node record it names: each fill lowers the hash's TTL to the
  shortest remaining TTL of the records it named (and to the cap, ``lookup_cache_s``). Both
  TTLs count on the Redis server's clock, frozen while a script runs (Redis 7), so while the
  hash exists every node it names is live. A draining node deletes the hash together with
  its record (one transaction); a node's first heartbeat in a process deletes it after
  setting its record's TTL (a shorter TTL applies at once).
- Writers delete the fields of the blocks they publish or withdraw, after changing the
  block sets, in the same pipeline. A field a writer failed to delete (a cut connection, a
  sidecar of an older version) is stale for at most the hash's TTL: it can lack a holder or
  name one that no longer holds the block, which costs a miss (peers check what they get),
  never wrong bytes.

:class:`WarmHints` remembers which chains this client looked up while the hash still holds
them (the script says how long it will): only those try the hash first; any other lookup
runs the script at once, so a lookup that finds nothing cached still costs one round trip.
The script fills the hash only for a chain this client looked up before (within
``lookup_cache_s``): filling costs about a third of the walk, wasted on the many chains
looked up once.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

__all__ = ["LOOKUP_LUA", "WarmHints", "cached_prefix", "runs"]

#: Longest live prefix in one call (single server only: it reads keys it is not given).
#: ARGV: the node-record prefix, the block-key prefix, the lookup hash, every key's hex digest
#: laid end to end, the raw keys laid end to end (empty when not filling; one argument each:
#: encoding and parsing 64 arguments cost more than the round trip), the hex width, the raw
#: width, and the hash's TTL cap in ms (0: leave the hash alone). The answer is run-length coded, ``[holders, count,
#: holders, count, ...]`` with each key's live holders sorted and joined by spaces:
#: consecutive blocks of a prefix are usually held by the same nodes, so a 64-key answer is a
#: few short strings, after one number: how long the lookup hash will live, in ms (0: it
#: holds nothing of this lookup). Every key it reads, up to and including the first without
#: a live holder, goes into the hash, whose TTL it lowers to the shortest remaining TTL of
#: the node records it named. A write that fails (out of memory, a hash of another type)
#: deletes the hash instead: the lookup still answers.
LOOKUP_LUA = """
local node_prefix, blk_prefix, cache, hexes, raws = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local hw, rw, cap = tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8])
local call, sub, match = redis.call, string.sub, string.match
local out, fill, alive, nodeof = {}, {}, {}, {}
local bound, ttl = cap, 0
local prev, run = nil, 0
for i = 0, #hexes / hw - 1 do
  local live = {}
  for _, h in ipairs(call('SMEMBERS', blk_prefix .. sub(hexes, i * hw + 1, (i + 1) * hw))) do
    -- a chain's blocks mostly have the same few holders: each is parsed once
    local node = nodeof[h]
    if node == nil then
      node = match(h, '^(.*)@[^@]*$') or false
      nodeof[h] = node
    end
    if node then
      local a = alive[node]
      if a == nil then
        local left = call('PTTL', node_prefix .. node)
        a = left ~= -2
        -- a record without a TTL (created a moment before its PEXPIRE): cache nothing. One
        -- millisecond off the bound: PTTL and PEXPIRE may read the clock 1 ms apart
        if left == -1 then bound = 0 elseif a and left - 1 < bound then bound = left - 1 end
        alive[node] = a
      end
      if a then live[#live + 1] = h end
    end
  end
  local joined = live[1] or ''
  if #live > 1 then
    table.sort(live)
    joined = table.concat(live, ' ')
  end
  if cap > 0 then
    fill[#fill + 1] = sub(raws, i * rw + 1, (i + 1) * rw)
    fill[#fill + 1] = joined
  end
  if joined == '' then break end
  if joined == prev then
    run = run + 1
  else
    if prev then out[#out + 1] = prev; out[#out + 1] = run end
    prev, run = joined, 1
  end
end
if prev then out[#out + 1] = prev; out[#out + 1] = run end
if #fill > 0 and bound > 0 then
  local ok = true
  if redis.call('EXISTS', cache) == 0 then
    -- a value longer than 64 bytes makes a new hash a hashtable at once: a small hash is a
    -- listpack, where each field of an HMGET is a linear scan (a 64-key lookup: 5x slower)
    fill[#fill + 1] = '~'
    fill[#fill + 1] = 'kvpool lookup hash: raw block key -> its holders on live nodes (docs/redis-schema.md)'
  end
  for j = 1, #fill, 1000 do
    local r = redis.pcall('HSET', cache, unpack(fill, j, math.min(j + 999, #fill)))
    if type(r) == 'table' and r.err then ok = false; break end
  end
  if ok then
    local t = redis.call('PTTL', cache)
    if t < 0 or t > bound then
      local r = redis.pcall('PEXPIRE', cache, bound)
      if type(r) == 'table' and r.err then ok = false end
    end
  end
  if ok then
    ttl = redis.call('PTTL', cache)
  else
    redis.pcall('DEL', cache)
  end
end
table.insert(out, 1, math.max(ttl, 0))
return out
"""


def runs(res: Sequence[Any]) -> list[list[str]]:
    """A run-length answer (the lookup script's, after its first number) as one holder
    list per key (lists of a run are one object: callers only read them)."""
    out: list[list[str]] = []
    for i in range(0, len(res) - 1, 2):
        joined = res[i].decode() if isinstance(res[i], bytes) else res[i]
        out += [joined.split(" ")] * int(res[i + 1])
    return out


def _holders(value: str) -> list[str]:
    """A cached value's holders: what the script keeps, ``node@tier`` (whatever else a
    writer without the pool secret put there is dropped, as the script drops it)."""
    return [h for h in value.split(" ") if "@" in h]


def cached_prefix(values: Sequence[str | None]) -> tuple[list[list[str]], int | None]:
    """What the lookup hash says about a chain (its ``HMGET`` reply): the holders of the
    leading keys it knows, and the index of the first key it does not know (None when it
    knows where the prefix ends). Lists of a run are one object, as in :func:`runs`."""
    if not values:
        return [], None
    first = values[0]
    if first and values.count(first) == len(values):  # one holder list for every key
        every = _holders(first)
        return ([every] * len(values) if every else []), None
    out: list[list[str]] = []
    prev: str | None = None
    held: list[str] = []
    for i, v in enumerate(values):
        if v is None:
            return out, i
        if v != prev:
            prev, held = v, _holders(v)
        if not held:
            return out, None
        out.append(held)
    return out, None


class WarmHints:
    """What this client knows of the chains (by last key) it looked up: those the lookup
    hash holds (until when the script said), and those looked up once within ``again_s``
    without filling the hash. Bounded: forgets everything at ``limit`` of either."""

    NEW, AGAIN, CACHED = "new", "again", "cached"

    def __init__(self, again_s: float, limit: int = 65536) -> None:
        self.again_s = again_s
        self.limit = limit
        self._until: dict[bytes, float] = {}
        self._seen: dict[bytes, float] = {}

    def state(self, last_key: bytes) -> str:
        """CACHED: read the hash first. AGAIN: run the script and fill the hash. NEW: run
        the script without filling it (most chains are looked up once; filling costs)."""
        now = time.monotonic()
        if now < self._until.get(last_key, 0.0):
            return self.CACHED
        seen = self._seen.get(last_key)
        return self.AGAIN if seen is not None and now - seen < self.again_s else self.NEW

    def seen(self, last_key: bytes) -> None:
        """Looked up without filling the hash."""
        if len(self._seen) >= self.limit:
            self._seen.clear()
        self._seen[last_key] = time.monotonic()

    def cached(self, last_key: bytes, ttl_s: float) -> None:
        """The hash holds this chain's lookup for ``ttl_s`` more (as the script said)."""
        if len(self._until) >= self.limit:
            self._until.clear()
        self._seen.pop(last_key, None)
        if ttl_s > 0:
            self._until[last_key] = time.monotonic() + ttl_s
        else:
            self._until.pop(last_key, None)

    def clear(self) -> None:
        self._until.clear()
        self._seen.clear()
