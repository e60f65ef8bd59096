"""The pool's Redis index as the operator sees it: read the node registry, purge keys.

Key schema: docs/redis-schema.md (``kvp:<pool>:nodes``, ``kvp:<pool>:node:<N>``, ...).
The only module that imports ``redis``; its errors become :class:`IndexUnavailableError`
with a reason for the IndexReachable condition. Retries are an object passed in, as
redis-py recommends: a few quick ones on connection errors and timeouts only.
"""

from __future__ import annotations

import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import redis
from redis.backoff import ExponentialBackoff
from redis.exceptions import InvalidResponse, RedisClusterException
from redis.retry import Retry

from kvpool_operator.errors import IndexUnavailableError

#: Errors worth a quick retry inside one reconcile (the timer retries the rest later).
RETRYABLE_ERRORS: tuple[type[Exception], ...] = (redis.ConnectionError, redis.TimeoutError)
#: Everything a Redis call may raise (RedisClusterException is no RedisError).
REDIS_ERRORS: tuple[type[Exception], ...] = (redis.RedisError, RedisClusterException)
Client = redis.Redis | redis.RedisCluster
_PURGE_BATCH = 500
#: A pool's node registry past this many names is not read (as the sidecars' own bound): a
#: Redis the pool's owner points the operator at may hold anything.
MAX_NODES = 4096
#: Node names the operator reads (as the sidecars name themselves).
_NODE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,252}")
#: The whole of one reconcile's talk with Redis may take this many times the per-call
#: timeout: a server that answers a byte at a time never trips a per-read timeout, and
#: would hold one of the operator's few worker threads (every pool's reconciles) for ever.
DEADLINE_TIMEOUTS = 4
#: Bytes read from Redis at most between two commands sent on a connection (one reply, or a
#: pipeline's: 64 nodes' heartbeats take 1 MiB with 64 GPUs each; 4,096 node names at most 1 MiB): a Redis the pool's owner points
#: the operator at, or a writer to the pool's own, could send replies of any size, and the
#: operator (every pool's) would grow until killed, at every restart again. A purge's SCAN
#: replies are small, and as many as it takes.
MAX_REPLY_BYTES = 4 << 20
#: Heartbeat hashes read in one pipeline (about 2.6 KiB each with 8 GPUs, 16 KiB with 64).
_HEARTBEATS_AT_ONCE = 64
#: Bytes of heartbeats one reconcile keeps at most (4,096 nodes of 32 GPUs each): what the
#: per-command cap allows adds up over a pool's pipelines (4,096 planted 62 KiB heartbeats
#: took the operator to 521 MiB, its limit 256 Mi).
MAX_SNAPSHOT_BYTES = 48 << 20
#: What a heartbeat field counts for beside its bytes (the objects it becomes: 1.3 million
#: small fields, 26 MB of them, took the operator 415 MiB).
_FIELD_WEIGHT = 256
_TOO_LARGE = "answered with more than"
#: What redis-py raises on replies from a server that does not speak Redis as it expects
#: (a ``+OK`` to HELLO fails with AttributeError): the pool's Redis is not trusted.
CLIENT_FAULTS: tuple[type[Exception], ...] = (AttributeError, TypeError, ValueError, KeyError, IndexError)
T = TypeVar("T")


class _Budget:
    """One reconcile's deadline, shared by every socket of its client, and the bytes a
    socket may read for one command's (or pipeline's) replies."""

    def __init__(self, seconds: float, most_bytes: int) -> None:
        self.deadline = time.monotonic() + seconds
        self.most_bytes = most_bytes


