"""Byte views of the pages of an SGLang HiCache host pool, and copies between piece lists.

SGLang's host pools say where a page's bytes are with ``get_page_buffer_meta(indices)``:
one ``(address, size)`` per piece of every page (an MLA ``page_first`` page is one piece;
an MHA page is a K and a V piece, or one of each per layer under ``layer_first``).
:class:`HostPages` turns those into memoryviews of the pool's own tensors, so the pool
client copies straight between them and the sidecar's arena. An address that falls in no
tensor the pool owns is refused (:class:`HostPagesError`), never read or written.

Only torch is needed (through :func:`kvpool_client.tensors.tensor_bytes`); nothing here
imports SGLang.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvpool_client.errors import KVPoolError
from kvpool_client.tensors import tensor_bytes

#: Host pool attributes that hold its page tensors (a tensor, or a list of them).
_BUFFERS = ("kv_buffer", "k_buffer", "v_buffer", "index_k_buffer", "index_k_scale_buffer")


class HostPagesError(KVPoolError, ValueError):
    """The host pool's pages cannot be read as byte runs of its own tensors, or indices are bad."""


def _tensors(pool: Any) -> list[Any]:
    out: list[Any] = []
    for name in _BUFFERS:
        value = getattr(pool, name, None)
        items = value if isinstance(value, (list, tuple)) else [value]
        out += [t for t in items if t is not None and hasattr(t, "data_ptr") and t.numel() > 0]
    return out


class HostPages:
    """Views of a host pool's pages; ``pieces`` is every page's piece sizes, in order."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.page_size = int(getattr(pool, "page_size", 0) or 0)
        if self.page_size <= 0 or not hasattr(pool, "get_page_buffer_meta"):
            raise HostPagesError(f"{type(pool).__name__} is not a paged SGLang host pool")
        #: (start address, end address, writable byte view) of each tensor of the pool
        self._regions: list[tuple[int, int, memoryview]] = []
        for t in _tensors(pool):
            if t.device.type != "cpu" or not t.is_contiguous():
                continue
            view = tensor_bytes(t)
            start = int(t.data_ptr())
            self._regions.append((start, start + view.nbytes, view))
        if not self._regions:
            raise HostPagesError(f"{type(pool).__name__} holds no host tensor (a logical pool stores no KV)")
        self._regions.sort(key=lambda r: r[1] - r[0], reverse=True)  # whole buffers before views into them
        import torch

        probe = self._meta(torch.arange(self.page_size, dtype=torch.int64), 1)
        self.pieces: tuple[int, ...] = tuple(n for _, n in probe)
        self.page_bytes = sum(self.pieces)

    def _meta(self, indices: Any, pages: int) -> list[tuple[int, int]]:
        ptrs, sizes = self.pool.get_page_buffer_meta(indices)
        if len(ptrs) != len(sizes) or not ptrs or len(ptrs) % pages:
            raise HostPagesError(f"the host pool described {len(ptrs)} pieces for {pages} pages")
        return [(int(p), int(n)) for p, n in zip(ptrs, sizes)]

    def _view(self, ptr: int, size: int) -> memoryview:
        for start, end, view in self._regions:
            if start <= ptr and ptr + size <= end:
                return view[ptr - start : ptr - start + size]
        raise HostPagesError(f"a page piece of {size} bytes lies outside the host pool's tensors")

    def views(self, host_indices: Any, pages: int) -> list[list[memoryview]]:
        """The pieces of ``pages`` pages at ``host_indices`` (``page_size`` indices each)."""
        if pages <= 0:
            return []
        n = int(host_indices.numel())
        if n != pages * self.page_size:
            raise HostPagesError(f"{pages} pages need {pages * self.page_size} host indices, got {n}")
        meta = self._meta(host_indices.cpu(), pages)
        per = len(meta) // pages
        if per != len(self.pieces):
            raise HostPagesError(f"the host pool described {per} pieces per page, {len(self.pieces)} at start")
        out = []
        for i in range(pages):
            page = meta[i * per : (i + 1) * per]
            if tuple(sz for _, sz in page) != self.pieces:
                raise HostPagesError("a page's pieces differ in size from the pool's pages at start")
            out.append([self._view(p, sz) for p, sz in page])
        return out


def copy_runs(dst: Sequence[memoryview], src: Sequence[memoryview]) -> None:
    """Copy the concatenation of ``src`` into the concatenation of ``dst`` (equal sizes)."""
    total = sum(v.nbytes for v in src)
    if sum(v.nbytes for v in dst) != total:
        raise HostPagesError(f"cannot copy {total} bytes into {sum(v.nbytes for v in dst)}")
    si, soff = 0, 0
    for d in dst:
        doff = 0
        while doff < d.nbytes:
            s = src[si]
            step = min(d.nbytes - doff, s.nbytes - soff)
            d[doff : doff + step] = s[soff : soff + step]
            doff += step
            soff += step
            if soff == s.nbytes:
                si, soff = si + 1, 0


__all__ = ["HostPages", "HostPagesError", "copy_runs"]
