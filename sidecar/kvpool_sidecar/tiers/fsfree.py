"""The free space of the filesystem a disk tier lives on, asked once a while far from its end.

A disk tier never offers more room than its filesystem has (other files, a smaller volume
than configured): :meth:`FsFree.free` answers from ``statvfs``. One answer stands for
:data:`FS_FREE_TTL_S` (less what the tier wrote since), where it leaves at least
:data:`FS_SLACK_BYTES` more than the tier's own size does: every reserve asks, on the event
loop and under the tier's lock, and the call took 1.4% of the sidecar's loop in
``make demo``. Near the filesystem's end every reserve asks it again. Another program that
fills the filesystem faster than the slack in the time makes a write fail for want of space
(the write is then refused, as without it).
"""

from __future__ import annotations

import os

FS_FREE_TTL_S = 0.05
FS_SLACK_BYTES = 256 << 20


class FsFree:
    """The free bytes of the filesystem at ``root`` for a tier of ``capacity`` bytes; not
    thread-safe (the tier asks under its lock)."""

    def __init__(self, root: str, capacity: int) -> None:
        self._root = root
        self._capacity = capacity
        #: The last ``statvfs`` answer, the tier's use then, and until when it stands (monotonic).
        self._seen = 0
        self._used = 0
        self._until = 0.0

    def free(self, used: int, now: float) -> int:
        """The filesystem's free bytes, the tier using ``used`` bytes at ``now`` (on the clock
        of :data:`FS_FREE_TTL_S`); the tier's capacity where the directory is not there yet."""
        if now < self._until:
            return self._seen - (used - self._used)
        try:
            st = os.statvfs(self._root)
        except OSError:
            return self._capacity  # not there yet (open() creates it): the size decides
        free = st.f_bavail * st.f_frsize
        far = free - (self._capacity - used) >= FS_SLACK_BYTES
        self._seen, self._used, self._until = free, used, now + FS_FREE_TTL_S if far else 0.0
        return free
