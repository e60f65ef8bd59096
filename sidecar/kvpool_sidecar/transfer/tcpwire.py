"""The TCP transport's wire format, and the coroutines that take its frames off a socket.

Connection: ``b"KVPP" | version | client nonce``, then the mutual HMAC handshake of
:mod:`kvpool_sidecar.transfer.auth`, which also gives both ends a key for the connection.
Requests are frames ``u32 length | msgpack [op, request id, keys] | tag``; the tag, and the
one at the end of each answer's header, is the MAC of the frame's msgpack bytes under the
connection's key and its place in the connection's sequence (``auth.FrameSeal``): a frame
that fails it ends the connection, before any of it is decoded (version 4; version 3 put the
tag inside the msgpack list, so a forged frame was decoded whole before it was refused).
The answer to a GET is one header frame ``[request id, 0, [[size, checksum, tenant] | nil,
...]] | tag`` (nil for a key not held, and for the copies of a key after its first place in
the request: each block is sent once) followed by each block that was found, in order: the
12-byte nonce of its MAC, its payload, then the MAC's 16-byte tag (AES-256-GMAC under the
connection's key, over the request id, the block's index, key, size, checksum and tenant,
and the payload; the sender counts its nonces, see :mod:`~kvpool_sidecar.transfer.auth`). A block whose MAC is wrong is dropped and the
connection closed: only the node at the other end of the handshake can make one.

A frame's buffer grows as its bytes arrive (never to the length it announced first), and a
served connection's frame must arrive whole within :data:`FRAME_TIMEOUT_S` of its length.
The serving side is in :mod:`kvpool_sidecar.transfer.tcpserve`, the fetching side in
:mod:`kvpool_sidecar.transfer.tcpfetch`.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

from kvpool_client.errors import ProtocolError
from kvpool_client.protocol import HEADER, decode
from kvpool_sidecar.transfer import auth
from kvpool_sidecar.transfer.base import PeerAuthError, PeerError

MAGIC = b"KVPP\x04"
OP_GET = 1
#: The answer ``[request id, ERR_UNKNOWN_OP]`` to an operation this node does not serve
#: (e.g. the Mooncake transport's LOOKUP sent to a node on plain TCP); the connection stays.
ERR_UNKNOWN_OP = 1
HANDSHAKE_TIMEOUT_S = 5.0
MAX_FRAME = 16 << 20
MAX_KEYS = 4096
#: Objects (lists, and the items of lists that hold anything but numbers: see
#: :func:`kvpool_client.protocol.decode`) a peer frame may decode into: a request of
#: MAX_KEYS keys, or an answer's header of MAX_KEYS ``[size, checksum, tenant]`` (five
#: each: its place in the list, its list, and its three items).
FRAME_OBJECTS = 5 * MAX_KEYS + 16
#: Numbers in long lists a peer frame may hold: none of its lists holds more than three.
FRAME_NUMBERS = 64
#: Once a served connection's frame has sent its length, the whole frame must come within
#: this (a length announced, then nothing, had held the connection for good).
FRAME_TIMEOUT_S = HANDSHAKE_TIMEOUT_S
#: A frame is taken at most this many bytes at a time, its buffer grown as they arrive: a
#: peer that announced 16 MiB and sent a byte had held 16 MiB here, zero-filled, while it
#: sent nothing more.
RECV_CHUNK = 256 << 10


class _PeerClosed(PeerError):
    """The peer closed the connection (its end of stream)."""


async def _recv_exact(loop: asyncio.AbstractEventLoop, sock: socket.socket, n: int) -> bytes:
    """The next ``n`` bytes, taken :data:`RECV_CHUNK` at most at a time: what is held for them
    is what has arrived."""
    buf = bytearray()
    while len(buf) < n:
        chunk = await loop.sock_recv(sock, min(n - len(buf), RECV_CHUNK))
        if not chunk:
            raise _PeerClosed("the peer closed the connection")
        if len(chunk) == n:
            return chunk  # (all of it at once: no copy)
        buf += chunk
    return bytes(buf)


async def _recv_sealed(loop: asyncio.AbstractEventLoop, sock: socket.socket, frames: auth.FrameSeal, *,
                       limit: int = MAX_FRAME, idle: float | None = None) -> list[Any]:
    """The next frame, its MAC checked and taken off before any of it is decoded
    (:class:`~kvpool_sidecar.transfer.auth.FrameSeal`); ``limit`` and ``idle`` as for
    :func:`_recv_frame`."""
    payload = frames.open(await _recv_frame(loop, sock, limit, idle))
    if payload is None:
        raise PeerAuthError("a frame's MAC does not match: not from the authenticated peer, or out of turn")
    try:
        return decode(payload, max_items=MAX_KEYS, max_map=0, max_objects=FRAME_OBJECTS, max_numbers=FRAME_NUMBERS)
    except ProtocolError as e:
        raise PeerError(str(e)) from e


async def _recv_frame(loop: asyncio.AbstractEventLoop, sock: socket.socket, limit: int = MAX_FRAME,
                      idle: float | None = None) -> bytes:
    """The bytes of the next frame, after its length (at most ``limit`` of them). With
    ``idle`` (a served connection waiting for its next request), the length must come within
    ``idle`` seconds and the rest of the frame within :data:`FRAME_TIMEOUT_S` of it."""
    try:
        async with asyncio.timeout(idle):
            (length,) = HEADER.unpack(await _recv_exact(loop, sock, HEADER.size))
    except TimeoutError:
        raise PeerError(f"no request in {idle} s") from None
    if length > limit:
        raise PeerError(f"frame of {length} bytes exceeds {limit}")
    try:
        async with asyncio.timeout(None if idle is None else FRAME_TIMEOUT_S):
            return await _recv_exact(loop, sock, length)
    except TimeoutError:
        raise PeerError(f"a frame of {length} bytes did not arrive within {FRAME_TIMEOUT_S} s") from None
