"""CUDA IPC descriptors of GPU-tier blocks: check one, open it, copy it device to device.

The sidecar's GPU tier hands a local CUDA engine a *descriptor* of a block: a mapping of
plain values only (ints, bytes, a bool, lists), so it travels in msgpack like the rest of
the local protocol and never carries pickled callables. Its fields:

``v``
    the descriptor format, :data:`DESCRIPTOR_VERSION`.
``device``, ``device_uuid``
    the CUDA device index in the sidecar, and the device's 16-byte UUID (empty when the
    sidecar could not read it). The UUID is what names the GPU: a consumer with another
    ``CUDA_VISIBLE_DEVICES`` opens the device of that UUID under its own index.
``handle``, ``storage_size``, ``storage_offset``
    the storage's shareable CUDA handle as torch writes it (``[version][kind][payload]``,
    kind ``c`` a ``cudaMalloc`` block followed by its 64-byte ``cudaIpcMemHandle_t``, kind
    ``e`` an expandable segment; a bare 64-byte handle from older torch), the storage's
    size in bytes, and its offset in bytes inside that CUDA allocation.
``ref_counter_handle``, ``ref_counter_offset``
    the shared-memory file and slot of the reference the sidecar holds for this consumer:
    the sidecar's memory stays allocated until the consumer's storage is gone.
``event_handle``, ``event_sync_required``
    the 64-byte ``cudaIpcEventHandle_t`` recorded after the sidecar's last write; the
    consumer's stream waits on it before it reads (when ``event_sync_required``).
``buffer_offset``, ``extents``, ``nbytes``
    where the tier's buffer starts in the storage (bytes), the block's ``[offset, length]``
    runs inside the buffer, in block order, and their total.

These are the fields of ``torch.multiprocessing.reductions.reduce_tensor`` for a CUDA
tensor; :func:`open_storage` hands them to torch's own ``rebuild_cuda_tensor``, so the
consumer side keeps torch's caching of opened handles and its reference counting.

**Open each descriptor once.** It carries one reference to the sidecar's memory that the
consumer gives back when the opened storage is freed; ask the sidecar for a new descriptor
for each use. The consumer must be another process (CUDA refuses to open a handle in the
process that made it) on the same node, seeing the same GPU, and must share ``/dev/shm``
with the sidecar (the reference counters live there). Whoever holds a descriptor can
read and write the sidecar's whole GPU allocation: give them to trusted engines only.

Optional: torch is imported when a function that needs it runs; without torch they raise
:class:`~kvpool_client.tensors.TorchUnavailableError`. :func:`parse_descriptor` and
:func:`coalesce` need no torch and no GPU.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvpool_client.errors import CudaIpcError, IpcDescriptorError
from kvpool_client.tensors import TensorLayoutError, TorchUnavailableError

if TYPE_CHECKING:
    import torch

#: The descriptor format this module writes and reads.
DESCRIPTOR_VERSION = 1
#: ``CUDA_IPC_HANDLE_SIZE``: a ``cudaIpcMemHandle_t`` or ``cudaIpcEventHandle_t``.
CUDA_IPC_HANDLE_BYTES = 64
#: Kinds of torch's versioned storage handle (its second byte).
HANDLE_KIND_MALLOC, HANDLE_KIND_EXPANDABLE = ord("c"), ord("e")
#: Bound on a storage handle (an expandable segment's grows with its number of pieces).
MAX_HANDLE_BYTES = 1 << 20
#: The reference counter's handle is a shared-memory file name (``NAME_MAX``).
MAX_REF_COUNTER_HANDLE_BYTES = 255
#: torch's ``CUDA_IPC_REF_COUNTER_FILE_SIZE``: slots in one reference-counter file.
REF_COUNTER_SLOTS = 10_000
MAX_DEVICE_INDEX = 1023
#: Bound on a block's extents (a fragmented 256 MiB block of 4 KiB pages).
MAX_EXTENTS = 1 << 16
MAX_STORAGE_BYTES = 1 << 48
UUID_BYTES = 16

_FIELDS = frozenset({
    "v", "device", "device_uuid", "handle", "storage_size", "storage_offset", "ref_counter_handle",
    "ref_counter_offset", "event_handle", "event_sync_required", "buffer_offset", "extents", "nbytes",
})

#: A coalesced copy: (source offset in the storage, offset in the destination, length), bytes.
Run = tuple[int, int, int]


@dataclass(frozen=True)
class IpcDescriptor:
    """A descriptor whose every field was checked (see the module doc for their meaning)."""

    device: int
    device_uuid: bytes
    handle: bytes
    storage_size: int
    storage_offset: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    buffer_offset: int
    #: The block's runs as ``(offset, length)`` in the *storage* (``buffer_offset`` added).
    extents: tuple[tuple[int, int], ...]
    nbytes: int


def _bad(field: str, why: str) -> IpcDescriptorError:
    return IpcDescriptorError(f"malformed CUDA IPC descriptor: {field!r} {why}")


def _int(desc: Mapping[str, Any], field: str, lo: int, hi: int) -> int:
    value = desc[field]
    if type(value) is not int:  # bool is an int too, and no descriptor field is a float
        raise _bad(field, f"must be an integer, not {type(value).__name__}")
    if not lo <= value <= hi:
        raise _bad(field, f"must be in [{lo}, {hi}], got {value}")
    return value


def _bytes(desc: Mapping[str, Any], field: str, lo: int, hi: int) -> bytes:
    value = desc[field]
    if not isinstance(value, bytes | bytearray):
        raise _bad(field, f"must be bytes, not {type(value).__name__}")
    if not lo <= len(value) <= hi:
        size = f"{lo} bytes" if lo == hi else f"{lo} to {hi} bytes"
        raise _bad(field, f"must be {size}, got {len(value)}")
    return bytes(value)


def _storage_handle(desc: Mapping[str, Any]) -> bytes:
    handle = _bytes(desc, "handle", 2, MAX_HANDLE_BYTES)
    if len(handle) == CUDA_IPC_HANDLE_BYTES:  # a bare cudaIpcMemHandle_t (torch before versioned handles)
        return handle
    kind = handle[1]
    if kind == HANDLE_KIND_MALLOC and len(handle) != 2 + CUDA_IPC_HANDLE_BYTES:
        raise _bad("handle", f"of kind 'c' must be {2 + CUDA_IPC_HANDLE_BYTES} bytes, got {len(handle)}")
    if kind == HANDLE_KIND_EXPANDABLE and len(handle) <= 2:
        raise _bad("handle", "of kind 'e' has no payload")
    if kind not in (HANDLE_KIND_MALLOC, HANDLE_KIND_EXPANDABLE):
        raise _bad("handle", f"has unknown kind {kind:#04x} (known: 'c' cudaMalloc, 'e' expandable segment)")
    return handle


def _extents(desc: Mapping[str, Any], buffer_offset: int, storage_size: int) -> tuple[tuple[int, int], ...]:
    raw = desc["extents"]
    if not isinstance(raw, list | tuple):
        raise _bad("extents", f"must be a list of [offset, length] pairs, not {type(raw).__name__}")
    if not 1 <= len(raw) <= MAX_EXTENTS:
        raise _bad("extents", f"must hold 1 to {MAX_EXTENTS} runs, got {len(raw)}")
    room = storage_size - buffer_offset
    out: list[tuple[int, int]] = []
    for i, pair in enumerate(raw):
        if not isinstance(pair, list | tuple) or len(pair) != 2 or any(type(x) is not int for x in pair):
            raise _bad("extents", f"[{i}] must be an [offset, length] pair of integers")
        off, n = pair
        if off < 0 or n <= 0:
            raise _bad("extents", f"[{i}] must have offset >= 0 and length > 0, got [{off}, {n}]")
        if off + n > room:
            raise _bad("extents", f"[{i}] = [{off}, {n}] ends past the {room} bytes of the buffer in the storage")
        out.append((buffer_offset + off, n))
    ordered = sorted(out)
    for (a, n), (b, _) in zip(ordered, ordered[1:]):
        if a + n > b:
            raise _bad("extents", f"overlap at buffer offset {b - buffer_offset}")
    return tuple(out)


def parse_descriptor(desc: Mapping[str, Any]) -> IpcDescriptor:
    """Check every field of ``desc``; :class:`IpcDescriptorError` names the first bad one."""
    if not isinstance(desc, Mapping):
        raise IpcDescriptorError(f"malformed CUDA IPC descriptor: a mapping expected, not {type(desc).__name__}")
    names = set(desc)
    if any(not isinstance(k, str) for k in names):
        raise IpcDescriptorError("malformed CUDA IPC descriptor: field names must be strings")
    if missing := sorted(_FIELDS - names):
        raise IpcDescriptorError(f"malformed CUDA IPC descriptor: missing {', '.join(missing)}")
    if unknown := sorted(names - _FIELDS):
        raise IpcDescriptorError(f"malformed CUDA IPC descriptor: unknown {', '.join(unknown)}")
    version = desc["v"]
    if type(version) is not int or version != DESCRIPTOR_VERSION:
        raise _bad("v", f"must be {DESCRIPTOR_VERSION} (the version this client reads), got {version!r}")
    uuid_bytes = _bytes(desc, "device_uuid", 0, UUID_BYTES)
    if len(uuid_bytes) not in (0, UUID_BYTES):
        raise _bad("device_uuid", f"must be {UUID_BYTES} bytes or empty, got {len(uuid_bytes)}")
    storage_size = _int(desc, "storage_size", 1, MAX_STORAGE_BYTES)
    buffer_offset = _int(desc, "buffer_offset", 0, storage_size - 1)
    event_sync = desc["event_sync_required"]
    if type(event_sync) is not bool:
        raise _bad("event_sync_required", f"must be a bool, not {type(event_sync).__name__}")
    ref_counter = _bytes(desc, "ref_counter_handle", 1, MAX_REF_COUNTER_HANDLE_BYTES)
    if b"\0" in ref_counter:
        raise _bad("ref_counter_handle", "must be a file name without NUL bytes")
    extents = _extents(desc, buffer_offset, storage_size)
    nbytes = _int(desc, "nbytes", 1, MAX_STORAGE_BYTES)
    if nbytes != sum(n for _, n in extents):
        raise _bad("nbytes", f"is {nbytes} but the extents add up to {sum(n for _, n in extents)}")
    return IpcDescriptor(
        device=_int(desc, "device", 0, MAX_DEVICE_INDEX),
        device_uuid=uuid_bytes,
        handle=_storage_handle(desc),
        storage_size=storage_size,
        storage_offset=_int(desc, "storage_offset", 0, MAX_STORAGE_BYTES),
        ref_counter_handle=ref_counter,
        ref_counter_offset=_int(desc, "ref_counter_offset", 0, REF_COUNTER_SLOTS - 1),
        event_handle=_bytes(desc, "event_handle", CUDA_IPC_HANDLE_BYTES, CUDA_IPC_HANDLE_BYTES),
        event_sync_required=event_sync,
        buffer_offset=buffer_offset,
        extents=extents,
        nbytes=nbytes,
    )


def coalesce(extents: Sequence[tuple[int, int]]) -> list[Run]:
    """One copy per run of source-adjacent extents: ``(source offset, dest offset, length)``.

    The destination is the block's bytes end to end, so an extent that starts where the
    previous one ends in the source continues the same copy.
    """
    runs: list[Run] = []
    pos = 0
    for off, n in extents:
        if runs and runs[-1][0] + runs[-1][2] == off:
            src, dst, length = runs[-1]
            runs[-1] = (src, dst, length + n)
        else:
            runs.append((off, pos, n))
        pos += n
    return runs


def resolve_device(index: int, want_uuid: bytes, local_uuids: Sequence[bytes]) -> int:
    """The local index of the descriptor's GPU: by UUID when it has one, else by index."""
    if want_uuid:
        for i, u in enumerate(local_uuids):
            if u == want_uuid:
                return i
        raise CudaIpcError(f"the descriptor's GPU {uuid.UUID(bytes=want_uuid)} is not visible to this process "
                           f"({len(local_uuids)} CUDA devices visible)")
    if index >= len(local_uuids):
        raise CudaIpcError(f"the descriptor names cuda:{index} but {len(local_uuids)} CUDA devices are visible")
    return index


