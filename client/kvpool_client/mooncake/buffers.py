"""The caller's memory: buffers registered by address, and the handles ``get_buffer`` returns.

Mooncake's zero-copy calls take raw addresses (``buffer_ptr``) of memory the caller
registered with ``register_buffer``. kvpool reads and writes such memory with the CPU
(``ctypes``), so it must be host memory mapped in this process; GPU memory is not
supported. Every address range a call names must lie inside one registered buffer, or the
call answers ``INVALID_PARAMS`` without touching it: a stray pointer becomes an error, not a
write to arbitrary memory (Mooncake documents unregistered memory as undefined behaviour).
"""

from __future__ import annotations

import ctypes


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class Registry:
    """Registered ``[start, end)`` address ranges, none overlapping."""

    def __init__(self) -> None:
        self._ranges: dict[int, int] = {}

    def register(self, ptr: int, size: int) -> bool:
        """Add a buffer; False for a bad range or one that overlaps a registered one."""
        if not (_is_int(ptr) and _is_int(size)) or ptr <= 0 or size <= 0:
            return False
        end = ptr + size
        if any(ptr < e and s < end for s, e in self._ranges.items()):
            return False
        self._ranges[ptr] = end
        return True

    def unregister(self, ptr: int) -> bool:
        """Forget the buffer registered at exactly ``ptr``; False if there is none."""
        return self._ranges.pop(ptr, None) is not None

    def clear(self) -> None:
        self._ranges.clear()

    def end_of(self, ptr: int) -> int | None:
        """The end of the registered buffer holding address ``ptr``, if one does."""
        if not _is_int(ptr):
            return None
        for s, e in self._ranges.items():
            if s <= ptr < e:
                return e
        return None

    def view(self, ptr: int, size: int) -> memoryview | None:
        """A writable view of ``size`` bytes at ``ptr``; None unless a registered buffer holds
        all of them (a size of 0 needs ``ptr`` inside one)."""
        if not _is_int(size) or size < 0:
            return None
        end = self.end_of(ptr)
        if end is None or ptr + size > end:
            return None
        return memory_at(ptr, size)


def memory_at(ptr: int, size: int) -> memoryview:
    """``size`` bytes at address ``ptr`` as a writable byte view (no check: see Registry)."""
    return memoryview((ctypes.c_ubyte * size).from_address(ptr)).cast("B")


class BufferHandle(bytearray):
    """An object's bytes, as Mooncake's ``get_buffer`` returns them: a buffer (``bytes(h)``,
    ``memoryview(h)``, ``numpy.frombuffer(h)``) with ``ptr()`` and ``size()``."""

    def ptr(self) -> int:
        """The address of the first byte (valid while the handle lives and keeps its size)."""
        if not self:
            return 0
        return ctypes.addressof(ctypes.c_char.from_buffer(self))

    def size(self) -> int:
        return len(self)