class _CappedSocket:
    """A client socket whose reads end at the reconcile's deadline, and past
    :attr:`_Budget.most_bytes` read since it last sent (both OSError, which redis-py turns
    into its connection and timeout errors); the rest is the socket's."""

    def __init__(self, sock: Any, budget: _Budget) -> None:
        self._sock = sock
        self._budget = budget
        self._left = budget.most_bytes
        self._timeout: float | None = sock.gettimeout()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)

    def sendall(self, data: Any, *args: Any) -> None:
        self._left = self._budget.most_bytes  # a command (or a pipeline's): its replies start
        self._sock.sendall(data, *args)

    def _took(self, n: int) -> None:
        self._left -= n
        if self._left < 0:
            raise OSError("Redis {} {} bytes to one command".format(_TOO_LARGE, self._budget.most_bytes))

    def settimeout(self, value: float | None) -> None:
        self._timeout = value
        self._sock.settimeout(value)

    def gettimeout(self) -> float | None:
        return self._timeout

    def _wait(self) -> None:
        left = self._budget.deadline - time.monotonic()
        if left <= 0:
            raise socket.timeout("the reconcile's deadline for Redis passed")
        if self._timeout is None or self._timeout > left:
            self._sock.settimeout(left)
        elif self._sock.gettimeout() != self._timeout:
            self._sock.settimeout(self._timeout)

    def recv(self, n: int, *args: Any) -> bytes:
        self._wait()
        data: bytes = self._sock.recv(n, *args)
        self._took(len(data))
        return data

    def recv_into(self, buffer: Any, n: int = 0, *args: Any) -> int:
        self._wait()
        got: int = self._sock.recv_into(buffer, n, *args)
        self._took(got)
        return got


#: Slots of a Redis Cluster: a CLUSTER SLOTS answer names ranges of 0 to this, less one.
CLUSTER_SLOTS = 16384


def _asks_slots(args: tuple[Any, ...]) -> bool:
    """Whether a command's arguments are CLUSTER SLOTS (redis-py sends it as one string).
    Latin-1: a key need not be UTF-8 (a purge's UNLINK names keys a writer chose)."""
    words = [w.upper() for a in args[:2] for w in (a.decode("latin-1") if isinstance(a, bytes) else str(a)).split()]
    return words[:2] == ["CLUSTER", "SLOTS"]


def check_slot_map(reply: object) -> None:
    """Refuse a CLUSTER SLOTS answer that no Redis Cluster sends, before redis-py reads it:
    redis-py makes a dict entry for every slot of every range, and one range ``[0, 10**8]``
    (60 bytes, from a server the pool's owner chose) had taken the operator past its
    memory limit, at every restart again. Ranges must lie in ``0 .. 16383`` and cover at
    most 16,384 slots together."""
    if not isinstance(reply, list) or len(reply) > CLUSTER_SLOTS:
        raise InvalidResponse("the CLUSTER SLOTS answer is not a list of at most 16384 ranges")
    covered = 0
    for entry in reply:
        if not isinstance(entry, list) or len(entry) < 3 or not all(isinstance(x, int) for x in entry[:2]) \
                or not 0 <= entry[0] <= entry[1] < CLUSTER_SLOTS:
            raise InvalidResponse("the CLUSTER SLOTS answer holds a range outside slots 0-16383")
        covered += entry[1] - entry[0] + 1
    if covered > CLUSTER_SLOTS:
        raise InvalidResponse("the CLUSTER SLOTS answer covers more than 16384 slots")


def _capped(base: type[Any], budget: _Budget) -> type[Any]:
    """``base`` (redis-py's connection class for the URL's scheme) with its sockets capped,
    and its CLUSTER SLOTS answers checked (:func:`check_slot_map`)."""

    class Capped(base):  # type: ignore[misc]
        _slots_asked = False

        def _connect(self) -> Any:
            return _CappedSocket(super()._connect(), budget)

        def send_command(self, *args: Any, **kwargs: Any) -> None:
            self._slots_asked = False
            super().send_command(*args, **kwargs)
            self._slots_asked = _asks_slots(args)  # (after: a reconnect's handshake reads its own)

        def send_packed_command(self, *args: Any, **kwargs: Any) -> None:
            self._slots_asked = False  # (a pipeline's, or a handshake's)
            super().send_packed_command(*args, **kwargs)

        def read_response(self, *args: Any, **kwargs: Any) -> Any:
            asked, self._slots_asked = self._slots_asked, False
            reply = super().read_response(*args, **kwargs)
            if asked:
                check_slot_map(reply)
            return reply

    return Capped


def _connection_class(url: str) -> type[Any]:
    scheme = url.partition("://")[0].lower()
    if scheme == "rediss":
        return redis.SSLConnection
    if scheme == "unix":
        return redis.UnixDomainSocketConnection
    return redis.Connection


