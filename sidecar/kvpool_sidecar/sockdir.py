"""Where the sidecar may put a Unix socket that clients trust.

A process that can replace a socket file with one of its own reads the first bytes of every
client that connects next (a HELLO and its token, a router's replay request), so the
directory a socket lies in must be one no other user can write (in a sticky one such as /tmp,
another user cannot replace our socket, but can bind its name while the sidecar is down, and
the sidecar then refuses to start while clients connect to theirs), and so must the way to it:
a directory above it that another user owns, or may write without the sticky bit, lets that
user rename the socket's directory, while the sidecar runs, and put one of its own in its
place; and a symbolic link on the path that another user owns (planted in a sticky directory
such as /tmp, pointing at our directory when we start) can be pointed elsewhere later, and
every client that follows it then reaches that user's socket.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from kvpool_sidecar.errors import SidecarError
from kvpool_sidecar.links import foreign_link, walk

#: The mode of the directories :func:`make_socket_dir` makes (less the umask): clients of
#: other users reach the socket through them, none may write in them.
DIR_MODE = 0o755


def check_socket_dir(where: Path) -> None:
    """SidecarError unless ``where`` belongs to this process's user or root and no one else
    may write in it (not even a sticky directory, as /tmp: others may not replace our files
    there, but may take a name of ours while it is free), unless every directory on the way
    to it belongs to this process's user or root and is either writable by no one else or
    sticky, and unless every symbolic link on the way to it belongs to this process's user or
    root."""
    _check_links(where)
    way, missing = _the_way(where)
    if missing:
        raise SidecarError(f"the socket's directory {where} does not exist")
    for above in way[:-1]:
        _check_above(above, where)
    st = _stat(way[-1], where)
    if st.st_uid not in (0, os.geteuid()):
        raise SidecarError(f"the socket's directory {where} belongs to uid {st.st_uid}, not to this sidecar's user "
                           "or root: that user could replace the socket with one of its own")
    if st.st_mode & 0o022:
        # sticky or not: the sticky bit keeps others from replacing our socket, not from
        # binding its name while this sidecar is down (at every restart), and clients that
        # connect then give that process their HELLO, token, and trust in what it answers
        raise SidecarError(f"the socket's directory {where} is writable by other users (mode "
                           f"{stat.S_IMODE(st.st_mode):o}): any of them could bind the socket's name while the "
                           "sidecar is down, or replace it; make it 0750")


def make_socket_dir(where: Path) -> None:
    """Make ``where`` and the directories missing on the way to it (:data:`DIR_MODE`), then
    :func:`check_socket_dir` it. The way is checked before anything is made (a symbolic link
    of another user's is not followed into its target), and each directory is made in the
    one before it, opened without following links: one that turns out to be a link is refused."""
    _check_links(where)
    way, missing = _the_way(where)
    if missing:
        for above in way:
            _check_above(above, where)
        _make(way[-1], missing, where)
    check_socket_dir(where)


def _make(base: Path, names: list[str], where: Path) -> None:
    """Make ``names`` one in the other in ``base`` (a real directory), without following links."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
    try:
        fd = os.open(base, flags | os.O_NOFOLLOW)
    except OSError as e:
        raise SidecarError(f"cannot make the socket's directory {where}: {base}: {e}") from e
    try:
        for name in names:
            if name == ".":
                continue
            if name == "..":
                raise SidecarError(f"the socket's path {where} has '..' after a directory not made yet")
            try:
                os.mkdir(name, DIR_MODE, dir_fd=fd)
            except FileExistsError:
                pass  # (made meanwhile: opened below only if it is a directory, not a link)
            try:
                inner = os.open(name, flags | os.O_NOFOLLOW, dir_fd=fd)
            except OSError as e:
                raise SidecarError(f"cannot make the socket's directory {where}: {name}: {e}") from e
            os.close(fd)
            fd = inner
    except OSError as e:
        raise SidecarError(f"cannot make the socket's directory {where}: {e}") from e
    finally:
        os.close(fd)


def _check_above(above: Path, where: Path) -> None:
    """SidecarError unless ``above``, a directory on the way to ``where``, is one no other
    user could rename ``where`` (or a directory on the way) in."""
    st = _stat(above, where)
    if st.st_uid not in (0, os.geteuid()):
        raise SidecarError(f"{above}, a directory on the way to the socket's directory {where}, belongs to uid "
                           f"{st.st_uid}, not to this sidecar's user or root: that user could replace the socket's "
                           "directory (rename it, and make one of its own in its place) and the socket with it")
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        raise SidecarError(f"{above}, a directory on the way to the socket's directory {where}, is writable by other "
                           f"users without the sticky bit (mode {stat.S_IMODE(st.st_mode):o}): any of them could "
                           "replace the socket's directory (rename it, and make one of its own in its place) and the "
                           "socket with it")


def _stat(at: Path, where: Path) -> os.stat_result:
    try:
        return at.lstat()  # (no link: the way's links are followed)
    except OSError as e:
        raise SidecarError(f"cannot check the socket's path {where}: {at}: {e}") from e


def _the_way(where: Path) -> tuple[list[Path], list[str]]:
    """The directories the kernel looks names up in on the way to ``where``, symbolic links
    followed as :func:`~kvpool_sidecar.links.foreign_link` follows them, then ``where``
    itself (its real path) when it exists; and the names left once one is missing."""
    way: list[Path] = []
    try:
        for at, name, st, rest in walk(where):
            way.append(at)
            if st is None:
                return way, [name, *rest]
        way.append(Path(os.path.realpath(where)))  # (the links on the way: ours or root's, checked)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise SidecarError(f"the socket's path {where} has too many symbolic links") from e
        raise SidecarError(f"cannot check the socket's path {where}: {e}") from e
    return way, []


def _check_links(where: Path) -> None:
    """SidecarError if a component of ``where`` is a symbolic link another user owns."""
    try:
        found = foreign_link(where)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise SidecarError(f"the socket's path {where} has too many symbolic links") from e
        raise SidecarError(f"cannot check the socket's path {where}: {e}") from e
    if found is not None:
        at, uid = found
        raise SidecarError(f"the socket's path goes through {at}, a symbolic link that uid {uid} owns: "
                           "that user could point it at a socket of its own; use the real directory")
