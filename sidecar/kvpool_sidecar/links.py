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
from collections.abc import Iterator
from pathlib import Path

#: Symbolic links followed on the way before a path is refused (the kernel's own limit).
MAX_LINKS = 40


def walk(where: str | os.PathLike[str]) -> Iterator[tuple[Path, str, os.stat_result | None, list[str]]]:
    """Each name the kernel looks up on the way to ``where``: the directory it is looked up
    in (a real one, no link in it), the name, the name's ``lstat`` (None: it is not there,
    and the walk ends) and the names left after it. A symbolic link is one step, then its
    target's names are walked in its place. OSError (ELOOP) past :data:`MAX_LINKS` links, and
    any other error of a lookup."""
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
        try:
            st = (at / part).lstat()
        except FileNotFoundError:
            yield at, part, None, list(pending)
            return
        yield at, part, st, list(pending)
        if not stat.S_ISLNK(st.st_mode):
            at = at / part
            continue
        seen += 1
        if seen > MAX_LINKS:
            raise OSError(errno.ELOOP, f"{where} has too many symbolic links on its way")
        target = Path(os.readlink(at / part))
        pending = list(target.parts) + pending
        if target.is_absolute():
            at = Path(pending.pop(0))


def foreign_link(where: str | os.PathLike[str]) -> tuple[Path, int] | None:
    """The first symbolic link on the way to ``where`` (any component, the last too) that
    belongs to another user than this process's or root, with its owner's uid; None when
    there is none. Components not there yet end the walk (the caller makes them, as
    directories). OSError (ELOOP) past :data:`MAX_LINKS` links."""
    for at, name, st, _ in walk(where):
        if st is not None and stat.S_ISLNK(st.st_mode) and st.st_uid not in (0, os.geteuid()):
            return at / name, st.st_uid
    return None