class _Stoppable(Retry):
    """redis-py's retries, until :meth:`stop`: a client cut at its deadline must not
    reconnect and start again."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.stopped = False

    def stop(self) -> None:
        self.stopped = True

    def __deepcopy__(self, memo: dict[int, Any]) -> _Stoppable:
        return self  # (each connection deep-copies its retry: they must all see stop())

    def call_with_retry(self, do: Callable[[], T], fail: Callable[..., Any], *args: Any, **kwargs: Any) -> T:
        def attempt() -> T:  # every attempt, the first included, checks the deadline
            if self.stopped:
                raise redis.TimeoutError("the reconcile's deadline for Redis passed")
            return do()
        return super().call_with_retry(attempt, fail, *args, **kwargs)


def _cut(client: Client, retry: _Stoppable) -> None:
    """At the deadline: no more retries, and every socket of the client shut, so that a read
    waiting on one fails at once. The sockets are reached past redis-py's pool lock (its
    ``disconnect`` waits on that lock, which a connection still in its handshake holds)."""
    retry.stop()
    pools = [client.connection_pool] if isinstance(client, redis.Redis) else [
        n.redis_connection.connection_pool for n in client.get_nodes()  # type: ignore[no-untyped-call]
        if n.redis_connection is not None]
    for pool in pools:
        conns = list(getattr(pool, "_in_use_connections", ())) + list(getattr(pool, "_available_connections", ()))
        for conn in conns:
            sock = getattr(conn, "_sock", None)
            if sock is not None:
                try:
                    # a shut socket still takes what the server keeps sending (Linux reads a
                    # dripping peer's bytes after SHUT_RD): the next read that has to wait fails
                    sock.settimeout(0.001)
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


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
    if _TOO_LARGE in str(error):
        return IndexUnavailableError("Redis at {} sent more than the operator reads: {}".format(where, error),
                                     "ReplyTooLarge")
    if isinstance(error, (redis.ConnectionError, redis.TimeoutError)):
        return IndexUnavailableError("cannot reach Redis at {}: {}".format(where, error), "Unreachable")
    return IndexUnavailableError("Redis at {} failed: {}".format(where, error), "RedisError")


def _not_redis(error: Exception, url: str) -> IndexUnavailableError:
    return IndexUnavailableError("the server at {} does not answer as Redis does: {!r}".format(_redact(url), error),
                                 "RedisError")


def redact(url: str) -> str:
    """The URL without any userinfo (the CRD forbids it; be safe in messages anyway)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    authority, slash, path = rest.partition("/")
    return "{}://{}{}{}".format(scheme, authority.rpartition("@")[2], slash, path)


_redact = redact


@contextmanager
def connect(url: str, password: str | None, *, timeout_s: float, cluster: bool = False) -> Iterator[Client]:
    """A client for one reconcile (a cluster client with ``cluster``), closed afterwards."""
    retry = _Stoppable(ExponentialBackoff(cap=1.0, base=0.05), 2, supported_errors=RETRYABLE_ERRORS)
    # the deadline and the bytes hold from here: a cluster client reads its slot map as it is made
    capped = _capped(_connection_class(url), _Budget(DEADLINE_TIMEOUTS * timeout_s, MAX_REPLY_BYTES))
    client: Client
    try:
        if cluster:
            client = redis.RedisCluster.from_url(url, password=password, socket_connect_timeout=timeout_s,
                                                 socket_timeout=timeout_s, retry=retry, connection_class=capped)
        else:
            client = redis.Redis.from_url(url, password=password, socket_connect_timeout=timeout_s,
                                          socket_timeout=timeout_s, retry=retry, connection_class=capped)
    except REDIS_ERRORS as e:  # a cluster client reads the slot map on creation
        raise _translate(e, url) from e
    except CLIENT_FAULTS as e:  # an invalid URL, or a slot map that is no Redis's
        raise IndexUnavailableError("invalid Redis URL {}, or no Redis there: {}".format(_redact(url), e),
                                    "InvalidURL") from e
    watchdog = threading.Timer(DEADLINE_TIMEOUTS * timeout_s, _cut, (client, retry))
    watchdog.daemon = True
    watchdog.start()
    try:
        yield client
    finally:
        watchdog.cancel()
        client.close()


