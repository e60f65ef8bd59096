"""torch helpers: blocks as tensors, and the shared arena as pinned host memory.

Optional: ``pip install kvpool[torch]``. This module imports torch only when one of its
functions runs; without torch they raise :class:`TorchUnavailableError`.

A block is the raw bytes of one contiguous tensor. dtype and shape are not stored: the
KV layout is part of the model fingerprint (:mod:`kvpool_client.keys`), so a reader that
asks for a key already knows both. A block whose size differs from the destination's
raises a :class:`KVPoolError` (:class:`TensorLayoutError` when it is smaller): a
fingerprint that leaves out part of the layout.

GPU engines: :func:`register_arena_pinned` page-locks the client's mapping of the sidecar's
arena (``cudaHostRegister``), and :func:`arena_tensor` aliases that mapping as one uint8
CPU tensor. A block's extents ``(offset, length)`` come from the protocol's low-level
``ALLOC`` (put) and ``ACQUIRE`` (get) answers; ``arena[off:off + n].copy_(src, non_blocking=True)``
then moves device bytes straight into the pool by DMA (and back from it for a get), with no
CPU copy. Synchronize the stream before ``COMMIT`` (whose checksum is
:func:`kvpool_client.integrity.checksum` over those extents) or before ``RELEASE``.
"""

from __future__ import annotations

import ctypes
import logging
import weakref
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeAlias

from kvpool_client.errors import KVPoolError
from kvpool_client.keys import BlockKey
from kvpool_client.protocol import PutStatus

if TYPE_CHECKING:
    import torch

    from kvpool_client.blockinfo import PutHints
    from kvpool_client.client import AsyncPoolClient, HeldBlocks, PoolClient
    from kvpool_client.reservation import Reservation

    AnyClient: TypeAlias = PoolClient | AsyncPoolClient  # explicit: the client imports this module's users

logger = logging.getLogger(__name__)

#: Alignment of each block in the pinned staging of CUDA destinations (a dtype view needs it).
_ALIGN = 256

#: Bytes read per round into CUDA destinations: a round's host work (a verified copy, or a
#: verification in place) overlaps the DMA of the round before it.
ROUND_BYTES = 256 << 20

#: Arena mappings this process registered with CUDA: client -> (address, size).
_registered: weakref.WeakKeyDictionary[Any, tuple[int, int]] = weakref.WeakKeyDictionary()


class TorchUnavailableError(KVPoolError, ImportError):
    """torch is not installed; ``pip install kvpool[torch]``."""


class TensorLayoutError(KVPoolError, ValueError):
    """A tensor cannot be a block as it is: not contiguous, empty, or of the wrong size."""


def _torch() -> Any:
    try:
        import torch
    except ImportError as e:
        raise TorchUnavailableError("kvpool's tensor helpers need torch: pip install kvpool[torch]") from e
    return torch


def _arena_view(client: AnyClient) -> memoryview:
    view: memoryview | None = client._view
    if view is None:
        raise KVPoolError("the client has no shared arena (a TCP connection, or closed)")
    return view


def _address(view: memoryview) -> int:
    """The address of a writable buffer's first byte (the ctypes export is dropped at once)."""
    anchor = ctypes.c_char.from_buffer(view)
    try:
        return ctypes.addressof(anchor)
    finally:
        del anchor


