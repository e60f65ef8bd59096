"""The RDMA-capable peer transport: control over authenticated TCP, data by Mooncake reads.

Control is the TCP transport's connection (same magic, same mutual HMAC handshake, same
``u32 length | msgpack`` frames); a plain ``GET`` is still answered, so TCP-transport
clients can read from this node, and a node on the TCP transport answers ``LOOKUP`` as an
unknown operation, after which this client reads from it by ``GET``. The bytes move by one-sided reads of the Mooncake
Transfer Engine (``protocol`` ``rdma`` when ``/sys/class/infiniband`` lists a device,
else ``tcp``; metadata by ``P2PHANDSHAKE``, no etcd). Each side registers its DRAM
arenas (one per key space) with its engine. A fetch:

1. client -> ``[LOOKUP, rid, keys]``; the server lends the blocks (read leases pin them;
   a key repeated in the request is lent at its first place only, its copies answer nil)
   and answers ``[rid, 0, segment, base, [[size, checksum, tenant, [[address, len],
   ...], mac] | nil, ...]]`` (``base`` is 0: the extents are the server's addresses); ``mac``
   is the block's MAC under the connection's key (its nonce, then its AES-256-GMAC tag: what
   the TCP transport sends around each payload). The list answers a prefix of the keys, as
   many as fit the objects a peer frame may hold (:func:`answer_cut`: a fragmented arena
   makes a block's extents many); the client asks for the rest in another round. It holds the leases until ``RELEASE``, the connection closes or
   ``lease_timeout_s`` passes, so a dying client cannot pin blocks forever.
2. the client reserves room in its arena, pairs local and remote extents and reads them
   with ``batch_transfer_sync_read`` in a worker thread (the event loop stays live).
3. client -> ``[RELEASE, rid]``; while the ack travels it verifies every checksum and
   MAC and commits or aborts each block; then it awaits ``[rid, 0, released]``.

A deadline bounds every fetch. One peer's reads may hold at most ``reads_per_peer`` worker
threads (stuck ones included), so a hung peer only makes its own blocks miss. A transfer
cannot be cancelled, so on a timeout the room stays reserved until the engine gives up (``MC_TCP_PROGRESS_TIMEOUT_SEC``, defaulted to
5 s here). A batch the engine reports failed may still have slices in flight (it fails
the batch on the first bad slice), so the room of a failed or abandoned read stays
reserved for ``failed_read_quarantine_s`` more before it is aborted: never while bytes
may still land in it.

Construction initialises the engine; when that fails it raises
:class:`MooncakeUnavailable`, a :class:`PeerError` that is also an :class:`ImportError`,
so ``make_transport`` falls back to the TCP transport.

Security: the handshake authenticates the control path, and each block's MAC (bound to the
connection) authenticates the bytes that are committed, so no one without the pool secret
gets a block accepted. But Mooncake's engine serves (and accepts writes to) any registered
address to whoever reaches its ports, which listen on every interface: anyone on the
fabric can read any block in the arena, and corrupt blocks as they are read (they are then
dropped, a miss). Use this transport only on a private, trusted fabric.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ctypes
import hmac
import importlib
import logging
import os
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpool_client.integrity import checksum
from kvpool_client.keys import RAW_KEY_BYTES
from kvpool_sidecar.transfer import auth, tcpserve
from kvpool_sidecar.transfer.base import BlockSink, BlockSource, LocalTransferError, OutgoingBlock, PeerError, lend_once
from kvpool_sidecar.transfer.tcp import TcpTransport
from kvpool_sidecar.transfer.tcppool import _Conn
from kvpool_sidecar.transfer.tcpwire import ERR_UNKNOWN_OP, FRAME_OBJECTS, MAX_KEYS, _recv_sealed

_engine_module = importlib.import_module("mooncake.engine")  # ImportError: make_transport falls back to tcp

logger = logging.getLogger(__name__)

OP_LOOKUP = 16
OP_RELEASE = 17
LEASE_TIMEOUT_S = 10.0
#: Lent requests one connection may hold at once; the oldest is released past this.
MAX_HELD = 8
#: Pieces per engine batch (its per-peer TCP queue rejects a few thousand at once).
MAX_BATCH = 1024
CLOSE_WAIT_S = 6.0
#: How long the room of a failed read stays reserved: longer than the engine's own
#: transfer and slice timeouts (30 s by default), so no late slice lands in reused room.
FAILED_READ_QUARANTINE_S = 120.0
_WILDCARDS = ("", "0.0.0.0", "::")

#: ``(local address, remote address, length)``.
Piece = tuple[int, int, int]


class MooncakeUnavailable(PeerError, ImportError):
    """The Mooncake engine could not start (no package, no device, bad configuration)."""

    code = "peer_mooncake"


def rdma_available() -> bool:
    """Whether the kernel lists an RDMA device."""
    root = Path("/sys/class/infiniband")
    return root.is_dir() and any(root.iterdir())


def _address(view: memoryview) -> int:
    """The virtual address of a writable view's first byte."""
    c = ctypes.c_char.from_buffer(view)
    try:
        return ctypes.addressof(c)
    finally:
        del c  # drop the buffer export at once, so the arena can still be closed


