"""Where the sidecar may put a Unix socket that clients trust.

A process that can replace a socket file with one of its own reads the first bytes of every
client that connects next (a HELLO and its token, a router's replay request), so the
directory a socket lies in must be one no other user can write (in a sticky one such as /tmp,
another user cannot replace our socket, but can bind its name while the sidecar is down, and
the sidecar then refuses to start while clients connect to theirs), and so must the way to it: a
symbolic link on the path that another user owns (planted in a sticky directory such as
/tmp, pointing at our directory when we start) can be pointed elsewhere later, and every
client that follows it then reaches that user's socket.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from kvpool_sidecar.errors import SidecarError
from kvpool_sidecar.links import foreign_link


def check_socket_dir(where: Path) -> None:
    """SidecarError unless ``where`` belongs to this process's user or root and no one else
    may write in it (not even a sticky directory, as /tmp: others may not replace our files
    there, but may take a name of ours while it is free), and unless every symbolic link on
    the way to it belongs to this process's user or root."""
    _check_links(where)
    st = where.stat()
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
