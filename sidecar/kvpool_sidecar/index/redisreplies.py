"""Replies bounded on the client: one read past its budget ends its connection.

A reply is read whole before redis-py hands it over, however long: a holders value of 300 MB
someone wrote to Redis would be taken into memory to be refused. The scripts of
:mod:`~kvpool_sidecar.index.redisbounds` measure on the server and never send past their
bounds, at a price: a 64-key lookup's ``HMGET`` in a script costs Redis 38 microseconds
against 16 bare (its arguments and its reply converted to Lua and back). :func:`bounded` lets
a command be sent bare instead: while it is read, the connection's parser
(:class:`BoundedHiredisParser`) counts the bytes it takes from the socket, and the first read
past the budget raises :class:`ReplyTooLongError`, which redis-py answers by closing the
connection (what the server had left to send is never read). The caller then asks again
through the script, which answers within its bounds whatever was planted.

Only hiredis's parser is bounded (:func:`use_bounded_replies`); without hiredis there is none, and
the index always reads through its scripts.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

__all__ = ["BoundedHiredisParser", "ReplyTooLongError", "bounded", "use_bounded_replies"]

#: The most bytes one reply read in this context may take from the socket; None: any.
_budget: ContextVar[int | None] = ContextVar("kvpool_reply_budget", default=None)


class ReplyTooLongError(RedisError):
    """A reply went past the budget of :func:`bounded`; its connection is closed. Not a
    connection error: redis-py does not retry it, and the caller chooses what comes next."""


class bounded:  # noqa: N801 (a context manager, named as one reads it: ``with bounded(n):``)
    """Each reply read in this block (by this task) takes at most about ``budget`` bytes from
    its socket: a read past it raises :class:`ReplyTooLongError`. What a parser held before
    the reply began, one socket read at most, is not counted."""

    __slots__ = ("_budget", "_token")

    def __init__(self, budget: int) -> None:
        self._budget = budget

    def __enter__(self) -> None:
        self._token = _budget.set(self._budget)

    def __exit__(self, *exc: object) -> None:
        _budget.reset(self._token)


BoundedHiredisParser: Any
try:
    from redis._parsers.hiredis import _AsyncHiredisParser
    from redis.utils import HIREDIS_AVAILABLE
except ImportError:  # a redis-py laid out otherwise: no bounded parser, the scripts read
    BoundedHiredisParser = None
else:
    class _Bounded(_AsyncHiredisParser):
        """hiredis's parser, counting the bytes one reply takes from the socket."""

        __slots__ = ("_taken",)

        def __init__(self, socket_read_size: int) -> None:
            super().__init__(socket_read_size)
            self._taken = 0

        async def read_response(self, *args: Any, **kwargs: Any) -> Any:
            self._taken = 0
            return await super().read_response(*args, **kwargs)

        async def read_from_socket(self) -> bool:
            budget = _budget.get()
            if budget is None:
                unbounded: Any = super().read_from_socket  # (redis-py's parsers are untyped)
                return bool(await unbounded())
            stream: Any = self._stream
            buffer = await stream.read(self._read_size)
            if not buffer or not isinstance(buffer, bytes):
                raise RedisConnectionError("Connection closed by server.")
            self._taken += len(buffer)
            if self._taken > budget:
                raise ReplyTooLongError(f"a reply past {budget} bytes")
            reader: Any = self._reader
            reader.feed(buffer)
            return True

    BoundedHiredisParser = _Bounded if HIREDIS_AVAILABLE else None


def use_bounded_replies(client: Redis) -> bool:
    """Make the connections ``client`` opens from now on honour :func:`bounded`; False (and
    no change) where there is no bounded parser. Call it before the client's first command."""
    if BoundedHiredisParser is None:
        return False
    client.connection_pool.connection_kwargs["parser_class"] = BoundedHiredisParser
    return True
