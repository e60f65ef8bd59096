"""The disk tier's block format, shared by its two layouts (one file per block,
:mod:`~kvpool_sidecar.tiers.disk`; records in segments, :mod:`~kvpool_sidecar.tiers.segments`),
and the small I/O helpers both use.

A block on disk is a header, then its stored payload (little-endian)::

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

With ``compression: zstd`` every payload is shuffled (even bytes, then odd bytes: the high
and low bytes of 16-bit values group, which compresses far better) and compressed; it is
stored raw (flags 0) when that is not smaller, so a block never takes more than its raw size
plus its header.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
import struct
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import xxhash
import zstandard

from kvpool_client.integrity import checksum, gather_with_checksum
from kvpool_sidecar.errors import CorruptBlockError
from kvpool_sidecar.links import foreign_link
from kvpool_sidecar.tiers.base import BlockRecord

MAGIC = b"KVPB"
VERSION = 1
FLAG_ZSTD = 0x1
FLAG_SHUFFLE = 0x2
KEY_BYTES = 48
MAX_TENANT_BYTES = 255
_FIXED = struct.Struct("<4sHHHH48sQQQB")
_U64 = struct.Struct("<Q")
MAX_HEADER_BYTES = _FIXED.size + MAX_TENANT_BYTES + _U64.size


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


def advance(bufs: list[memoryview], n: int) -> None:
    """Drop the first ``n`` bytes of ``bufs`` (after a short vectored read or write)."""
    while bufs and n >= bufs[0].nbytes:
        n -= bufs.pop(0).nbytes
    if n:
        bufs[0] = bufs[0][n:]

def prepare(record: BlockRecord, views: Sequence[memoryview], compression: str, level: int
            ) -> tuple[StoredBlock, bytes, Sequence[memoryview], int | None]:
    """What a layout writes for a block: its header, the pieces of its stored payload, and
    the checksum to verify those pieces against as they are written (None: already checked,
    when the payload was compressed). CorruptBlockError if ``views`` are not the block."""
    if sum(flat_bytes(v).nbytes for v in views) != record.size:
        raise CorruptBlockError(f"block {record.key.hex()}: views do not hold {record.size} bytes")
    header = pack_header(record, 0, record.size)
    pieces: Sequence[memoryview] = views
    flags = 0
    expect: int | None = record.checksum
    if compression == "zstd" and record.size:
        buf = memoryview(bytearray(record.size))
        if gather_with_checksum(buf, views) != record.checksum:
            raise CorruptBlockError(f"block {record.key.hex()}: checksum mismatch at write")
        flags, payload = encode_payload(buf, level)
        pieces, expect = [memoryview(payload)], None
        header = pack_header(record, flags, len(payload))
    return StoredBlock(record, len(header), flags, sum(flat_bytes(p).nbytes for p in pieces)), header, pieces, expect


def payload_problem(block: StoredBlock, stored: memoryview, dest: memoryview) -> str:
    """Decode a block's stored payload into ``dest`` (when compressed) and check it; what is
    wrong with it, or "" when it is the block."""
    try:
        if block.flags:
            decode_payload(block.flags, stored, dest)
        if checksum(dest) != block.record.checksum:
            return "payload checksum mismatch"
    except CorruptBlockError as e:
        return str(e)
    return ""


def make_private_dir(path: str, *, follow: bool = True) -> None:
    """Create ``path`` (mode 0700) if needed, make it 0700 (whatever other mode it had), and
    refuse it unless this process's user owns it: a directory another user owns (or could
    write before it was made 0700) is theirs to fill, and a block or a seal key planted there
    would be served as the pool's. ``follow=True`` (the tier's own ``disk.path``): a symbolic
    link on the way to it is refused unless this process's user or root owns it
    (:func:`check_links`). ``follow=False`` (a directory inside the tier's): a symlink is
    refused. OSError if it cannot be created or read; PermissionError if it is refused."""
    if follow:
        check_links(path)
    os.makedirs(path, mode=0o700, exist_ok=True)
    # Checked and made 0700 through a descriptor, after the links are checked again: a link
    # another user planted between the first check and makedirs (a cleaner had removed the
    # directory from a sticky /tmp) had been followed, and its target, any directory of
    # root's for a sidecar run as root, made the tier's and chmodded 0700.
    # (O_PATH: a directory of ours this user may not read, 0300, is still made 0700)
    try:
        fd = os.open(path, os.O_PATH | os.O_DIRECTORY | (0 if follow else os.O_NOFOLLOW))
    except OSError as e:
        if e.errno == errno.ENOTDIR or (e.errno == errno.ELOOP and not follow):
            raise PermissionError(errno.ENOTDIR, f"{path} is not a directory"
                                  + ("" if follow else " (a symlink?)")) from None
        raise
    try:
        if follow:
            check_links(path)
        st = os.fstat(fd)
        now = os.stat(path, follow_symlinks=follow)
        if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
            raise PermissionError(errno.EPERM, f"{path} changed while it was checked")
        owned_by_us(st, path)
        if stat.S_IMODE(st.st_mode) != 0o700:
            # tenants' KV: no other user reads or writes it (an O_PATH descriptor takes no
            # fchmod; its /proc link names the directory checked)
            os.chmod(f"/proc/self/fd/{fd}", 0o700)
    finally:
        os.close(fd)


def check_links(path: str) -> None:
    """PermissionError if a symbolic link on the way to ``path`` (any component, the last
    too) belongs to another user than this process's or root: the rule the socket's
    directory follows (:mod:`kvpool_sidecar.links`). Such a link can be pointed at a
    directory of that user's: the tier would write tenants' blocks there and, at a restart,
    serve what it finds there. OSError (ELOOP) past too many links."""
    found = foreign_link(path)
    if found is not None:
        at, uid = found
        raise PermissionError(errno.EPERM, f"the disk tier's path {path} goes through {at}, a symbolic link "
                                           f"that uid {uid} owns: that user could point it at a directory "
                                           "of its own, where the tier would write and read tenants' blocks; "
                                           "use the real directory")


def owned_by_us(st: os.stat_result, path: str) -> None:
    """PermissionError unless this process's user owns what ``st`` describes."""
    if st.st_uid != os.geteuid():
        raise PermissionError(errno.EPERM, f"{path} belongs to uid {st.st_uid}, not to this sidecar's user "
                                           f"({os.geteuid()}): another user could plant blocks in the disk tier; "
                                           "give the tier's directory and all in it to the sidecar's user "
                                           "(chown -R) or choose another disk.path")


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def libc_function(name: str, *argtypes: Any) -> Callable[..., int] | None:
    """The C library's ``name`` (setting errno, returning an int), or None where it lacks it."""
    try:
        fn = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    fn.argtypes = list(argtypes)
    fn.restype = ctypes.c_int
    return fn  # type: ignore[no-any-return]


def raise_errno() -> None:
    """Raise the OSError of the errno a :func:`libc_function` call left."""
    err = ctypes.get_errno()
    raise OSError(err, os.strerror(err))