def _text(value: object) -> str:
    """A reply as text. Replies are read as bytes (the client decodes nothing): whoever can
    write to Redis can write bytes that are not UTF-8, and a decoding client raised on them,
    past the handlers' Redis errors: the pool's status stopped and its deletion never ended."""
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)


def read_snapshot(client: Client, pool_id: str, url: str = "") -> IndexSnapshot:
    """Registered and live nodes with their heartbeat hashes, in two round trips."""
    prefix = key_prefix(pool_id)
    try:
        count = int(client.scard(prefix + "nodes"))
        if count > MAX_NODES:
            raise IndexUnavailableError("the node registry in Redis at {} holds {} names, more than the {} a pool "
                                        "may have; not read".format(_redact(url), count, MAX_NODES), "TooManyNodes")
        members = client.smembers(prefix + "nodes")
        if len(members) > MAX_NODES:  # (SCARD's count is the server's word)
            raise IndexUnavailableError("the node registry in Redis at {} holds more than the {} names a pool may "
                                        "have; not read".format(_redact(url), MAX_NODES), "TooManyNodes")
        registered = sorted(n for n in map(_text, members) if _NODE_NAME.fullmatch(n))
        live = _heartbeats(client, registered, prefix, url)
    except REDIS_ERRORS as e:
        raise _translate(e, url) from e
    except CLIENT_FAULTS as e:
        raise _not_redis(e, url) from e
    return IndexSnapshot(live=live, registered=frozenset(registered))


def _heartbeats(client: Client, nodes: list[str], prefix: str, url: str) -> dict[str, dict[str, str]]:
    """The heartbeat hashes of ``nodes`` that exist, as text, a pipeline of
    :data:`_HEARTBEATS_AT_ONCE` at a time (one at a time on a cluster, whose pipelines send a
    command again on its own, under a cap of its own, when the pipeline's read fails), and no
    more than :data:`MAX_SNAPSHOT_BYTES` of them in all, each field counted with
    :data:`_FIELD_WEIGHT` for the objects it becomes: IndexUnavailableError past it."""
    at_once = 1 if isinstance(client, redis.RedisCluster) else _HEARTBEATS_AT_ONCE
    live: dict[str, dict[str, str]] = {}
    kept = 0
    for at in range(0, len(nodes), at_once):
        pipe = _pipeline(client)
        batch = nodes[at : at + at_once]
        for node in batch:
            pipe.hgetall(prefix + "node:" + node)
        for node, h in zip(batch, pipe.execute()):
            if not isinstance(h, dict) or not h:
                continue
            kept += sum(len(k) + len(v) + _FIELD_WEIGHT for k, v in h.items())
            if kept > MAX_SNAPSHOT_BYTES:
                raise IndexUnavailableError("the heartbeats in Redis at {} take more than the {} bytes the "
                                            "operator reads of a pool".format(_redact(url), MAX_SNAPSHOT_BYTES),
                                            "ReplyTooLarge")
            live[node] = {_text(k): _text(v) for k, v in h.items()}
    return live


def _pipeline(client: Client) -> Any:
    if isinstance(client, redis.RedisCluster):
        return client.pipeline()  # type: ignore[no-untyped-call]
    return client.pipeline(transaction=False)


def ping(client: Client, url: str = "") -> None:
    try:
        client.ping()
    except REDIS_ERRORS as e:
        raise _translate(e, url) from e
    except CLIENT_FAULTS as e:
        raise _not_redis(e, url) from e


def purge(client: Client, pool_id: str, url: str = "") -> int:
    """Delete every ``kvp:<pool>:*`` key (SCAN + UNLINK in batches); returns how many."""
    removed = 0
    batch: list[bytes] = []
    try:
        for key in client.scan_iter(match=key_prefix(pool_id) + "*", count=_PURGE_BATCH):
            batch.append(key)  # as bytes: a key that is not UTF-8 goes too
            if len(batch) >= _PURGE_BATCH:
                removed += int(client.unlink(*batch))
                batch.clear()
        if batch:
            removed += int(client.unlink(*batch))
    except REDIS_ERRORS as e:
        raise _translate(e, url) from e
    except CLIENT_FAULTS as e:
        raise _not_redis(e, url) from e
    return removed
