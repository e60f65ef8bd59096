"""Clients of the node's sidecar: :class:`PoolClient` (blocking) and :class:`AsyncPoolClient`.

Both speak :mod:`kvpool_client.protocol` and batch every call: one round trip for a
lookup of hundreds of keys, two for a put (allocate, then commit), one and a half for a
get (acquire; the release is sent without waiting for its answer).

Over the Unix socket the client maps the sidecar's shared DRAM arena and copies block
bytes directly into and out of it, checksumming while the bytes are hot; a block whose
bytes do not match the checksum recorded at commit is reported to the sidecar (which
drops it) and returned as a miss, never as data. Over TCP the data travels inline.

Either client raises only :class:`kvpool_client.errors.KVPoolError` subclasses. Every call
has a deadline (``timeout``): a dead or stuck sidecar becomes :class:`ConnectionLostError`,
which an engine treats as a miss.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import fcntl
import itertools
import mmap
import os
import select
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgpack

from kvpool_client.blockinfo import EngineBlock, PutHints, engine_wire
from kvpool_client.errors import ConnectionLostError, DeadlineError, KVPoolError, ProtocolError, RemoteError
from kvpool_client.integrity import checksum_many, checksums_until, copy_many, gather_many, landing
from kvpool_client.keys import BlockKey
from kvpool_client.memory import BackgroundPrefault
from kvpool_client.reservation import AsyncReservation, Reservation, put_statuses
from kvpool_client.protocol import FD_BYTE, HEADER, NO_FD_BYTE, PROTOCOL_VERSION, ErrorCode, Op, PutStatus, decode, encode

if TYPE_CHECKING:
    import torch

DEFAULT_SOCKET = os.environ.get("KVPOOL_SOCKET_PATH", "/run/kvpool/kvpool.sock")

KeyLike = BlockKey | bytes
Payload = bytes | bytearray | memoryview


#: ``fcntl``'s seals on a memfd (Linux): the arena must be sealed against shrinking.
_F_GET_SEALS = getattr(fcntl, "F_GET_SEALS", 1034)
_F_SEAL_SHRINK = getattr(fcntl, "F_SEAL_SHRINK", 0x2)


def _check_sealed(fd: int, size: int) -> None:
    """Refuse an arena descriptor that could shrink under the mapping (whoever sent it could
    then kill the engine with SIGBUS at its next touch of the arena) or is smaller than said."""
    try:
        sealed = fcntl.fcntl(fd, _F_GET_SEALS) & _F_SEAL_SHRINK
        big_enough = os.fstat(fd).st_size >= size
    except OSError as e:  # not a memfd at all
        raise ProtocolError(f"the sidecar's arena descriptor cannot be sealed: {e.strerror}") from e
    if not sealed or not big_enough:
        raise ProtocolError("the sidecar's arena is not sealed against shrinking, or smaller than it said")


@dataclass(frozen=True, slots=True)
class Lookup:
    """The longest prefix of the asked keys the pool holds, and each block's tier."""

    prefix: int
    tiers: list[str]


def _raw(keys: Sequence[KeyLike]) -> list[bytes]:
    try:
        return [k.raw for k in keys]  # type: ignore[union-attr]
    except AttributeError:
        return [k.raw if isinstance(k, BlockKey) else bytes(k) for k in keys]


def _bytes_view(b: Payload) -> memoryview:
    v = memoryview(b)
    return v if v.format == "B" and v.ndim == 1 and v.c_contiguous else v.cast("B")


def _answer(body: list[Any]) -> list[Any]:
    """An answer frame as the sidecar sends them: ``[request id, status, result]``
    (ProtocolError otherwise: the connection is then lost, never the reader's thread or task)."""
    if len(body) != 3 or type(body[0]) is not int or type(body[1]) is not int:
        raise ProtocolError("malformed answer from the sidecar")
    return body


def _result(body: list[Any]) -> Any:
    _, status, result = body
    if status != 0:
        name, message = result if isinstance(result, list) and len(result) == 2 else ("internal", str(result))
        raise RemoteError(str(name), str(message))
    return result


#: Requests whose answers hold leases: an answer that comes after its caller gave up
#: (a timeout, a cancellation) must give them back, or they stay held until disconnect.
_LEASING = (Op.ACQUIRE, Op.ALLOC, Op.ACQUIRE_DEVICE)
#: Requests that settle what a call began (give back leases and rooms, commit what was
#: written): sent even past a task's deadline (:meth:`PoolClient.within`), or what they
#: settle would stay held until the leases expire.
_SETTLING = frozenset({Op.RELEASE, Op.ABORT, Op.COMMIT})


def _undo(op: Op, body: list[Any]) -> tuple[Op, list[Any]] | None:
    """The request that gives back the leases of a late answer to ``op`` (None: nothing)."""
    try:
        result = _result(body)
    except KVPoolError:
        return None
    if not isinstance(result, list):
        return None
    if op in (Op.ACQUIRE, Op.ACQUIRE_DEVICE):
        reads = [[item[0], False] for item in result if isinstance(item, list) and item]
        return (Op.RELEASE, reads) if reads else None
    writes = [item[1] for item in result if isinstance(item, list) and len(item) == 3 and item[2] is not None]
    return (Op.ABORT, writes) if writes else None


def _token(token: str | bytes | None) -> bytes | None:
    """The token to present: given, or read from ``$KVPOOL_TOKEN_FILE``."""
    if token is None:
        path = os.environ.get("KVPOOL_TOKEN_FILE")
        if not path:
            return None
        try:
            with open(path, "rb") as f:
                return f.read().strip()
        except OSError as e:
            raise KVPoolError(f"cannot read the tenant token from KVPOOL_TOKEN_FILE: {e.strerror}") from e
    return token.encode() if isinstance(token, str) else bytes(token)


def _wire_size(value: object) -> int:
    return len(msgpack.packb(value, use_bin_type=True))


