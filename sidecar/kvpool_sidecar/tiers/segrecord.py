"""A record of the segment tier: what one is on disk, and how one is told from any other bytes.

A block is a record in a segment file (:mod:`~kvpool_sidecar.tiers.segfiles`), at an offset
that is a multiple of 4 KiB::

    record = header (the block file's header, :func:`~kvpool_sidecar.tiers.diskformat.pack_header`)
             | seal (16 bytes) | stored payload | zeros up to the next 4 KiB

The seal is a keyed BLAKE2b of the header under the tier's own secret (``segments/.seal-key``,
32 random bytes, 0600, made at the first open: :func:`seal_key`): a header that anyone else
wrote (a tenant's payload can hold any bytes) never passes for a record, wherever it lies.
:func:`sealed` tells a record's start at the scan at open; :func:`record_problem` checks a
whole record read back.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import logging
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass

from kvpool_sidecar.tiers.diskformat import StoredBlock, fsync_dir, owned_by_us, parse_header
from kvpool_sidecar.tiers.segfiles import Segment, aligned

logger = logging.getLogger(__name__)

KEY_FILE = ".seal-key"
SEAL_BYTES = 16


@dataclass(frozen=True, slots=True)
class Slot:
    """Where a block's record lies."""

    block: StoredBlock
    segment: Segment
    offset: int

    @property
    def span(self) -> int:
        """Header, seal and stored payload."""
        return self.block.file_bytes + SEAL_BYTES

    @property
    def length(self) -> int:
        return aligned(self.span)


def seal_of(key: bytes, header: bytes | memoryview) -> bytes:
    """The seal of ``header`` under the tier's secret ``key``."""
    return hashlib.blake2b(header, key=key, digest_size=SEAL_BYTES).digest()


def sealed(key: bytes, head: bytes) -> StoredBlock | None:
    """The block whose header ``head`` begins with, if this tier wrote it (sealed)."""
    block, _ = parse_header(head, None)
    if block is None or not hmac.compare_digest(
            head[block.header_len : block.header_len + SEAL_BYTES], seal_of(key, head[: block.header_len])):
        return None
    return block


def record_problem(key: bytes, slot: Slot, head: memoryview, seal: memoryview, payload: Callable[[], str]) -> str:
    """What is wrong with a whole record read (or ""): its header and seal, then what
    ``payload()`` finds of its bytes."""
    parsed, reason = parse_header(head, None)
    if parsed is None or parsed != slot.block or not hmac.compare_digest(seal, seal_of(key, head)):
        return reason or "header does not match the block"
    return payload()


def seal_key(directory: str) -> bytes:
    """The tier's secret for sealing headers, in ``directory``: read, or made once (OSError
    if neither)."""
    path = os.path.join(directory, KEY_FILE)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        # (O_NONBLOCK: a FIFO in its place had hung the tier's open for good)
        with open(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC), "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise PermissionError(errno.EPERM, f"{path} is not a regular file")
            owned_by_us(st, path)  # a key another user planted seals its records
            key = f.read()
        if len(key) == 32:
            return key
        logger.warning("disk tier: %s is damaged; a new key makes every record here unreadable", path)
        os.unlink(path)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        key = os.urandom(32)
        os.write(fd, key)
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_dir(directory)
    return key
