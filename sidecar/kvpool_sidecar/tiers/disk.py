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

File format (little-endian), header then payload::

    off  size  field
    0    4     magic b"KVPB"
    4    2     format version (1)
    6    2     flags: bit 0 zstd-compressed payload, bit 1 byte-shuffle filter (2 planes)
    8    2     header length (85 + n + 8)
    10   2     key length (48)
    12   48    key (raw BlockKey)
    60   8     logical payload size (BlockRecord.size)
    68   8     stored payload size (== logical size unless compressed)
    76   8     payload checksum: xxh3-64 of the logical (uncompressed) payload
    84   1     tenant length n (<= 255)
    85   n     tenant, utf-8
    85+n 8     header checksum: xxh3-64 of bytes [0, 85+n)

The file size must be header length + stored size. With ``compression: zstd`` every
payload is shuffled (even bytes, then odd bytes: the high and low bytes of 16-bit values
group, which compresses far better) and compressed; it is stored raw (flags 0) when that
is not smaller, so a file never exceeds :meth:`DiskTier.estimate_bytes`.

Thread safety: methods may run in several threads at once on different keys. The table is
guarded by a lock never held during I/O; writes in flight reserve their space up front so
concurrent writes cannot overrun the capacity. Do not read a key while writing or deleting
that same key.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import itertools
import logging
import os
import struct
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import cast

import xxhash
import zstandard

from kvpool_client.integrity import checksum, gather_with_checksum
from kvpool_sidecar.config import DiskSettings
from kvpool_sidecar.errors import CorruptBlockError, TierFullError, TierIOError
from kvpool_sidecar.tiers.base import BlockRecord, TierKind, WriteResult, scatter

logger = logging.getLogger(__name__)

MAGIC = b"KVPB"
VERSION = 1
FLAG_ZSTD = 0x1
FLAG_SHUFFLE = 0x2
KEY_BYTES = 48
MAX_TENANT_BYTES = 255
EXT = ".kvb"
_FIXED = struct.Struct("<4sHHHH48sQQQB")
_U64 = struct.Struct("<Q")
MAX_HEADER_BYTES = _FIXED.size + MAX_TENANT_BYTES + _U64.size
#: Payload bytes hashed and then handed to the kernel per piece (stays in L2 cache).
_PIECE = 256 * 1024
#: Bytes gathered into one ``writev`` call.
_BATCH = 4 * 1024 * 1024
_IOV_MAX = 512
#: Files larger than this are read with a WILLNEED hint first (the kernel's usual window).
_READAHEAD_ALONE = 128 * 1024
#: Threads reading block headers at open (NVMe serves many reads in parallel).
_OPEN_THREADS = 8


def header_length(tenant_bytes: int) -> int:
    """Bytes of a header whose tenant name takes ``tenant_bytes`` utf-8 bytes."""
    return _FIXED.size + tenant_bytes + _U64.size


@dataclass(frozen=True, slots=True)
class StoredBlock:
    """A block as its header describes it: the record, and how its payload is stored."""

    record: BlockRecord
    header_len: int
    flags: int
    stored: int

    @property
    def file_bytes(self) -> int:
        return self.header_len + self.stored


def errname(e: OSError) -> str:
    code = errno.errorcode.get(e.errno or 0, str(e.errno))
    return f"{code} ({e.strerror})"


def flat_bytes(view: memoryview) -> memoryview:
    """``view`` as one-dimensional unsigned bytes (needs a C-contiguous buffer)."""
    return view if view.ndim == 1 and view.format == "B" else view.cast("B")


def pack_header(record: BlockRecord, flags: int, stored: int) -> bytes:
    """The header of a block file (see the module docstring)."""
    tenant = record.tenant.encode("utf-8")
    if len(record.key) != KEY_BYTES:
        raise ValueError(f"disk tier keys are {KEY_BYTES} bytes, got {len(record.key)}")
    if len(tenant) > MAX_TENANT_BYTES:
        raise ValueError(f"tenant name longer than {MAX_TENANT_BYTES} utf-8 bytes")
    body = _FIXED.pack(MAGIC, VERSION, flags, header_length(len(tenant)), KEY_BYTES,
                       record.key, record.size, stored, record.checksum, len(tenant)) + tenant
    return body + _U64.pack(xxhash.xxh3_64_intdigest(body))


