"""What a call sends: keys as the wire carries them, payloads as byte views, the items
of an ALLOC (a chain's depths and parents, engine block descriptions, hints) and the
tenant's token."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvpool_client.answers import max_batch, undo_of
from kvpool_client.blockinfo import EngineBlock, PutHints, engine_wire
from kvpool_client.errors import KVPoolError
from kvpool_client.keys import BlockKey
from kvpool_client.protocol import Op


DEFAULT_SOCKET = os.environ.get("KVPOOL_SOCKET_PATH", "/run/kvpool/kvpool.sock")

KeyLike = BlockKey | bytes
Payload = bytes | bytearray | memoryview


def raw_keys(keys: Sequence[KeyLike]) -> list[bytes]:
    try:
        return [k.raw for k in keys]  # type: ignore[union-attr]
    except AttributeError:
        return [k.raw if isinstance(k, BlockKey) else bytes(k) for k in keys]


def bytes_view(b: Payload) -> memoryview:
    v = memoryview(b)
    return v if v.format == "B" and v.ndim == 1 and v.c_contiguous else v.cast("B")


def destinations(n: int, into: Sequence[Payload] | None) -> list[memoryview | None]:
    """Where each of a get's ``n`` blocks lands: a buffer of ``into`` each, or None each (the
    client makes them). Fewer buffers than keys, or a read-only one, are an error before
    anything is asked: the
    blocks past the last buffer had been acquired and never released (their leases held until
    the connection closed) and the result came back shorter than the keys."""
    if into is None:
        return [None] * n
    if len(into) < n:
        raise KVPoolError(f"{len(into)} buffers to read {n} blocks into")
    views: list[memoryview | None] = []
    for i, b in enumerate(into):
        v = bytes_view(b)
        if v.readonly:  # (found only as its block was copied: a BufferError, past the client's errors)
            raise KVPoolError(f"buffer {i} to read a block into is read-only")
        views.append(v)
    return views


def batches(items: list[Any], info: dict[str, Any]) -> list[list[Any]]:
    """``items`` in lists of at most the ``max_batch`` of the sidecar that said ``info`` at
    HELLO (it refuses a request of more whole); none for none."""
    n = max_batch(info)
    return [items[i:i + n] for i in range(0, len(items), n)]


def request_pieces(bounds: list[tuple[int, int]] | None, count: int, info: dict[str, Any]) -> list[tuple[int, int]]:
    """The ``[start, end)`` pieces a batch of ``count`` items goes in (``bounds``, or None:
    the whole batch as one), each cut to at most the sidecar's ``max_batch`` items (see
    :func:`batches`); one empty piece for an empty batch (whose request is still sent)."""
    n = max_batch(info)
    out: list[tuple[int, int]] = []
    for lo, hi in bounds or [(0, count)]:
        out += [(a, min(a + n, hi)) for a in range(lo, hi, n)] or [(lo, hi)]
    return out


def abort_allocated(send: Callable[[Op, list[Any]], object], allocs: list[Any], info: dict[str, Any]) -> None:
    """Give back the room of ALLOC answers ``allocs`` (a call that failed part way), in ABORTs
    the sidecar takes, sent without waiting; a connection that is gone gives it back anyway."""
    undo = undo_of(Op.ALLOC, [0, 0, allocs])
    if undo is not None:
        with contextlib.suppress(KVPoolError):
            for batch in batches(undo[1], info):
                send(Op.ABORT, batch)


def tenant_token(token: str | bytes | None) -> bytes | None:
    """The token to present: given, or read from ``$KVPOOL_TOKEN_FILE``."""
    if token is None:
        path = os.environ.get("KVPOOL_TOKEN_FILE")
        if not path:
            return None
        try:
            with open(path, "rb") as f:
                return f.read().strip()
        except OSError as e:
            raise KVPoolError(f"cannot read the tenant token from KVPOOL_TOKEN_FILE: {e.strerror}") from e
    return token.encode() if isinstance(token, str) else bytes(token)


def _alloc_items(keys: list[bytes], sizes: list[int], chain: bool, depth0: int, parent: bytes | None,
                 engine: list[dict[str, Any] | None] | None = None) -> list[Any]:
    items: list[Any] = []
    for i, (k, n) in enumerate(zip(keys, sizes)):
        if chain:
            items.append([k, n, depth0 + i, keys[i - 1] if i else parent])
        else:
            items.append([k, n, -1, None])
        if engine is not None and engine[i] is not None:
            items[-1].append(engine[i])
    return items


@dataclass(slots=True)
class PutPlan:
    """A put's items and views, checked, and the trailing arguments of its request."""

    items: list[Any]
    views: list[memoryview]
    extra: tuple[Any, ...]


def alloc_plan(keys: Sequence[KeyLike], sizes: Sequence[int], chain: bool, depth: int, parent: KeyLike | None,
                hints: PutHints | None,
                engine: Sequence[EngineBlock | None] | None) -> tuple[list[Any], tuple[Any, ...]]:
    """An ALLOC's items and the trailing arguments of its request."""
    raw = raw_keys(keys)
    if len(raw) != len(sizes):
        raise KVPoolError("put needs one payload per key")
    par = raw_keys([parent])[0] if parent is not None else None
    items = _alloc_items(raw, list(sizes), chain, depth, par, engine_wire(engine, len(raw)))
    wire = hints.wire() if hints is not None else None
    return items, () if wire is None else (wire,)


def put_plan(keys: Sequence[KeyLike], payloads: Sequence[Payload], chain: bool, depth: int,
              parent: KeyLike | None, hints: PutHints | None,
              engine: Sequence[EngineBlock | None] | None) -> PutPlan:
    views = [bytes_view(p) for p in payloads]
    items, extra = alloc_plan(keys, [v.nbytes for v in views], chain, depth, parent, hints, engine)
    return PutPlan(items, views, extra)

