"""The Lua scripts of the index's node lifecycle, and their loading on a client.

A sweep claims a dead node with a token, renews the claim and gives it back only while it
still holds that token (:data:`RELEASE_LUA`, :data:`RENEW_LUA`), and ends by owing the node
a re-publish if its hash is back (:data:`SWEPT_LUA`); a re-publish takes a run's token in
the node hash when it begins (:data:`BEGIN_LUA`) and marks the hash as holding this life's
inventory when it ends, unless a sweep ended on it meanwhile (:data:`MARK_LUA`). Each reads
and writes one key, so each runs on a cluster too. :class:`NodeScripts` registers them on a
client.
"""

from __future__ import annotations

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.commands.core import AsyncScript

#: Delete a key only if it still holds this caller's token (one key: fine on a cluster).
RELEASE_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

#: Extend a key's TTL only if it still holds this caller's token.
RENEW_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""

#: A re-publish begins: the node hash, where it exists (a hash created here would have no
#: TTL), takes the run's token in ``republishing``; returns its ``swept`` count (nil: gone).
BEGIN_LUA = """
if redis.call('EXISTS', KEYS[1]) == 0 then return false end
redis.call('HSET', KEYS[1], 'republishing', ARGV[1])
return redis.call('HGET', KEYS[1], 'swept') or '0'
"""

#: Mark a node hash as holding this life's inventory: only if it is the hash the re-publish
#: began on (it still holds the run's token: a hash Redis lost meanwhile, which the next
#: heartbeat made again, holds none) and no sweep has ended on it since (its ``swept`` count
#: is the one read then). 1 marked, 0 swept meanwhile, -1 gone (or made again).
MARK_LUA = """
if redis.call('HGET', KEYS[1], 'republishing') ~= ARGV[3] then return -1 end
redis.call('HDEL', KEYS[1], 'republishing')
if (redis.call('HGET', KEYS[1], 'swept') or '0') ~= ARGV[2] then return 0 end
redis.call('HSET', KEYS[1], 'published', ARGV[1])
return 1
"""

#: A sweep's removals have ended: a node hash that is back owes a re-publish, and a
#: re-publish running now will not mark it.
SWEPT_LUA = """
if redis.call('EXISTS', KEYS[1]) == 1 then
  redis.call('HINCRBY', KEYS[1], 'swept', 1)
  redis.call('HDEL', KEYS[1], 'published')
  return 1
end
return 0
"""


class NodeScripts:
    """The scripts above, registered on one client: each is called as
    ``script(keys=[...], args=[...])``."""

    def __init__(self, r: Redis | RedisCluster) -> None:
        self.release: AsyncScript = r.register_script(RELEASE_LUA)
        self.renew: AsyncScript = r.register_script(RENEW_LUA)
        self.begin: AsyncScript = r.register_script(BEGIN_LUA)
        self.mark: AsyncScript = r.register_script(MARK_LUA)
        self.swept: AsyncScript = r.register_script(SWEPT_LUA)
