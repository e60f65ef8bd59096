"""The asyncio client of the node's sidecar (:class:`AsyncPoolClient`): many tasks may
share one connection, their requests multiplexed by id; the answer of a call whose caller
gave up (a timeout, a cancellation) gives back the leases it holds. No request names more
keys than the sidecar's ``max_batch`` (said at HELLO; it refuses a longer request whole): a
call of more goes in as many requests as it takes, one after the other, within one timeout
(a put's COMMITs, and a reservation's, each within its own), and a lookup chunk after chunk
while each is held whole.

The client keeps only what the answers still to come need: the requests sent and not yet
answered (their operation: a late answer's leases go back) and the futures of the calls
still waiting. An answer to a request never sent, or answered already, is a sidecar that
lost its place in the stream (or floods it): the connection is dropped, as it is when more
than :data:`MOST_ABANDONED` requests whose callers gave up stay unanswered."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import os
import socket
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvpool_client.answers import (LEASING, Check, Lookup, acquired_items, allocated_items, answer_limit,
                                   check_greeting, check_length, count_of, decode_answer, lookup_result, marker_fd,
                                   max_batch, put_results, result_of, stats_of, take_fds, undo_of)
from kvpool_client.arena import ArenaCore, HeldBlocks, inline_results, inline_step
from kvpool_client.blockinfo import EngineBlock, PutHints
from kvpool_client.calls import (DEFAULT_SOCKET, KeyLike, Payload, PutPlan, abort_allocated, alloc_plan, batches,
                                 destinations, put_plan, raw_keys, request_pieces, tenant_token)
from kvpool_client.errors import ConnectionLostError, KVPoolError, ProtocolError
from kvpool_client.protocol import HEADER, PROTOCOL_VERSION, Op, PutStatus, encode
from kvpool_client.reservation import AsyncReservation, put_statuses
from kvpool_client.unixconnect import connect_unix

if TYPE_CHECKING:
    import torch

#: Requests whose callers gave up (a timeout, a cancellation) or never waited (a RELEASE, an
#: ABORT) that may stay unanswered at once: past it the sidecar is taken for lost (it answers
#: every request it reads; a connection closed gives back every lease it held). Each such
#: request had kept its future until its answer came, forever where none came (500 calls
#: timed out against a sidecar that stopped answering: 500 futures kept).
MOST_ABANDONED = 1 << 16


class AsyncPoolClient(ArenaCore):
    """An asyncio client; many tasks may share it (requests are multiplexed by id)."""

    def __init__(self, verify: bool = True, timeout: float = 10.0, prefault: bool = True) -> None:
        super().__init__(verify, prefault)
        self.timeout = timeout
        self._ids = itertools.count(1)
        #: Every request sent whose answer has not come, by id: its operation.
        self._sent: dict[int, Op] = {}
        #: The calls waiting for their answers (a subset of :attr:`_sent`).
        self._waiting: dict[int, asyncio.Future[Any]] = {}
        #: Why the connection is gone, once it is.
        self._lost: KVPoolError | None = None
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._pump: asyncio.Task[None] | None = None

    @classmethod
    async def connect(cls, socket_path: str | None = None, *, host: str | None = None, port: int | None = None,
                      tenant: str = "default", token: str | bytes | None = None, timeout: float = 10.0,
                      verify: bool = True, prefault: bool = True) -> AsyncPoolClient:
        self = cls(verify, timeout, prefault)
        loop = asyncio.get_running_loop()
        # one deadline for the whole handshake: each of its steps had waited a timeout of its
        # own (a sidecar slow at each took several times the timeout)
        deadline = loop.time() + timeout

        def left() -> float:
            return max(0.0, deadline - loop.time())

        fd: int | None = None
        sock: socket.socket | None = None
        token_sent = tenant_token(token)
        info: Any = None
        try:
            try:
                if host is not None or port is not None:
                    self._reader, self._writer = await asyncio.wait_for(
                        asyncio.open_connection(host or "127.0.0.1", port), left())
                else:
                    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                    # (blocking, in a thread: the kernel waits for room in a full listen queue,
                    # where the loop's non-blocking connect failed at once; unixconnect.py)
                    await asyncio.to_thread(connect_unix, sock, socket_path or DEFAULT_SOCKET, left())
                    sock.setblocking(False)
                    check_greeting(*await asyncio.wait_for(_recv_fds(loop, sock), left()))
                    # HELLO on the raw socket: the descriptor comes with the byte before its answer
                    hello = [int(Op.HELLO), next(self._ids), PROTOCOL_VERSION, tenant, token_sent]
                    await asyncio.wait_for(loop.sock_sendall(sock, encode(hello)), left())
                    fd = marker_fd(*await asyncio.wait_for(_recv_fds(loop, sock), left()))
                    info_body = await asyncio.wait_for(_recv_frame_raw(loop, sock), left())
                    info = result_of(info_body)
                    self._reader, self._writer = await asyncio.open_unix_connection(sock=sock)
                    sock = None  # (the transport's now)
            except (OSError, asyncio.TimeoutError) as e:
                raise ConnectionLostError(f"cannot connect to the sidecar: {e!r}") from e
            self._pump = loop.create_task(self._read_loop())
            if host is not None or port is not None:
                info = await self._call(Op.HELLO, PROTOCOL_VERSION, tenant, token_sent, deadline=deadline)
            arena, fd = fd, None
            self._map(arena, info)  # (which closes the descriptor, whatever it raises)
        except BaseException:
            # a handshake that failed, or was cancelled (an engine's own timeout around it): its
            # socket, its reader task and the arena's descriptor had stayed open when cancelled
            if sock is not None:
                sock.close()
            if fd is not None:  # (a malformed answer is no reason to keep the arena mapped)
                os.close(fd)
            self._drop(ConnectionLostError("the handshake did not complete"))
            self._unmap()
            raise
        return self

    async def __aenter__(self) -> AsyncPoolClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._pump is not None:
            self._pump.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._pump
        if self._writer is not None:
            transport = self._writer.transport
            if transport.get_write_buffer_size():
                # What is still unsent belongs to calls already given up on (past their
                # timeouts), and a closed connection's leases go back anyway: a close had
                # waited for a stuck sidecar to take it, for as long as it stayed stuck.
                transport.abort()
            else:
                self._writer.close()
            try:
                await asyncio.wait_for(self._writer.wait_closed(), self.timeout)
            except (OSError, ConnectionError):
                pass
            except asyncio.TimeoutError:
                transport.abort()
        self._fail(ConnectionLostError("client closed"))
        self._unmap()

    def _fail(self, exc: KVPoolError) -> None:
        self._lost = exc  # every later call fails at once instead of waiting out its timeout
        for fut in self._waiting.values():
            if not fut.done():
                fut.set_exception(exc)
        self._waiting.clear()
        self._sent.clear()  # (no answer is read any more)

    def _drop(self, exc: KVPoolError) -> None:
        """Give the connection up at once, waiting for nothing (a handshake that failed or was
        cancelled, a sidecar that lost its place in the stream): its calls fail with ``exc``,
        its reader stops, its socket closes (the sidecar takes back every lease it held). The
        arena stays mapped until :meth:`close` (blocks held may still be read)."""
        if self._pump is not None and self._pump is not asyncio.current_task():
            self._pump.cancel()
        if self._writer is not None:
            self._writer.transport.abort()
        self._fail(exc)

    async def _read_loop(self) -> None:
        reader = self._reader
        if reader is None:
            return
        try:
            while True:
                head = await reader.readexactly(HEADER.size)
                (length,) = HEADER.unpack(head)
                check_length(length, answer_limit(self.info))
                body = decode_answer(await reader.readexactly(length), self.info)
                op = self._sent.pop(body[0], None)
                if op is None:
                    if body[0] == 0:  # (sent, saying why, as the sidecar closes the connection)
                        self._fail(ProtocolError(f"the sidecar rejected the stream: {str(body[2])[:200]}"))
                        break
                    # a reply to a request never sent, or answered already: the stream is not
                    # the one this client wrote to (a flood of them had kept the engine's loop
                    # busy reading them, turn after turn, for as long as the sidecar sent them)
                    raise ProtocolError(f"the sidecar answered request {body[0]}, which awaits no answer")
                fut = self._waiting.pop(body[0], None)
                if fut is not None and not fut.done():
                    fut.set_result(body)
                elif op in LEASING:  # its caller timed out or was cancelled: give the leases back
                    self._give_back(op, body)
        except (asyncio.IncompleteReadError, OSError, ProtocolError) as e:
            self._fail(ConnectionLostError(f"lost the sidecar: {e!r}"))
        if self._writer is not None:
            self._writer.transport.abort()  # (the stream cannot be read on)

    def _send(self, op: Op, *args: Any) -> int:
        """Send a request without waiting for its answer; its id."""
        if self._lost is not None:
            raise ConnectionLostError(str(self._lost))
        if self._writer is None or self._writer.is_closing():
            raise ConnectionLostError("not connected")
        if len(self._sent) - len(self._waiting) >= MOST_ABANDONED:
            self._drop(ConnectionLostError(f"the sidecar left {MOST_ABANDONED} requests unanswered whose callers "
                                           "gave up"))
            raise ConnectionLostError(str(self._lost))
        rid = next(self._ids)
        frame = encode([int(op), rid, *args])  # (first: a request that cannot be sent leaves nothing waiting)
        self._sent[rid] = op
        self._writer.write(frame)
        return rid

    def _give_back(self, op: Op, body: list[Any]) -> None:
        """Release or abort the leases of an answer nobody will use."""
        undo = undo_of(op, body)
        if undo is not None:
            with contextlib.suppress(KVPoolError):  # (a connection gone gives them back)
                self._send(*undo)

    def _deadline(self) -> float:
        """The event loop's time by which a call begun now must be answered."""
        return asyncio.get_running_loop().time() + self.timeout

    async def _call(self, op: Op, *args: Any, check: Check | None = None, deadline: float | None = None) -> Any:
        """The result of request ``op``, through ``check`` where given: an answer of a shape
        no sidecar sends (:mod:`~kvpool_client.answers`) is dropped, the leases it names
        given back, and the call raises ProtocolError. ``deadline`` (the loop's time; one
        timeout from now where not given) bounds the wait for room and for the answer."""
        writer = self._writer
        loop = asyncio.get_running_loop()
        if deadline is None:
            deadline = loop.time() + self.timeout  # the wait for room and for the answer, together
        if writer is not None and writer.transport.get_write_buffer_size() > answer_limit(self.info):
            # the sidecar has not taken what was sent before (it reads a connection's requests
            # only while fewer than a few run): this one waits for room, within its timeout,
            # rather than pile up here without bound and run long after its caller gave up
            try:
                await asyncio.wait_for(writer.drain(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError as e:
                raise ConnectionLostError(f"the sidecar took no request within {self.timeout}s") from e
            except (ConnectionError, OSError) as e:
                raise ConnectionLostError(f"lost the sidecar: {e!r}") from e
        rid = self._send(op, *args)
        fut: asyncio.Future[Any] = loop.create_future()
        self._waiting[rid] = fut
        try:
            body = await asyncio.wait_for(fut, max(0.0, deadline - loop.time()))
        except (asyncio.TimeoutError, asyncio.CancelledError) as e:
            # the answer came just as the caller gave up: nobody will use what it holds
            if op in LEASING and fut.done() and not fut.cancelled() and fut.exception() is None:
                self._give_back(op, fut.result())
            if isinstance(e, asyncio.TimeoutError):
                raise ConnectionLostError(f"the sidecar did not answer within {self.timeout}s") from e
            raise
        finally:
            # (a caller that gave up keeps nothing here: its answer, when it comes, is known by
            # the request's id alone, and gives back the leases it holds)
            self._waiting.pop(rid, None)
        result = result_of(body)
        if check is None:
            return result
        try:
            return check(result)
        except ProtocolError:
            if op in LEASING:
                self._give_back(op, body)
            raise

    async def lookup(self, keys: Sequence[KeyLike]) -> Lookup:
        """:meth:`PoolClient.lookup` for asyncio."""
        raw = raw_keys(keys)
        deadline = self._deadline()
        prefix, tiers = 0, list[str]()
        for lo, hi in request_pieces(None, len(raw), self.info):  # (one request, empty, for no keys)
            got: Lookup = await self._call(Op.LOOKUP, raw[lo:hi], check=functools.partial(lookup_result, asked=hi - lo),
                                           deadline=deadline)
            prefix += got.prefix
            tiers += got.tiers
            if got.prefix < hi - lo:  # (the prefix ends in this chunk)
                break
        return Lookup(prefix, tiers)

    async def put(self, keys: Sequence[KeyLike], payloads: Sequence[Payload], *, chain: bool = False,
                  depth: int = 0, parent: KeyLike | None = None, hints: PutHints | None = None,
                  engine: Sequence[EngineBlock | None] | None = None) -> list[PutStatus]:
        plan = put_plan(keys, payloads, chain, depth, parent, hints, engine)
        out: list[PutStatus] = []
        if not self.shm:
            for frame in self._inline_frames(plan.items, plan.views):
                if isinstance(frame, PutStatus):
                    out.append(frame)
                else:
                    out += [PutStatus(s) for s in await self._call(
                        Op.PUT_INLINE, frame, *plan.extra, check=functools.partial(put_results, asked=len(frame)))]
            return out
        deadline = self._deadline()
        for lo, hi in request_pieces(None, len(plan.items), self.info):  # (one committed before the next is asked)
            out += await self._put_piece(plan, lo, hi, deadline)
        return out

    async def _put_piece(self, plan: PutPlan, lo: int, hi: int, deadline: float) -> list[PutStatus]:
        """Items ``[lo, hi)`` of a put: allocated by ``deadline``, copied, committed (within
        a timeout of its own: the COMMIT settles what was begun)."""
        allocs = await self._call(Op.ALLOC, plan.items[lo:hi], *plan.extra,
                                  check=functools.partial(allocated_items, asked=hi - lo), deadline=deadline)
        commits, aborts = self._write(allocs, plan.views[lo:hi])
        if aborts:
            await self._call(Op.ABORT, aborts)
        done = await self._call(Op.COMMIT, commits, check=functools.partial(put_results, asked=len(commits),
                                                                             committed=True)) if commits else []
        return put_statuses(allocs, done, aborts)

    async def reserve(self, keys: Sequence[KeyLike], sizes: Sequence[int], *, chain: bool = False, depth: int = 0,
                      parent: KeyLike | None = None, hints: PutHints | None = None,
                      engine: Sequence[EngineBlock | None] | None = None) -> AsyncReservation:
        """:meth:`PoolClient.reserve` for asyncio."""
        if not self.shm:
            raise KVPoolError("reserve writes into the shared arena: connect over the Unix socket")
        items, extra = alloc_plan(keys, sizes, chain, depth, parent, hints, engine)
        allocs: list[Any] = []
        deadline = self._deadline()
        try:
            for lo, hi in request_pieces(None, len(items), self.info):
                allocs += await self._call(Op.ALLOC, items[lo:hi], *extra,
                                           check=functools.partial(allocated_items, asked=hi - lo), deadline=deadline)
        except BaseException:
            abort_allocated(self._send, allocs, self.info)  # (the room of the requests answered so far)
            raise
        views, extents, broken = self._room(allocs, sizes)

        async def commit(leases: list[list[int]]) -> list[int]:
            done: list[int] = []
            for batch in batches(leases, self.info):
                done += await self._call(Op.COMMIT, batch, check=functools.partial(put_results, asked=len(batch),
                                                                                   committed=True))
            return done

        async def abort(leases: list[int]) -> None:
            for batch in batches(leases, self.info):
                await self._call(Op.ABORT, batch)

        if broken:
            await abort(broken)
        return AsyncReservation(allocs, views, extents, broken, commit, abort)

    async def get(self, keys: Sequence[KeyLike], into: Sequence[memoryview | bytearray] | None = None
                  ) -> list[memoryview | None]:
        raw = raw_keys(keys)
        outs = destinations(len(raw), into)
        deadline = self._deadline()
        if not self.shm:
            blobs: list[bytes | None] = []
            most = max_batch(self.info)
            while len(blobs) < len(raw):
                asked = raw[len(blobs):len(blobs) + most]
                blobs += inline_step(await self._call(Op.GET_INLINE, asked, deadline=deadline), len(asked))
            return inline_results(blobs, outs)
        results: list[memoryview | None] = []
        for lo, hi in request_pieces(None, len(raw), self.info):
            acquired = await self._call(Op.ACQUIRE, raw[lo:hi], check=functools.partial(acquired_items, asked=hi - lo),
                                        deadline=deadline)
            releases: list[Any] = [[a[0], False] for a in acquired if a is not None]
            try:
                got, releases = self._read(acquired, outs[lo:hi])
            finally:
                if releases:
                    self._send(Op.RELEASE, releases)
            results += got
        return results

    async def acquire(self, keys: Sequence[KeyLike]) -> HeldBlocks:
        """:meth:`PoolClient.acquire` for asyncio (the release is sent without waiting)."""
        if not self.shm:
            raise KVPoolError("zero-copy acquire needs the shared arena (a Unix-socket connection)")
        raw = raw_keys(keys)
        deadline = self._deadline()
        acquired: list[Any] = []

        def release(held: list[Any]) -> None:  # (in RELEASEs the sidecar takes: the pieces may hold more)
            for batch in batches(held, self.info):
                self._send(Op.RELEASE, batch)

        try:
            for lo, hi in request_pieces(None, len(raw), self.info):
                acquired += await self._call(Op.ACQUIRE, raw[lo:hi], check=functools.partial(acquired_items,
                                                                                              asked=hi - lo),
                                             deadline=deadline)
            views, extents, leases = self._hold(acquired)
        except BaseException:  # (nothing named to the caller: the pieces held so far go back)
            with contextlib.suppress(KVPoolError):
                release([[a[0], False] for a in acquired if a is not None])
            raise
        return HeldBlocks(views, extents, leases, release)

    async def get_cuda(self, keys: Sequence[KeyLike], into: Sequence[torch.Tensor]) -> list[bool]:
        """:meth:`PoolClient.get_cuda` for asyncio. The device copies run on the event loop's
        thread, on its current CUDA stream, and are done on return (they block the loop for
        as long as they take)."""
        from kvpool_client import devread

        raw = raw_keys(keys)
        devread.check_destinations(len(raw), into)
        if not self.device_reads:
            return [False] * len(raw)
        deadline = self._deadline()
        found: list[devread.DeviceHit | None] = []
        reads: list[list[Any]] = []
        try:
            for lo, hi in request_pieces(None, len(raw), self.info):
                answer = await self._call(Op.ACQUIRE_DEVICE, raw[lo:hi], deadline=deadline)
                reads += devread.releases(answer)
                found += devread.hits(answer, hi - lo)
            return devread.fill(found, into)
        finally:
            for batch in batches(reads, self.info):
                self._send(Op.RELEASE, batch)

    async def _counted(self, op: Op, raw: list[bytes]) -> int:
        """A PIN, UNPIN or REMOVE of ``raw`` in requests the sidecar takes, their counts added."""
        deadline = self._deadline()
        return sum([int(await self._call(op, raw[lo:hi], check=count_of, deadline=deadline))
                    for lo, hi in request_pieces(None, len(raw), self.info)])

    async def pin(self, keys: Sequence[KeyLike]) -> int:
        return await self._counted(Op.PIN, raw_keys(keys))

    async def unpin(self, keys: Sequence[KeyLike]) -> int:
        return await self._counted(Op.UNPIN, raw_keys(keys))

    async def remove(self, keys: Sequence[KeyLike]) -> int:
        """:meth:`PoolClient.remove` for asyncio."""
        return await self._counted(Op.REMOVE, raw_keys(keys))

    async def stats(self) -> dict[str, Any]:
        result: dict[str, Any] = await self._call(Op.STATS, check=stats_of)
        return result


async def _recv_fds(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> tuple[bytes, list[int]]:
    """One handshake byte and any descriptor attached to it, without blocking the loop."""
    fut: asyncio.Future[tuple[bytes, list[int]]] = loop.create_future()

    def ready() -> None:
        try:
            msg, fds = take_fds(sock)
        except BlockingIOError:
            return
        except OSError as e:
            fut.set_exception(e)
        else:
            fut.set_result((msg, fds))
        loop.remove_reader(sock.fileno())

    loop.add_reader(sock.fileno(), ready)
    try:
        return await fut
    finally:
        loop.remove_reader(sock.fileno())


async def _recv_frame_raw(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> list[Any]:
    """One whole frame read from the raw socket (before the stream reader exists)."""
    async def exact(n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = await loop.sock_recv(sock, n - len(buf))
            if not chunk:
                raise ConnectionResetError("the sidecar closed the connection during the handshake")
            buf += chunk
        return bytes(buf)

    (length,) = HEADER.unpack(await exact(HEADER.size))
    check_length(length, answer_limit({}))
    return decode_answer(await exact(length), {})
