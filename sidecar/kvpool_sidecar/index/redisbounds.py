"""Reads bounded on the Redis server, before anything is sent: node records and names,
holders values and block sets, inventory pages.

Anyone who can write to Redis writes these. A length checked once a reply is here comes too
late: the reply (a field of up to 512 MB, a set of a million names) has already been sent,
taken into memory and, for JSON, parsed on the event loop. These scripts measure on the
server (``HSTRLEN``, ``SCARD``, a member's length) and send nothing past the bounds. Each
touches one key, so they run on a cluster too, and they go as ``EVAL`` (a few hundred bytes
of source a call; Redis keeps the compiled script), so a server that lost its script cache
needs no reload.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

#: A node hash's fields as the index writes them (``RedisIndex.heartbeat``): those its
#: signature covers, the other scalars, then the JSON ones. A reader that checks signatures
#: reads the signed ones first, and the rest of a record only once it believes it.
SIGNED_FIELDS = ("address", "heartbeat", "sig")
SCALAR_FIELDS = SIGNED_FIELDS + ("version", "hits", "misses")
JSON_FIELDS = ("tiers", "gpus")
RECORD_FIELDS = SCALAR_FIELDS + JSON_FIELDS

#: KEYS[1]: a node hash. ARGV: the bound of a scalar field, of a JSON field, then the field
#: names (JSON ones last, as many as ARGV[3] says). The fields' values; 0 when there is no
#: such key (a node gone), -1 when it is not a hash or a field is past its bound.
_RECORD_LUA = """
local t = redis.call('TYPE', KEYS[1])['ok']
if t == 'none' then return 0 end
if t ~= 'hash' then return -1 end
local scalar, json, first_json = tonumber(ARGV[1]), tonumber(ARGV[2]), #ARGV - tonumber(ARGV[3]) + 1
for i = 4, #ARGV do
  local bound = scalar
  if i >= first_json then bound = json end
  if redis.call('HSTRLEN', KEYS[1], ARGV[i]) > bound then return -1 end
end
return redis.call('HMGET', KEYS[1], unpack(ARGV, 4))
"""

#: :func:`record_command`'s answer for a key that is not a node hash, or a field past its bound.
REFUSED = -1

#: KEYS[1]: the nodes set. ARGV: the most names to send, the longest name, then names to
#: send whatever the sample (the nodes live at the last look) when they are members. The
#: whole set when it is no larger, else a random sample of it, without names past the
#: longest; then the members among those given. Not a set: nothing.
_NAMES_LUA = """
if redis.call('TYPE', KEYS[1])['ok'] ~= 'set' then return {} end
local most, longest = tonumber(ARGV[1]), tonumber(ARGV[2])
local names
if redis.call('SCARD', KEYS[1]) <= most then
  names = redis.call('SMEMBERS', KEYS[1])
else
  names = redis.call('SRANDMEMBER', KEYS[1], most)
end
local out = {}
for _, x in ipairs(names) do
  if #x <= longest then out[#out + 1] = x end
