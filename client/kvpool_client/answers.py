"""What the sidecar may answer, checked before the client builds anything from it.

Both clients read answer frames through these checks: the frame's announced length against
what that sidecar may send (:func:`answer_limit`), its objects against what its answers
hold (:func:`answer_objects`), its shape (``[request id, status, result]``), and the
handshake's bytes and descriptors. A sidecar that answers past them loses the connection
(:class:`~kvpool_client.errors.ProtocolError`), never the reader's thread or task. Also here:
which requests hold leases, so that a late answer gives them back (:func:`undo_of`).
"""

from __future__ import annotations

import array
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvpool_client.errors import ConnectionLostError, KVPoolError, ProtocolError, RemoteError
from kvpool_client.protocol import FD_BYTE, NO_FD_BYTE, PROTOCOL_VERSION, Op, PutStatus, decode


@dataclass(frozen=True, slots=True)
class Lookup:
    """The longest prefix of the asked keys the pool holds, and each block's tier."""

    prefix: int
    tiers: list[str]


def check_answer(body: list[Any]) -> list[Any]:
    """An answer frame as the sidecar sends them: ``[request id, status, result]``
    (ProtocolError otherwise: the connection is then lost, never the reader's thread or task)."""
    if len(body) != 3 or type(body[0]) is not int or type(body[1]) is not int:
        raise ProtocolError("malformed answer from the sidecar")
    return body


#: What an answer's result must be, checked (and returned, made of what it held) or refused.
Check = Callable[[Any], Any]


def check_items(result: object, asked: int) -> list[Any]:
    """An answer of one item per key asked (ALLOC, ACQUIRE, COMMIT, PUT_INLINE): a list of
    ``asked`` items (ProtocolError otherwise: a result is never paired with another key than
    its own)."""
    if not isinstance(result, list) or len(result) != asked:
        raise ProtocolError(f"the sidecar answered {len(result) if isinstance(result, list) else 'no list of'} "
                            f"items for {asked} keys")
    return result


#: What a put's statuses may be (see :class:`~kvpool_client.protocol.PutStatus`).
_STATUSES = frozenset(int(s) for s in PutStatus)


def _u64(v: object) -> bool:
    """An unsigned 64-bit integer (a lease id, a checksum): what a request can send back."""
    return type(v) is int and 0 <= v < 1 << 64


def _extents(v: object) -> bool:
    """Pieces of the arena as ``[offset, length]`` pairs of integers (where in the arena the
    client checks before it touches them: :meth:`~kvpool_client.arena.ArenaCore._block_views`)."""
    return isinstance(v, list) and all(isinstance(p, list) and len(p) == 2 and _u64(p[0]) and _u64(p[1]) for p in v)


def acquired_items(result: object, asked: int) -> list[Any]:
    """An ACQUIRE answer: per key asked, None (a miss) or ``[lease, size, checksum, extents]``."""
    items = check_items(result, asked)
    for item in items:
        if item is not None and not (isinstance(item, list) and len(item) == 4 and _u64(item[0]) and _u64(item[1])
                                     and _u64(item[2]) and _extents(item[3])):
            raise ProtocolError("malformed ACQUIRE answer from the sidecar")
    return items


def allocated_items(result: object, asked: int) -> list[Any]:
    """An ALLOC answer: per key asked, ``[status, lease, extents or None]``."""
    items = check_items(result, asked)
    for item in items:
        if not (isinstance(item, list) and len(item) == 3 and type(item[0]) is int and item[0] in _STATUSES
                and _u64(item[1]) and (item[2] is None or _extents(item[2]))):
            raise ProtocolError("malformed ALLOC answer from the sidecar")
    return items


def put_results(result: object, asked: int, *, committed: bool = False) -> list[int]:
    """A PUT_INLINE answer (or, ``committed``, a COMMIT's, where a negative code is a lease
    the sidecar no longer knew): per block, a :class:`~kvpool_client.protocol.PutStatus`."""
    items = check_items(result, asked)
    if not all(type(s) is int and (s in _STATUSES or (committed and -(1 << 31) < s < 0)) for s in items):
        raise ProtocolError("malformed put statuses from the sidecar")
    return items


