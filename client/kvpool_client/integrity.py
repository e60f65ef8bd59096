"""Block checksums: xxh3-64 over a block's payload, computed while the bytes are hot.

A block's checksum is fixed when its writer commits it and travels with the block through
every tier and transfer; every reader verifies it before handing the bytes on. Copy and
checksum are fused chunk by chunk so that the hash reads bytes still in cache instead of
making a second pass over memory. The sync client's put hashes its blocks ahead while it
waits for the sidecar to find them room (:func:`checksums_until`, until the answer begins to arrive) and
copies those without hashing; either way the checksum is of the writer's bytes as read.

The copies are the C library's ``memmove`` on the buffers' addresses, and the hash is
xxhash's: both run without the GIL, so a batch of blocks big enough to pay for it is split
over a few threads (:func:`gather_many`, :func:`copy_many`). Where a copy's destination lies
a few bytes past its source within a page (a bytearray, 16 bytes into its first page, filled
from a page-aligned arena extent is the common case), the C library's copy of a chunk runs
several times slower (measured 1.6 GB/s against 5.6 on the development machines); such
chunks go through a per-thread bounce buffer half a page from both ends, one more copy of a
chunk that stays in cache.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait

import xxhash

logger = logging.getLogger(__name__)

#: Bytes copied (and then hashed) per step: small enough to stay in L2.
CHUNK = 256 * 1024

#: Bytes per step of a copy through the bounce buffer: both copies stay in L2, and the hash
#: of a step this long runs without the GIL (xxhash keeps it for 64 KiB and less).
BOUNCE_CHUNK = 128 * 1024

#: The page size against which a copy's source and destination are placed.
PAGE = 4096

#: Distances (destination minus source, modulo a page) from 1 to ``SLOW_SKEW - 1`` bytes are
#: the slow ones (glibc 2.36's ``rep movsb`` path on AMD EPYC: 2.2-2.5 GB/s at 1 to 24 bytes,
#: 5.3-6.9 from 40 up and at 0).
SLOW_SKEW = 64

#: A batch of at least this many bytes, in blocks of at least PARALLEL_BLOCK bytes on
#: average, is copied by several threads ...
PARALLEL_BYTES = 4 << 20

#: ... (smaller ones hand the GIL to and fro between each thread's steps for longer than
#: the steps take: batches of 512 KiB blocks ran 25% slower on two threads).
PARALLEL_BLOCK = 1 << 20

#: Threads that copy one batch at most (the caller's among them): ``KVPOOL_COPY_THREADS``
#: where set, else 8 or the CPUs this process may use if fewer (:func:`set_copy_threads`
#: changes it). A restore of 4 GiB into an H200 verified in place took 234 ms on 4 threads,
#: 146 ms on 8 and 128 ms on 16 (one DMA of it: 78 ms), so 8 takes most of the gain without
#: a whole socket's cores. A pod's CPU limit counts (:func:`cpus`).

#: The cgroup (v2) file that holds this process's CPU quota and period.
CPU_MAX_PATH = "/sys/fs/cgroup/cpu.max"


def cpus() -> int:
    """The CPUs this process may use: its affinity mask (which a cpuset narrows), or fewer
    where its cgroup's quota allows less (a pod's CPU limit: ``cpu.max``, rounded up)."""
    try:
        n = len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):  # no affinity call on this platform
        n = os.cpu_count() or 1
    try:
        with open(CPU_MAX_PATH) as f:
            quota, period = f.read().split()[:2]
        if quota != "max" and int(period) > 0:
            n = min(n, max(1, -(-int(quota) // int(period))))
    except (OSError, ValueError):  # no cgroup v2 here, or a file not as the kernel writes it
        pass
    return n


def _threads_from_env() -> int:
    raw = os.environ.get("KVPOOL_COPY_THREADS", "").strip()
    if not raw:
        return min(8, cpus())
    if not (raw.isascii() and raw.isdigit()) or int(raw) < 1:
        # not fatal: the sidecar imports this module too, and must start whatever a pod's
        # environment says
        default = min(8, cpus())
        logger.warning("KVPOOL_COPY_THREADS must be a whole number of at least 1, not %r; using %d",
                       raw, default)
        return default
    return int(raw)


COPY_THREADS = _threads_from_env()

Buffer = memoryview

_PYBUF_WRITABLE = 0x0001


class _PyBuffer(ctypes.Structure):
    """CPython's ``Py_buffer``, to read the address of any contiguous buffer."""

    _fields_ = [("buf", ctypes.c_void_p), ("obj", ctypes.c_void_p), ("len", ctypes.c_ssize_t),
                ("itemsize", ctypes.c_ssize_t), ("readonly", ctypes.c_int), ("ndim", ctypes.c_int),
                ("format", ctypes.c_char_p), ("shape", ctypes.c_void_p), ("strides", ctypes.c_void_p),
                ("suboffsets", ctypes.c_void_p), ("internal", ctypes.c_void_p)]


