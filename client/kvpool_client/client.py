"""Clients of the node's sidecar: :class:`PoolClient` (blocking) and :class:`AsyncPoolClient`.

Both speak :mod:`kvpool_client.protocol` and batch every call: one round trip for a
lookup of hundreds of keys, two for a put (allocate, then commit), one and a half for a
get (acquire; the release is sent without waiting for its answer). The blocking client
sends a large batch of small blocks in pieces, so that its copies overlap the sidecar's
work (:mod:`kvpool_client.pipeline`), and never names more keys in one request than the
sidecar's ``max_batch`` (said at HELLO; it refuses a longer request whole): a longer lookup
goes chunk after chunk while every key of a chunk is held, within one timeout in all, and
any other call in as many requests as it takes.

Over the Unix socket the client maps the sidecar's shared DRAM arena and copies block
bytes directly into and out of it, checksumming while the bytes are hot; a block whose
bytes do not match the checksum recorded at commit is reported to the sidecar (which
drops it) and returned as a miss, never as data. Over TCP the data travels inline.

Either client raises only :class:`kvpool_client.errors.KVPoolError` subclasses. Every call
has a deadline (``timeout``): a dead or stuck sidecar becomes :class:`ConnectionLostError`,
which an engine treats as a miss.

This module holds the blocking client; the asyncio one is :mod:`kvpool_client.aclient`
(importable from here too). What both share: :mod:`~kvpool_client.arena` (the mapping and
the copies), :mod:`~kvpool_client.calls` (what a call sends) and
:mod:`~kvpool_client.answers` (what an answer may be).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import select
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from kvpool_client.aclient import AsyncPoolClient
from kvpool_client.answers import (LEASING, SETTLING, Check, Lookup, acquired_items, allocated_items, answer_limit,
                                   check_greeting, check_length, count_of, decode_answer, lookup_result, marker_fd,
                                   max_batch, put_results, result_of, stats_of, take_fds, undo_of)
from kvpool_client.arena import ArenaCore, HeldBlocks, inline_gets, inline_results
from kvpool_client.blockinfo import EngineBlock, PutHints
from kvpool_client.calls import (DEFAULT_SOCKET, KeyLike, Payload, PutPlan, abort_allocated, alloc_plan, batches,
                                 destinations, put_plan, raw_keys, request_pieces, tenant_token)
from kvpool_client.errors import ConnectionLostError, DeadlineError, KVPoolError, ProtocolError
from kvpool_client.integrity import checksums_until
from kvpool_client.pipeline import AHEAD, pieces
from kvpool_client.reservation import Reservation, put_statuses
from kvpool_client.unixconnect import connect_unix
from kvpool_client.protocol import HEADER, PROTOCOL_VERSION, ErrorCode, Op, PutStatus, encode

if TYPE_CHECKING:
    import torch

#: Within a task's deadline (:meth:`PoolClient.within`), the least a put waits for the answers
#: to COMMITs it sent, though the deadline passed (never more than the client's timeout).
SETTLE_GRACE_S = 1.0


def _left(deadline: float) -> float:
    """Seconds left until ``deadline`` (monotonic); TimeoutError where none are."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the handshake's deadline passed")
    return left


def counted(call: Callable[..., Any], op: Op, raw: list[bytes], info: dict[str, Any]) -> int:
    """A PIN, UNPIN or REMOVE of ``raw`` in requests of at most ``max_batch`` keys (one,
    empty, for none), their counts added."""
    return sum(int(call(op, raw[lo:hi], check=count_of)) for lo, hi in request_pieces(None, len(raw), info))


