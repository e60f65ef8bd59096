"""Where a pool block's bytes live in an engine's paged KV cache, and batched copies.

An engine keeps its KV in per-layer tensors whose first dimension is the block (vLLM's
standardized ``[B, H, N, C]`` views, a plain ``[num_blocks, ...]`` cache of any engine).
One *pool block* is one engine block for every layer of the shard: the bytes of layer 0's
page, then layer 1's, and so on, in the order the engine lists its layers. Inside a page
the bytes keep the engine's own physical order, so the pool block is exactly what the
engine's layout holds (the layout's name is part of the model fingerprint).

:class:`PagedLayout` finds, once, each layer's *segments*: runs of bytes that repeat at a
fixed stride from one block to the next (a layer whose head groups sit outside the block
dimension has one segment per group). Segments that follow each other in memory are
merged, so in a block-outermost layout (all layers of a block in one run) a block is one
segment, and a copy of ``n`` blocks is one indexed copy, not ``n * layers`` small ones.
:meth:`PagedLayout.gather` and :meth:`PagedLayout.scatter` move any set of blocks between
the cache and a ``[n, block_bytes]`` staging tensor with one indexed copy per segment.

Only torch is needed (imported when a layout is built); nothing here knows vLLM.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvpool_client.errors import KVPoolError

if TYPE_CHECKING:
    import torch


class LayoutError(KVPoolError, ValueError):
    """The KV cache tensors cannot be read as paged blocks (shape, device or overlap)."""


@dataclass(frozen=True, slots=True)
class Segment:
    """Bytes of every block at ``offset + b * stride``, ``length`` long, in one storage."""

    storage: int  # index into PagedLayout.storages
    offset: int
    stride: int
    length: int


def _torch() -> Any:
    try:
        import torch
    except ImportError as e:  # pragma: no cover - the engines always have torch
        raise LayoutError("paged KV layouts need torch") from e
    return torch


def _layer_segments(t: torch.Tensor, num_blocks: int, base: int) -> list[tuple[int, int, int]]:
    """``(offset, stride, length)`` of each run of layer tensor ``t``'s block pages."""
    if t.dim() < 1 or t.shape[0] % num_blocks:
        raise LayoutError(f"a layer's first dimension ({tuple(t.shape)}) is not a multiple of {num_blocks} blocks")
    if t.shape[0] != num_blocks:
        ratio = t.shape[0] // num_blocks  # kernel blocks: several per engine block, one stride apart
        t = t.as_strided((num_blocks, ratio, *t.shape[1:]), (t.stride(0) * ratio, *t.stride()))
    el = t.element_size()
    block_stride = t.stride(0) * el
    dims = sorted((d for d in range(1, t.dim()) if t.shape[d] > 1), key=lambda d: t.stride(d))
    # the densest run: dims that continue the one below them; each index of the rest
    # (head groups outside the block, or layers interleaved inside it) is a run of its own
    length = el
    inner: list[int] = []
    for d in dims:
        if t.stride(d) * el != length:
            break
        inner.append(d)
        length *= t.shape[d]
    outer = [d for d in dims if d not in inner]
    if num_blocks > 1 and block_stride < length:
        raise LayoutError("blocks of one layer overlap in memory")
    start = t.data_ptr() - base
    out = []
    for index in itertools.product(*(range(t.shape[d]) for d in outer)):
        off = start + sum(i * t.stride(d) * el for i, d in zip(index, outer))
        out.append((off, block_stride, length))
    return out


class PagedLayout:
    """The segments of a pool block in an engine's per-layer paged KV tensors."""

    def __init__(self, layers: Sequence[torch.Tensor], num_blocks: int) -> None:
        tc = _torch()
        if not layers:
            raise LayoutError("no KV cache layers")
        if num_blocks <= 0:
            raise LayoutError("the cache needs at least one block")
        self.num_blocks = num_blocks
        self.device = layers[0].device
        self.storages: list[torch.Tensor] = []  # one flat uint8 tensor per distinct allocation
        ptrs: dict[int, int] = {}
        segs: list[Segment] = []
        for t in layers:
            if t.device != self.device:
                raise LayoutError("every KV layer must live on one device")
            st = t.untyped_storage()
            idx = ptrs.get(st.data_ptr())
            if idx is None:
                idx = ptrs[st.data_ptr()] = len(self.storages)
                flat = tc.empty(0, dtype=tc.uint8, device=self.device)
                flat.set_(st, 0, (st.nbytes(),), (1,))
                self.storages.append(flat)
            for off, stride, length in _layer_segments(t, num_blocks, st.data_ptr()):
                segs.append(Segment(idx, off, stride, length))
        self.segments = _merge(segs)
        self.block_bytes = sum(s.length for s in self.segments)
        for s in self.segments:
            end = s.offset + (num_blocks - 1) * s.stride + s.length
            if s.offset < 0 or end > self.storages[s.storage].numel():
                raise LayoutError("a KV layer reaches outside its allocation")
        self._views = [tc.as_strided(self.storages[s.storage], (num_blocks, s.length), (s.stride, 1), s.offset)
                       for s in self.segments]

    def describe(self) -> str:
        """The geometry a fingerprint should carry: bytes per block and per segment."""
        return f"{self.block_bytes}B/" + ",".join(str(s.length) for s in self.segments)

    def _index(self, block_ids: Sequence[int]) -> torch.Tensor:
        tc = _torch()
        for b in block_ids:
            if not 0 <= b < self.num_blocks:
                raise LayoutError(f"block id {b} outside the cache's {self.num_blocks} blocks")
        index: torch.Tensor = tc.tensor(list(block_ids), dtype=tc.long, device=self.device)
        return index

    def gather(self, block_ids: Sequence[int], out: torch.Tensor | None = None) -> torch.Tensor:
        """Blocks ``block_ids`` as rows of a ``[n, block_bytes]`` uint8 tensor on the cache's device."""
        tc = _torch()
        idx = self._index(block_ids)
        if out is None and len(self._views) == 1:
            rows: torch.Tensor = self._views[0].index_select(0, idx)
            return rows
        if out is None:
            out = tc.empty((len(block_ids), self.block_bytes), dtype=tc.uint8, device=self.device)
        col = 0
        for view in self._views:
            n = view.shape[1]
            out[:, col : col + n].copy_(view.index_select(0, idx))
            col += n
        return out

    def scatter(self, block_ids: Sequence[int], src: torch.Tensor) -> None:
        """Write rows of ``src`` (``[n, block_bytes]`` uint8, the cache's device) into the blocks."""
        if src.dim() != 2 or src.shape[0] != len(block_ids) or src.shape[1] != self.block_bytes:
            raise LayoutError(f"scatter needs a [{len(block_ids)}, {self.block_bytes}] source, got {tuple(src.shape)}")
        idx = self._index(block_ids)
        col = 0
        for view in self._views:
            n = view.shape[1]
            view.index_copy_(0, idx, src[:, col : col + n])
            col += n


def _merge(segs: list[Segment]) -> list[Segment]:
    """Merge segments that follow each other in memory at the same block stride."""
    out: list[Segment] = []
    for s in segs:
        last = out[-1] if out else None
        if last is not None and last.storage == s.storage and last.stride == s.stride \
                and last.offset + last.length == s.offset and last.length + s.length <= s.stride:
            out[-1] = Segment(s.storage, last.offset, s.stride, last.length + s.length)
        else:
            out.append(s)
    return out


__all__ = ["LayoutError", "PagedLayout", "Segment"]
