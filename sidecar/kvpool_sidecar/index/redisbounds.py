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

#: A node hash's fields as the index writes them (``RedisIndex.heartbeat``): the scalars,
#: then the JSON ones.
SCALAR_FIELDS = ("address", "heartbeat", "sig", "version", "hits", "misses")
JSON_FIELDS = ("tiers", "gpus")
RECORD_FIELDS = SCALAR_FIELDS + JSON_FIELDS

#: KEYS[1]: a node hash. ARGV: the bound of a scalar field, of a JSON field, then the field
#: names (JSON ones last, as many as ARGV[3] says). The fields' values, or 0 when the key is
#: not a hash or any field is past its bound.
_RECORD_LUA = """
if redis.call('TYPE', KEYS[1])['ok'] ~= 'hash' then return 0 end
local scalar, json, first_json = tonumber(ARGV[1]), tonumber(ARGV[2]), #ARGV - tonumber(ARGV[3]) + 1
for i = 4, #ARGV do
  local bound = scalar
  if i >= first_json then bound = json end
  if redis.call('HSTRLEN', KEYS[1], ARGV[i]) > bound then return 0 end
end
return redis.call('HMGET', KEYS[1], unpack(ARGV, 4))
"""

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


def record_command(key: str, scalar_bytes: int, json_bytes: int) -> tuple[Any, ...]:
    """The command that reads node hash ``key``'s :data:`RECORD_FIELDS` within their bounds."""
    return ("EVAL", _RECORD_LUA, 1, key, scalar_bytes, json_bytes, len(JSON_FIELDS), *RECORD_FIELDS)


def record_fields(reply: Any) -> dict[str, str] | None:
    """A :func:`record_command` reply as the fields present; None for a key that is not a
    node hash, a field past its bound, or no address."""
    if not isinstance(reply, list) or len(reply) != len(RECORD_FIELDS):
        return None
    fields = {f: v for f, v in zip(RECORD_FIELDS, reply) if isinstance(v, str)}
    return fields if fields.get("address") else None


def names_command(key: str, most: int, longest: int, live: Sequence[str]) -> tuple[Any, ...]:
    """The command that reads at most ``most`` names of set ``key`` (and those of ``live``
    still in it), none longer than ``longest``."""
    return ("EVAL", _NAMES_LUA, 1, key, most, longest, *live)


__all__ = ["JSON_FIELDS", "RECORD_FIELDS", "SCALAR_FIELDS", "names_command", "record_command", "record_fields"]