class PoolClient(ArenaCore):
    """A blocking client; one call at a time (not thread-safe). A call may have several
    requests in flight (a batch in pieces: :mod:`kvpool_client.pipeline`)."""

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
        #: Requests of a call in pieces (:mod:`~kvpool_client.pipeline`) whose answers are
        #: kept when they come while another's is read, and those kept so far.
        self._awaited: set[int] = set()
        self._early: dict[int, list[Any]] = {}
        self._rbuf = bytearray()
        unix = host is None and port is None
        # one deadline for the whole handshake: each of its steps had waited a timeout of its
        # own (a sidecar slow at each took three times the timeout)
        deadline = time.monotonic() + timeout
        try:
            if not unix:
                self._sock = socket.create_connection((host or "127.0.0.1", port or 0), timeout=timeout)
                self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            else:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        except OSError as e:
            raise ConnectionLostError(f"cannot connect to the sidecar: {e}") from e
        try:
            if unix:
                connect_unix(self._sock, socket_path or DEFAULT_SOCKET, _left(deadline))
                self._sock.settimeout(_left(deadline))
                check_greeting(*take_fds(self._sock))
        except (OSError, KVPoolError) as e:
            self._sock.close()
            if isinstance(e, KVPoolError):
                raise
            raise ConnectionLostError(f"cannot connect to the sidecar: {e}") from e
        fd: int | None = None
        try:
            rid = self._send(Op.HELLO, PROTOCOL_VERSION, tenant, tenant_token(token), deadline=deadline)
            if unix:
                try:
                    self._sock.settimeout(_left(deadline))
                    fd = marker_fd(*take_fds(self._sock))
                except OSError as e:
                    raise ConnectionLostError(f"lost the sidecar during the handshake: {e}") from e
            info = self._recv(rid, deadline)
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
        try:
            with contextlib.suppress(OSError):
                self._sock.close()  # (first: the sidecar takes back the leases held)
        finally:
            self._unmap()  # (raises BufferError while a view of the arena lives)

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
            if op in SETTLING:  # what a call began is settled whatever the task's deadline
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
        if op in LEASING:
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

    def _recv(self, rid: int, deadline: float | None = None, check: Check | None = None) -> Any:
        """The answer to request ``rid``, by ``deadline`` (monotonic; default: the timeout from
        now), through ``check`` where given: an answer of a shape no sidecar sends
        (:mod:`~kvpool_client.answers`) is dropped whole, the leases it names given back, and
        the call raises ProtocolError (the connection serves the next one)."""
        deadline = self._deadline() if deadline is None else deadline
        body = self._early.pop(rid, None)  # (one that came while another answer was read)
        buf = self._rbuf
        while body is None:
            # a frame leaves the buffer only whole: a call that times out part way through an
            # answer leaves it there, and the next call reads on from where it stopped (taking
            # the header first had left the next call reading the body as a header)
            self._fill(HEADER.size, deadline)
            (length,) = HEADER.unpack_from(buf)
            try:
                check_length(length, answer_limit(self.info))
            except ProtocolError:
                self._sock.close()  # (the rest of the stream cannot be found)
                raise
            self._fill(HEADER.size + length, deadline)
            payload = bytes(memoryview(buf)[HEADER.size:HEADER.size + length])
            del buf[:HEADER.size + length]  # (before it is decoded: a malformed frame is not read again)
            got = decode_answer(payload, self.info)
            if got[0] == rid:
                body = got
            elif got[0] in self._awaited:
                self._early[got[0]] = got  # (its leases stay listed: _forget gives them back)
            else:
                op = self._leasing.pop(got[0], None)
                undo = undo_of(op, got) if op is not None else None
                if undo is not None:  # the answer to a call that timed out: give its leases back
                    self._send(*undo, deadline=deadline)  # (within this call's time)
                if got[0] == 0:
                    result_of(got)
                    raise ProtocolError("the sidecar rejected the stream")
        self._awaited.discard(rid)
        op = self._leasing.pop(rid, None)
        result = result_of(body)
        try:
            return result if check is None else check(result)
        except ProtocolError:
            undo = undo_of(op, body) if op is not None else None
            if undo is not None:
                with contextlib.suppress(KVPoolError):
                    self._send(*undo, deadline=deadline)
            raise

    def _call(self, op: Op, *args: Any, check: Check | None = None) -> Any:
        if op in SETTLING:  # settles a call already made: its own timeout, whatever the task's deadline
            deadline = time.monotonic() + self.timeout
            return self._recv(self._send(op, *args, deadline=deadline), deadline, check)
        return self._recv(self._send(op, *args), check=check)

    def _forget(self, rids: Sequence[int]) -> None:
        """Stop waiting for the answers to ``rids`` (a call in pieces that failed part way):
        the leases of one already kept go back now, those of one still to come when it comes."""
        for rid in rids:
            self._awaited.discard(rid)
            body = self._early.pop(rid, None)
            op = self._leasing.pop(rid, None) if body is not None else None
            undo = undo_of(op, body) if op is not None and body is not None else None
            if undo is not None:
                with contextlib.suppress(KVPoolError):  # (a connection lost takes them back)
                    self._send(*undo)

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
        """The longest prefix of ``keys`` the pool holds, and each of its blocks' tier. Keys
        past the sidecar's ``max_batch`` are asked in further requests, each only while the
        one before was held whole, all within one timeout."""
        raw = raw_keys(keys)
        prefix, tiers = 0, list[str]()
        with self.within():
            for lo, hi in request_pieces(None, len(raw), self.info):  # (one request, empty, for no keys)
                got: Lookup = self._call(Op.LOOKUP, raw[lo:hi], check=functools.partial(lookup_result, asked=hi - lo))
                prefix += got.prefix
                tiers += got.tiers
                if got.prefix < hi - lo:  # (the prefix ends in this chunk)
                    break
        return Lookup(prefix, tiers)

    def put(self, keys: Sequence[KeyLike], payloads: Sequence[Payload], *, chain: bool = False,
            depth: int = 0, parent: KeyLike | None = None, hints: PutHints | None = None,
            engine: Sequence[EngineBlock | None] | None = None) -> list[PutStatus]:
        """Store blocks; ``chain`` says ``keys`` are consecutive blocks of one prefix.

        ``hints`` (about the request) and ``engine`` (one engine identity per block, or
        None) are optional; see :mod:`kvpool_client.blockinfo`."""
        plan = put_plan(keys, payloads, chain, depth, parent, hints, engine)
        out: list[PutStatus] = []
        if not self.shm:
            for frame in self._inline_frames(plan.items, plan.views):
                if isinstance(frame, PutStatus):
                    out.append(frame)
                else:
                    out += [PutStatus(s) for s in self._call(Op.PUT_INLINE, frame, *plan.extra,
                                                             check=functools.partial(put_results, asked=len(frame)))]
            return out
        if self._cap is not None and time.monotonic() >= self._cap:
            raise DeadlineError("the task's deadline passed before the put was sent")
        deadline = self._deadline()  # the hashing below counts in the call's time
        # (a sidecar that says so keeps a chain put in pieces from evicting its own head)
        if self.info.get("put_pieces") is True:
            bounds = pieces([v.nbytes for v in plan.views], put=True, most=max_batch(self.info))
            return self._put_pieces(plan, request_pieces(bounds, len(plan.items), self.info), deadline)
        for piece in request_pieces(None, len(plan.items), self.info):  # (one committed before the next is asked)
            out += self._put_pieces(plan, [piece], deadline)
        return out

    def _put_pieces(self, plan: PutPlan, bounds: list[tuple[int, int]], deadline: float) -> list[PutStatus]:
        """:meth:`put` in ``bounds`` (:mod:`~kvpool_client.pipeline`; one piece, the whole
        batch, where it goes whole): each piece copied as soon as its ALLOC is answered (the
        first hashed ahead while the sidecar finds it room), and committed at once; the
        COMMITs' answers read last. A put that fails part way may have stored the blocks of
        its earlier pieces (each one whole and verified); the room of the others goes back."""
        allocs: list[int] = []  # each piece's ALLOC request, as sent
        done: list[tuple[list[Any], list[int], int | None, int]] = []  # each piece's answer, aborts, COMMIT, commits
        try:
            for i, (lo, hi) in enumerate(bounds):
                while len(allocs) < len(bounds) and len(allocs) <= i + AHEAD:
                    a, b = bounds[len(allocs)]
                    allocs.append(self._send(Op.ALLOC, plan.items[a:b], *plan.extra, deadline=deadline))
                    self._awaited.add(allocs[-1])
                views = plan.views[lo:hi]
                sums = checksums_until(views, self._answered) if i == 0 else None
                answer = self._recv(allocs[i], deadline, functools.partial(allocated_items, asked=hi - lo))
                try:
                    commits, aborts = self._write(answer, views, sums)
                except BaseException:
                    undo = undo_of(Op.ALLOC, [0, 0, answer])  # (its room, which nothing will commit)
                    if undo is not None:
                        with contextlib.suppress(KVPoolError):
                            self._send(*undo)
                    raise
                if aborts:
                    self._send(Op.ABORT, aborts)  # answered later; _recv skips the answer
                commit = self._send(Op.COMMIT, commits) if commits else None
                if commit is not None:
                    self._awaited.add(commit)
                done.append((answer, aborts, commit, len(commits)))
            # the COMMITs settle what was begun: their own timeout, but within a task (:meth:`within`)
            # by its deadline, which bounds the whole put (a put had waited a timeout for its ALLOCs,
            # then a fresh one for its COMMITs), though never less than SETTLE_GRACE_S (a put whose
            # copies ended at the deadline still hears what it stored)
            now = time.monotonic()
            settle = now + self.timeout
            if self._cap is not None:
                settle = min(settle, max(self._cap, now + SETTLE_GRACE_S))
            out: list[PutStatus] = []
            for answer, aborts, commit, n in done:
                results = [] if commit is None else \
                    self._recv(commit, settle, functools.partial(put_results, asked=n, committed=True))
                out += put_statuses(answer, results, aborts)
            return out
        except BaseException:
            self._forget(allocs + [commit for _, _, commit, _ in done if commit is not None])
            raise

    def reserve(self, keys: Sequence[KeyLike], sizes: Sequence[int], *, chain: bool = False, depth: int = 0,
                parent: KeyLike | None = None, hints: PutHints | None = None,
                engine: Sequence[EngineBlock | None] | None = None) -> Reservation:
        """Room for blocks of ``sizes`` bytes that the caller writes into the arena itself
        (by DMA from a GPU, say), then commits (:class:`~kvpool_client.reservation.Reservation`);
        the arguments are :meth:`put`'s. Needs the shared arena (a Unix socket client)."""
        if not self.shm:
            raise KVPoolError("reserve writes into the shared arena: connect over the Unix socket")
        items, extra = alloc_plan(keys, sizes, chain, depth, parent, hints, engine)
        allocs: list[Any] = []
        try:
            for lo, hi in request_pieces(None, len(items), self.info):
                allocs += self._call(Op.ALLOC, items[lo:hi], *extra,
                                     check=functools.partial(allocated_items, asked=hi - lo))
        except BaseException:
            abort_allocated(self._send, allocs, self.info)  # (the room of the requests answered so far)
            raise
        views, extents, broken = self._room(allocs, sizes)

        def commit(leases: list[list[int]]) -> list[int]:
            done: list[int] = []
            for batch in batches(leases, self.info):
                done += self._call(Op.COMMIT, batch, check=functools.partial(put_results, asked=len(batch),
                                                                             committed=True))
            return done

        def abort(leases: list[int]) -> None:
            for batch in batches(leases, self.info):
                self._call(Op.ABORT, batch)

        if broken:
            abort(broken)
        return Reservation(allocs, views, extents, broken, commit, abort)

    def get(self, keys: Sequence[KeyLike], into: Sequence[memoryview | bytearray] | None = None
            ) -> list[memoryview | None]:
        """Read blocks (into ``into`` when given); ``None`` for a miss or a bad block."""
        raw = raw_keys(keys)
        outs = destinations(len(raw), into)
        if not self.shm:
            return inline_results(inline_gets(lambda ks: self._call(Op.GET_INLINE, ks), raw, max_batch(self.info)),
                                  outs)
        bounds = request_pieces(pieces([o.nbytes for o in outs[:len(raw)] if o is not None] if into is not None else [],
                                 put=False, most=max_batch(self.info)), len(raw), self.info)
        results: list[memoryview | None] = []

        def take(acquired: list[Any], lo: int, hi: int) -> None:  # copied out, its leases released
            releases: list[Any] = [[a[0], False] for a in acquired if a is not None]
            try:
                got, releases = self._read(acquired, outs[lo:hi])
            finally:
                if releases:
                    self._send(Op.RELEASE, releases)  # answered later; _recv skips the answer
            results.extend(got)

        self._acquired(raw, bounds, take)
        return results

    def _acquired(self, raw: list[bytes], bounds: list[tuple[int, int]],
                  take: Callable[[list[Any], int, int], None]) -> None:
        """ACQUIRE ``raw`` in ``bounds`` (:mod:`~kvpool_client.pipeline`, cut to the
        sidecar's ``max_batch``: :func:`~kvpool_client.calls.request_pieces`), a few pieces asked ahead: ``take`` gets each
        piece's answer (checked) and its ``[lo, hi)`` as soon as it comes, and releases or
        keeps its leases, whatever it raises; a failure part way gives back the leases of the
        pieces ``take`` never got (now, or when their answers come)."""
        if self._cap is not None and time.monotonic() >= self._cap:
            raise DeadlineError("the task's deadline passed before ACQUIRE was sent")
        deadline = self._deadline()
        asked: list[int] = []
        try:
            for i, (lo, hi) in enumerate(bounds):
                while len(asked) < len(bounds) and len(asked) <= i + AHEAD:
                    a, b = bounds[len(asked)]
                    asked.append(self._send(Op.ACQUIRE, raw[a:b], deadline=deadline))
                    self._awaited.add(asked[-1])
                take(self._recv(asked[i], deadline, functools.partial(acquired_items, asked=hi - lo)), lo, hi)
        except BaseException:
            self._forget(asked)
            raise

    def acquire(self, keys: Sequence[KeyLike], sizes: Sequence[int] | None = None) -> HeldBlocks:
        """Pin blocks and read them in place, without a copy (needs the shared arena).

        Use as ``with pool.acquire(keys) as held: ...``; each block is checksummed (unless
        ``verify=False``) before it is handed out. Given the blocks' ``sizes`` (an engine
        knows its block's bytes), a batch of small blocks is asked for in pieces, each
        verified as soon as it comes while the sidecar serves the next
        (:mod:`kvpool_client.pipeline`).
        """
        if not self.shm:
            raise KVPoolError("zero-copy acquire needs the shared arena (a Unix-socket connection)")
        raw = raw_keys(keys)
        if sizes is not None and len(sizes) != len(raw):
            raise KVPoolError(f"{len(sizes)} sizes for {len(raw)} keys")
        bounds = request_pieces(pieces(sizes, put=False, most=max_batch(self.info)) if sizes is not None else None,
                          len(raw), self.info)
        views: list[list[memoryview] | None] = []
        extents: list[list[tuple[int, int]] | None] = []
        leases: list[Any] = []

        def take(acquired: list[Any], lo: int, hi: int) -> None:  # verified, its leases kept
            try:
                got = self._hold(acquired)
            except BaseException:  # (interrupted: nothing of this piece is kept)
                with contextlib.suppress(KVPoolError):
                    self._send(Op.RELEASE, [[a[0], False] for a in acquired if a is not None])
                raise
            views.extend(got[0])
            extents.extend(got[1])
            leases.extend(got[2])

        def release(held: list[Any]) -> None:  # (in RELEASEs the sidecar takes: pieces may hold more)
            for batch in batches(held, self.info):
                self._send(Op.RELEASE, batch)

        try:
            self._acquired(raw, bounds, take)
        except BaseException:
            if leases:  # (never named to the caller: the pieces held so far)
                with contextlib.suppress(KVPoolError):
                    release(leases)
            raise
        return HeldBlocks(views, extents, leases, release)

    def get_cuda(self, keys: Sequence[KeyLike], into: Sequence[torch.Tensor]) -> list[bool]:
        """Copy the blocks the sidecar's GPU tier holds straight into CUDA tensors ``into``
        (one contiguous tensor of the block's size per key, any dtype), device to device
        through CUDA IPC; per key, whether it was filled. The rest are misses here: read
        them with :meth:`get`. Nothing is asked when the sidecar said at HELLO that it
        serves this connection no GPU-tier copies. The copies are done on return and their
        leases are released, also on error; see :mod:`kvpool_client.devread`."""
        from kvpool_client import devread  # torch and CUDA IPC: only for the engines that read the GPU tier

        raw = raw_keys(keys)
        devread.check_destinations(len(raw), into)
        if not self.device_reads:
            return [False] * len(raw)
        found: list[devread.DeviceHit | None] = []
        reads: list[list[Any]] = []
        try:
            for lo, hi in request_pieces(None, len(raw), self.info):
                answer = self._call(Op.ACQUIRE_DEVICE, raw[lo:hi])
                reads += devread.releases(answer)
                found += devread.hits(answer, hi - lo)
            return devread.fill(found, into)
        finally:
            for batch in batches(reads, self.info):
                self._send(Op.RELEASE, batch)  # answered later; _recv skips the answer

    def pin(self, keys: Sequence[KeyLike]) -> int:
        return counted(self._call, Op.PIN, raw_keys(keys), self.info)

    def unpin(self, keys: Sequence[KeyLike]) -> int:
        return counted(self._call, Op.UNPIN, raw_keys(keys), self.info)

    def remove(self, keys: Sequence[KeyLike]) -> int:
        """Delete blocks this client's tenant wrote from this node; returns how many went (a
        missing one, another tenant's, or one being promoted from disk right now, does not
        count). A reader holding one keeps its bytes until it releases them; copies other
        nodes fetched earlier stay."""
        return counted(self._call, Op.REMOVE, raw_keys(keys), self.info)

    def stats(self) -> dict[str, Any]:
        result: dict[str, Any] = self._call(Op.STATS, check=stats_of)
        return result


__all__ = ["DEFAULT_SOCKET", "AsyncPoolClient", "ErrorCode", "HeldBlocks", "KeyLike", "Lookup", "Payload", "PoolClient",
           "PutStatus"]
