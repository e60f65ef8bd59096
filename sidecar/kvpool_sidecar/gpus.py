"""The node's GPUs as NVML sees them: model, memory and health, for the node's heartbeat
and the pool's status; and the NVML library for sizing the GPU tier."""

from __future__ import annotations

import logging
import warnings
from typing import Any

logger = logging.getLogger(__name__)


def nvml() -> Any | None:
    """The pynvml module, initialised; ``None`` (logged) without pynvml or an NVIDIA driver.
    The caller shuts it down (``nvmlShutdown``) when done."""
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


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _health(lib: Any, h: Any) -> dict[str, Any]:
    """What NVML says of a device's health, where the device reports it: uncorrected ECC
    errors since boot, pages waiting to be retired, temperature; ``ok`` is False when
    any of them says the device is failing."""
    out: dict[str, Any] = {}
    try:
        out["ecc_uncorrected"] = int(lib.nvmlDeviceGetTotalEccErrors(
            h, lib.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, lib.NVML_VOLATILE_ECC))
    except lib.NVMLError:
        pass  # no ECC on this device
    try:
        out["retire_pending"] = bool(lib.nvmlDeviceGetRetiredPagesPendingStatus(h))
    except lib.NVMLError:
        pass
    try:
        out["temperature_c"] = int(lib.nvmlDeviceGetTemperature(h, lib.NVML_TEMPERATURE_GPU))
    except lib.NVMLError:
        pass
    out["ok"] = not out.get("ecc_uncorrected") and not out.get("retire_pending")
    return out


def gpu_inventory() -> list[dict[str, Any]]:
    """The node's GPUs (index, model name, UUID, total and free bytes, health); [] without
    GPUs or driver."""
    lib = nvml()
    if lib is None:
        return []
    out: list[dict[str, Any]] = []
    try:
        for i in range(lib.nvmlDeviceGetCount()):
            h = lib.nvmlDeviceGetHandleByIndex(i)
            mem = lib.nvmlDeviceGetMemoryInfo(h)
            out.append({
                "index": i,
                "name": _text(lib.nvmlDeviceGetName(h)),
                "uuid": _text(lib.nvmlDeviceGetUUID(h)),
                "total_bytes": int(mem.total),
                "free_bytes": int(mem.free),
                "health": _health(lib, h),
            })
    except lib.NVMLError as e:
        logger.warning("GPU inventory incomplete: %s", e)
    finally:
        lib.nvmlShutdown()
    return out
