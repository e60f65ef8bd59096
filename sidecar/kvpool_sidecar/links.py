"""Symbolic links on the way to a directory the sidecar trusts, and who owns them.

A link another user owns (planted in a directory others may write, as /tmp, pointing at a
directory of ours when the sidecar starts) can be pointed at a directory of that user's
later: the socket's directory (:mod:`kvpool_sidecar.sockdir`) and the disk tier's
(:mod:`kvpool_sidecar.tiers.diskformat`) refuse a path through one.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

#: Symbolic links followed on the way before a path is refused (the kernel's own limit).
MAX_LINKS = 40


def foreign_link(where: str | os.PathLike[str]) -> tuple[Path, int] | None:
    """The first symbolic link on the way to ``where`` (any component, the last too) that
    belongs to another user than this process's or root, with its owner's uid; None when
    there is none. Components not there yet end the walk (the caller makes them, as
    directories). OSError (ELOOP) past :data:`MAX_LINKS` links."""
    seen = 0
    pending = list((Path.cwd() / where).parts)  # not normalized: '..' is resolved as the kernel does
    at = Path(pending.pop(0))
    while pending:
        part = pending.pop(0)
        if part == "..":
            at = at.parent  # (``at`` holds no link: each was replaced by its target)
            continue
        if part == ".":
            continue
        at = at / part
        try:
            st = at.lstat()
        except FileNotFoundError:
            return None
        if not stat.S_ISLNK(st.st_mode):
            continue
        if st.st_uid not in (0, os.geteuid()):
            return at, st.st_uid
        seen += 1
        if seen > MAX_LINKS:
            raise OSError(errno.ELOOP, f"{where} has too many symbolic links on its way")
        target = Path(os.readlink(at))
        pending = list(target.parts) + pending
        at = at.parent if not target.is_absolute() else Path(pending.pop(0))
    return None