_get_buffer = ctypes.pythonapi.PyObject_GetBuffer
_get_buffer.argtypes = [ctypes.py_object, ctypes.POINTER(_PyBuffer), ctypes.c_int]
_get_buffer.restype = ctypes.c_int
_release_buffer = ctypes.pythonapi.PyBuffer_Release
_release_buffer.argtypes = [ctypes.POINTER(_PyBuffer)]
_release_buffer.restype = None
_memmove = ctypes.memmove  # a plain C call: runs without the GIL


def address(view: Buffer, writable: bool = False) -> int:
    """Where ``view``'s first byte lies in this process's memory. BufferError when it is not
    contiguous, or not writable and ``writable`` is asked (so a copy never writes into
    memory Python holds read-only)."""
    if not view.readonly and view.c_contiguous and view.nbytes:  # the quick way: 0.7 µs, not 3.7
        return int(ctypes.addressof(ctypes.c_char.from_buffer(view)))
    b = _PyBuffer()
    _get_buffer(view, ctypes.byref(b), _PYBUF_WRITABLE if writable else 0)  # raises the buffer's error
    try:
        if b.len != view.nbytes:
            raise BufferError(f"buffer of {b.len} bytes behind a view of {view.nbytes}")
        return int(b.buf or 0)
    finally:
        _release_buffer(ctypes.byref(b))


def slow_skew(dst: int, src: int) -> bool:
    """Whether copying from address ``src`` to ``dst`` hits the slow case (see the module)."""
    return 0 < (dst - src) % PAGE < SLOW_SKEW


