"""The GPU tier: one large torch CUDA allocation cut into pages, like the DRAM arena.

Optional: it needs torch with CUDA. :meth:`GpuTier.create` returns ``None`` (and logs
why) when torch, CUDA or the configured device is missing, so a node without GPUs runs
with its other tiers. The tier takes ``GpuSettings.size_bytes``, or else
``GpuSettings.fraction`` of the device's free memory as pynvml reports it
(``torch.cuda.mem_get_info`` when NVML fails), in one ``torch.empty`` of uint8; blocks
occupy page extents ``(byte offset, byte length)`` from the same :class:`PageAllocator`
as the DRAM tier.

Host <-> device copies go through a pinned staging buffer (grown on demand, one copy at a
time under a lock) and are complete when :meth:`write` or :meth:`read_into` returns.

Local CUDA engines open blocks through CUDA IPC (:meth:`GpuTier.ipc_descriptor`, plain
values described in :mod:`kvpool_sidecar.tiers.gpu_ipc`): the descriptor shares the whole
allocation's handle plus the block's extents. The consumer must be another process on the
same node that sees the same physical GPU; it gets access to the whole allocation, so the
sidecar gives descriptors only where every tenant shares one key space (see
``docs/security.md``), and keeps the block allocated while the consumer holds its lease.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import threading
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from kvpool_client.integrity import checksum
from kvpool_sidecar.config import GpuSettings
from kvpool_sidecar.errors import CorruptBlockError, TierError, TierIOError
from kvpool_sidecar.gpus import nvml
from kvpool_sidecar.tiers.alloc import Extent, PagedSpace
from kvpool_sidecar.tiers.base import BlockRecord, TierKind, WriteResult, write_each
from kvpool_sidecar.tiers.gpu_ipc import ipc_descriptor

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

#: Where a node with an NVIDIA driver shows its devices: without them, torch is not even imported.
_NVIDIA_DEVICES = ("/dev/nvidiactl", "/dev/nvidia0", "/proc/driver/nvidia/version")


def _device_memory(tc: Any, index: int) -> tuple[int, int]:
    """Free and total memory of CUDA device ``index``: NVML (matched by UUID), else the CUDA
    runtime."""
    lib = nvml()
    if lib is not None:
        try:
            uuid = str(getattr(tc.cuda.get_device_properties(index), "uuid", ""))
            h = (lib.nvmlDeviceGetHandleByUUID("GPU-" + uuid) if uuid
                 else lib.nvmlDeviceGetHandleByIndex(index))
            mem = lib.nvmlDeviceGetMemoryInfo(h)
            return int(mem.free), int(mem.total)
        except lib.NVMLError as e:
            logger.info("pynvml failed (%s); sizing the GPU tier from torch.cuda.mem_get_info", e)
        finally:
            lib.nvmlShutdown()
    free, total = tc.cuda.mem_get_info(index)
    return int(free), int(total)


def tier_bytes(settings: GpuSettings, free_bytes: int, total_bytes: int, page_bytes: int) -> int:
    """The tier's size in whole pages: ``size_bytes``, else ``fraction`` of free memory, and
    never so much that less than ``engine_reserve`` of the device's total stays free for
    the engines (0: no room, the tier stays off)."""
    want = settings.size_bytes or int(free_bytes * settings.fraction)
    if total_bytes:
        want = min(want, free_bytes - int(total_bytes * settings.engine_reserve))
    return max(0, want) // page_bytes * page_bytes


def _host_view(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU uint8 tensor (which must outlive it)."""
    return memoryview((ctypes.c_ubyte * t.numel()).from_address(t.data_ptr())).cast("B")


@contextlib.contextmanager
def _device_errors(what: str) -> Iterator[None]:
    """torch's errors of a copy (CUDA's among them: RuntimeError) as the tier's TierIOError,
    which the store takes as that copy's failure, not its own."""
    try:
        yield
    except RuntimeError as e:
        raise TierIOError(f"{what} the GPU tier failed: {e}") from e


