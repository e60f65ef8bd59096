"""Reads of node records and names bounded on the Redis server, before anything is sent.

Anyone who can write to Redis writes these. A length checked once a reply is here comes too
late: the reply (a field of up to 512 MB, a set of a million names) has already been sent,
taken into memory and, for JSON, parsed on the event loop. These scripts measure on the
server (``HSTRLEN``, ``SCARD``) and send nothing past the bounds. Each touches one key, so
they run on a cluster too, and they go as ``EVAL`` (a few hundred bytes of source a call;
Redis keeps the compiled script), so a server that lost its script cache needs no reload.
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


__all__ = ["JSON_FIELDS", "RECORD_FIELDS", "REFUSED", "SCALAR_FIELDS", "SIGNED_FIELDS", "names_command", "record_command",
           "record_fields"]
