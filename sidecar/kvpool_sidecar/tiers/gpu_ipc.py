"""CUDA IPC descriptors of GPU-tier blocks: plain values a local engine opens without pickle.

:func:`ipc_descriptor` describes a block of a CUDA buffer (the GPU tier's allocation) as a
mapping of ints, bytes, a bool and lists: what ``torch.multiprocessing.reductions.reduce_tensor``
produces for the buffer (its storage's shareable CUDA handle, size and offset, the device,
the reference-counter file and slot, the IPC event recorded after the last write) plus the
device's UUID and the block's extents inside the buffer. It packs with msgpack like the rest
of the local protocol; :mod:`kvpool_client.cudaipc` (which defines the format and checks it
on both sides) opens it in the engine's process. Unlike pickling ``reduce_tensor``'s output,
a consumer never unpickles callables that a peer chose.

Each call shares the buffer's storage anew: torch takes one reference-counter slot and one
IPC event per call, and keeps the memory allocated until the consumer that opened that
descriptor frees its storage. So make one descriptor per use, open it exactly once, and
give descriptors only to trusted local engines (a holder reaches the whole allocation).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from kvpool_client.cudaipc import DESCRIPTOR_VERSION, MAX_EXTENTS, device_uuid, parse_descriptor
from kvpool_client.errors import IpcDescriptorError
from kvpool_sidecar.errors import TierError

if TYPE_CHECKING:
    import torch

#: The arguments of ``rebuild_cuda_tensor`` that the descriptor carries, by descriptor field.
_SHARED = {
    "device": "storage_device",
    "handle": "storage_handle",
    "storage_size": "storage_size_bytes",
    "storage_offset": "storage_offset_bytes",
    "ref_counter_handle": "ref_counter_handle",
    "ref_counter_offset": "ref_counter_offset",
    "event_handle": "event_handle",
    "event_sync_required": "event_sync_required",
}


def _check_extents(extents: Sequence[tuple[int, int]], size: int) -> list[list[int]]:
    if not 1 <= len(extents) <= MAX_EXTENTS:
        raise TierError(f"a CUDA IPC descriptor takes 1 to {MAX_EXTENTS} extents, got {len(extents)}")
    out: list[list[int]] = []
    for off, n in extents:
        if type(off) is not int or type(n) is not int or off < 0 or n <= 0 or off + n > size:
            raise TierError(f"extent ({off!r}, {n!r}) is not inside the {size}-byte GPU buffer")
        out.append([off, n])
    return out


def _shared_fields(buffer: torch.Tensor) -> dict[str, Any]:
    """``reduce_tensor``'s arguments for ``rebuild_cuda_tensor``, by parameter name."""
    from torch.multiprocessing import reductions

    reduce: Callable[[torch.Tensor], tuple[Callable[..., Any], tuple[Any, ...]]] = reductions.reduce_tensor
    try:
        rebuild, args = reduce(buffer.detach())
    except RuntimeError as e:  # a CUDA error while sharing
        raise TierError(f"cannot share the GPU buffer over CUDA IPC: {e}") from e
    if rebuild is not reductions.rebuild_cuda_tensor:
        raise TierError(f"torch shared the GPU buffer with {getattr(rebuild, '__name__', rebuild)!r}, "
                        "not rebuild_cuda_tensor")
    try:
        return dict(inspect.signature(rebuild).bind(*args).arguments)
    except TypeError as e:
        raise TierError(f"this torch's reduce_tensor does not match its rebuild_cuda_tensor: {e}") from e


def ipc_descriptor(buffer: torch.Tensor, extents: list[tuple[int, int]]) -> dict[str, Any]:
    """A descriptor of the block at ``extents`` (byte offset, length) of CUDA ``buffer``.

    ``buffer`` is contiguous (the GPU tier's uint8 allocation); the block's bytes are the
    extents in order. Raises :class:`TierError` for a buffer that is not on a CUDA device,
    extents outside it, or a share that torch refuses.
    """
    try:
        import torch as tc
    except ImportError as e:
        raise TierError("CUDA IPC needs torch with CUDA") from e
    if not isinstance(buffer, tc.Tensor):
        raise TierError(f"CUDA IPC needs a CUDA tensor, not {type(buffer).__name__}")
    if not buffer.is_cuda:
        raise TierError(f"CUDA IPC needs a CUDA buffer; this one is on {buffer.device}")
    if not buffer.is_contiguous():
        raise TierError("CUDA IPC needs a contiguous buffer")
    size = buffer.numel() * buffer.element_size()
    runs = _check_extents(extents, size)
    fields = _shared_fields(buffer)
    desc: dict[str, Any] = {"v": DESCRIPTOR_VERSION}
    for name, arg in _SHARED.items():
        desc[name] = fields[arg]
    desc["handle"] = bytes(desc["handle"]) if desc["handle"] is not None else None
    desc["ref_counter_handle"] = bytes(desc["ref_counter_handle"])
    desc["event_handle"] = bytes(desc["event_handle"])
    for name in ("device", "storage_size", "storage_offset", "ref_counter_offset"):
        desc[name] = int(desc[name])
    desc["event_sync_required"] = bool(desc["event_sync_required"])
    desc["device_uuid"] = device_uuid(desc["device"])
    desc["buffer_offset"] = int(fields["tensor_offset"]) * buffer.element_size()
    desc["extents"] = runs
    desc["nbytes"] = sum(n for _, n in runs)
    try:
        parse_descriptor(desc)  # the consumer's own checks: a torch whose handles changed fails here
    except IpcDescriptorError as e:
        raise TierError(f"torch produced a CUDA IPC descriptor kvpool cannot send: {e}") from e
    return desc


__all__ = ["ipc_descriptor"]
