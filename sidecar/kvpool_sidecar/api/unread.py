"""Answers written to local clients that do not read them: a bound across the node.

A client that stops reading its socket stops being read (backpressure), but the requests it
already has running still answer, and the transport buffers those answers: up to about
``(max_inflight + 1) * max_frame_bytes`` per connection, so many connections that never read
could make the sidecar hold far more than its tiers (hundreds of MiB each). :class:`Unread`
keeps, across the node's connections, what each connection's transport buffers while it says
it is full (its reader is behind: the count as of its last answer, until it drains). When
the total passes ``api.max_unread_bytes``, the connection holding the most is aborted, which
drops its buffer at once: it is the one furthest behind, a dead or hostile client more
likely than an engine between two reads.

The other direction is bounded by a second :class:`Unread`: the bytes of requests a
connection has received but not yet whole (a frame may be up to ``api.max_frame_bytes``, and
a client may leave it unfinished for ``api.frame_timeout_s``), counted after every read, with
the same limit and the same rule.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Generic, TypeVar

__all__ = ["Unread"]

C = TypeVar("C", bound=Hashable)


class Unread(Generic[C]):
    """Bytes buffered for connections whose readers are behind, per connection and in all."""

    __slots__ = ("limit", "total", "aborted", "_held")

    def __init__(self, limit: int) -> None:
        if limit <= 0:
            raise ValueError("the bound on unread answers must be positive")
        self.limit = limit
        self.total = 0
        #: Connections aborted for holding the most when the total passed the limit.
        self.aborted = 0
        self._held: dict[C, int] = {}

    def held(self, conn: C) -> int:
        """Bytes counted for ``conn``."""
        return self._held.get(conn, 0)

    def behind(self, conn: C, buffered: int) -> C | None:
        """``conn``'s reader is behind and its transport buffers ``buffered`` bytes; the
        connection to abort when that takes the total past the limit (it is no longer
        counted), else None."""
        self.total += buffered - self._held.get(conn, 0)
        self._held[conn] = buffered
        if self.total <= self.limit:
            return None
        worst = max(self._held, key=self._held.__getitem__)
        self.drained(worst)
        self.aborted += 1
        return worst

    def drained(self, conn: C) -> None:
        """``conn`` caught up with its answers, or closed: it holds nothing any more."""
        self.total -= self._held.pop(conn, 0)
