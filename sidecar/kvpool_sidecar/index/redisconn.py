"""Talking to Redis: the index's settings, a client with explicit timeouts, retries and
backoff, and every Redis failure turned into :class:`IndexUnavailableError`.

The client (:func:`connect`) retries connection errors and timeouts, backing off
exponentially; each socket operation has its own limits, and each round trip the index makes
a deadline of its own (``deadline_s``). The URL carries host, port, db, TLS and credentials,
and never appears in a message or a log (:func:`connect` names it with its credentials
replaced). Whatever fails underneath (a Redis error, a socket's, a deadline, a reply that is
not UTF-8, a reply redis-py cannot decode), the index's caller gets :class:`IndexUnavailableError`
(:func:`translated`); for a reply that is not UTF-8, :class:`~kvpool_sidecar.errors.IndexDataError`,
its subclass: the index answered, and is not taken for down.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisClusterException, RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from kvpool_sidecar.errors import ConfigError, IndexDataError, IndexUnavailableError

__all__ = ["REDIS_ERRORS", "REPLY_ERRORS", "Command", "RedisIndexSettings", "chunks", "connect", "translated"]

#: What a call to Redis may fail with, but a deadline.
REDIS_ERRORS = (RedisError, RedisClusterException, OSError)
#: What redis-py's own code raises on a reply of a shape Redis never gives (an integer where
#: it takes a map, at ``HELLO``; a list too short to unpack): counted as a Redis failure only
#: when raised there (:func:`_in_redis_py`), never when raised in the index's own code.
REPLY_ERRORS = (TypeError, ValueError, AttributeError, IndexError)
#: One Redis command: its name and arguments.
Command = tuple[Any, ...]


@dataclass(frozen=True)
class RedisIndexSettings:
    """How the index talks to Redis; the URL carries host, port, db, TLS and credentials."""

    #: Pool name: every key starts with ``kvp:<pool>:``.
    pool: str = "default"
    #: Use Redis Cluster (``RedisCluster``) instead of one server.
    cluster: bool = False
    #: Credentials given apart from the URL (credentials in the URL take precedence).
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    #: A file holding the password (a mounted Secret); read once, stripped.
    password_file: str | None = None
    #: CA bundle for ``rediss://`` URLs.
    ssl_ca_certs: str | None = None
    #: Per-socket-operation limits (a dead peer is noticed after this).
    socket_timeout_s: float = 1.0
    connect_timeout_s: float = 1.0
    #: Hard limit of one round trip, retries included: no call waits longer per trip.
    deadline_s: float = 3.0
    #: Retries on connection errors and timeouts, with exponential backoff.
    retries: int = 2
    backoff_base_s: float = 0.05
    backoff_cap_s: float = 0.5
    #: How long lookups trust their list of live nodes: a node whose record expired within
    #: this long may still be named (a fetch from it is a miss). 0: every lookup reads the
    #: records again (in the same round trip).
    live_cache_s: float = 1.0
    #: Commands per pipeline (and members per SADD/SREM of an inventory).
    batch: int = 2000
    #: How long a sweeper's claim on a dead node lasts; renewed before each pipeline of the
    #: sweep. While it lasts, the node (if it comes back) holds off re-publishing, so the
    #: sweep's removals do not race its re-publish (a sweep that outlives its claim marks
    #: the node swept, which makes it re-publish again).
    sweep_claim_s: float = 30.0
    max_connections: int = 64


def _redacted(url: str) -> str:
    """``url`` with any user name and password replaced, for messages."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return "<unparseable>"
    at = rest.rfind("@")
    return f"{scheme}://***@{rest[at + 1:]}" if at >= 0 else url


def chunks(items: Sequence[Any], n: int) -> Iterator[Sequence[Any]]:
    for i in range(0, len(items), n):
        yield items[i : i + n]


def _in_redis_py(e: BaseException) -> bool:
    """Whether ``e`` was raised in redis-py's code (decoding a reply), by the innermost frame
    of its traceback: not in the index's own code, whose mistakes stay what they are."""
    tb = e.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    module = tb.tb_frame.f_globals.get("__name__")
    return isinstance(module, str) and module.partition(".")[0] == "redis"


@contextmanager
def translated(what: str, *, answered: bool = False) -> Iterator[None]:
    """Turn a Redis or socket failure into :class:`IndexUnavailableError`; ``answered``: a
    reply that is not UTF-8 fails this call alone (:class:`IndexDataError`), where what it
    read is one block's (a holders value), not what every read needs (the node records). A
    reply redis-py fails to decode (:data:`REPLY_ERRORS` raised in its code) is a Redis
    failure too; the index checks the shape of the replies it reads itself
    (:mod:`~kvpool_sidecar.index.redisrecords`)."""
    try:
        yield
    except asyncio.TimeoutError as e:
        raise IndexUnavailableError(f"redis index: {what}: no answer within the deadline") from e
    except UnicodeDecodeError as e:  # a value written by someone without the pool's code
        error = IndexDataError if answered else IndexUnavailableError
        raise error(f"redis index: {what}: a reply is not UTF-8") from e
    except REDIS_ERRORS as e:
        raise IndexUnavailableError(f"redis index: {what}: {type(e).__name__}: {e}") from e
    except REPLY_ERRORS as e:
        if not _in_redis_py(e):
            raise
        raise IndexUnavailableError(f"redis index: {what}: a reply Redis does not give "
                                    f"({type(e).__name__}: {str(e)[:200]})") from e


def connect(url: str, s: RedisIndexSettings) -> Redis | RedisCluster:
    """A client with explicit timeouts, retries and backoff; never logs the URL."""
    scheme = urlsplit(url).scheme
    if scheme not in ("redis", "rediss"):
        raise ConfigError("index url: must start with redis:// or rediss://")
    password = s.password
    if s.password_file:
        try:
            password = Path(s.password_file).read_text(encoding="utf-8").strip()
        except OSError as e:
            raise ConfigError(f"index password_file {s.password_file}: {e.strerror}") from e
    retryable: list[type[Exception]] = [RedisConnectionError, RedisTimeoutError]
    kw: dict[str, Any] = {
        "decode_responses": True, "socket_timeout": s.socket_timeout_s,
        "socket_connect_timeout": s.connect_timeout_s, "max_connections": s.max_connections,
        "retry": Retry(ExponentialBackoff(cap=s.backoff_cap_s, base=s.backoff_base_s), s.retries,
                       (RedisConnectionError, RedisTimeoutError)),
        "retry_on_error": retryable,
    }
    if s.username:
        kw["username"] = s.username
    if password:
        kw["password"] = password
    if scheme == "rediss" and s.ssl_ca_certs:
        kw["ssl_ca_certs"] = s.ssl_ca_certs
    try:
        if s.cluster:
            return RedisCluster.from_url(url, **kw)
        return Redis.from_url(url, **kw)
    except (ValueError, RedisClusterException) as e:
        # the parser's message may quote part of the URL, password included: never echo it
        raise ConfigError(f"index url {_redacted(url)} is not a valid Redis URL ({type(e).__name__})") from e