def parse_header(buf: bytes | bytearray | memoryview, file_size: int | None) -> tuple[StoredBlock | None, str]:
    """Validate a header (and the file size it implies, unless None); ``(None, reason)`` if invalid."""
    if len(buf) < _FIXED.size:
        return None, "file shorter than a header"
    magic, version, flags, hlen, klen, key, size, stored, csum, tlen = _FIXED.unpack_from(buf)
    if magic != MAGIC:
        return None, "bad magic"
    if version != VERSION:
        return None, f"unknown format version {version}"
    if hlen != header_length(tlen) or len(buf) < hlen:
        return None, "bad header length"
    body = hlen - _U64.size
    if _U64.unpack_from(buf, body)[0] != xxhash.xxh3_64_intdigest(bytes(buf[:body])):
        return None, "header checksum mismatch"
    if klen != KEY_BYTES or flags & ~(FLAG_ZSTD | FLAG_SHUFFLE) or flags == FLAG_SHUFFLE:
        return None, "bad key length or flags"
    if (stored != size) if not flags & FLAG_ZSTD else (stored >= size):
        return None, "stored size inconsistent with flags"
    if file_size is not None and file_size != hlen + stored:
        return None, f"file is {file_size} bytes, header says {hlen + stored}"
    try:
        tenant = bytes(buf[_FIXED.size : _FIXED.size + tlen]).decode("utf-8")
    except UnicodeDecodeError:
        return None, "tenant is not utf-8"
    return StoredBlock(BlockRecord(key, size, csum, tenant), hlen, flags, stored), ""


_local = threading.local()


def _compressor(level: int) -> zstandard.ZstdCompressor:
    """A per-thread compressor (zstandard contexts are not thread-safe)."""
    cache: dict[int, zstandard.ZstdCompressor] = _local.__dict__.setdefault("zstd", {})
    if level not in cache:
        cache[level] = zstandard.ZstdCompressor(level=level, write_content_size=True)
    return cache[level]


def encode_payload(data: memoryview, level: int) -> tuple[int, bytes | memoryview]:
    """Shuffle and zstd-compress ``data``; ``(flags, stored bytes)``, raw if not smaller."""
    data = flat_bytes(data)
    n = data.nbytes
    half = (n + 1) // 2
    planes = memoryview(bytearray(n))
    planes[:half], planes[half:] = data[0::2], data[1::2]
    packed: bytes = _compressor(level).compress(planes)
    if len(packed) < n:
        return FLAG_ZSTD | FLAG_SHUFFLE, packed
    return 0, data


def decode_payload(flags: int, stored: bytes | bytearray | memoryview, dest: memoryview) -> None:
    """Undo :func:`encode_payload` into ``dest``; CorruptBlockError if it does not fit."""
    dest = flat_bytes(dest)
    if not flags & FLAG_ZSTD:
        if len(stored) != dest.nbytes:
            raise CorruptBlockError("stored payload has the wrong size")
        dest[:] = stored
        return
    try:
        if zstandard.frame_content_size(stored) != dest.nbytes:
            raise CorruptBlockError("compressed frame has the wrong content size")
        raw = zstandard.ZstdDecompressor().decompress(stored, max_output_size=dest.nbytes)
    except zstandard.ZstdError as e:
        raise CorruptBlockError(f"compressed payload does not decode: {e}") from e
    if len(raw) != dest.nbytes:
        raise CorruptBlockError("decompressed payload has the wrong size")
    if flags & FLAG_SHUFFLE:
        half, rv = (dest.nbytes + 1) // 2, memoryview(raw)
        dest[0::2], dest[1::2] = rv[:half], rv[half:]
    else:
        dest[:] = raw


