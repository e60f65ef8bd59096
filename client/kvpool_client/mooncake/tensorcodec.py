"""Tensors as object values, for ``put_tensor`` / ``get_tensor``.

A tensor's value is a small self-describing header followed by its elements' bytes (as
``tensor.contiguous()`` lays them out in CPU memory)::

    b"KVTN" | u8 version | u8 ndim | u16 len(dtype) | dtype name | u64 dims... | zero pad

padded to a multiple of 64 bytes, so the elements stay aligned for any dtype. This is
kvpool's own format, not Mooncake's: values written by Mooncake's ``put_tensor`` are not
readable here, nor the other way round. torch is imported only when a tensor call runs.
"""

from __future__ import annotations

import struct
from typing import Any

MAGIC = b"KVTN"
VERSION = 1
_HEAD = struct.Struct("<4sBBH")
_ALIGN = 64
_MAX_DIMS = 64


def _torch() -> Any:
    import torch  # optional dependency: pip install kvpool[torch]

    return torch


def is_tensor(value: object) -> bool:
    try:
        torch = _torch()
    except ImportError:
        return False
    return isinstance(value, torch.Tensor)


def encode(tensor: Any) -> list[memoryview]:
    """The value of ``tensor``: [header, element bytes] (of a conjugate or negative view, the
    values it shows). Raises ValueError for a tensor that cannot be stored (too many
    dimensions), or torch's RuntimeError for one torch cannot copy to host memory (a meta
    or sparse tensor)."""
    torch = _torch()
    t = tensor.detach().resolve_conj().resolve_neg()
    if t.device.type != "cpu":
        t = t.to("cpu")
    t = t.contiguous()
    if t.dim() > _MAX_DIMS:
        raise ValueError(f"a tensor of {t.dim()} dimensions has more than {_MAX_DIMS}")
    name = str(t.dtype).removeprefix("torch.").encode("ascii")
    head = _HEAD.pack(MAGIC, VERSION, t.dim(), len(name)) + name + struct.pack(f"<{t.dim()}Q", *t.shape)
    head += bytes(-len(head) % _ALIGN)
    data = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else b""
    return [memoryview(head), memoryview(data).cast("B")]


def decode(value: bytearray) -> Any | None:
    """The tensor a value holds (sharing its memory); None if it is not a tensor's value."""
    torch = _torch()
    if len(value) < _HEAD.size:
        return None
    magic, version, ndim, name_len = _HEAD.unpack_from(value)
    end = _HEAD.size + name_len + 8 * ndim
    if magic != MAGIC or version != VERSION or len(value) < end:
        return None
    dtype = getattr(torch, bytes(value[_HEAD.size : _HEAD.size + name_len]).decode("ascii", "replace"), None)
    if not isinstance(dtype, torch.dtype):
        return None
    shape = struct.unpack_from(f"<{ndim}Q", value, _HEAD.size + name_len)
    spread = 1
    for d in shape:  # torch takes int64 sizes and strides: a shape past them is not a tensor
        spread *= max(d, 1)
    if spread >= 2**63:
        return None
    start = end + (-end % _ALIGN)
    numel = 1
    for d in shape:
        numel *= d
    if len(value) - start != numel * dtype.itemsize:
        return None
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(value, dtype=torch.uint8, offset=start).view(dtype).reshape(shape)
