"""The shared DRAM arena, as both clients see it: mapping it (sealed against shrinking)
and copying blocks into and out of it, verifying every block's checksum while its bytes
are hot (:class:`ArenaCore`); zero-copy holds of blocks in it (:class:`HeldBlocks`); and the
inline (TCP) path's frames and answers, where there is no arena."""

from __future__ import annotations

import fcntl
import mmap
import os
from collections.abc import Callable, Sequence
from typing import Any

import msgpack

from kvpool_client.answers import max_batch
from kvpool_client.errors import ConnectionLostError, KVPoolError, ProtocolError
from kvpool_client.integrity import checksum_many, copy_many, gather_many, landing
from kvpool_client.memory import BackgroundPrefault
from kvpool_client.protocol import PutStatus


#: ``fcntl``'s seals on a memfd (Linux): the arena must be sealed against shrinking.
_F_GET_SEALS = getattr(fcntl, "F_GET_SEALS", 1034)
_F_SEAL_SHRINK = getattr(fcntl, "F_SEAL_SHRINK", 0x2)


def check_sealed(fd: int, size: int) -> None:
    """Refuse an arena descriptor that could shrink under the mapping (whoever sent it could
    then kill the engine with SIGBUS at its next touch of the arena) or is smaller than said."""
    try:
        sealed = fcntl.fcntl(fd, _F_GET_SEALS) & _F_SEAL_SHRINK
        big_enough = os.fstat(fd).st_size >= size
    except OSError as e:  # not a memfd at all
        raise ProtocolError(f"the sidecar's arena descriptor cannot be sealed: {e.strerror}") from e
    if not sealed or not big_enough:
        raise ProtocolError("the sidecar's arena is not sealed against shrinking, or smaller than it said")


def _wire_size(value: object) -> int:
    return len(msgpack.packb(value, use_bin_type=True))


class ArenaCore:
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
                check_sealed(fd, int(info["arena_bytes"]))
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
        """Inline puts cut into frames the sidecar accepts (within its frame size and its
        ``max_batch`` items), in order; a block that can never fit one frame is answered
        here with TOO_LARGE."""
        most = max_batch(self.info)
        said = self.info.get("max_frame_bytes")
        # (a HELLO of another type here had raised ValueError at every put)
        limit = (said if type(said) is int and said > 0 else 64 << 20) - 4096
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
            if current and (size + cost > limit or len(current) >= most):
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

    def _block_views(self, extents: list[list[int]], size: int) -> list[memoryview] | None:
        """Views of a block's ``extents``, or None where they do not hold exactly ``size``
        bytes of the arena (a broken answer: an extent past the arena's end, which a slice
        would have cut short, or pieces of another length than the block's)."""
        room = self._view.nbytes if self._view is not None else 0
        if sum(n for _, n in extents) != size or not all(n > 0 and off + n <= room for off, n in extents):
            return None
        return self._extents(extents)

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
        # extents that do not hold exactly the block are a broken answer: no bytes
        pieces: list[list[memoryview] | None] = []
        for item in acquired:
            vs = None if item is None else self._block_views(item[3], item[1])
            pieces.append(None if vs is None else [v.toreadonly() for v in vs])
        sums = iter(checksum_many([vs for vs in pieces if vs is not None]) if self.verify else [])
        for item, vs in zip(acquired, pieces):
            if item is None:
                views.append(None)
                extents.append(None)
                continue
            lease, size, csum, ext = item
            ok = vs is not None and (not self.verify or next(sums) == csum)
            leases.append([lease, not ok])
            views.append(vs if ok else None)
            extents.append([(int(o), int(n)) for o, n in ext] if ok else None)
            if not ok:
                for v in vs or ():
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
            src = self._block_views(extents, size)
            if src is None:  # a broken answer: never part of a block (nor room made for it)
                releases.append([lease, True])
                results.append(None)
                continue
            dst = landing(size) if out is None else out
            if dst.nbytes < size:  # the caller releases every lease
                for _, views in [*jobs, (dst, src)]:  # and nothing raised keeps a view of the arena alive
                    for v in views:
                        v.release()
                raise KVPoolError(f"destination of {dst.nbytes} bytes is too small for a block of {size}")
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


def inline_step(got: object, asked: int) -> list[bytes | None]:
    """What one inline get answer brought. The sidecar keeps each answer under its frame
    limit: a ``False`` item was not sent (the answer was full) and is asked for again."""
    if not isinstance(got, list) or len(got) != asked:
        raise ProtocolError("malformed inline get answer")
    sent = got.index(False) if False in got else len(got)  # (only the answer's last items may be left out)
    if not sent or any(b is not False for b in got[sent:]) \
            or not all(b is None or isinstance(b, bytes) for b in got[:sent]):
        raise ProtocolError("malformed inline get answer" if sent
                            else "the sidecar answered an inline get with nothing")
    return got[:sent]


def inline_gets(call: Callable[[list[bytes]], object], keys: list[bytes], most: int = 4096) -> list[bytes | None]:
    """``keys`` read inline, at most ``most`` (the sidecar's ``max_batch``) a request."""
    out: list[bytes | None] = []
    while len(out) < len(keys):
        asked = keys[len(out):len(out) + most]
        out += inline_step(call(asked), len(asked))
    return out


def inline_results(blobs: list[bytes | None], outs: list[memoryview | None]) -> list[memoryview | None]:
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

