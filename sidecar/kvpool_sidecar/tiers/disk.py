"""The disk tier: one file per block under ``DiskSettings.path``; survives restarts.

Files live at ``<path>/<kk>/<key hex>.kvb`` (``kk`` = hex of ``key[16]``, the first byte
of the chain digest: 256 subdirectories keep directories small). A write goes to
``<kk>/.<name>.<pid>.<n>.tmp`` and is renamed into place, so a crash leaves no file or a
complete one; ``open()`` deletes leftover temp files. ``fsync: always`` fsyncs the file,
then its directory, before a write returns; with ``never`` a power loss may leave a torn
file, which ``open()`` (header and size checks) or ``read_into()`` (checksum) discards.
``write_many()`` (the store's write-ahead) writes a batch with one ``syncfs`` for all of it
instead of two fsyncs per file: durable when it returns, and a crash before that may leave
torn files of that batch, discarded the same way.

A file is a block's header and stored payload (:mod:`~kvpool_sidecar.tiers.diskformat`);
its size must be the header length plus the stored size, so a file never exceeds
:meth:`DiskTier.estimate_bytes`. This is the ``disk.layout: files`` layout; the default is
:mod:`~kvpool_sidecar.tiers.segments`.

Thread safety: methods may run in several threads at once on different keys. The table is
guarded by a lock never held during I/O; writes in flight reserve their space up front so
concurrent writes cannot overrun the capacity. Do not read a key while writing or deleting
that same key.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import errno
import functools
import itertools
import logging
import os
import stat
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

import xxhash

from kvpool_sidecar.config import DiskSettings
from kvpool_sidecar.errors import CorruptBlockError, TierFullError, TierIOError
from kvpool_sidecar.tiers.base import BlockRecord
from kvpool_sidecar.tiers.diskformat import (
    KEY_BYTES, MAX_HEADER_BYTES, MAX_TENANT_BYTES, StoredBlock, advance, errname, flat_bytes, fsync_dir,
    header_length, libc_function, make_private_dir, owned_by_us, parse_header, payload_problem, prepare,
    raise_errno,
)
from kvpool_sidecar.tiers.keyed import KeyedDiskTier

logger = logging.getLogger(__name__)

EXT = ".kvb"
#: Payload bytes hashed and then handed to the kernel per piece (stays in L2 cache).
_PIECE = 256 * 1024
#: Bytes gathered into one ``writev`` call.
_BATCH = 4 * 1024 * 1024
_IOV_MAX = 512
#: Files larger than this are read with a WILLNEED hint first (the kernel's usual window).
_READAHEAD_ALONE = 128 * 1024
#: Threads reading block headers at open (NVMe serves many reads in parallel).
_OPEN_THREADS = 8


def _pieces(views: Sequence[memoryview]) -> Iterator[memoryview]:
    for v in views:
        flat = flat_bytes(v)
        for off in range(0, flat.nbytes, _PIECE):
            yield flat[off : off + _PIECE]


def _writev_all(fd: int, bufs: list[memoryview]) -> None:
    while bufs:
        n = os.writev(fd, bufs)
        if n == 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        advance(bufs, n)


def _preadv_all(fd: int, bufs: list[memoryview]) -> int:
    """Fill ``bufs`` from offset 0; the number of bytes read (short at end of file)."""
    total = 0
    while bufs and (n := os.preadv(fd, bufs, total)):
        total += n
        advance(bufs, n)
    return total


def _unlink(path: str) -> None:
    """Remove a block's file (gone already is fine); TierIOError if it stays."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        raise TierIOError(f"disk tier: cannot delete {path}: {errname(e)}") from e


def _unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        logger.warning("disk tier: cannot remove %s: %s", path, errname(e))


#: ``syncfs(2)``: flush one filesystem (None where the C library lacks it).
_SYNCFS = libc_function("syncfs", ctypes.c_int)


def _syncfs(path: str) -> None:
    """Make everything written to ``path``'s filesystem durable; OSError if it could not."""
    if _SYNCFS is None:
        raise OSError(errno.ENOSYS, "syncfs is not available")
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        if _SYNCFS(fd) != 0:
            raise_errno()
    finally:
        os.close(fd)


