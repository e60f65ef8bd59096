"""Pre-faulting shared mappings for writing.

A page of the shared arena is writable in a process only after a write fault in that
process (``MAP_POPULATE`` maps shared pages read-only). Taking those faults during a put
or a peer receive costs about a third of the copy's speed the first time each page is
used; ``MADV_POPULATE_WRITE`` (Linux 5.14+) takes them all up front. The call runs
through ctypes, which releases the GIL, so it can run in a background thread.

In the background it runs in steps of :data:`STEP` bytes and stops between two when told:
a client that closes (or a short-lived one: a probe, the CLI) must not wait for a whole
arena's pages (a 4 GiB arena took 0.9-1.2 s, and 3.9 s when its pages were not yet
allocated), nor unmap it from under a running madvise.
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


#: Bytes made writable per step in the background (a few ms each).
STEP = 32 << 20


def _populate(addr: int, size: int) -> bool:
    if _libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(size), MADV_POPULATE_WRITE) == 0:
        return True
    logger.info("MADV_POPULATE_WRITE unavailable (errno %d); pages fault in on first use", ctypes.get_errno())
    return False


def prefault_write(mm: mmap.mmap) -> bool:
    """Make every page of ``mm`` writable without faults; False where the kernel can't."""
    return _populate(_address(mm), len(mm))


class BackgroundPrefault:
    """:func:`prefault_write` in a daemon thread, :data:`STEP` bytes at a time, that
    :meth:`stop` ends after the step under way (the caller goes on at once)."""

    def __init__(self, mm: mmap.mmap) -> None:
        self._addr, self._size = _address(mm), len(mm)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvpool-prefault", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        for off in range(0, self._size, STEP):
            if self._stop.is_set() or not _populate(self._addr + off, min(STEP, self._size - off)):
                return

    def wait(self) -> None:
        """Until every page is writable (or the kernel cannot, or it was stopped)."""
        self._thread.join()

    def stop(self) -> None:
        """End after the step under way; returns at once."""
        self._stop.set()

    def cancel(self) -> None:
        """End after the step under way and wait for it: the mapping may then go."""
        self.stop()
        self._thread.join()