def count_of(result: object) -> int:
    """A PIN, UNPIN or REMOVE answer: how many blocks it touched."""
    if not isinstance(result, int) or isinstance(result, bool) or not 0 <= result < 1 << 64:
        raise ProtocolError("malformed count from the sidecar")
    return result


def stats_of(result: object) -> dict[str, Any]:
    """A STATS answer: a map."""
    if not isinstance(result, dict):
        raise ProtocolError("malformed STATS answer from the sidecar")
    return result


def result_of(body: list[Any]) -> Any:
    _, status, result = body
    if status != 0:
        name, message = result if isinstance(result, list) and len(result) == 2 else ("internal", str(result))
        raise RemoteError(str(name), str(message))
    return result


#: Requests whose answers hold leases: an answer that comes after its caller gave up
#: (a timeout, a cancellation) must give them back, or they stay held until disconnect.
LEASING = (Op.ACQUIRE, Op.ALLOC, Op.ACQUIRE_DEVICE)
#: Requests that settle what a call began (give back leases and rooms, commit what was
#: written): sent even past a task's deadline (:meth:`PoolClient.within`), or what they
#: settle would stay held until the leases expire.
SETTLING = frozenset({Op.RELEASE, Op.ABORT, Op.COMMIT})


def undo_of(op: Op, body: list[Any]) -> tuple[Op, list[Any]] | None:
    """The request that gives back the leases of a late answer to ``op`` (None: nothing)."""
    try:
        result = result_of(body)
    except KVPoolError:
        return None
    if not isinstance(result, list):
        return None
    if op in (Op.ACQUIRE, Op.ACQUIRE_DEVICE):
        reads = [[item[0], False] for item in result if isinstance(item, list) and item and _u64(item[0])]
        return (Op.RELEASE, reads) if reads else None
    writes = [item[1] for item in result
              if isinstance(item, list) and len(item) == 3 and item[2] is not None and _u64(item[1])]
    return (Op.ABORT, writes) if writes else None


