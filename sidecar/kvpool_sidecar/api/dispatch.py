"""One local connection's requests, once framed: which are served, by which handler, and
their answers.

A request is refused before any handler when its connection was over ``max_connections``
(UNAVAILABLE, then closed), while the sidecar drains (UNAVAILABLE; RELEASE still served) and
before HELLO (BAD_REQUEST; past :data:`PRE_HELLO_REQUESTS` of them the connection closes).
The others are served from tables built once per connection: those that complete at once
answer inside ``data_received``; the others, and long COMMITs, PINs, UNPINs and REMOVEs
(run a slice at a time, later requests of the connection waiting for them), run as guarded
tasks, each step charged to the payer's turn, and answer when done.

The framing, flow control and lifetime are the connection's
(:class:`~kvpool_sidecar.api.connection.LocalConnection`), which passes itself to each request:
this object holds it only weakly (a cycle would keep a closed connection, and its buffer,
until a full collection), and a task running holds it through its arguments.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import weakref
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from kvpool_client.protocol import ErrorCode, Op
from kvpool_sidecar.api.admission import Admission, HelloRefused
from kvpool_sidecar.api.budget import IndexBudget
from kvpool_sidecar.api.limits import LocalLimits
from kvpool_sidecar.api.localclient import LocalClient
from kvpool_sidecar.api.reads import ReadRequests
from kvpool_sidecar.api.turns import TenantTurns
from kvpool_sidecar.api.unread import Unread
from kvpool_sidecar.api.writes import WriteRequests
from kvpool_sidecar.errors import RequestError, SidecarError
from kvpool_sidecar.peers import PeerReader
from kvpool_sidecar.ratelog import warn_once

if TYPE_CHECKING:
    from kvpool_sidecar.api.connection import LocalConnection

__all__ = ["PRE_HELLO_REQUESTS", "Requests"]

logger = logging.getLogger(__name__)

_CODES = {
    "bad_request": ErrorCode.BAD_REQUEST,
    "too_large": ErrorCode.TOO_LARGE,
    "unknown_lease": ErrorCode.UNKNOWN_LEASE,
    "quota": ErrorCode.QUOTA,
    "full": ErrorCode.FULL,
    "io": ErrorCode.IO,
    "corrupt": ErrorCode.CORRUPT,
    "unavailable": ErrorCode.UNAVAILABLE,
}

_OP_NAMES = {int(op): op.name.lower() for op in Op}

#: Requests a client may send before one of its HELLOs is admitted (each other request is
#: answered "say HELLO first", each HELLO that fails with why); with the last it is closed.
#: Strangers each pipelining 400 of them, 300 new ones a second, had kept a new engine's
#: HELLO waiting 1.2 s at the median in the turn they share (a review).
PRE_HELLO_REQUESTS = 8


class Requests:
    """One connection's requests: the handlers that serve them, the ones running, answers."""

    def __init__(self, conn: LocalConnection, client: LocalClient, limits: LocalLimits, admission: Admission, *,
                 peers: PeerReader | None, turns: TenantTurns, budget: IndexBudget,
                 unread: Unread[LocalConnection], inbound: Unread[LocalConnection]) -> None:
        #: Its connection, weakly: only for a task's end (see :meth:`_task_done`).
        self._conn = weakref.ref(conn)
        self.store = client.store
        self.limits = limits
        self.peers = peers
        self._turns = turns
        self.admission = admission
        #: Its requests running as tasks (``max_inflight`` at most: see the connection's flow).
        self.tasks: set[asyncio.Task[None]] = set()
        #: The sliced request running, which this connection's later requests wait for.
        self.ordered: asyncio.Task[None] | None = None
        #: Requests it sent before HELLO (:data:`PRE_HELLO_REQUESTS` at most).
        self.strays = 0
        #: The sidecar drains: new requests get UNAVAILABLE (see :meth:`drain`).
        self.draining = False
        reads = ReadRequests(client, peers=peers, unread=unread, inbound=inbound, budget=budget)
        writes = WriteRequests(client)
        #: The handlers of the requests answered at once and of those run as tasks (LOOKUP is
        #: either: at once without peers), bound here once: a request costs one lookup.
        self._sync: dict[int, Callable[..., Any]] = {
            Op.HELLO: admission.hello, Op.LOOKUP: reads.lookup, Op.COMMIT: writes.commit, Op.ABORT: writes.abort,
            Op.RELEASE: reads.release, Op.PIN: writes.pin, Op.UNPIN: writes.unpin, Op.STATS: reads.stats,
            Op.REMOVE: writes.remove,
        }
        self._async: dict[int, Callable[..., Awaitable[Any]]] = {
            Op.ALLOC: writes.alloc, Op.ACQUIRE: reads.acquire, Op.PUT_INLINE: writes.put_inline,
            Op.GET_INLINE: reads.get_inline, Op.LOOKUP: reads.lookup_pool, Op.ACQUIRE_DEVICE: reads.acquire_device,
        }
        #: ... and those of long COMMITs, PINs, UNPINs and REMOVEs, run as tasks a slice at a time.
        self._sliced = writes.sliced()
        self._long = writes.long

    def drain(self) -> list[asyncio.Task[None]]:
        """Take no new requests (they get UNAVAILABLE); the requests still running."""
        self.draining = True
        return list(self.tasks)

    def error(self, conn: LocalConnection, rid: int, code: ErrorCode, message: str) -> None:
        """Answer request ``rid`` of ``conn`` with an error."""
        conn._send([rid, int(code), [code.name.lower(), message]])

    def dispatch(self, conn: LocalConnection, body: list[Any], payer: str) -> None:
        """Serve one request of ``conn``, charging what it took of the loop to ``payer``'s turn
        (the steps of a request run as a task are charged as they run)."""
        turns = self._turns
        begun = turns.clock()
        outer, turns.payer = turns.payer, payer
        try:
            self._serve(conn, body, payer)
            if not conn._greeted and self.strays >= PRE_HELLO_REQUESTS and not conn._closed:
                warn_once(logger, "strays", "closing local clients that send %d requests, HELLOs that fail among "
                          "them, before a HELLO is answered", PRE_HELLO_REQUESTS)
                conn._inbound.drained(conn)  # (closed: nothing more of it is read or counted)
                conn._close()
        finally:
            turns.payer = outer
            turns.charge(payer, turns.clock() - begun)

    def _serve(self, conn: LocalConnection, body: list[Any], payer: str) -> None:
        op, rid, args = body[0], body[1], body[2:]
        if not isinstance(rid, int) or not isinstance(op, int):
            conn._fatal(0, "op and request id must be integers")
            return
        if conn._refused:
            admission = self.admission
            if op == Op.HELLO and admission.raw is not None and not admission.marker_sent:
                admission.marker_sent = True
                with contextlib.suppress(RequestError):
                    admission.send_marker()  # the client reads this byte before any answer to HELLO
            self.error(conn, rid, ErrorCode.UNAVAILABLE,
                       f"the sidecar has {self.limits.max_connections} local connections open, "
                       "its limit (api.max_connections)")
            conn._close()
            return
        if self.draining and op != Op.RELEASE:  # giving back what it holds is still welcome
            self.error(conn, rid, ErrorCode.UNAVAILABLE, "the sidecar is shutting down")
            return
        if not conn._greeted:
            self.strays += 1  # (HELLOs that fail too: see dispatch)
            if op != Op.HELLO:
                self.error(conn, rid, ErrorCode.BAD_REQUEST, "say HELLO first: nothing is served before the "
                                                             "client's tenant is established")
                return
        handler = self._sync.get(op) if op != Op.LOOKUP or self.peers is None else None
        sliced = self._sliced.get(op) if args and self._long(args[0]) else None
        started = time.perf_counter()
        try:
            if handler is not None and sliced is None:
                conn._send([rid, 0, handler(*args)])
                self.store.metrics.observe(_OP_NAMES.get(op, "unknown"), time.perf_counter() - started)
                return
            ahandler = sliced or self._async.get(op)
            if ahandler is None:
                raise RequestError(f"unknown operation {op}")
            coro = self._turns.charged(payer, ahandler(*args))  # each step charged as it runs
        except TypeError:
            self.error(conn, rid, ErrorCode.BAD_REQUEST, f"wrong arguments for operation {op}")
            return
        except SidecarError as e:
            self.error(conn, rid, _CODES.get(e.code, ErrorCode.INTERNAL), str(e))
            if isinstance(e, HelloRefused):  # one guess of a tenant's proof per connection
                conn._inbound.drained(conn)  # (closed: nothing more of it is read or counted)
                conn._close()
            return
        task = asyncio.get_running_loop().create_task(self._run(conn, rid, op, coro, started, payer))
        self.tasks.add(task)
        if sliced is not None:
            # answered at once when short, so in order with the requests after it: when
            # sliced, those wait for it (other connections' go on between its slices)
            self.ordered = task
        task.add_done_callback(self._task_done)
        conn._flow()

    async def _run(self, conn: LocalConnection, rid: int, op: int, coro: Awaitable[Any], started: float,
                   payer: str) -> None:
        """Task guard: every failure becomes an error answer, never a dead daemon. Its
        answer's encoding is charged to ``payer``'s turn, as its steps are (up to a frame of
        inline blocks)."""
        try:
            result = await coro
        except asyncio.CancelledError:
            raise
        except SidecarError as e:
            self.error(conn, rid, _CODES.get(e.code, ErrorCode.INTERNAL), str(e))
            return
        except TypeError:
            self.error(conn, rid, ErrorCode.BAD_REQUEST, f"wrong arguments for operation {op}")
            return
        except Exception:  # noqa: BLE001 - task guard: answer, log, keep serving
            logger.exception("internal error in local operation %s", op)
            self.error(conn, rid, ErrorCode.INTERNAL, "internal error; see the sidecar's log")
            return
        sending = self._turns.clock()
        conn._send([rid, 0, result])
        self._turns.charge(payer, self._turns.clock() - sending)
        self.store.metrics.observe(_OP_NAMES.get(op, "unknown"), time.perf_counter() - started)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self.tasks.discard(task)
        if task is self.ordered:
            self.ordered = None
        conn = self._conn()
        if conn is not None:  # (one gone was closed first: its flow is over)
            conn._flow()