def _arena_views(obj: object) -> list[memoryview]:
    """The whole shared arenas behind a source or sink (its ``arena_views()``; none without)."""
    fn = getattr(obj, "arena_views", None)
    views = list(fn()) if callable(fn) else []
    return [v for v in views if isinstance(v, memoryview) and not v.readonly and v.nbytes > 0]


def pair_extents(local: Sequence[tuple[int, int]], remote: Sequence[tuple[int, int]]) -> list[Piece]:
    """Cut two ``(address, length)`` lists covering the same bytes into common pieces."""
    out: list[Piece] = []
    i = j = lo = ro = 0
    while i < len(local) and j < len(remote):
        (la, ln), (ra, rn) = local[i], remote[j]
        n = min(ln - lo, rn - ro)
        if n > 0:
            if out and out[-1][0] + out[-1][2] == la + lo and out[-1][1] + out[-1][2] == ra + ro:
                out[-1] = (out[-1][0], out[-1][1], out[-1][2] + n)  # contiguous on both sides
            else:
                out.append((la + lo, ra + ro, n))
        lo, ro = lo + n, ro + n
        if lo >= ln:
            i, lo = i + 1, 0
        if ro >= rn:
            j, ro = j + 1, 0
    return out


#: Remote addresses are 64-bit: the engine refuses (TypeError) a read past them.
ADDRESS_LIMIT = 1 << 64


def _extents(raw: object, size: int, base: int = 0) -> list[tuple[int, int]]:
    """The peer's extents of a block of ``size`` bytes, as addresses (``base`` added), each
    within the 64-bit address space; PeerError otherwise."""
    if not isinstance(raw, list) or not raw:
        raise PeerError("malformed extents from peer")
    out: list[tuple[int, int]] = []
    for x in raw:
        if not (isinstance(x, list) and len(x) == 2 and all(type(v) is int and v >= 0 for v in x) and x[1] > 0):
            raise PeerError("malformed extent from peer")
        if base + x[0] + x[1] > ADDRESS_LIMIT:
            raise PeerError("peer's extent lies outside a 64-bit address space")
        out.append((base + x[0], x[1]))
    if sum(n for _, n in out) != size:
        raise PeerError("peer's extents do not add up to the block size")
    return out


def _verify(items: Sequence[tuple[int, object, int, list[memoryview], Any, bytes]]) -> list[bool]:
    """Whether each block read (``(index, lease, checksum, views, MAC state, MAC)``) has its
    checksum and its MAC."""
    out = []
    for _, _, csum, views, tag, mac in items:
        for v in views:
            tag.update(v)
        out.append(checksum(views) == csum and hmac.compare_digest(tag.digest(), mac))
    return out


#: Objects the peer's decoder counts in a ``LOOKUP`` answer besides its blocks: the frame's
#: list and its six items (request id, status, segment, base, the blocks' list, the seal),
#: and the blocks' list itself.
_ANSWER_OBJECTS = 8


#: Blocks one ``LOOKUP`` lends at most: as many as could fit its answer (one extent each).
MOST_LENT = (FRAME_OBJECTS - _ANSWER_OBJECTS) // 10


def answer_cut(blocks: Sequence[OutgoingBlock | None]) -> int:
    """How many of ``blocks`` (a prefix) a ``LOOKUP`` answer carries within the objects a
    peer frame may decode into (:data:`~kvpool_sidecar.transfer.tcpwire.FRAME_OBJECTS`): a
    missing block is one (its place in the list), a lent one eight and two per extent (its
    place, its list and five items, its extents' list, and each extent). 4,096 blocks of one
    extent each would not fit, nor 512 of 16 (a fragmented arena): the whole answer had been
    refused, every block a miss and the connection dropped."""
    left = FRAME_OBJECTS - _ANSWER_OBJECTS
    for n, b in enumerate(blocks):
        left -= 1 if b is None else 8 + 2 * len(b.views)
        if left < 0:
            return n
    return len(blocks)


