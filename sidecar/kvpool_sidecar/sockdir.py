"""Where the sidecar may put a Unix socket that clients trust.

A process that can replace a socket file with one of its own reads the first bytes of every
client that connects next (a HELLO and its token, a router's replay request), so the
directory a socket lies in must be one no other user can change.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from kvpool_sidecar.errors import SidecarError


def check_socket_dir(where: Path) -> None:
    """SidecarError unless ``where`` belongs to this process's user or root and no one else
    may write in it (a sticky directory, as /tmp, keeps others from replacing our files)."""
    st = where.stat()
    if st.st_uid not in (0, os.geteuid()):
        raise SidecarError(f"the socket's directory {where} belongs to uid {st.st_uid}, not to this sidecar's user "
                           "or root: that user could replace the socket with one of its own")
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        raise SidecarError(f"the socket's directory {where} is writable by other users (mode "
                           f"{stat.S_IMODE(st.st_mode):o}, not sticky): any of them could replace the socket with "
                           "one of its own; make it 0750")