def _check_block(t: torch.Tensor) -> int:
    """The bytes of block ``t``; TensorLayoutError where its memory is not those bytes."""
    if not t.is_contiguous():
        raise TensorLayoutError("a block must be a contiguous tensor; call .contiguous() first")
    if t.is_conj() or t.is_neg():  # lazy views: the memory does not hold the values
        raise TensorLayoutError("a block cannot be a lazy conjugate or negative view; call .resolve_conj() "
                                "and .resolve_neg() first")
    n: int = t.numel() * t.element_size()
    if n == 0:
        raise TensorLayoutError("a block cannot be an empty tensor")
    return n


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A writable byte view of contiguous tensor ``t``: zero-copy for a CPU tensor.

    A GPU tensor is first copied to host memory (the view is then of that copy, and
    writing into it does not change ``t``). The view keeps its tensor alive.
    """
    _torch()
    if t.device.type != "cpu":
        t = t.detach().to("cpu")
    n = _check_block(t)
    raw = (ctypes.c_ubyte * n).from_address(t.data_ptr())
    raw._kvpool_owner = t  # type: ignore[attr-defined]  # the memory's owner lives as long as the view
    return memoryview(raw).cast("B")


def put_tensors(client: PoolClient, keys: Sequence[BlockKey | bytes], tensors: Sequence[torch.Tensor],
                **put_kwargs: Any) -> list[PutStatus]:
    """Store one block per tensor (``put_kwargs`` go to :meth:`PoolClient.put`, e.g. ``chain``).

    Non-contiguous tensors are rejected with :class:`TensorLayoutError` rather than copied:
    the caller chose the layout the fingerprint names, and a silent ``.contiguous()`` would
    hide a layout mismatch (and cost a copy per block).
    """
    _torch()
    if len(keys) != len(tensors):
        raise KVPoolError("put_tensors needs one tensor per key")
    return client.put(keys, [tensor_bytes(t) for t in tensors], **put_kwargs)


def _rounds(sizes: Sequence[int]) -> list[tuple[int, int]]:
    """``[lo, hi)`` ranges of consecutive blocks of about :data:`ROUND_BYTES` each (at least
    one block per round)."""
    out: list[tuple[int, int]] = []
    lo, acc = 0, 0
    for i, n in enumerate(sizes):
        if acc and acc + n > ROUND_BYTES:
            out.append((lo, i))
            lo, acc = i, 0
        acc += n
    if lo < len(sizes):
        out.append((lo, len(sizes)))
    return out


def _destinations(tc: Any, keys: Sequence[Any], like: torch.Tensor | Sequence[torch.Tensor],
                  device: torch.device | str | None) -> list[torch.Tensor]:
    if isinstance(like, tc.Tensor):
        dev = tc.device(device) if device is not None else like.device
        return [tc.empty(like.shape, dtype=like.dtype, device=dev) for _ in keys]
    if device is not None:
        raise KVPoolError("device applies to a template; a list of destinations has its own")
    dests = list(like)
    if len(dests) != len(keys):
        raise KVPoolError("get_tensors needs one destination per key")
    for d in dests:
        if not d.is_contiguous():
            raise TensorLayoutError("destination tensors must be contiguous")
    return dests


def _wrong_size(d: torch.Tensor, got: int) -> TensorLayoutError:
    return TensorLayoutError(f"block of {got} bytes does not fill a {tuple(d.shape)} {d.dtype} tensor")


def get_tensors(client: PoolClient, keys: Sequence[BlockKey | bytes], like: torch.Tensor | Sequence[torch.Tensor],
                device: torch.device | str | None = None) -> list[torch.Tensor | None]:
    """Read blocks into tensors; ``None`` for a miss (or a block that failed its checksum).

    ``like`` a tensor: a template; each hit is read into a new tensor of its shape and
    dtype on ``device`` (default: ``like``'s device). ``like`` a list: one contiguous
    destination per key, filled in place (``device`` must be None); a missed destination
    may hold partial bytes. CPU destinations receive the bytes straight from the arena;
    CUDA ones through pinned host staging and ``copy_(non_blocking=True)`` on the current
    stream (the staging buffer is freed safely by torch's pinned-memory allocator), in
    rounds of about :data:`ROUND_BYTES`: the verified copy of a round into staging runs
    while the DMA of the round before it is in flight.
    """
    tc = _torch()
    dests = _destinations(tc, keys, like, device)
    sizes = [d.numel() * d.element_size() for d in dests]
    offsets: list[int | None] = []  # into the pinned staging of the CUDA destinations
    pos = 0
    for d, n in zip(dests, sizes):
        offsets.append(None if d.device.type == "cpu" else pos)
        pos += 0 if d.device.type == "cpu" else -(-n // _ALIGN) * _ALIGN
    staging: Any = tc.empty(pos, dtype=tc.uint8, pin_memory=True) if pos else None
    staged = [None if off is None else staging[off : off + n] for off, n in zip(offsets, sizes)]
    bufs = [tensor_bytes(d if part is None else part) for d, part in zip(dests, staged)]
    out: list[torch.Tensor | None] = []
    for lo, hi in _rounds(sizes):
        got = client.get(keys[lo:hi], into=bufs[lo:hi])
        for d, n, part, res in zip(dests[lo:hi], sizes[lo:hi], staged[lo:hi], got):
            if res is None:
                out.append(None)
                continue
            if res.nbytes != n:
                raise _wrong_size(d, res.nbytes)
            if part is not None:
                d.copy_(part.view(d.dtype).view(d.shape), non_blocking=True)
            out.append(d)
    return out


class HeldRounds:
    """Blocks acquired round by round (about :data:`ROUND_BYTES` each, verified in place) and
    held until every copy out of them is done: leaving the ``with`` block synchronizes the
    current streams of the CUDA ``devices`` the copies went to, then releases every round,
    also when an error is raised."""

    def __init__(self, client: PoolClient, devices: Iterable[torch.device]) -> None:
        self.client = client
        self.devices = {d for d in devices if d.type == "cuda"}
        self._held: list[HeldBlocks] = []

    def acquire(self, keys: Sequence[BlockKey | bytes], sizes: Sequence[int]) -> Iterator[tuple[int, HeldBlocks]]:
        """Each round's first index into ``keys`` and its blocks, one round at a time."""
        for lo, hi in _rounds(sizes):
            blocks = self.client.acquire(keys[lo:hi], sizes[lo:hi])  # (small blocks: in pieces)
            self._held.append(blocks)
            yield lo, blocks

    def __enter__(self) -> HeldRounds:
        return self

    def __exit__(self, *exc: object) -> None:
        tc = _torch()
        try:
            for dev in self.devices:  # the arena's pages may be reused once released
                tc.cuda.current_stream(dev).synchronize()
        finally:
            held, self._held = self._held, []
            first: BaseException | None = None
            for blocks in held:  # every round, whatever one release raises
                try:
                    blocks.release()
                except KVPoolError as e:
                    first = first or e
            if first is not None:
                raise first


def copy_out(arena: torch.Tensor, dst: torch.Tensor, extents: Sequence[tuple[int, int]]) -> None:
    """Copy a block's ``extents`` of ``arena`` (:func:`arena_tensor`) into the bytes of
    contiguous ``dst``, one ``copy_(non_blocking=True)`` per run of extents that lie end to
    end in the arena (a chain put together usually does)."""
    from kvpool_client.cudaipc import coalesce

    flat = dst.view(-1).view(_torch().uint8)
    for src, at, length in coalesce(extents):
        flat[at : at + length].copy_(arena[src : src + length], non_blocking=True)


def _fills(extents: Sequence[tuple[int, int]] | None, size: int) -> bool:
    return extents is not None and sum(length for _, length in extents) == size


def get_tensors_in_place(client: PoolClient, keys: Sequence[BlockKey | bytes],
                         dests: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
    """:func:`get_tensors` into contiguous CUDA tensors ``dests`` by DMA straight out of the
    shared arena, with no host copy: the blocks are acquired (verified in place) in rounds
    (:class:`HeldRounds`), so that the CPU verifies a round while the DMA of the round before
    it is in flight, and stay pinned until every copy is done. Without a registered arena
    (:func:`register_arena_pinned`) this is :func:`get_tensors`."""
    tc = _torch()
    dests = _destinations(tc, keys, list(dests), None)
    if client not in _registered or any(d.device.type != "cuda" for d in dests):
        return get_tensors(client, keys, dests)
    return _in_place(client, keys, dests)


def _in_place(client: PoolClient, keys: Sequence[BlockKey | bytes],
              dests: list[torch.Tensor]) -> list[torch.Tensor | None]:
    """The in-place read of :func:`get_tensors_in_place`, for destinations on any device."""
    sizes = [d.numel() * d.element_size() for d in dests]
    arena = arena_tensor(client)
    out: list[torch.Tensor | None] = []
    try:
        with HeldRounds(client, (d.device for d in dests)) as rounds:
            for lo, blocks in rounds.acquire(keys, sizes):
                for d, n, views, extents in zip(dests[lo:], sizes[lo:], blocks.views, blocks.extents):
                    if views is None or extents is None:
                        out.append(None)
                        continue
                    if not _fills(extents, n):
                        raise _wrong_size(d, sum(length for _, length in extents))
                    copy_out(arena, d, extents)
                    out.append(d)
    finally:
        del arena
    return out


def copy_in(arena: torch.Tensor, src: torch.Tensor, extents: Sequence[tuple[int, int]]) -> None:
    """Copy the bytes of contiguous ``src`` into a block's ``extents`` of ``arena``
    (:func:`arena_tensor`): :func:`copy_out` the other way."""
    from kvpool_client.cudaipc import coalesce

    flat = src.view(-1).view(_torch().uint8)
    for dst, at, length in coalesce(extents):
        arena[dst : dst + length].copy_(flat[at : at + length], non_blocking=True)


def arena_registered(client: AnyClient) -> bool:
    """Whether this process registered the client's arena with CUDA (:func:`register_arena_pinned`)."""
    return client in _registered


def put_tensors_in_place(client: PoolClient, keys: Sequence[BlockKey | bytes], tensors: Sequence[torch.Tensor], *,
                         chain: bool = False, depth: int = 0, parent: BlockKey | bytes | None = None,
                         hints: PutHints | None = None) -> list[PutStatus]:
    """:func:`put_tensors` from contiguous CUDA tensors by DMA straight into the shared
    arena, with no host copy: each round's room (about :data:`ROUND_BYTES`) is reserved
    (:meth:`PoolClient.reserve`), the tensors are copied into it on their devices' current
    streams, and once those copies are done the blocks are checksummed where they lie and
    committed, while the DMA of the next round is in flight. Without a registered arena
    (:func:`register_arena_pinned`), or for tensors not all on CUDA, this is :func:`put_tensors`."""
    tc = _torch()
    if len(keys) != len(tensors):
        raise KVPoolError("put_tensors needs one tensor per key")
    for t in tensors:
        _check_block(t)
    if client not in _registered or any(t.device.type != "cuda" for t in tensors):
        return put_tensors(client, keys, tensors, chain=chain, depth=depth, parent=parent, hints=hints)
    return _put_in_place(tc, client, keys, list(tensors), chain, depth, parent, hints)


def _put_in_place(tc: Any, client: PoolClient, keys: Sequence[BlockKey | bytes], tensors: list[torch.Tensor],
                  chain: bool, depth: int, parent: BlockKey | bytes | None,
                  hints: PutHints | None) -> list[PutStatus]:
    """The rounds of :func:`put_tensors_in_place`, for tensors on any device (the copies of
    CPU tensors are done when issued)."""
    sizes = [t.numel() * t.element_size() for t in tensors]
    arena = arena_tensor(client)
    devices = {t.device for t in tensors if t.device.type == "cuda"}
    statuses: list[PutStatus] = []
    open_: list[Reservation] = []
    try:
        for lo, hi in _rounds(sizes):
            room = client.reserve(keys[lo:hi], sizes[lo:hi], chain=chain, depth=depth + lo,
                                  parent=keys[lo - 1] if chain and lo else parent, hints=hints)
            open_.append(room)
            for t, extents in zip(tensors[lo:hi], room.extents):
                if extents is not None:
                    copy_in(arena, t, extents)
            copied = [tc.cuda.current_stream(d).record_event() for d in devices]
            if len(open_) > 1:  # the round before: its copies were waited for, commit it
                statuses += open_[0].commit()
                open_.pop(0)
            for ev in copied:
                ev.synchronize()
        while open_:
            statuses += open_[0].commit()
            open_.pop(0)
    except BaseException:
        _give_back(tc, open_, devices)
        raise
    finally:
        del arena
    return statuses


def _give_back(tc: Any, rooms: list[Reservation], devices: Iterable[torch.device]) -> None:
    """Abort ``rooms`` once no copy into them can still land; where the devices cannot say
    (a CUDA error), the room is left to the sidecar, which takes it back when the leases
    expire, rather than given back under a DMA still in flight."""
    try:
        for d in devices:
            tc.cuda.current_stream(d).synchronize()
    except RuntimeError:
        logger.warning("kvpool: a device failed during a put; its room returns when its leases expire")
        for room in rooms:
            room.abandon()
        return
    for room in rooms:  # every one, whatever one abort raises (the caller's error is the one raised)
        try:
            room.abort()
        except KVPoolError as e:
            logger.warning("kvpool: giving back the room of a failed put failed: %s", e)


def arena_tensor(client: AnyClient) -> torch.Tensor:
    """A uint8 CPU tensor aliasing the client's whole mapped arena (no copy).

    With the arena registered (:func:`register_arena_pinned`), a GPU engine reads a block
    straight into device memory: ``with client.acquire(keys) as held:`` then, for each
    ``(offset, length)`` in ``held.extents[i]``, ``dst.copy_(arena[offset:offset + length],
    non_blocking=True)`` and synchronize before the ``with`` block ends.

    The tensor holds a buffer export of the mapping, so the mapping cannot be unmapped
    under it: drop every arena tensor (and view of it) before ``client.close()``, which
    raises ``BufferError`` while one is alive.
    """
    tc = _torch()
    view = _arena_view(client)
    anchor = (ctypes.c_ubyte * view.nbytes).from_buffer(view)
    t: torch.Tensor = tc.frombuffer(anchor, dtype=tc.uint8)
    return t


def register_arena_pinned(client: AnyClient) -> bool:
    """Page-lock the client's arena mapping for CUDA DMA; False (logged) where that fails.

    Call :func:`unregister_arena_pinned` before closing the client (CUDA requires that
    registered memory be unregistered before it is unmapped).
    """
    tc = _torch()
    if client in _registered:
        return True
    if not tc.cuda.is_available():
        logger.info("arena not pinned: CUDA is not available")
        return False
    view = _arena_view(client)
    ptr, size = _address(view), view.nbytes
    err = tc.cuda.cudart().cudaHostRegister(ptr, size, 0)
    if int(err) != 0:
        logger.warning("arena not pinned: cudaHostRegister of %d bytes failed with CUDA error %d", size, int(err))
        return False
    _registered[client] = (ptr, size)
    # closing the client unmaps the arena: CUDA must forget the range first, or a later
    # mapping at the same address would be taken for these pages
    client.before_unmap.append(lambda: unregister_arena_pinned(client))
    logger.info("arena pinned: %d bytes registered with CUDA", size)
    return True


def unregister_arena_pinned(client: AnyClient) -> bool:
    """Undo :func:`register_arena_pinned`; False when the arena was not registered."""
    tc = _torch()
    entry = _registered.pop(client, None)
    if entry is None:
        return False
    err = tc.cuda.cudart().cudaHostUnregister(entry[0])
    if int(err) != 0:
        logger.warning("cudaHostUnregister failed with CUDA error %d", int(err))
        return False
    return True


__all__ = ["HeldRounds", "TensorLayoutError", "TorchUnavailableError", "arena_registered", "arena_tensor", "copy_in",
           "copy_out", "get_tensors", "get_tensors_in_place", "put_tensors", "put_tensors_in_place",
           "register_arena_pinned", "tensor_bytes", "unregister_arena_pinned"]