class _Bounce(threading.local):
    """A buffer per thread, placed half a page away from a given source."""

    def __init__(self) -> None:
        self.mem = bytearray(BOUNCE_CHUNK + 2 * PAGE)
        self.base = address(memoryview(self.mem), writable=True)

    def near(self, src: int) -> int:
        return self.base + (src + PAGE // 2 - self.base) % PAGE


_bounce = _Bounce()


def _copy(dst: int, src: int, n: int, skewed: bool) -> None:
    """Copy ``n`` bytes (at most one bounce chunk when ``skewed``) from ``src`` to ``dst``."""
    if skewed:
        mid = _bounce.near(src)
        _memmove(mid, src, n)
        _memmove(dst, mid, n)
    else:
        _memmove(dst, src, n)


def checksum(views: Sequence[Buffer] | Buffer) -> int:
    """The checksum of the concatenation of ``views``."""
    if isinstance(views, memoryview):
        return int(xxhash.xxh3_64_intdigest(views))
    h = xxhash.xxh3_64()
    for v in views:
        h.update(v)
    return int(h.intdigest())


def _check_sizes(dst: Sequence[Buffer] | Buffer, src: Sequence[Buffer] | Buffer) -> None:
    have = dst.nbytes if isinstance(dst, memoryview) else sum(d.nbytes for d in dst)
    want = src.nbytes if isinstance(src, memoryview) else sum(s.nbytes for s in src)
    if have != want:
        raise ValueError(f"destination holds {have} bytes, source {want}")


def copy_with_checksum(dst: Sequence[Buffer], src: Buffer) -> int:
    """Copy ``src`` into the consecutive buffers ``dst`` and return the checksum of ``src``.

    ``dst`` must hold exactly ``len(src)`` bytes in all (ValueError otherwise, nothing copied).
    """
    h = xxhash.xxh3_64()
    _scatter(dst, src, h)
    return int(h.intdigest())


def copy_into(dst: Sequence[Buffer], src: Buffer) -> None:
    """:func:`copy_with_checksum` without the checksum (for a source already hashed)."""
    _scatter(dst, src, None)


def copy_hashing(dst: Sequence[Buffer], src: Buffer, h: xxhash.xxh3_64) -> None:
    """:func:`copy_with_checksum` into a running hash ``h``: a block copied a piece at a time."""
    _scatter(dst, src, h)


def _scatter(dst: Sequence[Buffer], src: Buffer, h: xxhash.xxh3_64 | None) -> None:
    _check_sizes(dst, src)
    base = address(src) if src.nbytes else 0
    pos = 0
    for d in dst:
        n = d.nbytes
        if not n:
            continue
        at = address(d, writable=True)
        skewed = slow_skew(at, base + pos)
        most = BOUNCE_CHUNK if skewed else CHUNK
        if h is None and not skewed:
            _memmove(at, base + pos, n)  # nothing to hash while it is hot: one call
            pos += n
            continue
        off = 0
        while off < n:
            step = min(most, n - off)
            _copy(at + off, base + pos, step, skewed)
            if h is not None:
                h.update(src[pos : pos + step])
            off += step
            pos += step


def checksums_until(views: Sequence[Buffer], done: Callable[[], bool], every: int = CHUNK) -> list[int | None]:
    """The checksums of ``views``, in order, until ``done()`` (asked before the first block
    and then once per ``every`` bytes hashed at most) says to stop; None for those not hashed.
    A writer hashes its blocks this way while it waits for their room (the sidecar's answer),
    then copies them without hashing (:func:`copy_many`'s ``sums``)."""
    out: list[int | None] = [None] * len(views)
    since = every
    for i, v in enumerate(views):
        if since >= every:
            if done():
                break
            since = 0
        out[i] = int(xxhash.xxh3_64_intdigest(v))
        since += v.nbytes
    return out


def gather_with_checksum(dst: Buffer, src: Sequence[Buffer]) -> int:
    """Copy the consecutive buffers ``src`` into ``dst``; return the checksum of the copy.

    ``dst`` must hold exactly the bytes of ``src`` (ValueError otherwise, nothing copied).
    The hash reads the destination right after each chunk lands, so what is verified is
    what the caller receives.
    """
    h = xxhash.xxh3_64()
    gather_hashing(dst, src, h)
    return int(h.intdigest())


def gather_hashing(dst: Buffer, src: Sequence[Buffer], h: xxhash.xxh3_64) -> None:
    """:func:`gather_with_checksum` into a running hash ``h``: a block copied a piece at a time."""
    _check_sizes(dst, src)
    base = address(dst, writable=True) if dst.nbytes else 0
    pos = 0
    for s in src:
        n = s.nbytes
        if not n:
            continue
        at = address(s)
        skewed = slow_skew(base + pos, at)
        most = BOUNCE_CHUNK if skewed else CHUNK
        off = 0
        while off < n:
            step = min(most, n - off)
            _copy(base + pos, at + off, step, skewed)
            h.update(dst[pos : pos + step])
            off += step
            pos += step


def landing(size: int) -> Buffer:
    """A new buffer of ``size`` bytes for a block copied out of the arena: from 128 KiB up,
    page-aligned within a bytearray a page longer (as the arena's extents are, so never the
    slow case; a mapping of its own per block would run into the kernel's limit on mappings
    for a caller that keeps many), a plain bytearray below."""
    if size >= 32 * PAGE:
        view = memoryview(bytearray(size + PAGE))
        start = -address(view, writable=True) % PAGE
        return view[start : start + size]
    return memoryview(bytearray(size))


_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _forget_helpers() -> None:
    """In a forked child the helper threads are gone: make new ones when next needed."""
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_helpers)