def _close_fds(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


#: The HELLO answer (the only one before it) is a small map.
PRE_HELLO_ANSWER_BYTES = 1 << 20


#: Answers up to this size are decoded without counting their objects: counting costs a
#: Python call per list (an ACQUIRE answer of 4,096 blocks, 128 KiB, took 4.8 ms to decode
#: counted against 1.4), and tiny objects in a frame this size take about a second to build.
UNCOUNTED_ANSWER_BYTES = 4 << 20


def _given(info: dict[str, Any], name: str, default: int) -> int:
    v = info.get(name)
    return v if type(v) is int and v > 0 else default


def _answer_limit(info: dict[str, Any]) -> int:
    """The longest answer frame a sidecar that said ``info`` at HELLO may send: an inline
    answer stays within its ``max_frame_bytes`` (twice that, for headroom); an ACQUIRE answer
    of ``max_batch`` blocks of ``block_max_bytes``, each in pages of 4 KiB (the smallest),
    takes 20 bytes per extent and less than 64 more per block. Before HELLO (``info`` empty),
    :data:`PRE_HELLO_ANSWER_BYTES`."""
    if not info:
        return PRE_HELLO_ANSWER_BYTES
    extents = -(-_given(info, "block_max_bytes", 2 << 20) // 4096)
    return max(2 * _given(info, "max_frame_bytes", 64 << 20), _given(info, "max_batch", 4096) * (64 + 20 * extents))


def _answer_objects(info: dict[str, Any]) -> int:
    """The most objects an answer of that sidecar holds, as :func:`decode` counts them: an
    ACQUIRE answer of ``max_batch`` blocks counts 2 per extent and less than 64 more per
    block (a device descriptor included). An answer of tiny objects past it (empty lists: a
    byte each on the wire, some 56 in memory) is refused rather than built for seconds."""
    extents = -(-_given(info, "block_max_bytes", 2 << 20) // 4096)
    return _given(info, "max_batch", 4096) * (64 + 2 * extents) + 1024


def _decode_answer(payload: bytes | memoryview, info: dict[str, Any]) -> list[Any]:
    """An answer frame's body, within the objects that sidecar's answers hold."""
    return _answer(decode(payload, max_objects=_answer_objects(info), uncounted_bytes=UNCOUNTED_ANSWER_BYTES))


def _check_length(length: int, limit: int) -> None:
    """A frame header that announces more than a sidecar may send: the stream cannot be read
    on (ProtocolError; the caller drops the connection)."""
    if length > limit:
        raise ProtocolError(f"the sidecar announced an answer of {length} bytes, more than the {limit} it may send")


def _check_greeting(msg: bytes, fds: list[int]) -> None:
    """The byte a sidecar sends at accept: a plain one (a descriptor here is an old sidecar)."""
    _close_fds(fds)
    if not msg:
        raise ConnectionLostError("the sidecar closed the connection during the handshake")
    if fds or msg != NO_FD_BYTE:
        raise ProtocolError(f"the sidecar speaks an older protocol than {PROTOCOL_VERSION}; upgrade it")


def _take_fds(sock: socket.socket) -> tuple[bytes, list[int]]:
    """One byte and the descriptor sent with it, if any, received close-on-exec: the arena's
    descriptor opens every block of the space for writing, and a program a thread of the
    engine started before it was mapped and closed must not inherit it (Python 3.11's
    ``socket.recv_fds`` takes a ``flags`` argument and drops it)."""
    fds = array.array("i")
    msg, ancdata, _, _ = sock.recvmsg(1, socket.CMSG_LEN(fds.itemsize), socket.MSG_CMSG_CLOEXEC)
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
    return msg, list(fds)


def _marker_fd(msg: bytes, fds: list[int]) -> int | None:
    """The arena's descriptor from the byte sent after HELLO, if it carries one."""
    if not msg:
        _close_fds(fds)
        raise ConnectionLostError("the sidecar closed the connection during the handshake")
    if msg == FD_BYTE and fds:
        _close_fds(fds[1:])
        return fds[0]
    _close_fds(fds)
    return None


def _lookup_result(result: object, asked: int) -> Lookup:
    """A LOOKUP answer: the held prefix of the ``asked`` keys and its runs of tiers, which
    cover it exactly (ProtocolError otherwise: an answer never makes the client build more
    than it asked for)."""
    if not (isinstance(result, list) and len(result) == 2 and type(result[0]) is int
            and 0 <= result[0] <= asked and isinstance(result[1], list)):
        raise ProtocolError("malformed lookup answer from the sidecar")
    n, runs = result
    tiers: list[str] = []
    for run in runs:
        if not (isinstance(run, list) and len(run) == 2 and isinstance(run[0], str) and type(run[1]) is int
                and 0 < run[1] <= n - len(tiers)):
            raise ProtocolError("malformed lookup answer from the sidecar")
        tiers += [run[0]] * run[1]
    if len(tiers) != n:
        raise ProtocolError("malformed lookup answer from the sidecar")
    return Lookup(n, tiers)


def _alloc_items(keys: list[bytes], sizes: list[int], chain: bool, depth0: int, parent: bytes | None,
                 engine: list[dict[str, Any] | None] | None = None) -> list[Any]:
    items: list[Any] = []
    for i, (k, n) in enumerate(zip(keys, sizes)):
        if chain:
            items.append([k, n, depth0 + i, keys[i - 1] if i else parent])
        else:
            items.append([k, n, -1, None])
        if engine is not None and engine[i] is not None:
            items[-1].append(engine[i])
    return items


@dataclass(slots=True)
class _PutPlan:
    """A put's items and views, checked, and the trailing arguments of its request."""

    items: list[Any]
    views: list[memoryview]
    extra: tuple[Any, ...]


def _alloc_plan(keys: Sequence[KeyLike], sizes: Sequence[int], chain: bool, depth: int, parent: KeyLike | None,
                hints: PutHints | None,
                engine: Sequence[EngineBlock | None] | None) -> tuple[list[Any], tuple[Any, ...]]:
    """An ALLOC's items and the trailing arguments of its request."""
    raw = _raw(keys)
    if len(raw) != len(sizes):
        raise KVPoolError("put needs one payload per key")
    par = _raw([parent])[0] if parent is not None else None
    items = _alloc_items(raw, list(sizes), chain, depth, par, engine_wire(engine, len(raw)))
    wire = hints.wire() if hints is not None else None
    return items, () if wire is None else (wire,)


def _put_plan(keys: Sequence[KeyLike], payloads: Sequence[Payload], chain: bool, depth: int,
              parent: KeyLike | None, hints: PutHints | None,
              engine: Sequence[EngineBlock | None] | None) -> _PutPlan:
    views = [_bytes_view(p) for p in payloads]
    items, extra = _alloc_plan(keys, [v.nbytes for v in views], chain, depth, parent, hints, engine)
    return _PutPlan(items, views, extra)


class _Core:
    """What both clients share: the arena mapping and the copies in and out of it."""

    def __init__(self, verify: bool, prefault: bool = True) -> None:
        self.verify = verify
        #: Make the mapped arena writable up front, in a background thread (see memory.py).
        self.prefault = prefault
        self._prefault: BackgroundPrefault | None = None
        self.info: dict[str, Any] = {}
        self._arena: mmap.mmap | None = None
        self._view: memoryview | None = None
        #: Called before the arena is unmapped (closing the client).
        self.before_unmap: list[Callable[[], object]] = []

    @property
    def shm(self) -> bool:
        return self._view is not None

    @property
    def device_reads(self) -> bool:
        """Whether the sidecar may serve this connection GPU-tier copies (``get_cuda``)."""
        return bool(self.info.get("device_reads"))

    def _map(self, fd: int | None, info: object) -> None:
        """Take the HELLO answer ``info`` and map the arena behind ``fd`` (closed here)."""
        try:
            if not isinstance(info, dict) or (info.get("shm") and not (type(info.get("arena_bytes")) is int
                                                                       and info["arena_bytes"] > 0)):
                raise ProtocolError("malformed HELLO answer from the sidecar")
            self.info = info
            if fd is None:
                return
            if info.get("shm"):
                _check_sealed(fd, int(info["arena_bytes"]))
                try:
                    self._arena = mmap.mmap(fd, int(info["arena_bytes"]), flags=mmap.MAP_SHARED)
                except (OSError, ValueError) as e:  # (no address space or memory left for it: ENOMEM)
                    raise ConnectionLostError(f"cannot map the sidecar's shared arena: {e}") from e
                self._view = memoryview(self._arena)
                if self.prefault and info.get("prefault", True):
                    self._prefault = BackgroundPrefault(self._arena)
        finally:
            if fd is not None:
                os.close(fd)

    def wait_prefaulted(self) -> None:
        """Block until the background pre-fault of the arena (if any) is done."""
        if self._prefault is not None:
            self._prefault.wait()

    def _unmap(self) -> None:
        for hook in self.before_unmap:  # e.g. CUDA must forget a registration first
            hook()
        self.before_unmap.clear()
        if self._prefault is not None:  # the rest of the arena is not made writable for nothing
            self._prefault.cancel()
            self._prefault = None
        if self._view is not None:
            self._view.release()
            self._view = None
        if self._arena is not None:
            self._arena.close()
            self._arena = None

    def _inline_frames(self, items: list[Any], views: list[memoryview]) -> list[list[Any] | PutStatus]:
        """Inline puts cut into frames the sidecar accepts, in order; a block that can
        never fit one frame is answered here with TOO_LARGE."""
        limit = int(self.info.get("max_frame_bytes", 64 << 20)) - 4096
        frames: list[list[Any] | PutStatus] = []
        current: list[Any] = []
        size = 0
        for item, v in zip(items, views):
            cost = v.nbytes + 256 + (_wire_size(item[4]) if len(item) > 4 else 0)
            if cost > limit:
                if current:
                    frames.append(current)
                    current, size = [], 0
                frames.append(PutStatus.TOO_LARGE)
                continue
            if current and size + cost > limit:
                frames.append(current)
                current, size = [], 0
            current.append([item[0], bytes(v), *item[2:]])
            size += cost
        if current:
            frames.append(current)
        return frames

    def _extents(self, extents: list[list[int]]) -> list[memoryview]:
        v = self._view
        if v is None:
            raise KVPoolError("the arena is not mapped")
        return [v[off : off + n] for off, n in extents]

    def _write(self, allocs: list[Any], payloads: list[memoryview], sums: list[int | None] | None = None
               ) -> tuple[list[Any], list[int]]:
        """Copy payloads into their allocated extents (those whose checksum ``sums`` holds
        already, unhashed); commits to send and aborts (the allocations whose extents do not
        hold their block, :meth:`_room`)."""
        views, _, aborts = self._room(allocs, [p.nbytes for p in payloads])
        leases: list[Any] = []
        jobs: list[tuple[list[memoryview], memoryview]] = []
        given: list[int | None] = []
        for i, vs in enumerate(views):
            if vs is not None:
                leases.append(allocs[i][1])
                jobs.append((vs, payloads[i]))
                given.append(None if sums is None else sums[i])
        return [[lease, csum] for lease, csum in zip(leases, copy_many(jobs, given))], aborts

    def _room(self, allocs: list[Any], sizes: Sequence[int]) -> tuple[list[list[memoryview] | None],
                                                                     list[list[tuple[int, int]] | None], list[int]]:
        """Writable views and extents of allocated blocks, and the leases of those whose
        extents do not hold the block (a broken answer: they are aborted, never written)."""
        views: list[list[memoryview] | None] = []
        extents: list[list[tuple[int, int]] | None] = []
        broken: list[int] = []
        room = self._view.nbytes if self._view is not None else 0
        for (status, lease, ext), size in zip(allocs, sizes):
            pieces = [(int(off), int(n)) for off, n in ext] if status == PutStatus.ALLOCATED and ext else None
            if pieces is not None and sum(n for _, n in pieces) == size \
                    and all(off >= 0 and n > 0 and off + n <= room for off, n in pieces):
                views.append(self._extents([list(p) for p in pieces]))
                extents.append(pieces)
                continue
            if status == PutStatus.ALLOCATED:
                broken.append(lease)
            views.append(None)
            extents.append(None)
        return views, extents, broken

    def _hold(self, acquired: list[Any]) -> tuple[list[list[memoryview] | None], list[list[tuple[int, int]] | None],
                                                 list[Any]]:
        """Views of acquired blocks, verified in place; and the releases to send later."""
        views: list[list[memoryview] | None] = []
        extents: list[list[tuple[int, int]] | None] = []
        leases: list[Any] = []
        pieces = [None if item is None else [v.toreadonly() for v in self._extents(item[3])] for item in acquired]
        # extents that do not hold exactly the block are a broken answer: no bytes
        whole = [vs is not None and sum(v.nbytes for v in vs) == item[1] for vs, item in zip(pieces, acquired)]
        sums = iter(checksum_many([vs for vs, w in zip(pieces, whole) if w and vs is not None]) if self.verify else [])
        for item, vs, fits in zip(acquired, pieces, whole):
            if item is None or vs is None:
                views.append(None)
                extents.append(None)
                continue
            lease, size, csum, ext = item
            ok = fits and (not self.verify or next(sums) == csum)
            leases.append([lease, not ok])
            views.append(vs if ok else None)
            extents.append([(int(o), int(n)) for o, n in ext] if ok else None)
            if not ok:
                for v in vs:
                    v.release()
        return views, extents, leases

    def _read(self, acquired: list[Any], outs: list[memoryview | None]) -> tuple[list[memoryview | None], list[Any]]:
        """Copy acquired blocks out, verifying each; results and the releases to send."""
        results: list[memoryview | None] = []
        releases: list[Any] = []
        jobs: list[tuple[memoryview, list[memoryview]]] = []
        copied: list[tuple[int, Any, int]] = []  # (result index, lease, checksum) of each job
        for item, out in zip(acquired, outs):
            if item is None:
                results.append(None)
                continue
            lease, size, csum, extents = item
            dst = landing(size) if out is None else out
            if dst.nbytes < size:  # the caller releases every lease
                for _, views in jobs:  # and nothing raised keeps a view of the arena alive (it could not be unmapped)
                    for v in views:
                        v.release()
                raise KVPoolError(f"destination of {dst.nbytes} bytes is too small for a block of {size}")
            src = self._extents(extents)
            if sum(v.nbytes for v in src) != size:  # a broken answer: never part of a block
                releases.append([lease, True])
                results.append(None)
                continue
            dst = dst[:size]
            copied.append((len(results), lease, csum))
            jobs.append((dst, src))
            results.append(dst)
        for (i, lease, csum), got in zip(copied, gather_many(jobs)):
            ok = not self.verify or got == csum
            releases.append([lease, not ok])
            if not ok:
                results[i] = None
        return results, releases


def _inline_step(got: object, asked: int) -> list[bytes | None]:
    """What one inline get answer brought. The sidecar keeps each answer under its frame
    limit: a ``False`` item was not sent (the answer was full) and is asked for again."""
    if not isinstance(got, list) or len(got) != asked:
        raise ProtocolError("malformed inline get answer")
    sent = [b for b in got if b is not False]
    if not sent:
        raise ProtocolError("the sidecar answered an inline get with nothing")
    return [b if isinstance(b, bytes) else None for b in sent]


def _inline_gets(call: Callable[[list[bytes]], object], keys: list[bytes]) -> list[bytes | None]:
    out: list[bytes | None] = []
    while len(out) < len(keys):
        out += _inline_step(call(keys[len(out):]), len(keys) - len(out))
    return out


def _inline_results(blobs: list[bytes | None], outs: list[memoryview | None]) -> list[memoryview | None]:
    """Inline (TCP) get results, copied into the caller's buffers when given."""
    res: list[memoryview | None] = []
    for blob, out in zip(blobs, outs):
        if blob is None or out is None:
            res.append(None if blob is None else memoryview(blob))
        elif out.nbytes < len(blob):
            raise KVPoolError(f"destination of {out.nbytes} bytes is too small for a block of {len(blob)}")
        else:
            out[: len(blob)] = blob
            res.append(out[: len(blob)])
    return res


class HeldBlocks:
    """Blocks pinned in the shared arena for zero-copy reading (``acquire``).

    ``views[i]`` is block ``i``'s bytes as one or more memoryviews into the arena (a block
    may span several extents), or None for a miss or a block that failed its checksum;
    ``extents[i]`` are the same pieces as ``(arena offset, length)`` for device copies from
    a pinned registration of the arena (:mod:`kvpool_client.tensors`). The blocks stay
    pinned until :meth:`release` (or the end of the ``with`` block); read them, never write.
    """

    def __init__(self, views: list[list[memoryview] | None], extents: list[list[tuple[int, int]] | None],
                 leases: list[Any], release: Any) -> None:
        self.views = views
        self.extents = extents
        self._leases = leases
        self._release = release

    def __len__(self) -> int:
        return len(self.views)

    def release(self) -> None:
        """Unpin the blocks; their views must not be used afterwards."""
        if self._leases:
            leases, self._leases = self._leases, []
            for group in self.views:
                for v in group or ():
                    v.release()
            self._release(leases)

    def __enter__(self) -> HeldBlocks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class PoolClient(_Core):
    """A blocking client; one outstanding request at a time (not thread-safe)."""

    def __init__(self, socket_path: str | None = None, *, host: str | None = None, port: int | None = None,
                 tenant: str = "default", token: str | bytes | None = None, timeout: float = 10.0,
                 verify: bool = True, prefault: bool = True) -> None:
        """Connect and say hello as ``tenant``; ``token`` proves it where the tenant has one
        (always needed over TCP). The default token is read from ``$KVPOOL_TOKEN_FILE``."""
        super().__init__(verify, prefault)
        self.timeout = timeout
        #: The deadline (monotonic) of the task the calls under way are part of (:meth:`within`).
        self._cap: float | None = None
        self._ids = itertools.count(1)
        self._leasing: dict[int, Op] = {}
        self._rbuf = bytearray()
        unix = host is None and port is None
        try:
            if not unix:
                self._sock = socket.create_connection((host or "127.0.0.1", port or 0), timeout=timeout)
                self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            else:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                self._sock.settimeout(timeout)
        except OSError as e:
            raise ConnectionLostError(f"cannot connect to the sidecar: {e}") from e
        try:
            if unix:
                self._sock.connect(socket_path or DEFAULT_SOCKET)
                _check_greeting(*_take_fds(self._sock))
        except (OSError, KVPoolError) as e:
            self._sock.close()
            if isinstance(e, KVPoolError):
                raise
            raise ConnectionLostError(f"cannot connect to the sidecar: {e}") from e
        fd: int | None = None
        try:
            rid = self._send(Op.HELLO, PROTOCOL_VERSION, tenant, _token(token))
            if unix:
                try:
                    fd = _marker_fd(*_take_fds(self._sock))
                except OSError as e:
                    raise ConnectionLostError(f"lost the sidecar during the handshake: {e}") from e
            info = self._recv(rid)
        except KVPoolError:
            if fd is not None:
                os.close(fd)
            self._sock.close()
            raise
        try:
            self._map(fd, info)
        except KVPoolError:
            self._sock.close()
            raise

    def __enter__(self) -> PoolClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._unmap()
        with contextlib.suppress(OSError):
            self._sock.close()

    # -------------------------------------------------------------- framing
    @contextlib.contextmanager
    def within(self, seconds: float | None = None) -> Iterator[None]:
        """Every call made in the ``with`` block ends by one deadline, ``seconds`` (default:
        :attr:`timeout`) from now, besides each call's own timeout: a task of several calls
        (a load read in rounds) waits that long in all, not that long per call. A call
        begun past the deadline raises :class:`DeadlineError` and sends nothing, except what
        settles a call already made (a release, an abort, a commit); one under way when it
        passes ends as a call past its timeout does. Blocks nest: the earlier deadline
        holds."""
        outer = self._cap
        cap = time.monotonic() + (self.timeout if seconds is None else seconds)
        self._cap = cap if outer is None else min(outer, cap)
        try:
            yield
        finally:
            self._cap = outer

    def _deadline(self) -> float:
        """A call's deadline (monotonic) if it starts now: its timeout, or the task's deadline
        (:meth:`within`) where that comes first."""
        own = time.monotonic() + self.timeout
        return own if self._cap is None else min(own, self._cap)

    def _send(self, op: Op, *args: Any, deadline: float | None = None) -> int:
        """Send a request; by ``deadline`` (monotonic) where given, else within the call's
        deadline (:meth:`_deadline`)."""
        if deadline is None:
            if op in _SETTLING:  # what a call began is settled whatever the task's deadline
                deadline = time.monotonic() + self.timeout
            elif self._cap is not None and time.monotonic() >= self._cap:
                raise DeadlineError(f"the task's deadline passed before {Op(op).name} was sent")
            else:
                deadline = self._deadline()
        rid = next(self._ids)
        try:
            # (a read may have left the socket at what its deadline had left)
            self._sock.settimeout(max(1e-3, deadline - time.monotonic()))
            self._sock.sendall(encode([int(op), rid, *args]))
        except OSError as e:
            # part of the frame may have gone: the sidecar would read the next request as its
            # rest, so the connection is not used again
            self._sock.close()
            raise ConnectionLostError(f"lost the sidecar: {e}") from e
        if op in _LEASING:
            self._leasing[rid] = op
        return rid

    def _fill(self, n: int, deadline: float) -> None:
        """Read until the buffer holds ``n`` bytes, by ``deadline`` (monotonic): the call's
        timeout counts from its start, not from each byte (a sidecar that trickles an answer
        had held a 1 s call for 10 s)."""
        buf = self._rbuf
        while len(buf) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ConnectionLostError(self._late())
            try:
                self._sock.settimeout(left)
                chunk = self._sock.recv(max(65536, n - len(buf)))
            except TimeoutError as e:
                raise ConnectionLostError(self._late()) from e
            except OSError as e:
                raise ConnectionLostError(f"lost the sidecar: {e}") from e
            if not chunk:
                raise ConnectionLostError("the sidecar closed the connection")
            buf += chunk

    def _late(self) -> str:
        return f"the sidecar did not answer within {self.timeout} s" + (
            "" if self._cap is None else " (or by the task's deadline)")

    def _recv(self, rid: int, deadline: float | None = None) -> Any:
        """The answer to request ``rid``, by ``deadline`` (monotonic; default: the timeout from now)."""
        deadline = self._deadline() if deadline is None else deadline
        buf = self._rbuf
        while True:
            # a frame leaves the buffer only whole: a call that times out part way through an
            # answer leaves it there, and the next call reads on from where it stopped (taking
            # the header first had left the next call reading the body as a header)
            self._fill(HEADER.size, deadline)
            (length,) = HEADER.unpack_from(buf)
            try:
                _check_length(length, _answer_limit(self.info))
            except ProtocolError:
                self._sock.close()  # (the rest of the stream cannot be found)
                raise
            self._fill(HEADER.size + length, deadline)
            payload = bytes(memoryview(buf)[HEADER.size:HEADER.size + length])
            del buf[:HEADER.size + length]  # (before it is decoded: a malformed frame is not read again)
            body = _decode_answer(payload, self.info)
            op = self._leasing.pop(body[0], None)
            if body[0] == rid:
                return _result(body)
            undo = _undo(op, body) if op is not None else None
            if undo is not None:  # the answer to a call that timed out: give its leases back
                self._send(*undo, deadline=deadline)  # (within this call's time)
            if body[0] == 0:
                _result(body)
                raise ProtocolError("the sidecar rejected the stream")

    def _call(self, op: Op, *args: Any) -> Any:
        if op in _SETTLING:  # settles a call already made: its own timeout, whatever the task's deadline
            deadline = time.monotonic() + self.timeout
            return self._recv(self._send(op, *args, deadline=deadline), deadline)
        return self._recv(self._send(op, *args))

    def _answered(self) -> bool:
        """Whether an answer has begun to arrive (work done while waiting for one stops)."""
        if self._rbuf:
            return True
        fd = self._sock.fileno()
        if fd < 0:  # closed: the read that follows says so
            return True
        poller = select.poll()  # (select() takes no descriptor from 1024 up)
        poller.register(fd, select.POLLIN)
        try:
            return bool(poller.poll(0))
        except OSError:
            return True

    # -------------------------------------------------------------- operations
    def lookup(self, keys: Sequence[KeyLike]) -> Lookup:
        raw = _raw(keys)
        return _lookup_result(self._call(Op.LOOKUP, raw), len(raw))

    def put(self, keys: Sequence[KeyLike], payloads: Sequence[Payload], *, chain: bool = False,
            depth: int = 0, parent: KeyLike | None = None, hints: PutHints | None = None,
            engine: Sequence[EngineBlock | None] | None = None) -> list[PutStatus]:
        """Store blocks; ``chain`` says ``keys`` are consecutive blocks of one prefix.

        ``hints`` (about the request) and ``engine`` (one engine identity per block, or
        None) are optional; see :mod:`kvpool_client.blockinfo`."""
        plan = _put_plan(keys, payloads, chain, depth, parent, hints, engine)
        if not self.shm:
            out: list[PutStatus] = []
            for frame in self._inline_frames(plan.items, plan.views):
                if isinstance(frame, PutStatus):
                    out.append(frame)
                else:
                    out += [PutStatus(s) for s in self._call(Op.PUT_INLINE, frame, *plan.extra)]
            return out
        if self._cap is not None and time.monotonic() >= self._cap:
            raise DeadlineError("the task's deadline passed before the put was sent")
        deadline = self._deadline()  # the hashing below counts in the call's time
        rid = self._send(Op.ALLOC, plan.items, *plan.extra, deadline=deadline)
        sums = checksums_until(plan.views, self._answered)  # while the sidecar finds room
        allocs = self._recv(rid, deadline)
        commits, aborts = self._write(allocs, plan.views, sums)
        if aborts:
            self._call(Op.ABORT, aborts)
        done = self._call(Op.COMMIT, commits) if commits else []
        return put_statuses(allocs, done, aborts)

    def reserve(self, keys: Sequence[KeyLike], sizes: Sequence[int], *, chain: bool = False, depth: int = 0,
                parent: KeyLike | None = None, hints: PutHints | None = None,
                engine: Sequence[EngineBlock | None] | None = None) -> Reservation:
        """Room for blocks of ``sizes`` bytes that the caller writes into the arena itself
        (by DMA from a GPU, say), then commits (:class:`~kvpool_client.reservation.Reservation`);
        the arguments are :meth:`put`'s. Needs the shared arena (a Unix socket client)."""
        if not self.shm:
            raise KVPoolError("reserve writes into the shared arena: connect over the Unix socket")
        items, extra = _alloc_plan(keys, sizes, chain, depth, parent, hints, engine)
        allocs = self._call(Op.ALLOC, items, *extra)
        views, extents, broken = self._room(allocs, sizes)
        if broken:
            self._call(Op.ABORT, broken)
        return Reservation(allocs, views, extents, broken, lambda c: self._call(Op.COMMIT, c),
                           lambda a: self._call(Op.ABORT, a))

    def get(self, keys: Sequence[KeyLike], into: Sequence[memoryview | bytearray] | None = None
            ) -> list[memoryview | None]:
        """Read blocks (into ``into`` when given); ``None`` for a miss or a bad block."""
        raw = _raw(keys)
        outs: list[memoryview | None] = [None] * len(raw) if into is None else [_bytes_view(b) for b in into]
        if not self.shm:
            return _inline_results(_inline_gets(lambda ks: self._call(Op.GET_INLINE, ks), raw), outs)
        acquired = self._call(Op.ACQUIRE, raw)
        releases: list[Any] = [[a[0], False] for a in acquired if a is not None]
        try:
            results, releases = self._read(acquired, outs)
        finally:
            if releases:
                self._send(Op.RELEASE, releases)  # answered later; _recv skips the answer
        return results

    def acquire(self, keys: Sequence[KeyLike]) -> HeldBlocks:
        """Pin blocks and read them in place, without a copy (needs the shared arena).

        Use as ``with pool.acquire(keys) as held: ...``; each block is checksummed (unless
        ``verify=False``) before it is handed out.
        """
        if not self.shm:
            raise KVPoolError("zero-copy acquire needs the shared arena (a Unix-socket connection)")
        acquired = self._call(Op.ACQUIRE, _raw(keys))
        views, extents, leases = self._hold(acquired)
        return HeldBlocks(views, extents, leases, lambda rel: self._send(Op.RELEASE, rel))

    def get_cuda(self, keys: Sequence[KeyLike], into: Sequence[torch.Tensor]) -> list[bool]:
        """Copy the blocks the sidecar's GPU tier holds straight into CUDA tensors ``into``
        (one contiguous tensor of the block's size per key, any dtype), device to device
        through CUDA IPC; per key, whether it was filled. The rest are misses here: read
        them with :meth:`get`. Nothing is asked when the sidecar said at HELLO that it
        serves this connection no GPU-tier copies. The copies are done on return and their
        leases are released, also on error; see :mod:`kvpool_client.devread`."""
        from kvpool_client import devread  # torch and CUDA IPC: only for the engines that read the GPU tier

        raw = _raw(keys)
        devread.check_destinations(len(raw), into)
        if not self.device_reads:
            return [False] * len(raw)
        answer = self._call(Op.ACQUIRE_DEVICE, raw)
        try:
            return devread.fill(devread.hits(answer, len(raw)), into)
        finally:
            if reads := devread.releases(answer):
                self._send(Op.RELEASE, reads)  # answered later; _recv skips the answer

    def pin(self, keys: Sequence[KeyLike]) -> int:
        return int(self._call(Op.PIN, _raw(keys)))

    def unpin(self, keys: Sequence[KeyLike]) -> int:
        return int(self._call(Op.UNPIN, _raw(keys)))

    def remove(self, keys: Sequence[KeyLike]) -> int:
        """Delete blocks this client's tenant wrote from this node; returns how many went (a
        missing one, another tenant's, or one being promoted from disk right now, does not
        count). A reader holding one keeps its bytes until it releases them; copies other
        nodes fetched earlier stay."""
        return int(self._call(Op.REMOVE, _raw(keys)))

    def stats(self) -> dict[str, Any]:
        result: dict[str, Any] = self._call(Op.STATS)
        return result


class AsyncPoolClient(_Core):
    """An asyncio client; many tasks may share it (requests are multiplexed by id)."""

    def __init__(self, verify: bool = True, timeout: float = 10.0, prefault: bool = True) -> None:
        super().__init__(verify, prefault)
        self.timeout = timeout
        self._ids = itertools.count(1)
        self._leasing: dict[int, Op] = {}
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
        fd: int | None = None
        rid = next(self._ids)
        hello = [int(Op.HELLO), rid, PROTOCOL_VERSION, tenant, _token(token)]
        info_body: list[Any] | None = None
        try:
            if host is not None or port is not None:
                self._reader, self._writer = await asyncio.wait_for(
                    asyncio.open_connection(host or "127.0.0.1", port), timeout)
            else:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.setblocking(False)
                loop = asyncio.get_running_loop()
                try:
                    await asyncio.wait_for(loop.sock_connect(sock, socket_path or DEFAULT_SOCKET), timeout)
                    _check_greeting(*await asyncio.wait_for(_recv_fds(loop, sock), timeout))
                    # HELLO on the raw socket: the descriptor comes with the byte before its answer
                    await asyncio.wait_for(loop.sock_sendall(sock, encode(hello)), timeout)
                    fd = _marker_fd(*await asyncio.wait_for(_recv_fds(loop, sock), timeout))
                    info_body = await asyncio.wait_for(_recv_frame_raw(loop, sock), timeout)
                except BaseException:
                    sock.close()
                    if fd is not None:  # (a malformed answer is no reason to keep the arena mapped)
                        os.close(fd)
                        fd = None
                    raise
                self._reader, self._writer = await asyncio.open_unix_connection(sock=sock)
        except (OSError, asyncio.TimeoutError) as e:
            if fd is not None:
                os.close(fd)
            raise ConnectionLostError(f"cannot connect to the sidecar: {e!r}") from e
        self._pump = asyncio.get_running_loop().create_task(self._read_loop())
        try:
            if info_body is None and self._writer is not None:
                fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
                self._waiting[rid] = fut
                self._writer.write(encode(hello))
                try:
                    info_body = await asyncio.wait_for(fut, timeout)
                except asyncio.TimeoutError as e:
                    raise ConnectionLostError(f"the sidecar did not answer within {timeout}s") from e
            if info_body is None:
                raise ConnectionLostError("no answer to HELLO")
            info = _result(info_body)
        except KVPoolError:
            if fd is not None:
                os.close(fd)
            await self.close()
            raise
        try:
            self._map(fd, info)
        except KVPoolError:
            await self.close()
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
            self._writer.close()
            with contextlib.suppress(OSError, ConnectionError):
                await self._writer.wait_closed()
        self._fail(ConnectionLostError("client closed"))
        self._unmap()

    def _fail(self, exc: KVPoolError) -> None:
        self._lost = exc  # every later call fails at once instead of waiting out its timeout
        for fut in self._waiting.values():
            if not fut.done():
                fut.set_exception(exc)
        self._waiting.clear()

    async def _read_loop(self) -> None:
        reader = self._reader
        if reader is None:
            return
        try:
            while True:
                head = await reader.readexactly(HEADER.size)
                (length,) = HEADER.unpack(head)
                _check_length(length, _answer_limit(self.info))
                body = _decode_answer(await reader.readexactly(length), self.info)
                fut = self._waiting.pop(body[0], None)
                op = self._leasing.pop(body[0], None)
                if fut is not None and not fut.done():
                    fut.set_result(body)
                elif op is not None:  # its caller timed out or was cancelled: give the leases back
                    self._give_back(op, body)
                elif body[0] == 0:
                    self._fail(ProtocolError(f"the sidecar rejected the stream: {body[2]}"))
        except (asyncio.IncompleteReadError, OSError, ProtocolError) as e:
            self._fail(ConnectionLostError(f"lost the sidecar: {e!r}"))
            if self._writer is not None:
                self._writer.transport.abort()  # (the stream cannot be read on)

    def _send(self, op: Op, *args: Any) -> asyncio.Future[Any]:
        if self._lost is not None:
            raise ConnectionLostError(str(self._lost))
        if self._writer is None or self._writer.is_closing():
            raise ConnectionLostError("not connected")
        rid = next(self._ids)
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._waiting[rid] = fut
        if op in _LEASING:
            self._leasing[rid] = op
        self._writer.write(encode([int(op), rid, *args]))
        return fut

    def _give_back(self, op: Op, body: list[Any]) -> None:
        """Release or abort the leases of an answer nobody will use."""
        undo = _undo(op, body)
        if undo is not None and self._writer is not None and not self._writer.is_closing():
            self._writer.write(encode([int(undo[0]), next(self._ids), undo[1]]))

    async def _call(self, op: Op, *args: Any) -> Any:
        writer = self._writer
        if writer is not None and writer.transport.get_write_buffer_size() > _answer_limit(self.info):
            # the sidecar has not taken what was sent before (it reads a connection's requests
            # only while fewer than a few run): this one waits for room, within its timeout,
            # rather than pile up here without bound and run long after its caller gave up
            try:
                await asyncio.wait_for(writer.drain(), self.timeout)
            except asyncio.TimeoutError as e:
                raise ConnectionLostError(f"the sidecar took no request within {self.timeout}s") from e
            except (ConnectionError, OSError) as e:
                raise ConnectionLostError(f"lost the sidecar: {e!r}") from e
        fut = self._send(op, *args)
        try:
            body = await asyncio.wait_for(fut, self.timeout)
        except asyncio.TimeoutError as e:
            raise ConnectionLostError(f"the sidecar did not answer within {self.timeout}s") from e
        except asyncio.CancelledError:
            # cancelled just after the answer came: nobody will use what it holds
            if op in _LEASING and fut.done() and not fut.cancelled() and fut.exception() is None:
                self._give_back(op, fut.result())
            raise
        return _result(body)

    async def lookup(self, keys: Sequence[KeyLike]) -> Lookup:
        raw = _raw(keys)
        return _lookup_result(await self._call(Op.LOOKUP, raw), len(raw))

    async def put(self, keys: Sequence[KeyLike], payloads: Sequence[Payload], *, chain: bool = False,
                  depth: int = 0, parent: KeyLike | None = None, hints: PutHints | None = None,
                  engine: Sequence[EngineBlock | None] | None = None) -> list[PutStatus]:
        plan = _put_plan(keys, payloads, chain, depth, parent, hints, engine)
        if not self.shm:
            out: list[PutStatus] = []
            for frame in self._inline_frames(plan.items, plan.views):
                if isinstance(frame, PutStatus):
                    out.append(frame)
                else:
                    out += [PutStatus(s) for s in await self._call(Op.PUT_INLINE, frame, *plan.extra)]
            return out
        allocs = await self._call(Op.ALLOC, plan.items, *plan.extra)
        commits, aborts = self._write(allocs, plan.views)
        if aborts:
            await self._call(Op.ABORT, aborts)
        done = await self._call(Op.COMMIT, commits) if commits else []
        return put_statuses(allocs, done, aborts)

    async def reserve(self, keys: Sequence[KeyLike], sizes: Sequence[int], *, chain: bool = False, depth: int = 0,
                      parent: KeyLike | None = None, hints: PutHints | None = None,
                      engine: Sequence[EngineBlock | None] | None = None) -> AsyncReservation:
        """:meth:`PoolClient.reserve` for asyncio."""
        if not self.shm:
            raise KVPoolError("reserve writes into the shared arena: connect over the Unix socket")
        items, extra = _alloc_plan(keys, sizes, chain, depth, parent, hints, engine)
        allocs = await self._call(Op.ALLOC, items, *extra)
        views, extents, broken = self._room(allocs, sizes)
        if broken:
            await self._call(Op.ABORT, broken)
        return AsyncReservation(allocs, views, extents, broken, lambda c: self._call(Op.COMMIT, c),
                                lambda a: self._call(Op.ABORT, a))

    async def get(self, keys: Sequence[KeyLike], into: Sequence[memoryview | bytearray] | None = None
                  ) -> list[memoryview | None]:
        raw = _raw(keys)
        outs: list[memoryview | None] = [None] * len(raw) if into is None else [_bytes_view(b) for b in into]
        if not self.shm:
            blobs: list[bytes | None] = []
            while len(blobs) < len(raw):
                blobs += _inline_step(await self._call(Op.GET_INLINE, raw[len(blobs):]), len(raw) - len(blobs))
            return _inline_results(blobs, outs)
        acquired = await self._call(Op.ACQUIRE, raw)
        releases: list[Any] = [[a[0], False] for a in acquired if a is not None]
        try:
            results, releases = self._read(acquired, outs)
        finally:
            if releases:
                self._send(Op.RELEASE, releases)
        return results

    async def acquire(self, keys: Sequence[KeyLike]) -> HeldBlocks:
        """:meth:`PoolClient.acquire` for asyncio (the release is sent without waiting)."""
        if not self.shm:
            raise KVPoolError("zero-copy acquire needs the shared arena (a Unix-socket connection)")
        acquired = await self._call(Op.ACQUIRE, _raw(keys))
        views, extents, leases = self._hold(acquired)
        return HeldBlocks(views, extents, leases, lambda rel: self._send(Op.RELEASE, rel))

    async def get_cuda(self, keys: Sequence[KeyLike], into: Sequence[torch.Tensor]) -> list[bool]:
        """:meth:`PoolClient.get_cuda` for asyncio. The device copies run on the event loop's
        thread, on its current CUDA stream, and are done on return (they block the loop for
        as long as they take)."""
        from kvpool_client import devread

        raw = _raw(keys)
        devread.check_destinations(len(raw), into)
        if not self.device_reads:
            return [False] * len(raw)
        answer = await self._call(Op.ACQUIRE_DEVICE, raw)
        try:
            return devread.fill(devread.hits(answer, len(raw)), into)
        finally:
            if reads := devread.releases(answer):
                self._send(Op.RELEASE, reads)

    async def pin(self, keys: Sequence[KeyLike]) -> int:
        return int(await self._call(Op.PIN, _raw(keys)))

    async def unpin(self, keys: Sequence[KeyLike]) -> int:
        return int(await self._call(Op.UNPIN, _raw(keys)))

    async def remove(self, keys: Sequence[KeyLike]) -> int:
        """:meth:`PoolClient.remove` for asyncio."""
        return int(await self._call(Op.REMOVE, _raw(keys)))

    async def stats(self) -> dict[str, Any]:
        result: dict[str, Any] = await self._call(Op.STATS)
        return result


async def _recv_fds(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> tuple[bytes, list[int]]:
    """One handshake byte and any descriptor attached to it, without blocking the loop."""
    fut: asyncio.Future[tuple[bytes, list[int]]] = loop.create_future()

    def ready() -> None:
        try:
            msg, fds = _take_fds(sock)
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
    _check_length(length, _answer_limit({}))
    return _decode_answer(await exact(length), {})


__all__ = ["AsyncPoolClient", "ErrorCode", "HeldBlocks", "Lookup", "PoolClient", "PutStatus"]