@dataclass
class _Held:
    blocks: list[OutgoingBlock]
    timer: asyncio.TimerHandle


class _Rooms:
    """Reserved room of one fetch; aborted at most once, on the loop thread."""

    def __init__(self, sink: BlockSink) -> None:
        self.sink = sink
        #: (index, lease, checksum, views, the MAC hasher, the MAC the peer sent)
        self.items: list[tuple[int, object, int, list[memoryview], Any, bytes]] = []

    def abort(self) -> None:
        for _, lease, *_ in self.items:
            self.sink.abort(lease)
        self.items.clear()


def _macs(sealer: auth.Sealer, rid: int, keys: Sequence[bytes], blocks: Sequence[OutgoingBlock | None]) -> list[bytes]:
    """Each lent block's MAC (nonce and tag) under the connection's key (in a worker thread:
    it reads them all)."""
    out = []
    for i, b in enumerate(blocks):
        if b is None:
            continue
        h = sealer.mac(rid, i, keys[i], b.size, b.checksum, b.tenant)
        for v in b.views:
            h.update(v)
        out.append(h.digest())
    return out


class MooncakeTransport(TcpTransport):
    """Peer transfers by one-sided Mooncake reads between registered DRAM arenas."""

    name = "mooncake"

    def __init__(self, token: bytes, host: str = "127.0.0.1", port: int = 0, *, advertise: str | None = None,
                 connections_per_peer: int = 4, protocol: str | None = None, device_name: str = "",
                 engine_host: str | None = None, lease_timeout_s: float = LEASE_TIMEOUT_S,
                 workers: int = 16, sendfile: bool = False, pipelined: bool | None = None) -> None:
        super().__init__(token, host, port, advertise=advertise, connections_per_peer=connections_per_peer,
                         sendfile=sendfile, pipelined=pipelined)
        # The only environment the daemon reads outside config.py (no setting carries these):
        # $KVPOOL_MOONCAKE_PROTOCOL picks the engine's protocol, ``rdma`` or ``tcp`` (default:
        # rdma where the kernel lists an RDMA device, else tcp); $KVPOOL_MOONCAKE_DEVICE names
        # the RDMA device(s) the engine uses, e.g. ``mlx5_0`` (default empty, passed to the
        # engine as it is).
        chosen = protocol or os.environ.get("KVPOOL_MOONCAKE_PROTOCOL") or ("rdma" if rdma_available() else "tcp")
        if chosen not in ("rdma", "tcp"):
            raise ValueError(f"mooncake protocol must be 'rdma' or 'tcp', not {chosen!r}")
        self.protocol = chosen
        self.lease_timeout_s = lease_timeout_s
        self.failed_read_quarantine_s = FAILED_READ_QUARANTINE_S
        self.engine_host = engine_host or self._reachable_host()
        os.environ.setdefault("MC_TCP_PROGRESS_TIMEOUT_SEC", "5")  # bounds a stuck transfer's thread
        try:
            engine = _engine_module.TransferEngine()
            rc = engine.initialize(self.engine_host, "P2PHANDSHAKE", chosen,
                                   device_name or os.environ.get("KVPOOL_MOONCAKE_DEVICE", ""))  # see above
        except (RuntimeError, ValueError, TypeError) as e:
            raise MooncakeUnavailable(f"mooncake engine ({chosen}) failed to start: {e}") from e
        if rc != 0:
            raise MooncakeUnavailable(f"mooncake engine ({chosen}) failed to start: code {rc}")
        self._engine: Any = engine
        self.segment = f"{self.engine_host}:{int(engine.get_rpc_port())}"
        self._regions: dict[int, int] = {}  # registered arenas: base address -> size
        self._register_lock = asyncio.Lock()
        self._lending = False  # the source's arenas are registered
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="kvpool-mooncake")
        self._running: set[concurrent.futures.Future[int]] = set()
        #: Reads still running per peer segment (stuck ones included): each peer may occupy
        #: at most ``reads_per_peer`` of the workers, so a hung peer never starves the
        #: fetches from healthy ones (a fetch over the limit is a miss at once).
        self.reads_per_peer = max(1, min(connections_per_peer, workers // 4))
        self._reading: dict[str, set[concurrent.futures.Future[int]]] = {}
        self._held: dict[socket.socket, dict[int, _Held]] = {}
        logger.info("mooncake engine up: protocol %s, segment %s", chosen, self.segment)

    def _reachable_host(self) -> str:
        host = (self.advertise or "").rpartition(":")[0].strip("[]") or self.host
        return socket.gethostbyname(socket.gethostname()) if host in _WILDCARDS else host

    async def _register(self, view: memoryview) -> int:
        base = _address(view)
        async with self._register_lock:
            if base not in self._regions:
                rc = await asyncio.to_thread(self._engine.register_memory, base, view.nbytes)
                if rc != 0:
                    raise LocalTransferError(f"mooncake could not register the arena ({view.nbytes} bytes): "
                                             f"code {rc} (for rdma, check RLIMIT_MEMLOCK)")
                self._regions[base] = view.nbytes
        return base

    # ------------------------------------------------------------------ server
    async def start(self, source: BlockSource) -> str:
        arenas = _arena_views(source)
        if not arenas:
            logger.warning("the store has no shared arena: peers will miss on this node")
        for view in arenas:
            await self._register(view)
        self._lending = bool(arenas)
        return await super().start(source)

    async def _serve(self, sock: socket.socket) -> None:
        self._held[sock] = {}
        try:
            await super()._serve(sock)
        finally:
            for rid in list(self._held.get(sock, {})):
                self._release(sock, rid)
            self._held.pop(sock, None)

    def _holds_leases(self, sock: socket.socket) -> bool:
        return bool(self._held.get(sock))

    def _release(self, sock: socket.socket, rid: int) -> bool:
        held = self._held.get(sock, {}).pop(rid, None)
        if held is None or self._source is None:
            return False
        held.timer.cancel()
        self._source.give_back(held.blocks)
        return True

    async def _answer(self, loop: asyncio.AbstractEventLoop, sock: socket.socket, body: list[Any]) -> None:
        op = body[0] if body else None
        if op == OP_RELEASE and len(body) == 2 and type(body[1]) is int:
            async with asyncio.timeout(tcpserve.SEND_TIMEOUT_S):  # (past it: the connection closes)
                await loop.sock_sendall(sock, self._frames[sock].seal([body[1], 0, self._release(sock, body[1])]))
        elif op == OP_RELEASE:
            raise PeerError("malformed peer release")
        elif op == OP_LOOKUP:
            await self._lookup(loop, sock, body)
        else:
            await super()._answer(loop, sock, body)

    async def _lookup(self, loop: asyncio.AbstractEventLoop, sock: socket.socket, body: list[Any]) -> None:
        if len(body) != 3 or type(body[1]) is not int or not isinstance(body[2], list) or len(body[2]) > MAX_KEYS:
            raise PeerError("malformed peer lookup")
        rid, keys = body[1], body[2]
        if not all(type(k) is bytes and len(k) == RAW_KEY_BYTES for k in keys):
            raise PeerError("malformed key in peer lookup")
        source, held = self._source, self._held.get(sock)
        if source is None or held is None:
            raise PeerError("not serving")
        # no more than fit a frame are lent (lending reads, promotes and counts a hit), and the
        # answer says no more than fit: the client asks for the rest; a key repeated in the
        # request is lent once, at its first place (lend_once)
        keys = keys[:MOST_LENT]
        blocks: list[OutgoingBlock | None] = [None] * len(keys)
        if self._lending:
            blocks = await lend_once(source, keys)
        for n, b in enumerate(blocks):
            if b is not None and len(b.views) > MAX_KEYS:  # (more extents than a frame's list may hold: a miss)
                source.give_back([b])
                blocks[n] = None
        cut = answer_cut(blocks)
        if cut < len(blocks):
            past = [b for b in blocks[cut:] if b is not None]
            if past:
                source.give_back(past)
            blocks = blocks[:cut]
        lent = [b for b in blocks if b is not None]
        if lent:
            self._release(sock, rid)  # a reused request id must not strand the older leases
            while len(held) >= MAX_HELD:
                self._release(sock, next(iter(held)))
            held[rid] = _Held(lent, loop.call_later(self.lease_timeout_s, self._release, sock, rid))
        sealer = self._session_keys.get(sock)
        if sealer is None:
            raise PeerError("no session key: the connection did not authenticate")
        macs = await asyncio.to_thread(_macs, sealer, rid, keys, blocks) if lent else []
        it = iter(macs)
        items = [None if b is None else [b.size, b.checksum, b.tenant, [[_address(v), v.nbytes] for v in b.views],
                                         next(it)]
                 for b in blocks]
        # within a deadline, as a GET's answer: a reader that never read had held its
        # connection (a slot of the node's) for good; closed, its leases go back at once
        async with asyncio.timeout(tcpserve.SEND_TIMEOUT_S):
            await loop.sock_sendall(sock, self._frames[sock].seal([rid, 0, self.segment, 0, items]))

    # ------------------------------------------------------------------ client
    def _read(self, segment: str, pieces: list[Piece]) -> int:
        """Blocking: read every piece from ``segment`` (in a worker thread); 0 on success."""
        for at in range(0, len(pieces), MAX_BATCH):
            batch = pieces[at : at + MAX_BATCH]
            rc = int(self._engine.batch_transfer_sync_read(
                segment, [p[0] for p in batch], [p[1] for p in batch], [p[2] for p in batch]))
            if rc != 0:
                return rc
        return 0

    def _peer_full(self, segment: str) -> bool:
        """Whether ``segment`` already has ``reads_per_peer`` reads running (stuck ones too)."""
        running = {f for f in self._reading.get(segment, ()) if not f.done()}
        if running:
            self._reading[segment] = running
        else:
            self._reading.pop(segment, None)
        return len(running) >= self.reads_per_peer

    async def _transfer(self, segment: str, pieces: list[Piece], on_late: Callable[[bool], None]) -> int | None:
        """Run the reads in a worker; None, and nothing started, when the peer has too many
        reads running. If we stop waiting, ``on_late`` runs once the reads have ended, told
        whether they started (a read dropped from the queue wrote nothing)."""
        loop = asyncio.get_running_loop()
        if self._peer_full(segment):
            return None
        try:
            cf = self._pool.submit(self._read, segment, pieces)
        except RuntimeError:  # the transport is closing: nothing started
            return None
        self._running.add(cf)
        cf.add_done_callback(self._running.discard)
        self._reading.setdefault(segment, set()).add(cf)
        try:
            return await asyncio.wrap_future(cf)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if cf.cancelled() and task is not None and not task.cancelling():
                return None  # dropped by close() before a worker took it: nothing started
            self._after(cf, loop, on_late)
            raise
        except BaseException:
            self._after(cf, loop, on_late)
            raise

    @staticmethod
    def _after(cf: concurrent.futures.Future[int], loop: asyncio.AbstractEventLoop,
               on_late: Callable[[bool], None]) -> None:
        """Run ``on_late`` (on the loop) once the read ``cf`` we stopped waiting for ends,
        with whether it started."""
        def later(_: object) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is gone: nothing left to abort
                loop.call_soon_threadsafe(on_late, not cf.cancelled())
        if cf.done():
            on_late(not cf.cancelled())
        else:
            cf.add_done_callback(later)

    def _settle_rooms(self, rooms: _Rooms, started: bool) -> None:
        """The room of a read we stopped waiting for: held a while if the read ran (slices may
        still land), given back at once if it never started (it had been held as long)."""
        if started:
            self._quarantine(rooms)
        else:
            rooms.abort()

    def _quarantine(self, rooms: _Rooms) -> None:
        """Hold a failed read's room (slices may still land) and abort it later."""
        held = _Rooms(rooms.sink)
        held.items, rooms.items = rooms.items, []
        if held.items:
            asyncio.get_running_loop().call_later(self.failed_read_quarantine_s, held.abort)

    async def _fetch_on(self, conn: _Conn, keys: Sequence[bytes], sink: BlockSink, done: list[bool]) -> bool:
        if conn.plain:
            return await super()._fetch_on(conn, keys, sink, done)
        arenas = _arena_views(sink)
        if not arenas:
            raise LocalTransferError("the sink has no shared arena to receive into")
        regions = [(await self._register(v), v.nbytes) for v in arenas]
        start = 0
        while start < len(keys):
            # the peer answers as many blocks as fit a frame (answer_cut): ask again for the rest
            answered = await self._lookup_round(conn, keys, start, sink, done, regions)
            if answered is None:  # the peer runs the plain TCP transport: read from it by GET
                return await super()._fetch_on(conn, keys, sink, done)
            if not answered:
                break  # (not one block fits a frame: the rest are misses)
            start += answered
        return True  # (a block without room here is never read: nothing is left on the wire)

    async def _lookup_round(self, conn: _Conn, keys: Sequence[bytes], start: int, sink: BlockSink, done: list[bool],
                            regions: list[tuple[int, int]]) -> int | None:
        """One ``LOOKUP`` of ``keys[start:]``, its reads and its ``RELEASE``; how many of those
        keys the peer answered for (None: it has no Mooncake transport)."""
        loop = asyncio.get_running_loop()
        asked = keys[start:]
        rid = conn.rid = auth.new_request_id()
        await loop.sock_sendall(conn.sock, conn.frames.seal([OP_LOOKUP, rid, list(asked)]))
        ans = await _recv_sealed(loop, conn.sock, conn.frames)
        if len(ans) == 2 and ans[0] == rid and ans[1] == ERR_UNKNOWN_OP and not start:
            logger.info("peer %s has no mooncake transport; fetching from it over TCP", conn.address)
            conn.plain = True
            return None
        if len(ans) != 5 or ans[0] != rid or ans[1] != 0 or not isinstance(ans[2], str) \
                or type(ans[3]) is not int or not 0 <= ans[3] < ADDRESS_LIMIT \
                or not isinstance(ans[4], list) or len(ans[4]) > len(asked):
            raise PeerError("malformed peer answer")
        segment, base, items = ans[2], ans[3], ans[4]
        busy = self._peer_full(segment)  # its blocks miss; the connection stays clean
        if busy:
            logger.debug("reads from %s have not ended yet; its blocks miss for now", segment)
        rooms = _Rooms(sink)
        pending = False
        try:
            pieces: list[Piece] = []
            for j, item in enumerate(items):
                if item is None or busy:
                    continue
                i, key = start + j, asked[j]
                if not isinstance(item, list) or len(item) != 5:
                    raise PeerError("malformed block header from peer")
                size, csum, tenant, raw, mac = item
                if type(size) is not int or type(csum) is not int or not isinstance(tenant, str) or size <= 0 \
                        or type(mac) is not bytes or len(mac) != auth.MAC_BYTES:
                    raise PeerError("malformed block header from peer")
                remote = _extents(raw, size, base)
                room = await sink.reserve(key, size, tenant, depth=i, parent=keys[i - 1] if i else None)
                if room is None:
                    continue
                lease, views = room
                tag = auth.block_mac(conn.key, rid, j, key, size, csum, tenant, mac[: auth.NONCE_LEN])
                rooms.items.append((i, lease, csum, views, tag, mac))
                local = [(_address(v), v.nbytes) for v in views]
                if not all(any(b <= a and a + n <= b + size for b, size in regions) for a, n in local):
                    raise LocalTransferError("the sink's room lies outside its registered arena")
                pieces.extend(pair_extents(local, remote))
            if pieces:
                pending = True
                rc = await self._transfer(segment, pieces, lambda started: self._settle_rooms(rooms, started))
                pending = False
                if rc is None:  # the peer filled up meanwhile, or we are closing: nothing started
                    logger.debug("read of %d blocks from %s not started", len(rooms.items), segment)
                    rooms.abort()
                elif rc != 0:
                    logger.info("mooncake read of %d blocks from %s failed: code %d", len(rooms.items), segment, rc)
                    self._quarantine(rooms)
            await loop.sock_sendall(conn.sock, conn.frames.seal([OP_RELEASE, rid]))
            # hashed in a thread: a round may hold gigabytes, a second of the event loop
            verdicts = iter(await asyncio.to_thread(_verify, list(rooms.items)) if rooms.items else [])
            while rooms.items:
                i, lease, csum, views, tag, mac = rooms.items.pop(0)
                if not next(verdicts):
                    sink.abort(lease)
                    logger.warning("peer %s served block %s with a wrong checksum or MAC; dropped", segment,
                                   keys[i].hex())
                    continue
                sink.commit(lease, csum)
                done[i] = True
        except BaseException:
            if not pending:
                rooms.abort()
            raise
        ack = await _recv_sealed(loop, conn.sock, conn.frames)
        if len(ack) != 3 or ack[0] != rid or ack[1] != 0:
            raise PeerError("malformed release answer")
        return 0 if busy else len(items)  # (a busy peer's other blocks miss too: no more rounds)

    async def close(self) -> None:
        await super().close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        waited = 0.0
        while any(not f.done() for f in self._running) and waited < CLOSE_WAIT_S:
            await asyncio.sleep(0.05)
            waited += 0.05
        if any(not f.done() for f in self._running):
            logger.warning("mooncake reads still running at close; the engine is left in place")
            return
        engine, self._engine = self._engine, None
        if engine is None:
            return
        for base in self._regions:
            engine.unregister_memory(base)
        self._regions.clear()
        holder = [engine]
        del engine
        await asyncio.to_thread(holder.clear)  # the engine's teardown blocks for a moment