def close_fds(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


#: The HELLO answer (the only one before it) is a small map.
PRE_HELLO_ANSWER_BYTES = 1 << 20


#: Answers up to this size are decoded without counting their objects: counting costs a
#: Python call per list (an ACQUIRE answer of 4,096 blocks, 128 KiB, took 4.8 ms to decode
#: counted against 1.4), and tiny objects in a frame this size take about a second to build.
UNCOUNTED_ANSWER_BYTES = 4 << 20


#: Whatever a sidecar says at HELLO, no answer of it is longer than this, nor holds more
#: objects than :data:`MOST_ANSWER_OBJECTS`: its ``max_frame_bytes``, ``max_batch`` and
#: ``block_max_bytes`` set both bounds, and a HELLO of ``max_frame_bytes = 2**40`` had let an
#: answer of any length up to 4 GiB be read (and lifted the async client's bound on what it
#: waits to send). A sidecar of default settings has a bound of 128 MiB.
MOST_ANSWER_BYTES = 1 << 30
MOST_ANSWER_OBJECTS = 1 << 26


def _given(info: dict[str, Any], name: str, default: int) -> int:
    v = info.get(name)
    return v if type(v) is int and v > 0 else default


def max_batch(info: dict[str, Any]) -> int:
    """The most keys (items, leases) one request to the sidecar that said ``info`` at HELLO
    may name (``api.max_batch``; 4,096, its default, where it said none): it refuses a
    request of more whole (``bad_request``)."""
    return _given(info, "max_batch", 4096)


def answer_limit(info: dict[str, Any]) -> int:
    """The longest answer frame a sidecar that said ``info`` at HELLO may send: an inline
    answer stays within its ``max_frame_bytes`` (twice that, for headroom); an ACQUIRE answer
    of ``max_batch`` blocks of ``block_max_bytes``, each in pages of 4 KiB (the smallest),
    takes 20 bytes per extent and less than 64 more per block; never more than
    :data:`MOST_ANSWER_BYTES`. Before HELLO (``info`` empty), :data:`PRE_HELLO_ANSWER_BYTES`."""
    if not info:
        return PRE_HELLO_ANSWER_BYTES
    extents = -(-_given(info, "block_max_bytes", 2 << 20) // 4096)
    return min(MOST_ANSWER_BYTES, max(2 * _given(info, "max_frame_bytes", 64 << 20),
                                      _given(info, "max_batch", 4096) * (64 + 20 * extents)))


def answer_objects(info: dict[str, Any]) -> int:
    """The most objects an answer of that sidecar holds, as :func:`decode` counts them: an
    ACQUIRE answer of ``max_batch`` blocks counts 2 per extent and less than 64 more per
    block (a device descriptor included). An answer of tiny objects past it (empty lists: a
    byte each on the wire, some 56 in memory) is refused rather than built for seconds."""
    extents = -(-_given(info, "block_max_bytes", 2 << 20) // 4096)
    return min(MOST_ANSWER_OBJECTS, _given(info, "max_batch", 4096) * (64 + 2 * extents) + 1024)


def decode_answer(payload: bytes | memoryview, info: dict[str, Any]) -> list[Any]:
    """An answer frame's body, within the objects that sidecar's answers hold."""
    return check_answer(decode(payload, max_objects=answer_objects(info), uncounted_bytes=UNCOUNTED_ANSWER_BYTES))


def check_length(length: int, limit: int) -> None:
    """A frame header that announces more than a sidecar may send: the stream cannot be read
    on (ProtocolError; the caller drops the connection)."""
    if length > limit:
        raise ProtocolError(f"the sidecar announced an answer of {length} bytes, more than the {limit} it may send")


def check_greeting(msg: bytes, fds: list[int]) -> None:
    """The byte a sidecar sends at accept: a plain one (a descriptor here is an old sidecar)."""
    close_fds(fds)
    if not msg:
        raise ConnectionLostError("the sidecar closed the connection during the handshake")
    if fds or msg != NO_FD_BYTE:
        raise ProtocolError(f"the sidecar speaks an older protocol than {PROTOCOL_VERSION}; upgrade it")


def take_fds(sock: socket.socket) -> tuple[bytes, list[int]]:
    """One byte and the descriptor sent with it, if any, received close-on-exec: the arena's
    descriptor opens every block of the space for writing, and a program a thread of the
    engine started before it was mapped and closed must not inherit it (Python 3.11's
    ``socket.recv_fds`` takes a ``flags`` argument and drops it)."""
    fds = array.array("i")
    msg, ancdata, _, _ = sock.recvmsg(1, socket.CMSG_LEN(fds.itemsize), socket.MSG_CMSG_CLOEXEC)
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
    return msg, list(fds)


def marker_fd(msg: bytes, fds: list[int]) -> int | None:
    """The arena's descriptor from the byte sent after HELLO, if it carries one."""
    if not msg:
        close_fds(fds)
        raise ConnectionLostError("the sidecar closed the connection during the handshake")
    if msg == FD_BYTE and fds:
        close_fds(fds[1:])
        return fds[0]
    close_fds(fds)
    return None


def lookup_result(result: object, asked: int) -> Lookup:
    """A LOOKUP answer: the held prefix of the ``asked`` keys and its runs of tiers, which
    cover it exactly (ProtocolError otherwise: an answer never makes the client build more
    than it asked for)."""
    if not (isinstance(result, list) and len(result) == 2 and type(result[0]) is int
            and 0 <= result[0] <= asked and isinstance(result[1], list)):
        raise ProtocolError("malformed lookup answer from the sidecar")
    n, runs = result
    tiers: list[str] = []
    for run in runs:
        if not (isinstance(run, list) and len(run) == 2 and isinstance(run[0], str) and type(run[1]) is int
                and 0 < run[1] <= n - len(tiers)):
            raise ProtocolError("malformed lookup answer from the sidecar")
        tiers += [run[0]] * run[1]
    if len(tiers) != n:
        raise ProtocolError("malformed lookup answer from the sidecar")
    return Lookup(n, tiers)