def _torch() -> Any:
    try:
        import torch
    except ImportError as e:
        raise TorchUnavailableError("CUDA IPC descriptors need torch: pip install kvpool[torch]") from e
    return torch


def device_uuid(index: int) -> bytes:
    """The 16-byte UUID of CUDA device ``index`` (empty when torch does not report one)."""
    tc = _torch()
    raw = getattr(tc.cuda.get_device_properties(index), "uuid", None)
    data = getattr(raw, "bytes", None)  # torch's _CUuuid: 16 ints; str() is the 8-4-4-4-12 form
    if isinstance(data, bytes | list) and len(data) == UUID_BYTES:
        return bytes(data)
    try:
        return uuid.UUID(str(raw or "").removeprefix("GPU-")).bytes
    except ValueError:
        return b""


@dataclass(frozen=True)
class OpenedDescriptor:
    """A descriptor opened in this process: the shared storage as one uint8 CUDA tensor."""

    storage: torch.Tensor
    #: The block's runs as ``(offset, length)`` in :attr:`storage`.
    extents: tuple[tuple[int, int], ...]
    nbytes: int

    def parts(self) -> list[torch.Tensor]:
        """uint8 CUDA tensors aliasing each extent, in block order (writes reach the sidecar)."""
        return [self.storage.narrow(0, off, n) for off, n in self.extents]

    def copy_into(self, dest: torch.Tensor) -> None:
        """Copy the block device to device into contiguous CUDA ``dest`` of exactly
        :attr:`nbytes` bytes (any dtype), one copy per run of adjacent extents; done on return."""
        tc = _torch()
        if not isinstance(dest, tc.Tensor) or not dest.is_cuda:
            raise TensorLayoutError("the destination of a CUDA IPC copy must be a CUDA tensor")
        if not dest.is_contiguous():
            raise TensorLayoutError("the destination of a CUDA IPC copy must be contiguous")
        size = dest.numel() * dest.element_size()
        if size != self.nbytes:
            raise TensorLayoutError(f"the block is {self.nbytes} bytes; the destination holds {size}")
        flat = dest.detach().reshape(-1).view(tc.uint8)
        try:
            for src, dst, n in coalesce(self.extents):
                flat.narrow(0, dst, n).copy_(self.storage.narrow(0, src, n), non_blocking=True)
            tc.cuda.current_stream(dest.device).synchronize()
            if self.storage.device != dest.device:
                tc.cuda.current_stream(self.storage.device).synchronize()
        except RuntimeError as e:  # a CUDA error surfaces as a RuntimeError
            raise CudaIpcError(f"CUDA IPC copy of {self.nbytes} bytes failed: {e}") from e