class GpuTier(PagedSpace):
    """Page-granular accounts over one CUDA allocation, with copies to and from the host:
    the store's hottest :class:`~kvpool_sidecar.tiers.base.Tier` (no views: a copy always)."""

    kind = TierKind.GPU
    blocking = True
    release_blocks = False  # accounts only: the device memory stays the tier's
    accounts_only = False

    def __init__(self, buffer: torch.Tensor, page_bytes: int) -> None:
        super().__init__(buffer.numel(), page_bytes)
        self.buffer = buffer
        self._lock = threading.Lock()
        self._staging: torch.Tensor | None = None

    @classmethod
    def create(cls, settings: GpuSettings, page_bytes: int) -> GpuTier | None:
        """The tier from settings, or ``None`` (logged) without torch, CUDA or the device."""
        if not settings.enabled:
            return None
        if not any(os.path.exists(p) for p in _NVIDIA_DEVICES):
            logger.info("GPU tier off: no NVIDIA device on this node")
            return None
        try:
            import torch as tc
        except ImportError:
            logger.warning("GPU tier disabled: torch is not installed (pip install kvpool[torch])")
            return None
        if not tc.cuda.is_available():
            logger.warning("GPU tier disabled: CUDA is not available")
            return None
        if settings.device >= tc.cuda.device_count():
            logger.warning("GPU tier disabled: no CUDA device %d (%d visible)", settings.device,
                           tc.cuda.device_count())
            return None
        free, total = _device_memory(tc, settings.device)
        size = tier_bytes(settings, free, total, page_bytes)
        if size < page_bytes:
            logger.warning("GPU tier off: %d of %d bytes free on cuda:%d, and %.0f%% of the device stays "
                           "the engines' (gpu.engine_reserve)", free, total, settings.device,
                           100 * settings.engine_reserve)
            return None
        try:
            buf = tc.empty(size, dtype=tc.uint8, device=tc.device("cuda", settings.device))
        except (RuntimeError, MemoryError) as e:  # torch.cuda.OutOfMemoryError is a RuntimeError
            raise TierError(f"cannot allocate a GPU tier of {size} bytes on cuda:{settings.device}: {e}") from e
        logger.info("GPU tier: %d bytes on cuda:%d", size, settings.device)
        return cls(buf, page_bytes)

    # ------------------------------------------------------------- copies
    def _stage(self, size: int) -> torch.Tensor:
        import torch as tc

        if self._staging is None or self._staging.numel() < size:
            cap = max(size, 2 * self._staging.numel() if self._staging is not None else 0)
            self._staging = tc.empty(cap, dtype=tc.uint8, pin_memory=self.buffer.is_cuda)
        return self._staging[:size]

    def _sync(self) -> None:
        if self.buffer.is_cuda:
            import torch as tc

            tc.cuda.current_stream(self.buffer.device).synchronize()

    def write(self, extents: list[Extent], views: Sequence[memoryview]) -> None:
        """Copy a block's bytes (``views``, in order) from the host into its extents."""
        self._write(extents, views, None)

    def _write(self, extents: list[Extent], views: Sequence[memoryview], record: BlockRecord | None) -> None:
        """:meth:`write`; with ``record``, the bytes staged are checked against its checksum
        before they go up: the source (the shared arena) is read once, so what is checked is
        what the device gets, whatever writes into the source meanwhile."""
        size = sum(n for _, n in extents)
        if sum(v.nbytes for v in views) != size:
            raise TierError("the bytes to write do not match the block's extents")
        with self._lock:
            with _device_errors("a write into"):
                stage = self._stage(size)
                host = _host_view(stage)
                pos = 0
                for v in views:
                    host[pos : pos + v.nbytes] = v.cast("B")
                    pos += v.nbytes
            if record is not None and checksum([host[:size]]) != record.checksum:
                raise CorruptBlockError(f"block {record.key.hex()}: checksum mismatch on its way to the GPU")
            with _device_errors("a write into"):
                pos = 0
                for off, n in extents:
                    self.buffer[off : off + n].copy_(stage[pos : pos + n], non_blocking=True)
                    pos += n
                self._sync()

    def read_into(self, extents: list[Extent], dest: Sequence[memoryview]) -> None:
        """Copy a block's bytes from its extents into ``dest`` (in order); done on return."""
        size = sum(n for _, n in extents)
        if sum(d.nbytes for d in dest) != size:
            raise TierError("the destination does not match the block's extents")
        with self._lock, _device_errors("a read from"):
            stage = self._stage(size)
            pos = 0
            for off, n in extents:
                stage[pos : pos + n].copy_(self.buffer[off : off + n], non_blocking=True)
                pos += n
            self._sync()
            host = _host_view(stage)
            pos = 0
            for d in dest:
                d.cast("B")[:] = host[pos : pos + d.nbytes]
                pos += d.nbytes

    # ------------------------------------------------------------- Tier
    def reserve(self, record: BlockRecord) -> list[Extent] | None:
        return self.allocate(record.size)

    def release(self, place: list[Extent]) -> None:
        self.free(place)

    def write_copy(self, place: list[Extent], record: BlockRecord, src: Sequence[memoryview]) -> None:
        """:meth:`write`, of bytes checked against ``record`` as they are staged (the host
        side is cheap to hash; the device side is checked again when the block leaves)."""
        if sum(v.nbytes for v in src) != record.size:
            raise CorruptBlockError(f"block {record.key.hex()}: {sum(v.nbytes for v in src)} bytes, not "
                                    f"{record.size}, on their way to the GPU")
        self._write(place, src, record)

    def write_copies(self, items: Sequence[tuple[list[Extent], BlockRecord, Sequence[memoryview]]]
                     ) -> list[WriteResult]:
        return write_each(self, items)

    def read_copy(self, place: list[Extent], record: BlockRecord, dest: Sequence[memoryview]) -> None:
        self.read_into(place, dest)
        if checksum(dest) != record.checksum:
            raise CorruptBlockError(f"block {record.key.hex()}: checksum mismatch on its way from the GPU")

    def read_cached(self, place: list[Extent], record: BlockRecord, dest: Sequence[memoryview]) -> bool:
        """A copy from the device waits on it: always in a thread."""
        return False

    def views(self, place: list[Extent]) -> None:
        return None

    def close(self) -> None:
        self._staging = None

    def ipc_descriptor(self, place: list[Extent]) -> dict[str, Any]:
        """The CUDA IPC descriptor of a block for a local engine on this device (plain
        values; :mod:`kvpool_sidecar.tiers.gpu_ipc`). TierError on a buffer not in CUDA."""
        return ipc_descriptor(self.buffer, place)


__all__ = ["GpuTier", "tier_bytes"]
