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

Local CUDA engines open blocks through CUDA IPC (:meth:`GpuTier.ipc_handle`): the handle
holds ``torch.multiprocessing.reductions.reduce_tensor`` of each extent's narrowed view,
which shares the whole allocation's ``cudaIpcMemHandle`` plus the extent's offset. The
consumer must be another process on the same node that sees the same physical GPU; it
gets access to the allocation's memory, so only trusted local engines should be given
handles. The sidecar must keep the block allocated while the consumer uses it.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvpool_sidecar.config import GpuSettings
from kvpool_sidecar.errors import TierError
from kvpool_sidecar.tiers.alloc import Extent, PagedSpace
from kvpool_sidecar.tiers.base import TierKind

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


def _nvml() -> Any | None:
    """The pynvml module, initialised; ``None`` (logged) without pynvml or an NVIDIA driver."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # the deprecated 'pynvml' wrapper package
            import pynvml
    except ImportError:
        logger.info("pynvml is not installed")
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        logger.info("NVML unavailable: %s", e)
        return None
    return pynvml


def gpu_inventory() -> list[dict[str, Any]]:
    """The node's GPUs as NVML sees them (for the node registry); [] without GPUs or driver."""
    nvml = _nvml()
    if nvml is None:
        return []
    out: list[dict[str, Any]] = []
    try:
        for i in range(nvml.nvmlDeviceGetCount()):
            h = nvml.nvmlDeviceGetHandleByIndex(i)
            mem = nvml.nvmlDeviceGetMemoryInfo(h)
            name, uuid = nvml.nvmlDeviceGetName(h), nvml.nvmlDeviceGetUUID(h)
            out.append({
                "index": i,
                "name": name.decode() if isinstance(name, bytes) else str(name),
                "uuid": uuid.decode() if isinstance(uuid, bytes) else str(uuid),
                "total_bytes": int(mem.total),
                "free_bytes": int(mem.free),
            })
    except nvml.NVMLError as e:
        logger.warning("GPU inventory incomplete: %s", e)
    finally:
        nvml.nvmlShutdown()
    return out


def _free_device_bytes(tc: Any, index: int) -> int:
    """Free memory of CUDA device ``index``: NVML (matched by UUID), else the CUDA runtime."""
    nvml = _nvml()
    if nvml is not None:
        try:
            uuid = str(getattr(tc.cuda.get_device_properties(index), "uuid", ""))
            h = (nvml.nvmlDeviceGetHandleByUUID("GPU-" + uuid) if uuid
                 else nvml.nvmlDeviceGetHandleByIndex(index))
            return int(nvml.nvmlDeviceGetMemoryInfo(h).free)
        except nvml.NVMLError as e:
            logger.info("pynvml failed (%s); sizing the GPU tier from torch.cuda.mem_get_info", e)
        finally:
            nvml.nvmlShutdown()
    free, _total = tc.cuda.mem_get_info(index)
    return int(free)


def tier_bytes(settings: GpuSettings, free_bytes: int, page_bytes: int) -> int:
    """The tier's size: ``size_bytes``, else ``fraction`` of free memory; whole pages."""
    want = settings.size_bytes or int(free_bytes * settings.fraction)
    return want // page_bytes * page_bytes


def _host_view(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU uint8 tensor (which must outlive it)."""
    return memoryview((ctypes.c_ubyte * t.numel()).from_address(t.data_ptr())).cast("B")


@dataclass(frozen=True)
class GpuIpcHandle:
    """What a local CUDA engine needs to open one block: picklable; ``open()`` in the consumer."""

    device_index: int
    size: int
    #: One ``(rebuild function, arguments)`` per extent, from ``reduce_tensor``.
    parts: list[tuple[Callable[..., Any], tuple[Any, ...]]]

    def open(self) -> list[torch.Tensor]:
        """uint8 CUDA tensors aliasing the block's extents (in another process only)."""
        return [rebuild(*args) for rebuild, args in self.parts]


class GpuTier(PagedSpace):
    """Page-granular accounts over one CUDA allocation, with copies to and from the host."""

    kind = TierKind.GPU

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
        size = tier_bytes(settings, 0 if settings.size_bytes else _free_device_bytes(tc, settings.device),
                          page_bytes)
        if size < page_bytes:
            logger.warning("GPU tier disabled: %d bytes is less than one page", size)
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
        size = sum(n for _, n in extents)
        if sum(v.nbytes for v in views) != size:
            raise TierError("the bytes to write do not match the block's extents")
        with self._lock:
            stage = self._stage(size)
            host = _host_view(stage)
            pos = 0
            for v in views:
                host[pos : pos + v.nbytes] = v.cast("B")
                pos += v.nbytes
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
        with self._lock:
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

    def ipc_handle(self, extents: list[Extent]) -> GpuIpcHandle:
        """A CUDA IPC handle of a block's extents for a local engine (see the module doc)."""
        if not self.buffer.is_cuda:
            raise TierError("CUDA IPC needs a CUDA buffer")
        from torch.multiprocessing import reductions

        reduce_tensor: Callable[[torch.Tensor], tuple[Callable[..., Any], tuple[Any, ...]]] = reductions.reduce_tensor
        parts = [reduce_tensor(self.buffer.narrow(0, off, n)) for off, n in extents]
        return GpuIpcHandle(self.buffer.device.index or 0, sum(n for _, n in extents), parts)


__all__ = ["GpuIpcHandle", "GpuTier", "gpu_inventory", "tier_bytes"]
