"""Connecting to the sidecar's Unix socket within a time limit, waiting for room in its
listen queue.

A Unix socket's ``connect`` in non-blocking mode (Python's, under any timeout) fails at once
with ``EAGAIN`` while the listener's queue is full, where a TCP one would wait: any process
that may open the socket could keep it full with connections it never greets, and every
client's connect failed (28 of 40 in a review, 36 of 40 through asyncio, which took the
failure for a connection made). A blocking ``connect`` waits in the kernel for room, as long
as the socket's send timeout (``SO_SNDTIMEO``) allows: :func:`connect_unix` connects that way.
"""

from __future__ import annotations

import math
import socket
import struct

__all__ = ["connect_unix"]


def connect_unix(sock: socket.socket, path: str, seconds: float) -> None:
    """Connect ``sock`` (``AF_UNIX``) to ``path``, waiting up to ``seconds`` for room in a
    full listen queue; ``TimeoutError`` past that, ``OSError`` for any other failure. The
    socket is left in blocking mode with no send timeout: the caller sets its own."""
    if not seconds > 0 or not math.isfinite(seconds):
        raise TimeoutError("no time left to connect to the sidecar")
    whole = min(int(seconds), 1 << 31)
    micro = int((seconds - whole) * 1e6) if whole < 1 << 31 else 0
    sock.settimeout(None)
    # (a timeout of 0 is none at all: the shortest is a microsecond)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", whole, micro or (0 if whole else 1)))
    try:
        sock.connect(path)
    except BlockingIOError as e:  # (the send timeout passed with the queue still full)
        raise TimeoutError(f"the sidecar's socket took no connection within {seconds:.3g}s") from e
    finally:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", 0, 0))