def _pieces(views: Sequence[memoryview]) -> Iterator[memoryview]:
    for v in views:
        flat = flat_bytes(v)
        for off in range(0, flat.nbytes, _PIECE):
            yield flat[off : off + _PIECE]


def advance(bufs: list[memoryview], n: int) -> None:
    """Drop the first ``n`` bytes of ``bufs`` (after a short vectored read or write)."""
    while bufs and n >= bufs[0].nbytes:
        n -= bufs.pop(0).nbytes
    if n:
        bufs[0] = bufs[0][n:]


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


def _unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        logger.warning("disk tier: cannot remove %s: %s", path, errname(e))


def _libc_syncfs() -> Callable[[int], int] | None:
    try:
        fn = ctypes.CDLL(None, use_errno=True).syncfs
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int]
    fn.restype = ctypes.c_int
    return cast(Callable[[int], int], fn)


#: ``syncfs(2)``: flush one filesystem (None where the C library lacks it).
_SYNCFS = _libc_syncfs()


def _syncfs(path: str) -> None:
    """Make everything written to ``path``'s filesystem durable; OSError if it could not."""
    if _SYNCFS is None:
        raise OSError(errno.ENOSYS, "syncfs is not available")
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        if _SYNCFS(fd) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
    finally:
        os.close(fd)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class DiskTier:
    """Blocks as files on local NVMe; see the module docstring for format and guarantees."""

    kind = TierKind.DISK
    blocking = True
    accounts_only = False

    def __init__(self, settings: DiskSettings) -> None:
        if settings.path is None:
            raise ValueError("DiskTier needs settings.path")
        self._settings = settings
        self._root = os.path.abspath(settings.path)
        self._fsync = settings.fsync == "always"
        self._lock = threading.Lock()
        self._table: dict[bytes, StoredBlock] = {}
        self._used = 0
        self._reserved = 0
        self._discarded = 0
        self._seq = itertools.count()
        #: Per thread: inside :meth:`write_many`, whose one ``syncfs`` replaces the fsyncs.
        self._deferred = threading.local()

    @property
    def capacity_bytes(self) -> int:
        return self._settings.size_bytes

    @property
    def used_bytes(self) -> int:
        """Bytes of the block files held (headers included), not counting writes in flight."""
        return self._used

    @property
    def free_bytes(self) -> int:
        """Capacity left after stored files and the space reserved by writes in flight, and
        never more than the filesystem has: a filesystem that fills up (other files, a
        smaller volume than configured) shrinks the tier, so the store evicts disk blocks to
        make room instead of failing every demotion; it grows back when space returns."""
        with self._lock:
            return max(0, self._room_locked())

    def _fs_free(self) -> int:
        try:
            st = os.statvfs(self._root)
        except OSError:
            return self.capacity_bytes  # not there yet (open() creates it): the size decides
        return st.f_bavail * st.f_frsize

    def _room_locked(self) -> int:
        return min(self.capacity_bytes - self._used, self._fs_free()) - self._reserved

    @property
    def discarded_on_open(self) -> int:
        """Invalid or torn block files the last ``open()`` deleted."""
        return self._discarded

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
            os.makedirs(self._root, mode=0o700, exist_ok=True)
            try:
                os.chmod(self._root, 0o700)  # block files are tenants' KV: no other user reads them
            except OSError as e:
                logger.warning("disk tier: cannot make %s private (mode 0700): %s", self._root, errname(e))
            with os.scandir(self._root) as it:
                dirs = [d.path for d in it if len(d.name) == 2 and d.is_dir(follow_symlinks=False)]
            with ThreadPoolExecutor(_OPEN_THREADS) as pool:  # header reads are I/O-bound
                scans = list(pool.map(self._scan_dir, [self._root, *dirs]))
        except OSError as e:
            raise TierIOError(f"disk tier: cannot open directory {self._root}: {errname(e)}") from e
        table = {e.record.key: e for entries, _, _ in scans for e in entries}
        discarded, temps = sum(s[1] for s in scans), sum(s[2] for s in scans)
        with self._lock:
            self._table = table
            self._used = sum(e.file_bytes for e in table.values())
            self._reserved = 0
            self._discarded = discarded
            used = self._used
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
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                size = os.fstat(fd).st_size
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
        header = pack_header(record, 0, record.size)
        if sum(flat_bytes(v).nbytes for v in views) != record.size:
            raise CorruptBlockError(f"block {record.key.hex()}: views do not hold {record.size} bytes")
        need = len(header) + record.size
        with self._lock:
            held = self._table.get(record.key)
            if held is not None and held.record == record:
                return held.file_bytes  # the same block is already here
            # (a different record under the key, e.g. a stale file: replaced below)
            if need > self._room_locked():
                raise TierFullError(f"disk tier: no room for {need} bytes")
            self._reserved += need
        entry: StoredBlock | None = None
        try:
            entry = self._write(record, header, views)
        finally:
            with self._lock:  # swap the reservation for the file's real size atomically
                self._reserved -= need
                if entry is not None:
                    old = self._table.get(record.key)
                    self._used += entry.file_bytes - (old.file_bytes if old else 0)
                    self._table[record.key] = entry
        return entry.file_bytes

    def _write(self, record: BlockRecord, header: bytes, views: Sequence[memoryview]) -> StoredBlock:
        pieces: Sequence[memoryview] = views
        flags, verify = 0, True
        if self._settings.compression == "zstd" and record.size:
            buf = memoryview(bytearray(record.size))
            if gather_with_checksum(buf, views) != record.checksum:
                raise CorruptBlockError(f"block {record.key.hex()}: checksum mismatch at write")
            flags, payload = encode_payload(buf, self._settings.compression_level)
            pieces, verify = [memoryview(payload)], False
            header = pack_header(record, flags, len(payload))
        entry = StoredBlock(record, len(header), flags, sum(flat_bytes(p).nbytes for p in pieces))
        subdir, final = self._subdir(record.key), self._path(record.key)
        expect = record.checksum if verify else None
        try:
            try:
                self._write_file(subdir, final, header, pieces, expect)
            except FileNotFoundError:
                if os.path.isdir(subdir):
                    raise
                # The directory vanished under us: recreate it once and retry.
                os.makedirs(subdir, mode=0o700, exist_ok=True)
                if self._fsync and not getattr(self._deferred, "on", False):
                    _fsync_dir(self._root)
                self._write_file(subdir, final, header, pieces, expect)
        except OSError as e:
            raise TierIOError(f"disk tier: cannot write {final}: {errname(e)}") from e
        return entry

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
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, final)
            done = True
        finally:
            if not done:
                _unlink_quiet(tmp)
        if sync:
            try:
                _fsync_dir(subdir)
            except OSError:
                _unlink_quiet(final)
                raise

    def write_many(self, items: Sequence[tuple[BlockRecord, Sequence[memoryview]]]
                   ) -> list[int | CorruptBlockError | TierFullError | TierIOError]:
        """Store several blocks; per item, the bytes its file takes or the error that kept
        it out (as :meth:`write` would raise it).

        With ``fsync: always`` a batch is written and renamed into place without a sync
        per file, then its filesystem is synced once (``syncfs``): two fsyncs per block
        become one flush per batch. The batch is durable when this returns; a crash before
        that may leave some of its files torn, which :meth:`open` and :meth:`read_into`
        discard (as with ``fsync: never``). If the sync fails, the batch's new files are
        deleted and each is answered with a TierIOError.
        """
        batched = self._fsync and len(items) > 1 and _SYNCFS is not None
        self._deferred.on = batched
        out: list[int | CorruptBlockError | TierFullError | TierIOError] = []
        new: list[int] = []  # items written by this call (not already held)
        try:
            for i, (record, views) in enumerate(items):
                held = self.record(record.key) == record
                try:
                    out.append(self.write(record, views))
                except (CorruptBlockError, TierFullError, TierIOError) as e:
                    out.append(e)
                else:
                    if not held:
                        new.append(i)
        finally:
            self._deferred.on = False
        if batched and new:
            try:
                _syncfs(self._root)
            except OSError as e:
                err = TierIOError(f"disk tier: cannot sync a batch of {len(new)} blocks: {errname(e)}")
                for i in new:
                    with contextlib.suppress(TierIOError):  # the file stays; open() checks it
                        self.delete(items[i][0].key)
                    out[i] = err
        return out

    def prefetch(self, keys: Sequence[bytes]) -> int:
        """Ask the kernel to start reading these blocks' files (``POSIX_FADV_WILLNEED``):
        reads of a batch then overlap on the device instead of waiting one after another.
        Only a hint: nothing is checked or held; returns how many files were hinted."""
        n = 0
        for key in keys:
            if not self.contains(key):
                continue
            try:
                fd = os.open(self._path(key), os.O_RDONLY | os.O_CLOEXEC)
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
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                st = os.fstat(fd)
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
            raise TierIOError(f"disk tier: cannot read {path}: {errname(e)}") from e
        parsed, reason = parse_header(head, st.st_size)
        if got != entry.file_bytes:
            reason = f"short read ({got} of {entry.file_bytes} bytes)"
        elif parsed is None or parsed != entry:
            reason = reason or "header does not match the block"
        else:
            try:
                if entry.flags:
                    decode_payload(entry.flags, stored, dest)
                if checksum(dest) != entry.record.checksum:
                    reason = "payload checksum mismatch"
            except CorruptBlockError as e:
                reason = str(e)
        if reason:
            logger.warning("disk tier: discarding corrupt block %s: %s", path, reason)
            if self._forget(entry):
                _unlink_quiet(path)
            raise CorruptBlockError(f"disk tier: block {key.hex()} is corrupt: {reason}")
        return entry.record

    # ------------------------------------------------------------- Tier (a place is the key)
    def footprint(self, size: int, tenant: str | None = None) -> int:
        return self.estimate_bytes(size, tenant)

    def reserve(self, record: BlockRecord) -> bytes | None:
        """The key, when the block's file fits now (the write itself reserves the bytes)."""
        return record.key if self.free_bytes >= self.estimate_bytes(record.size, record.tenant) else None

    def release(self, place: bytes) -> None:
        self.delete(place)

    def write_copy(self, place: bytes, record: BlockRecord, src: Sequence[memoryview]) -> None:
        self.write(record, src)

    def write_copies(self, items: Sequence[tuple[bytes, BlockRecord, Sequence[memoryview]]]
                     ) -> list[WriteResult]:
        done = self.write_many([(record, src) for _, record, src in items])
        return [None if isinstance(r, int) else r for r in done]

    def read_copy(self, place: bytes, record: BlockRecord, dest: Sequence[memoryview]) -> None:
        """:meth:`read_into`, into one or more views, of the block ``record`` names: a file
        that holds another block (a stale copy under the key) is refused as corrupt."""
        held = self.record(place)
        if held is not None and held != record:
            raise CorruptBlockError(f"disk tier: the file of {place.hex()} holds another block")
        if len(dest) == 1:
            self.read_into(place, dest[0])
            return
        buf = memoryview(bytearray(sum(d.nbytes for d in dest)))
        self.read_into(place, buf)
        scatter(buf, dest)

    def views(self, place: bytes) -> None:
        return None

    def recover(self) -> list[tuple[BlockRecord, bytes]]:
        return [(r, r.key) for r in self.open()]

    def close(self) -> None:
        """Files need no closing."""

    def _forget(self, entry: StoredBlock) -> bool:
        """Drop ``entry`` from the table if it is still the one held; True if dropped."""
        with self._lock:
            if self._table.get(entry.record.key) is not entry:
                return False
            del self._table[entry.record.key]
            self._used -= entry.file_bytes
            return True

    def delete(self, key: bytes) -> int:
        """Delete the block; bytes freed (0 if not held). TierIOError if unlink fails."""
        with self._lock:
            entry = self._table.pop(key, None)
            if entry is None:
                return 0
            self._used -= entry.file_bytes
        path = self._path(key)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            raise TierIOError(f"disk tier: cannot delete {path}: {errname(e)}") from e
        return entry.file_bytes
