"""The pool's Redis index as the operator sees it: read the node registry, purge keys.

Key schema: docs/redis-schema.md (``kvp:<pool>:nodes``, ``kvp:<pool>:node:<N>``, ...).
The only module that imports ``redis``; its errors become :class:`IndexUnavailableError`
with a reason for the IndexReachable condition. Retries are an object passed in, as
redis-py recommends: a few quick ones on connection errors and timeouts only.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import redis
from redis.backoff import ExponentialBackoff
from redis.exceptions import RedisClusterException
from redis.retry import Retry

from kvpool_operator.errors import IndexUnavailableError

#: Errors worth a quick retry inside one reconcile (the timer retries the rest later).
RETRYABLE_ERRORS: tuple[type[Exception], ...] = (redis.ConnectionError, redis.TimeoutError)
#: Everything a Redis call may raise (RedisClusterException is no RedisError).
REDIS_ERRORS: tuple[type[Exception], ...] = (redis.RedisError, RedisClusterException)
Client = redis.Redis | redis.RedisCluster
_PURGE_BATCH = 500


def key_prefix(pool_id: str) -> str:
    return "kvp:{}:".format(pool_id)


@dataclass(frozen=True)
class IndexSnapshot:
    """What the index says about the pool's sidecars."""

    #: Live nodes (their ``kvp:P:node:N`` hash exists) and that hash's fields.
    live: dict[str, dict[str, str]] = field(default_factory=dict)
    #: Names in ``kvp:P:nodes`` (ever registered, live or not).
    registered: frozenset[str] = frozenset()


def _translate(error: Exception, url: str) -> IndexUnavailableError:
    where = _redact(url)
    if isinstance(error, redis.AuthenticationError) or "NOAUTH" in str(error) or "WRONGPASS" in str(error):
        return IndexUnavailableError("Redis at {} refused our credentials: {}".format(where, error),
                                     "AuthenticationFailed")
    if isinstance(error, (redis.ConnectionError, redis.TimeoutError)):
        return IndexUnavailableError("cannot reach Redis at {}: {}".format(where, error), "Unreachable")
    return IndexUnavailableError("Redis at {} failed: {}".format(where, error), "RedisError")


def _redact(url: str) -> str:
    """The URL without any userinfo (the CRD forbids it; be safe in messages anyway)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    authority, slash, path = rest.partition("/")
    return "{}://{}{}{}".format(scheme, authority.rpartition("@")[2], slash, path)


@contextmanager
def connect(url: str, password: str | None, *, timeout_s: float, cluster: bool = False) -> Iterator[Client]:
    """A client for one reconcile (a cluster client with ``cluster``), closed afterwards."""
    retry = Retry(ExponentialBackoff(cap=1.0, base=0.05), 2, supported_errors=RETRYABLE_ERRORS)
    client: Client
    try:
        if cluster:
            client = redis.RedisCluster.from_url(url, password=password, socket_connect_timeout=timeout_s,
                                                 socket_timeout=timeout_s, decode_responses=True, retry=retry)
        else:
            client = redis.Redis.from_url(url, password=password, socket_connect_timeout=timeout_s,
                                          socket_timeout=timeout_s, decode_responses=True, retry=retry)
    except ValueError as e:
        raise IndexUnavailableError("invalid Redis URL {}: {}".format(_redact(url), e), "InvalidURL") from e
    except REDIS_ERRORS as e:  # a cluster client reads the slot map on creation
        raise _translate(e, url) from e
    try:
        yield client
    finally:
        client.close()


def read_snapshot(client: Client, pool_id: str, url: str = "") -> IndexSnapshot:
    """Registered and live nodes with their heartbeat hashes, in two round trips."""
    prefix = key_prefix(pool_id)
    try:
        registered = sorted(str(n) for n in client.smembers(prefix + "nodes"))
        if isinstance(client, redis.RedisCluster):
            pipe = client.pipeline()  # type: ignore[no-untyped-call]
        else:
            pipe = client.pipeline(transaction=False)
        for node in registered:
            pipe.hgetall(prefix + "node:" + node)
        hashes = pipe.execute() if registered else []
    except REDIS_ERRORS as e:
        raise _translate(e, url) from e
    live = {node: {str(k): str(v) for k, v in h.items()} for node, h in zip(registered, hashes) if h}
    return IndexSnapshot(live=live, registered=frozenset(registered))


def ping(client: Client, url: str = "") -> None:
    try:
        client.ping()
    except REDIS_ERRORS as e:
        raise _translate(e, url) from e


def purge(client: Client, pool_id: str, url: str = "") -> int:
    """Delete every ``kvp:<pool>:*`` key (SCAN + UNLINK in batches); returns how many."""
    removed = 0
    batch: list[str] = []
    try:
        for key in client.scan_iter(match=key_prefix(pool_id) + "*", count=_PURGE_BATCH):
            batch.append(str(key))
            if len(batch) >= _PURGE_BATCH:
                removed += int(client.unlink(*batch))
                batch.clear()
        if batch:
            removed += int(client.unlink(*batch))
    except REDIS_ERRORS as e:
        raise _translate(e, url) from e
    return removed