end
for i = 3, #ARGV do
  if redis.call('SISMEMBER', KEYS[1], ARGV[i]) == 1 then out[#out + 1] = ARGV[i] end
end
return out
"""


#: KEYS[1]: the holders hash (one server). ARGV: the longest value to send, the width of a
#: field, then the fields joined (a width of 0: the fields each an argument of its own, for
#: fields of unequal lengths). Each field's value, or nil for a field missing or past the bound
#: (which the reader takes as no holders: that key alone misses); or one value where every
#: field has that value (a chain's keys mostly share their holders). Each field's length is
#: measured (``HSTRLEN``) before one ``HMGET`` reads those within the bound: a value past it
#: is neither sent nor copied into the script (an ``HMGET`` of a planted 300 MB value had
#: held the server 0.8 s a lookup). A lookup reads the hash bare (``index/redislookup.py``), its
#: reply bounded on the client, and through this script only where that reply went past its
#: budget, or with other commands in one pipeline: the script costs Redis about twice the
#: bare ``HMGET``'s time (64 fields: 60 against 16 microseconds).
_HELD_LUA = """
local longest, width, fields = tonumber(ARGV[1]), tonumber(ARGV[2]), {}
if width > 0 then
  local all = ARGV[3]
  for i = 1, #all, width do fields[#fields + 1] = string.sub(all, i, i + width - 1) end
else
  fields = {unpack(ARGV, 3)}
end
local vals, ok, at = {}, {}, {}
for i = 1, #fields do
  vals[i] = false
  if redis.call('HSTRLEN', KEYS[1], fields[i]) <= longest then
    ok[#ok + 1] = fields[i]
    at[#at + 1] = i
  end
end
if #ok > 0 then
  local got = redis.call('HMGET', KEYS[1], unpack(ok))
  for j = 1, #ok do vals[at[j]] = got[j] end
end
local first, same = vals[1], true
for i = 2, #vals do
  if vals[i] ~= first then
    same = false
    break
  end
end
if same and first then return first end
return vals
"""

#: (as bytes: packed as they are, each call)
_HELD_SOURCE = _HELD_LUA.encode()

#: Fields one :func:`held_command` asks at most (Lua's ``unpack`` takes about 8,000 values).
MAX_HELD_FIELDS = 4096

#: KEYS[1]: a block set (a cluster). ARGV: the most members, the most bytes (the members
#: joined by spaces, as in a holders value). Its members; nil when it has more, or they are
#: longer, or the key is not a set.
_SET_LUA = """
local n = redis.pcall('SCARD', KEYS[1])
if type(n) ~= 'number' or n > tonumber(ARGV[1]) then return false end
local members = redis.call('SMEMBERS', KEYS[1])
local size, most = -1, tonumber(ARGV[2])
for _, m in ipairs(members) do
  size = size + #m + 1
  if size > most then return false end
end
return members
"""

#: KEYS[1]: an inventory. ARGV: the cursor, the page size (``SSCAN``'s ``COUNT``), the width
#: of an entry (a raw block key's hex digits). The next cursor and the page's members that are
#: exactly that many lowercase hex digits: anything else (a member of hundreds of megabytes)
#: never leaves the server.
_PAGE_LUA = """
local page = redis.call('SSCAN', KEYS[1], ARGV[1], 'COUNT', ARGV[2])
local width, out = tonumber(ARGV[3]), {}
for _, m in ipairs(page[2]) do
  if #m == width and not string.find(m, '[^0-9a-f]') then out[#out + 1] = m end
end
return {page[1], out}
"""


def held_command(key: str, longest: int, fields: Sequence[bytes]) -> tuple[Any, ...]:
    """The command that reads ``fields`` (at most :data:`MAX_HELD_FIELDS`) of holders hash
    ``key``: each value, or nil past ``longest`` bytes; or one value, every field's
    (:func:`~kvpool_sidecar.index.redisrecords.held_reply` reads either)."""
    widths = set(map(len, fields))
    if len(widths) == 1 and 0 not in widths:
        return ("EVAL", _HELD_SOURCE, 1, key, longest, widths.pop(), b"".join(fields))
    return ("EVAL", _HELD_SOURCE, 1, key, longest, 0, *fields)


def set_command(key: str, most: int, longest: int) -> tuple[Any, ...]:
    """The command that reads block set ``key``: its members, or nil past ``most`` of them or
    ``longest`` bytes."""
    return ("EVAL", _SET_LUA, 1, key, most, longest)


def page_command(key: str, cursor: str, count: int, width: int) -> tuple[Any, ...]:
    """The command that reads one page of inventory ``key`` from ``cursor``: the next cursor
    and the members of ``width`` lowercase hex digits."""
    return ("EVAL", _PAGE_LUA, 1, key, cursor, count, width)


def record_command(key: str, scalar_bytes: int, json_bytes: int,
                   fields: Sequence[str] = RECORD_FIELDS) -> tuple[Any, ...]:
    """The command that reads ``fields`` of node hash ``key`` (scalars first, then those of
    :data:`JSON_FIELDS`) within their bounds."""
    return ("EVAL", _RECORD_LUA, 1, key, scalar_bytes, json_bytes, sum(f in JSON_FIELDS for f in fields), *fields)


def record_fields(reply: Any, fields: Sequence[str] = RECORD_FIELDS) -> dict[str, str] | None:
    """A :func:`record_command` reply for ``fields`` as those present; None for a node gone,
    a key that is not a node hash, or a field past its bound."""
    if not isinstance(reply, list) or len(reply) != len(fields):
        return None
    return {f: v for f, v in zip(fields, reply) if isinstance(v, str)}


def names_command(key: str, most: int, longest: int, live: Sequence[str]) -> tuple[Any, ...]:
    """The command that reads at most ``most`` names of set ``key`` (and those of ``live``
    still in it), none longer than ``longest``."""
    return ("EVAL", _NAMES_LUA, 1, key, most, longest, *live)


__all__ = ["JSON_FIELDS", "MAX_HELD_FIELDS", "RECORD_FIELDS", "REFUSED", "SCALAR_FIELDS", "SIGNED_FIELDS",
           "held_command", "names_command", "page_command", "record_command", "record_fields", "set_command"]