def _helpers() -> tuple[ThreadPoolExecutor | None, int]:
    """The helper threads and how many threads a batch may use, read together (None where
    only the caller's thread copies)."""
    global _pool
    with _pool_lock:
        threads = COPY_THREADS
        if threads < 2:
            return None, threads
        if _pool is None:
            _pool = ThreadPoolExecutor(threads - 1, thread_name_prefix="kvpool-copy")
        return _pool, threads


def set_copy_threads(n: int) -> None:
    """Copy and verify large batches on up to ``n`` threads (the caller's among them) from now
    on; ValueError below 1. New helper threads are made when next needed; the old ones finish
    the batches they were given and end (never shut down under a batch that holds them)."""
    global _pool, COPY_THREADS
    if n < 1:
        raise ValueError(f"copy threads must be at least 1, not {n}")
    with _pool_lock:
        _pool, COPY_THREADS = None, n


def _groups(sizes: list[int], threads: int | None = None) -> list[list[int]]:
    """Indices of ``sizes`` in at most ``threads`` (default COPY_THREADS) groups of about equal
    bytes, or one group when the batch is too small to share."""
    threads = COPY_THREADS if threads is None else threads
    total = sum(sizes)
    if threads < 2 or len(sizes) < 2 or total < max(PARALLEL_BYTES, PARALLEL_BLOCK * len(sizes)):
        return [list(range(len(sizes)))]
    k = min(threads, len(sizes))
    groups: list[list[int]] = [[] for _ in range(k)]
    share = total / k
    done = 0
    for i, n in enumerate(sizes):
        groups[min(k - 1, int(done / share))].append(i)
        done += n
    return [g for g in groups if g]


def one_thread(sizes: Sequence[int]) -> bool:
    """Whether a batch of blocks of ``sizes`` bytes is copied (or verified) by one thread alone."""
    return len(_groups(list(sizes))) == 1


def _spread(sizes: list[int], one: Callable[[int], int]) -> list[int]:
    pool, threads = _helpers()
    groups = _groups(sizes, threads if pool is not None else 1)
    out = [0] * len(sizes)

    def run(group: list[int]) -> None:
        for i in group:
            out[i] = one(i)

    futures: list[Future[None]] = []
    try:
        for g in groups[1:]:
            futures.append(pool.submit(run, g))  # type: ignore[union-attr]  # several groups: a pool
        run(groups[0])
    finally:
        wait(futures)  # every helper is done before the buffers may go, whatever raised
    for f in futures:
        f.result()  # re-raises a helper's error
    return out


def checksum_many(views: Sequence[Sequence[Buffer]]) -> list[int]:
    """:func:`checksum` of each block's pieces, the batch shared over threads."""
    return _spread([sum(v.nbytes for v in vs) for vs in views], lambda i: checksum(views[i]))


def gather_many(jobs: Sequence[tuple[Buffer, Sequence[Buffer]]]) -> list[int]:
    """:func:`gather_with_checksum` of each ``(dst, src)``, the batch shared over threads."""
    return _spread([d.nbytes for d, _ in jobs], lambda i: gather_with_checksum(*jobs[i]))


def copy_many(jobs: Sequence[tuple[Sequence[Buffer], Buffer]], sums: Sequence[int | None] | None = None) -> list[int]:
    """:func:`copy_with_checksum` of each ``(dst, src)``, the batch shared over threads; where
    ``sums`` holds a job's checksum already (:func:`checksums_until`), it is copied unhashed."""
    if sums is None:
        return _spread([s.nbytes for _, s in jobs], lambda i: copy_with_checksum(*jobs[i]))
    if len(sums) != len(jobs):
        raise ValueError(f"{len(sums)} checksums for {len(jobs)} copies")

    def one(i: int) -> int:
        known = sums[i]
        if known is None:
            return copy_with_checksum(*jobs[i])
        copy_into(*jobs[i])
        return known

    return _spread([s.nbytes for _, s in jobs], one)