class DiskTier(KeyedDiskTier):
    """Blocks as files on local NVMe; see the module docstring for format and guarantees."""

    def __init__(self, settings: DiskSettings) -> None:
        super().__init__(settings)
        self._table: dict[bytes, StoredBlock] = {}
        #: Keys whose file a write is putting in place now (see :meth:`detach`), and those of
        #: them whose older file a late release left to that write (to unlink if it fails).
        self._writing: collections.Counter[bytes] = collections.Counter()
        self._doomed: set[bytes] = set()
        #: Keys whose released file is being unlinked now, outside the lock (the event loop
        #: takes it too); a write of such a key waits for the unlink before it writes.
        self._unlinking: collections.Counter[bytes] = collections.Counter()
        self._unlinked = threading.Condition(self._lock)
        self._seq = itertools.count()
        #: Per thread: inside :meth:`write_many`, whose one ``syncfs`` replaces the fsyncs.
        self._deferred = threading.local()

    def __len__(self) -> int:
        return len(self._table)

    def contains(self, key: bytes) -> bool:
        return key in self._table

    def record(self, key: bytes) -> BlockRecord | None:
        entry = self._table.get(key)
        return None if entry is None else entry.record

    def keys(self) -> list[bytes]:
        with self._lock:
            return list(self._table)

    def stored_bytes(self, key: bytes) -> int:
        """Bytes the block's file takes; KeyError if the key is not held."""
        return self._table[key].file_bytes

    def estimate_bytes(self, size: int, tenant: str | None = None) -> int:
        """Upper bound of the file size for ``size`` payload bytes (any tenant if None)."""
        tlen = MAX_TENANT_BYTES if tenant is None else len(tenant.encode("utf-8"))
        return header_length(tlen) + size

    def _subdir(self, key: bytes) -> str:
        return os.path.join(self._root, key[16:17].hex())

    def _path(self, key: bytes) -> str:
        return os.path.join(self._subdir(key), key.hex() + EXT)

    def open(self) -> list[BlockRecord]:
        """Create the directory, drop temp files and invalid blocks, return the blocks held."""
        try:
            make_private_dir(self._root)
            with os.scandir(self._root) as it:
                dirs = [d.path for d in it if len(d.name) == 2 and d.is_dir(follow_symlinks=False)]
            for d in dirs:  # each must be ours too: another user's could be filled under us
                make_private_dir(d, follow=False)
            with ThreadPoolExecutor(_OPEN_THREADS) as pool:  # header reads are I/O-bound
                scans = list(pool.map(self._scan_dir, [self._root, *dirs]))
        except OSError as e:
            raise TierIOError(f"disk tier: cannot open directory {self._root}: {errname(e)}") from e
        table = {e.record.key: e for entries, _, _ in scans for e in entries}
        discarded, temps = sum(s[1] for s in scans), sum(s[2] for s in scans)
        with self._lock:
            self._table = table
            self._space.reset(sum(e.file_bytes for e in table.values()), discarded)
            used = self._space.used
        if temps or discarded:
            logger.warning("disk tier %s: removed %d temp files and %d invalid blocks",
                           self._root, temps, discarded)
        if used > self.capacity_bytes:
            logger.warning("disk tier %s: %d bytes of blocks found exceed the capacity of %d bytes",
                           self._root, used, self.capacity_bytes)
        return [e.record for e in table.values()]

    def _scan_dir(self, where: str) -> tuple[list[StoredBlock], int, int]:
        """The valid blocks in one directory, and how many invalid and temp files it removed."""
        entries: list[StoredBlock] = []
        bad = temps = 0
        with os.scandir(where) as it:
            for de in it:
                if de.name.startswith(".") and de.name.endswith(".tmp"):
                    _unlink_quiet(de.path)
                    temps += 1
                elif de.name.endswith(EXT):
                    entry = self._scan(de.path, de.name, where)
                    if entry is None:
                        _unlink_quiet(de.path)
                        bad += 1
                    else:
                        entries.append(entry)
        return entries, bad, temps

    def _scan(self, path: str, name: str, where: str) -> StoredBlock | None:
        try:
            key = bytes.fromhex(name[: -len(EXT)])
        except ValueError:
            key = b""
        if len(key) != KEY_BYTES or where != self._subdir(key):
            logger.warning("disk tier: discarding misplaced or misnamed file %s", path)
            return None
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)  # (a FIFO: no hang)
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    raise PermissionError(errno.EPERM, "not a regular file")
                owned_by_us(st, path)  # another user's file is never taken for a block
                size = st.st_size
                head = os.pread(fd, MAX_HEADER_BYTES, 0)
            finally:
                os.close(fd)
        except OSError as e:
            logger.warning("disk tier: discarding unreadable %s: %s", path, errname(e))
            return None
        entry, reason = parse_header(head, size)
        if entry is not None and entry.record.key != key:
            entry, reason = None, "key does not match the file name"
        if entry is None:
            logger.warning("disk tier: discarding invalid %s: %s", path, reason)
        return entry

    def write(self, record: BlockRecord, views: Sequence[memoryview]) -> int:
        """Store the block; returns the bytes its file takes (no-op if already held).

        Raises CorruptBlockError (``views`` do not match ``record``'s size or checksum;
        nothing is stored), TierFullError, TierIOError, ValueError (bad key or tenant).
        """
        block, header, pieces, expect = prepare(record, views, self._settings.compression,
                                                self._settings.compression_level)
        need = block.header_len + record.size
        with self._lock:
            held = self._table.get(record.key)
            if held is not None and held.record == record:
                return held.file_bytes  # the same block is already here
            # (a different record under the key, e.g. a stale file: replaced below)
            if need > self._space.room(self.clock()):
                raise TierFullError(f"disk tier: no room for {need} bytes")
            self._space.reserved += need
            self._writing[record.key] += 1
        entry: StoredBlock | None = None
        left = False  # a late release left the older file to this write, which failed
        try:
            entry = self._write(block, header, pieces, expect)
        finally:
            with self._lock:  # swap the reservation for the file's real size atomically
                self._space.reserved -= need
                self._writing[record.key] -= 1
                if not self._writing[record.key]:
                    del self._writing[record.key]
                    if record.key in self._doomed:
                        self._doomed.discard(record.key)
                        left = entry is None and record.key not in self._table
                        if left:  # it goes now (outside the lock, as a release's)
                            self._unlinking[record.key] += 1
                if entry is not None:
                    old = self._table.get(record.key)
                    self._space.used += entry.file_bytes - (old.file_bytes if old else 0)
                    self._table[record.key] = entry
            if left:
                with contextlib.suppress(TierIOError):
                    self._unlink_marked(record.key)
        return entry.file_bytes

    def _write(self, block: StoredBlock, header: bytes, pieces: Sequence[memoryview], expect: int | None
               ) -> StoredBlock:
        key = block.record.key
        subdir, final = self._subdir(key), self._path(key)
        with self._lock:
            # (counted in _writing already: no release that comes later unlinks the key's file,
            # but one that began before may be doing it now)
            while self._unlinking[key]:
                self._unlinked.wait()
        try:
            try:
                self._write_file(subdir, final, header, pieces, expect)
            except FileNotFoundError:
                if os.path.isdir(subdir):
                    raise
                # The directory vanished under us: recreate it once and retry.
                os.makedirs(subdir, mode=0o700, exist_ok=True)
                if self._fsync and not getattr(self._deferred, "on", False):
                    began = time.perf_counter()
                    fsync_dir(self._root)
                    self.io_seconds.synced(began)
                self._write_file(subdir, final, header, pieces, expect)
        except OSError as e:
            raise TierIOError(f"disk tier: cannot write {final}: {errname(e)}") from e
        return block

    def _write_file(self, subdir: str, final: str, header: bytes,
                    pieces: Sequence[memoryview], expect: int | None) -> None:
        sync = self._fsync and not getattr(self._deferred, "on", False)
        tmp = os.path.join(subdir, f".{os.path.basename(final)}.{os.getpid()}.{next(self._seq)}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        done = False
        try:
            try:
                hasher = xxhash.xxh3_64()
                batch, batched = [memoryview(header)], len(header)
                for piece in _pieces(pieces):
                    if expect is not None:
                        hasher.update(piece)
                    batch.append(piece)
                    batched += piece.nbytes
                    if batched >= _BATCH or len(batch) >= _IOV_MAX:
                        _writev_all(fd, batch)
                        batch, batched = [], 0
                _writev_all(fd, batch)
                if expect is not None and hasher.intdigest() != expect:
                    raise CorruptBlockError(f"block {os.path.basename(final)}: checksum mismatch at write")
                if sync:
                    began = time.perf_counter()
                    os.fsync(fd)
                    self.io_seconds.synced(began)
            finally:
                os.close(fd)
            os.rename(tmp, final)
            done = True
        finally:
            if not done:
                _unlink_quiet(tmp)
        if sync:
            began = time.perf_counter()
            try:
                fsync_dir(subdir)
            except OSError:
                _unlink_quiet(final)
                raise
            finally:
                self.io_seconds.synced(began)

    def _batch_begin(self, items: int) -> None:
        """With ``fsync: always`` a batch is written and renamed into place without a sync
        per file, then its filesystem is synced once (``syncfs``): two fsyncs per block
        become one flush per batch. A crash before that may leave some of its files torn,
        which :meth:`open` and :meth:`read_into` discard (as with ``fsync: never``)."""
        self._deferred.on = self._fsync and items > 1 and _SYNCFS is not None

    def _batch_end(self) -> Callable[[], None] | None:
        batched = getattr(self._deferred, "on", False)
        self._deferred.on = False
        return (lambda: _syncfs(self._root)) if batched else None

    def prefetch(self, keys: Sequence[bytes]) -> int:
        """Ask the kernel to start reading these blocks' files (``POSIX_FADV_WILLNEED``):
        reads of a batch then overlap on the device instead of waiting one after another.
        Only a hint: nothing is checked or held; returns how many files were hinted."""
        n = 0
        for key in keys:
            if not self.contains(key):
                continue
            try:
                fd = os.open(self._path(key), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
            except OSError:
                continue  # gone or unreadable: its read will say so
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
                n += 1
            except OSError:
                pass  # a filesystem without readahead hints
            finally:
                os.close(fd)
        return n

    def read_into(self, key: bytes, dest: memoryview) -> BlockRecord:
        """Read the block into ``dest`` and verify it; returns its record.

        KeyError if not held; ValueError if ``dest`` is not ``record.size`` bytes (a caller
        bug: the file is kept); CorruptBlockError (file deleted, key dropped) if the file is
        torn or fails its checksums, and then ``dest`` holds garbage; TierIOError on an OS
        error (the key is dropped if its file has vanished).
        """
        entry = self._table.get(key)
        if entry is None:
            raise KeyError(key.hex())
        dest = flat_bytes(dest)
        if dest.readonly or dest.nbytes != entry.record.size:
            raise ValueError(f"dest must be writable and hold exactly {entry.record.size} bytes "
                             f"(got {dest.nbytes}, readonly={dest.readonly})")
        path = self._path(key)
        head = memoryview(bytearray(entry.header_len))
        stored = dest if not entry.flags else memoryview(bytearray(entry.stored))
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    raise OSError(errno.EINVAL, "not a regular file")
                if st.st_size > _READAHEAD_ALONE:
                    # the whole file in flight at once: a plain read of a cold file waits for
                    # each readahead window in turn
                    with contextlib.suppress(OSError):
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
                got = _preadv_all(fd, [head, stored])
            finally:
                os.close(fd)
        except OSError as e:
            if isinstance(e, FileNotFoundError):
                self._forget(entry)
            elif e.errno in (errno.ELOOP, errno.EINVAL) and self._forget(entry):
                _unlink_quiet(path)  # a link or no regular file in its place: gone, as a corrupt block
            raise TierIOError(f"disk tier: cannot read {path}: {errname(e)}") from e
        parsed, reason = parse_header(head, st.st_size)
        if got != entry.file_bytes:
            reason = f"short read ({got} of {entry.file_bytes} bytes)"
        elif parsed is None or parsed != entry:
            reason = reason or "header does not match the block"
        else:
            reason = payload_problem(entry, stored, dest)
        if reason:
            logger.warning("disk tier: discarding corrupt block %s: %s", path, reason)
            if self._forget(entry):
                _unlink_quiet(path)
            raise CorruptBlockError(f"disk tier: block {key.hex()} is corrupt: {reason}")
        return entry.record

    def close(self) -> None:
        """Files need no closing."""

    def _forget(self, entry: StoredBlock) -> bool:
        """Drop ``entry`` from the table if it is still the one held; True if dropped."""
        with self._lock:
            if self._table.get(entry.record.key) is not entry:
                return False
            del self._table[entry.record.key]
            self._space.used -= entry.file_bytes
            return True

    def _detach(self, key: bytes) -> Callable[[], None] | None:
        """Take the block out of the table now; what unlinks its file, unless by then the key
        names another block's file (one written since, or being put in place: the file's name
        is the key's, so a write of the key that begins while the unlink runs waits for it,
        and an unlink that would begin while a write runs leaves the file to that write)."""
        with self._lock:
            entry = self._table.pop(key, None)
            if entry is None:
                return None
            self._space.used -= entry.file_bytes
        return functools.partial(self._unlink_unless_rewritten, key)

    def _unlink_unless_rewritten(self, key: bytes) -> None:
        with self._lock:
            if key in self._table:
                return  # (a newer block's file: the older one went when it was renamed over)
            if key in self._writing:
                self._doomed.add(key)  # a write renames its file over it, or unlinks it if it fails
                return
            self._unlinking[key] += 1  # a write of the key that starts now waits for this unlink
        self._unlink_marked(key)

    def _unlink_marked(self, key: bytes) -> None:
        """Unlink the key's file, counted in ``_unlinking`` by the caller under the lock, which
        is not held meanwhile; TierIOError if it stays."""
        try:
            _unlink(self._path(key))
        finally:
            with self._lock:
                self._unlinking[key] -= 1
                if not self._unlinking[key]:
                    del self._unlinking[key]
                self._unlinked.notify_all()

    def delete(self, key: bytes) -> int:
        """Delete the block; bytes freed (0 if not held). TierIOError if unlink fails."""
        with self._lock:
            entry = self._table.pop(key, None)
            if entry is None:
                return 0
            self._space.used -= entry.file_bytes
            if key in self._writing:  # (as a release's: the write renames over it, or unlinks it)
                self._doomed.add(key)
                return entry.file_bytes
            self._unlinking[key] += 1
        self._unlink_marked(key)
        return entry.file_bytes
