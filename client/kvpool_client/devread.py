"""GPU-tier hits copied device to device: the client side of ``ACQUIRE_DEVICE``.

A sidecar with a GPU tier keeps copies of the blocks read most in device memory. A CUDA
engine on the same GPU asks for them with ``ACQUIRE_DEVICE`` and gets, per hit, a read
lease and a CUDA IPC descriptor of the block's copy (:mod:`kvpool_client.cudaipc`); it opens
the descriptor, copies the block into its own tensor device to device, and releases the
lease. A miss (the block is not in the GPU tier, or this connection may not read it there)
is the caller's to read through the normal DRAM path (``get``).

Nothing is verified on the CPU here: the GPU tier checked the block's checksum when the
block was copied into it, and checks it again whenever the block leaves it (demoted, or
read back into DRAM). Reading the copy in place skips a host round trip, which is the point.

These helpers are shared by :class:`~kvpool_client.client.PoolClient` and
:class:`~kvpool_client.client.AsyncPoolClient` (``get_cuda``); torch is imported only when
they run.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvpool_client.cudaipc import copy_descriptor_into
from kvpool_client.errors import CudaIpcError, KVPoolError, ProtocolError
from kvpool_client.tensors import TensorLayoutError, TorchUnavailableError

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, slots=True)
class DeviceHit:
    """One block of an ``ACQUIRE_DEVICE`` answer: its lease, size, checksum and descriptor."""

    lease: int
    size: int
    checksum: int
    descriptor: Mapping[str, Any]


def check_destinations(keys: int, into: Sequence[torch.Tensor]) -> None:
    """Refuse before anything is asked: no torch or CUDA here, or a destination that is not
    a contiguous CUDA tensor (one per key)."""
    try:
        import torch as tc
    except ImportError as e:
        raise TorchUnavailableError("reading GPU-tier blocks needs torch with CUDA: pip install kvpool[torch]") from e
    if not tc.cuda.is_available():
        raise CudaIpcError("reading GPU-tier blocks needs CUDA, which this process does not have")
    if len(into) != keys:
        raise KVPoolError(f"get_cuda needs one destination per key ({keys} keys, {len(into)} destinations)")
    for i, dest in enumerate(into):
        if not isinstance(dest, tc.Tensor) or not dest.is_cuda:
            raise TensorLayoutError(f"destination {i} must be a CUDA tensor")
        if not dest.is_contiguous():
            raise TensorLayoutError(f"destination {i} must be contiguous")


def releases(answer: object) -> list[list[Any]]:
    """``RELEASE`` items for every lease in an answer, however malformed the rest of it is."""
    if not isinstance(answer, list):
        return []
    return [[item[0], False] for item in answer
            if isinstance(item, list) and item and type(item[0]) is int]


def hits(answer: object, keys: int) -> list[DeviceHit | None]:
    """The answer's items, checked: ``[lease, size, checksum, descriptor]`` or None."""
    if not isinstance(answer, list) or len(answer) != keys:
        raise ProtocolError(f"malformed ACQUIRE_DEVICE answer: expected {keys} items")
    out: list[DeviceHit | None] = []
    for item in answer:
        if item is None:
            out.append(None)
            continue
        if not isinstance(item, list) or len(item) != 4 or not all(type(x) is int for x in item[:3]) \
                or not isinstance(item[3], dict):
            raise ProtocolError("malformed ACQUIRE_DEVICE item: expected [lease, size, checksum, descriptor]")
        out.append(DeviceHit(item[0], item[1], item[2], item[3]))
    return out


def fill(found: Sequence[DeviceHit | None], into: Sequence[torch.Tensor]) -> list[bool]:
    """Copy each hit into its destination device to device; per key, whether it was filled.

    Every size is checked before the first copy: a destination of another size than its
    block is the caller's layout error (:class:`TensorLayoutError`), and nothing is copied.
    On any error, no destination of the call is to be trusted.
    """
    for i, (hit, dest) in enumerate(zip(found, into)):
        if hit is not None and dest.numel() * dest.element_size() != hit.size:
            raise TensorLayoutError(f"block {i} is {hit.size} bytes; its destination holds "
                                    f"{dest.numel() * dest.element_size()}")
    filled: list[bool] = []
    for hit, dest in zip(found, into):
        if hit is not None:
            copy_descriptor_into(hit.descriptor, dest)
        filled.append(hit is not None)
    return filled


__all__ = ["DeviceHit", "check_destinations", "fill", "hits", "releases"]
