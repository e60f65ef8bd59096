"""Pre-faulting shared mappings for writing.

A page of the shared arena is writable in a process only after a write fault in that
process (``MAP_POPULATE`` maps shared pages read-only). Taking those faults during a put
or a peer receive costs about a third of the copy's speed the first time each page is
used; ``MADV_POPULATE_WRITE`` (Linux 5.14+) takes them all up front. The call runs
through ctypes, which releases the GIL, so it can run in a background thread.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import mmap
import threading

logger = logging.getLogger(__name__)

MADV_POPULATE_WRITE = 23
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.madvise.restype = ctypes.c_int


def _address(mm: mmap.mmap) -> int:
    view = (ctypes.c_char * len(mm)).from_buffer(mm)
    try:
        return ctypes.addressof(view)
    finally:
        del view  # release the export at once: the mapping stays closable


def prefault_write(mm: mmap.mmap) -> bool:
    """Make every page of ``mm`` writable without faults; False where the kernel can't."""
    size = len(mm)
    if _libc.madvise(ctypes.c_void_p(_address(mm)), ctypes.c_size_t(size), MADV_POPULATE_WRITE) == 0:
        return True
    logger.info("MADV_POPULATE_WRITE unavailable (errno %d); pages fault in on first use", ctypes.get_errno())
    return False


def prefault_write_in_background(mm: mmap.mmap) -> threading.Thread:
    """:func:`prefault_write` in a daemon thread (the caller goes on at once)."""
    t = threading.Thread(target=prefault_write, args=(mm,), name="kvpool-prefault", daemon=True)
    t.start()
    return t
