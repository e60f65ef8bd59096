"""Descriptors kept open between operations on files: a bounded cache that threads share.

The segment disk tier reads, punches holes in and syncs files it is no longer appending to.
Opening the file for each of those (a path lookup, an open and a close: three syscalls
around one ``preadv``) had cost as much as the read itself from the page cache. A
:class:`DescriptorCache` keeps up to ``limit`` of them open, the least recently used going
first.

A descriptor is never closed while an operation holds it: each :meth:`DescriptorCache.opened`
counts itself a user, and one evicted or discarded while in use is closed by its last user.
Closing it earlier would let the kernel give its number to the next file opened anywhere in
the process, and the read still under way would then read that file.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

#: Descriptors a cache keeps by default: the segment tier reads from a few segments at a time
#: (64 of them are 4 GiB to 16 GiB of blocks), and the sidecar raises its limit on open files.
DEFAULT_LIMIT = 64


@dataclass(slots=True)
class _Held:
    fd: int
    users: int = 0
    #: Out of the cache (evicted or discarded): the last user closes it.
    dropped: bool = False


class DescriptorCache:
    """Up to ``limit`` descriptors, by a key of the caller's (one key, one path)."""

    def __init__(self, limit: int | None = None, flags: int = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC) -> None:
        """``limit``: descriptors kept open (:data:`DEFAULT_LIMIT` if None)."""
        limit = DEFAULT_LIMIT if limit is None else limit
        if limit < 1:
            raise ValueError("a descriptor cache holds at least one descriptor")
        self.limit = limit
        self._flags = flags
        self._lock = threading.Lock()
        self._held: OrderedDict[int, _Held] = OrderedDict()
        #: Dropped descriptors that a user still holds (closed when it lets go).
        self._dropped_in_use = 0
        #: Bumped by every discard and close: a descriptor opened across one is not kept (its
        #: file may be the one discarded, deleted since).
        self._generation = 0

    def __len__(self) -> int:
        """Descriptors open now (those in the cache and those dropped but still in use)."""
        with self._lock:
            return len(self._held) + self._dropped_in_use

    @contextlib.contextmanager
    def opened(self, key: int, path: str) -> Iterator[int]:
        """A descriptor of ``path`` (opened now, or kept from before) for the block of code
        this wraps; OSError if it cannot be opened."""
        held = self._take(key, path)
        try:
            yield held.fd
        finally:
            self._give(held)

    def discard(self, key: int) -> None:
        """Forget ``key``'s descriptor (its file is being deleted or replaced): closed now,
        or by its last user."""
        with self._lock:
            self._generation += 1
            held = self._held.pop(key, None)
            close = self._drop_locked(held) if held is not None else -1
        _close(close)

    def close(self) -> None:
        """Forget every descriptor (closed now, or each by its last user)."""
        with self._lock:
            self._generation += 1
            helds, self._held = list(self._held.values()), OrderedDict()
            closes = [self._drop_locked(h) for h in helds]
        for fd in closes:
            _close(fd)

    # ----------------------------------------------------------- internals
    def _take(self, key: int, path: str) -> _Held:
        with self._lock:
            held = self._held.get(key)
            if held is not None:
                self._held.move_to_end(key)
                held.users += 1
                return held
            generation = self._generation
        fd = os.open(path, self._flags)  # (not under the lock: other keys' reads go on)
        closes: list[int] = []
        with self._lock:
            held = self._held.get(key)
            if generation != self._generation:  # a discard or close came meanwhile: for this use only
                held = _Held(fd, dropped=True)
                self._dropped_in_use += 1
            elif held is not None:  # another thread opened it meanwhile: use that one
                self._held.move_to_end(key)
                closes.append(fd)
            else:
                held = self._held[key] = _Held(fd)
                while len(self._held) > self.limit:
                    _, oldest = self._held.popitem(last=False)
                    closes.append(self._drop_locked(oldest))
            held.users += 1
        for old in closes:
            _close(old)
        return held

    def _give(self, held: _Held) -> None:
        with self._lock:
            held.users -= 1
            close = -1
            if held.dropped and not held.users:
                close, held.fd = held.fd, -1
                self._dropped_in_use -= 1
        _close(close)

    def _drop_locked(self, held: _Held) -> int:
        """Take ``held`` out: its descriptor, to close now, or -1 where a user still holds it."""
        held.dropped = True
        if held.users:
            self._dropped_in_use += 1
            return -1
        fd, held.fd = held.fd, -1
        return fd


def _close(fd: int) -> None:
    if fd >= 0:
        with contextlib.suppress(OSError):
            os.close(fd)