def open_storage(desc: Mapping[str, Any]) -> OpenedDescriptor:
    """Check ``desc`` and open its storage once with torch's ``rebuild_cuda_tensor``."""
    d = parse_descriptor(desc)
    tc = _torch()
    if not tc.cuda.is_available():
        raise CudaIpcError("CUDA is not available in this process: a GPU-tier descriptor cannot be opened")
    uuids = [device_uuid(i) if d.device_uuid else b"" for i in range(tc.cuda.device_count())]
    local = resolve_device(d.device, d.device_uuid, uuids)
    from torch.multiprocessing import reductions

    rebuild: Callable[..., torch.Tensor] = reductions.rebuild_cuda_tensor
    try:
        whole = rebuild(
            tensor_cls=tc.Tensor, tensor_size=(d.storage_size,), tensor_stride=(1,), tensor_offset=0,
            storage_cls=tc.TypedStorage, dtype=tc.uint8, storage_device=local, storage_handle=d.handle,
            storage_size_bytes=d.storage_size, storage_offset_bytes=d.storage_offset, requires_grad=False,
            ref_counter_handle=d.ref_counter_handle, ref_counter_offset=d.ref_counter_offset,
            event_handle=d.event_handle, event_sync_required=d.event_sync_required,
        )
    except (RuntimeError, OSError, TypeError) as e:  # CUDA, a missing reference-counter file, another torch
        raise CudaIpcError(f"cannot open the CUDA IPC handle on cuda:{local}: {e}") from e
    return OpenedDescriptor(whole, d.extents, d.nbytes)


def open_descriptor(desc: Mapping[str, Any]) -> list[torch.Tensor]:
    """uint8 CUDA tensors aliasing the block's extents, in order (open each descriptor once)."""
    return open_storage(desc).parts()


def copy_descriptor_into(desc: Mapping[str, Any], dest: torch.Tensor) -> None:
    """Open ``desc`` and copy its block into CUDA ``dest`` device to device; done on return."""
    open_storage(desc).copy_into(dest)


__all__ = ["DESCRIPTOR_VERSION", "IpcDescriptor", "OpenedDescriptor", "coalesce", "copy_descriptor_into",
           "device_uuid", "open_descriptor", "open_storage", "parse_descriptor", "resolve_device"]
