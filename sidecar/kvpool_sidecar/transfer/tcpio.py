"""The TCP transport's blocking socket I/O, run in its worker threads: the bulk send of an
answer's blocks from the arena (each block MACed piece by piece as it goes,
:func:`blocking_send`), the bulk receive straight into the reserved arena extents (each piece
checksummed and MACed as it lands, on the receiving thread or pipelined on a second one,
:func:`blocking_recv`), and the socket options both ends set, keepalive among them
(:func:`tune`); and how the event loop hands one of those transfers to a worker, and waits
for it however it is cancelled (:func:`_bulk`).

The wire format is in :mod:`kvpool_sidecar.transfer.tcpwire`, the transport itself in
:mod:`kvpool_sidecar.transfer.tcp`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import os
import queue
import select
import socket
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import xxhash

from kvpool_client.integrity import cpus
from kvpool_sidecar.transfer import auth
from kvpool_sidecar.transfer.base import LocalTransferError, PeerAuthError, PeerError

T = TypeVar("T")

_SCRATCH = 1 << 20
#: Bytes of a block hashed into its MAC and sent at a time (see :func:`blocking_send`).
SEND_PIECE = 512 << 10
#: An answer's blocks must go at least this fast, after its timeout (the transport's
#: :data:`~kvpool_sidecar.transfer.tcpserve.SEND_TIMEOUT_S`; see :func:`blocking_send`).
MIN_SEND_RATE = 16 << 20
SOCKET_BUFFER = 4 << 20
#: A pipelined receive takes a block's bytes at most this many at a time and hands each piece
#: to its hashing thread (:class:`_Verifier`): enough that a hand-over is a small share of
#: hashing them, few enough that they are still in cache when hashed.
HASH_PIECE = 256 << 10
#: Receives are pipelined by default where the sidecar may run on at least this many CPUs:
#: the two threads of each receive then run at once. On fewer, they would take turns.
PIPELINE_MIN_CPUS = 4


#: TCP keepalive on every peer connection, both ends: a connection that carries nothing for
#: KEEPALIVE_IDLE_S is probed every KEEPALIVE_INTERVAL_S, and ends after KEEPALIVE_PROBES
#: go unanswered (a peer whose host died, or whose path went, without a FIN or a reset: its
#: sockets had been held, on both ends, until the next byte was sent on them).
KEEPALIVE_IDLE_S = 20
KEEPALIVE_INTERVAL_S = 5
KEEPALIVE_PROBES = 3


def tune(sock: socket.socket, *, receiver: bool) -> None:
    """No Nagle delay for small frames; keepalive probes; a large receive buffer on the
    fetching side.

    The sending side keeps the kernel's send-buffer autotuning: pinning SO_SNDBUF measured
    slower for ``sendfile`` on loopback.
    """
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", KEEPALIVE_IDLE_S), ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
                        ("TCP_KEEPCNT", KEEPALIVE_PROBES)):
        option = getattr(socket, name, None)  # (Linux's names; other systems keep their defaults)
        if option is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, option, value)
    if receiver:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER)


@dataclass
class Outgoing:
    """One block of an answer: where its bytes are, and its MAC (header fed in)."""

    extents: list[tuple[int, int]]
    views: list[memoryview]
    mac: auth.BlockMac
    #: The arena file to ``sendfile`` from (None: send the views).
    fd: int | None = None


def blocking_send(sock: socket.socket, blocks: list[Outgoing], timeout: float) -> None:
    """Bulk send in a worker thread: each block's MAC nonce, the block (``sendfile`` from the
    arena, or ``sendall`` of its views), then its MAC tag.

    The block goes in pieces of :data:`SEND_PIECE` bytes, each hashed into the MAC just
    before it is sent: the receiver is already taking (and hashing) one piece while the
    next is hashed here, where hashing the whole block first would leave it waiting.

    The whole answer must go within ``timeout`` plus its bytes at :data:`MIN_SEND_RATE`:
    a reader that takes a trickle at a time would otherwise hold this worker, and the read
    leases of every block of the answer, for as long as it liked.
    """
    total = sum(view.nbytes for b in blocks for view in b.views)
    deadline = time.monotonic() + timeout + total / MIN_SEND_RATE

    def left() -> float:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise PeerError("the peer takes the answer too slowly")
        sock.settimeout(remaining)
        return remaining

    try:
        for b in blocks:
            left()
            sock.sendall(b.mac.nonce)
            for (off, _), view in zip(b.extents, b.views, strict=True):
                for at in range(0, view.nbytes, SEND_PIECE):
                    piece = view[at : at + SEND_PIECE]
                    b.mac.update(piece)
                    if b.fd is None:
                        left()
                        sock.sendall(piece)
                    else:
                        _sendfile(sock, b.fd, [(off + at, piece.nbytes)], left())
            left()
            sock.sendall(b.mac.digest()[auth.NONCE_LEN:])
    finally:
        sock.setblocking(False)


def _writable(sock: socket.socket, timeout: float) -> bool:
    """Whether ``sock`` takes more bytes within ``timeout``: poll(2), not select(2), which
    refuses descriptors past 1,023 (the sidecar raises its limit to serve more clients)."""
    poller = select.poll()
    poller.register(sock, select.POLLOUT)
    return bool(poller.poll(max(0, int(timeout * 1000))))


def _sendfile(sock: socket.socket, fd: int, extents: list[tuple[int, int]], timeout: float) -> None:
    """``sendfile`` the extents of ``fd``, all within ``timeout``."""
    deadline = time.monotonic() + timeout
    for off, n in extents:
        while n:
            try:
                sent = os.sendfile(sock.fileno(), fd, off, n)
            except BlockingIOError:  # the fd stays non-blocking: wait for room
                if not _writable(sock, deadline - time.monotonic()):
                    raise PeerError("the peer stopped reading") from None
                continue
            if sent == 0:
                raise PeerError("the peer stopped reading")
            off += sent
            n -= sent


def _scratch_views(scratch: memoryview, size: int) -> Iterator[memoryview]:
    """Views of ``scratch`` that together take ``size`` bytes (made one at a time)."""
    for i in range(0, size, scratch.nbytes):
        yield scratch[: min(scratch.nbytes, size - i)]


def _recv_exact_into(sock: socket.socket, buf: memoryview) -> None:
    got = 0
    while got < buf.nbytes:
        k = sock.recv_into(buf[got:])
        if k == 0:
            raise PeerError("the peer closed the connection")
        got += k


class _Checks:
    """The checks of one receive's blocks, in order, on the receiving thread: each piece is
    hashed (checksum and MAC) as it lands, still in cache; at a block's end its MAC is
    checked against what came with it and its checksum appended to ``sums`` (None for a
    block there was no room for). A MAC that fails appends None, sets :attr:`failed` and
    ends the checks (the stream is not the authenticated peer's)."""

    def __init__(self, sums: list[int | None]) -> None:
        self._sums = sums
        self.failed = False

    def piece(self, h: Any, mac: Any, view: memoryview) -> None:
        self._check((h, mac, view))

    def end(self, h: Any, mac: Any, expected: bytes) -> None:
        self._check((h, mac, None, expected))

    def close(self) -> None:
        """Return once every piece handed over is hashed and every block checked."""

    def _check(self, item: tuple[Any, ...]) -> None:
        if self.failed:
            return
        h, mac, view = item[:3]
        if view is not None:
            h.update(view)
            mac.update(view)
        elif h is None:
            self._sums.append(None)  # a block there was no room for: read and dropped
        elif hmac.compare_digest(mac.digest(), item[3]):
            self._sums.append(int(h.intdigest()))
        else:
            self._sums.append(None)
            self.failed = True


class _Verifier(_Checks):
    """:class:`_Checks` on a thread of their own, in order, while the receiving thread takes
    the next bytes off the socket.

    On an H200 node's 16 cores a 4 MiB fetch ran at 0.49x raw loopback TCP, and the fetch's
    wire part at 0.61x: its receiving thread took each piece off the socket, then hashed it
    twice (xxh3 for the checksum, GMAC for the MAC) before it took the next. Both hashes
    release the GIL, so a second thread hashes one piece while the first receives the next.
    The pieces handed over are already in their arena extents, which stay the transfer's
    until the receive returns, after :meth:`close`.
    """

    def __init__(self, workers: ThreadPoolExecutor, sums: list[int | None]) -> None:
        super().__init__(sums)
        self._queue: queue.SimpleQueue[tuple[Any, ...] | None] = queue.SimpleQueue()
        self._job = workers.submit(self._run)

    def piece(self, h: Any, mac: Any, view: memoryview) -> None:
        self._queue.put((h, mac, view))

    def end(self, h: Any, mac: Any, expected: bytes) -> None:
        self._queue.put((h, mac, None, expected))

    def close(self) -> None:
        self._queue.put(None)
        self._job.result()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            self._check(item)  # after a failure: drained, not hashed


def blocking_recv(sock: socket.socket, blocks: list[tuple[list[memoryview] | None, int, Callable[[bytes], Any]]],
                   timeout: float, sums: list[int | None], hashers: ThreadPoolExecutor | None = None
                   ) -> list[int | None]:
    """Bulk receive in a worker thread straight into the reserved arena extents.

    Each block comes as its MAC's nonce, its bytes and the MAC's tag; ``blocks[i][2]`` makes
    block ``i``'s MAC from the nonce. Each piece a ``recv_into`` takes is checked as it
    lands (:class:`_Checks`; with ``hashers``, pieces of at most :data:`HASH_PIECE`, on one
    of them while this thread takes the next: :class:`_Verifier`); blocks without room
    (``None`` views) are read into scratch and discarded. A wrong MAC ends the transfer. Each block's checksum
    is appended to ``sums`` as soon as the block is complete and its MAC checked, so a
    transfer cut short keeps its whole blocks.
    """
    try:
        checks = _Checks(sums) if hashers is None else _Verifier(hashers, sums)
    except RuntimeError as e:  # the transport is closing: its hash workers take no more
        raise LocalTransferError("the transport is closing") from e
    sock.settimeout(timeout)
    # bytes asked of one recv_into: on the receiving thread, as many as the socket holds
    most = HASH_PIECE if hashers is not None else 1 << 62
    scratch: memoryview | None = None
    try:
        for views, size, make_mac in blocks:
            nonce = bytearray(auth.NONCE_LEN)
            _recv_exact_into(sock, memoryview(nonce))
            mac = make_mac(bytes(nonce))
            h = None
            if views is None:
                scratch = scratch or memoryview(bytearray(_SCRATCH))
                for piece in _scratch_views(scratch, size):
                    _recv_exact_into(sock, piece)
            else:
                h = xxhash.xxh3_64()
                for v in views:
                    got, n = 0, v.nbytes
                    while got < n:
                        k = sock.recv_into(v[got : min(n, got + most)])
                        if k == 0:
                            raise PeerError("the peer closed the connection")
                        checks.piece(h, mac, v[got : got + k])
                        got += k
                        if checks.failed:
                            raise PeerAuthError("a block's MAC does not match: not from the authenticated peer")
            tag = bytearray(auth.TAG_LEN)
            _recv_exact_into(sock, memoryview(tag))
            checks.end(h, mac, bytes(nonce) + bytes(tag))
            if checks.failed:
                raise PeerAuthError("a block's MAC does not match: not from the authenticated peer")
    finally:
        try:
            checks.close()  # the arena extents stay the transfer's until their hashing is done
        finally:
            sock.setblocking(False)
    if checks.failed:
        raise PeerAuthError("a block's MAC does not match: not from the authenticated peer")
    return sums


def pipelined_default() -> bool:
    """Whether receives are pipelined where ``peer.pipelined_receive`` is not set."""
    return cpus() >= PIPELINE_MIN_CPUS


async def _bulk(workers: ThreadPoolExecutor, sock: socket.socket, fn: Callable[..., T], *args: Any) -> T:
    """Run a blocking bulk transfer on ``sock`` in one of ``workers``.

    If the caller is cancelled (a deadline) before a worker took the job, the job is
    dropped. If a worker runs it, the socket is shut down so the worker's blocking call
    returns at once, and the worker is waited for before the cancellation goes on, through
    any further cancellation too (a deadline, then the requester's connection closing): a
    socket shut down still hands over what it had queued, so the worker may copy into the
    arena for a while yet, and nobody may release or reuse the extents it touches until it
    has returned.
    """
    try:
        job = workers.submit(fn, sock, *args)
    except RuntimeError as e:  # the transport is closing: its workers take no more (no fault of the peer's)
        raise LocalTransferError("the transport is closing") from e
    work = asyncio.wrap_future(job)
    try:
        return await asyncio.shield(work)
    except asyncio.CancelledError:
        if job.cancel():  # never started: it touched nothing
            raise
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
        while not work.done():
            try:
                await asyncio.wait({work})
            except asyncio.CancelledError:
                continue  # cancelled again: the worker still writes, wait on
        if not work.cancelled():
            work.exception()  # retrieved: how it ended is of no use to anyone now
        raise
