"""Bind mounts through mount(2) and umount2(2), and whether a path is a mount point.

Called through libc (ctypes) rather than the ``mount`` program, so the plugin's image needs
no util-linux and no output is parsed. A bind takes its source from an ``O_PATH`` descriptor
(``/proc/self/fd/N``): the directory that was checked is the one mounted, even if its path
changes in between. The plugin runs as root with CAP_SYS_ADMIN (privileged).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from pathlib import Path

from kvpool_csi.errors import MountError

MS_RDONLY = 0x1
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_NOEXEC = 0x8
MS_REMOUNT = 0x20
MS_BIND = 0x1000
UMOUNT_NOFOLLOW = 0x8
MOUNTINFO = Path("/proc/self/mountinfo")

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_void_p]
_libc.mount.restype = ctypes.c_int
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
_libc.umount2.restype = ctypes.c_int


def _mount(source: str | None, target: str, flags: int) -> None:
    if _libc.mount(None if source is None else os.fsencode(source), os.fsencode(target), None, flags, None) != 0:
        err = ctypes.get_errno()
        raise MountError("mount({}, {}, flags={:#x}) failed: {}".format(source, target, flags, os.strerror(err)),
                         err)


def bind_dir(source_fd: int, target: str, *, read_only: bool) -> None:
    """Bind the directory open as ``source_fd`` onto ``target`` with nosuid, nodev, noexec (and
    read-only when asked). A bind takes those flags only on a remount; when the remount fails
    the bind is undone, so a target is never left mounted with fewer restrictions."""
    _mount("/proc/self/fd/{}".format(source_fd), target, MS_BIND)
    flags = MS_REMOUNT | MS_BIND | MS_NOSUID | MS_NODEV | MS_NOEXEC | (MS_RDONLY if read_only else 0)
    try:
        _mount(None, target, flags)
    except MountError:
        unmount(target)
        raise


def unmount(target: str) -> None:
    """Unmount ``target`` (never following a symlink in its last component)."""
    if _libc.umount2(os.fsencode(target), UMOUNT_NOFOLLOW) != 0:
        err = ctypes.get_errno()
        raise MountError("umount({}) failed: {}".format(target, os.strerror(err)), err)


def _unescape(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash in paths as octal escapes (``\\040``)."""
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and i + 3 < len(field) and field[i + 1:i + 4].isdigit():
            out.append(chr(int(field[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def mount_count(path: str) -> int:
    """How many mounts sit on ``path`` in this mount namespace (0: not a mount point).

    Read from ``/proc/self/mountinfo``: comparing devices with the parent misses a bind mount
    of a directory of the same filesystem.
    """
    count = 0
    with open(MOUNTINFO, encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            fields = line.split(" ", 5)
            if len(fields) > 4 and _unescape(fields[4]) == path:
                count += 1
    return count
