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
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypeAlias

from kvpool_client.errors import KVPoolError
from kvpool_client.keys import BlockKey
from kvpool_client.protocol import PutStatus

if TYPE_CHECKING:
    import torch

    from kvpool_client.client import AsyncPoolClient, PoolClient

    AnyClient: TypeAlias = PoolClient | AsyncPoolClient  # explicit: the client imports this module's users

logger = logging.getLogger(__name__)

#: Alignment of each block in the pinned staging of CUDA destinations (a dtype view needs it).
_ALIGN = 256

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


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A writable byte view of contiguous tensor ``t``: zero-copy for a CPU tensor.

    A GPU tensor is first copied to host memory (the view is then of that copy, and
    writing into it does not change ``t``). The view keeps its tensor alive.
    """
    _torch()
    if t.device.type != "cpu":
        t = t.detach().to("cpu")
    if not t.is_contiguous():
        raise TensorLayoutError("a block must be a contiguous tensor; call .contiguous() first")
    if t.is_conj() or t.is_neg():  # lazy views: the memory does not hold the values
        raise TensorLayoutError("a block cannot be a lazy conjugate or negative view; call .resolve_conj() "
                                "and .resolve_neg() first")
    n = t.numel() * t.element_size()
    if n == 0:
        raise TensorLayoutError("a block cannot be an empty tensor")
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


def get_tensors(client: PoolClient, keys: Sequence[BlockKey | bytes], like: torch.Tensor | Sequence[torch.Tensor],
                device: torch.device | str | None = None) -> list[torch.Tensor | None]:
    """Read blocks into tensors; ``None`` for a miss (or a block that failed its checksum).

    ``like`` a tensor: a template; each hit is read into a new tensor of its shape and
    dtype on ``device`` (default: ``like``'s device). ``like`` a list: one contiguous
    destination per key, filled in place (``device`` must be None); a missed destination
    may hold partial bytes. CPU destinations receive the bytes straight from the arena;
    CUDA ones through pinned host staging and ``copy_(non_blocking=True)`` on the current
    stream (the staging buffer is freed safely by torch's pinned-memory allocator).
    """
    tc = _torch()
    if isinstance(like, tc.Tensor):
        dev = tc.device(device) if device is not None else like.device
        dests = [tc.empty(like.shape, dtype=like.dtype, device=dev) for _ in keys]
    else:
        if device is not None:
            raise KVPoolError("device applies to a template; a list of destinations has its own")
        dests = list(like)
        if len(dests) != len(keys):
            raise KVPoolError("get_tensors needs one destination per key")
    for d in dests:
        if not d.is_contiguous():
            raise TensorLayoutError("destination tensors must be contiguous")
    sizes = [d.numel() * d.element_size() for d in dests]
    offsets: list[int | None] = []  # into the pinned staging of the CUDA destinations
    pos = 0
    for d, n in zip(dests, sizes):
        offsets.append(None if d.device.type == "cpu" else pos)
        pos += 0 if d.device.type == "cpu" else -(-n // _ALIGN) * _ALIGN
    staging: Any = tc.empty(pos, dtype=tc.uint8, pin_memory=True) if pos else None
    staged = [None if off is None else staging[off : off + n] for off, n in zip(offsets, sizes)]
    bufs = [tensor_bytes(d if part is None else part) for d, part in zip(dests, staged)]
    got = client.get(keys, into=bufs)
    out: list[torch.Tensor | None] = []
    for d, n, part, res in zip(dests, sizes, staged, got):
        if res is None:
            out.append(None)
            continue
        if res.nbytes != n:
            raise TensorLayoutError(f"block of {res.nbytes} bytes does not fill a {tuple(d.shape)} {d.dtype} tensor")
        if part is not None:
            d.copy_(part.view(d.dtype).view(d.shape), non_blocking=True)
        out.append(d)
    return out


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


__all__ = ["TensorLayoutError", "TorchUnavailableError", "arena_tensor", "get_tensors", "put_tensors",
           "register_arena_pinned", "tensor_bytes", "unregister_arena_pinned"]
