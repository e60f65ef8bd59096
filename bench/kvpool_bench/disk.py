"""``kvpool bench disk``: the disk tier's demote and promote rates against the raw disk.

For each block size, the same bytes (``total`` per size, in blocks of that size) are:

- written raw: appended to one file with ``os.write``, with the tier's fsync policy
  (``always``: an ``fdatasync`` after each block, the least a crash-safe write of one block
  needs; ``never``: none), the baseline for demotion;
- read raw: that file read back sequentially after its pages were dropped from the page
  cache (``fsync`` then ``POSIX_FADV_DONTNEED``, untimed), the baseline for promotion;
- demoted: written by the disk tier one block after another (``write``: with the default
  segment layout a record appended to a segment file and, with ``always``, an
  ``fdatasync``; with ``disk.layout: files`` its own file, renamed into place, and the
  file's and its directory's fsync), as an eviction that must write its block first does;
- demoted in batches: ``write_many`` of at most the store's write-ahead batch
  (``WRITE_AHEAD_BATCH_BYTES``), one sync per batch with ``always``, as the store's
  write-ahead writes the coldest blocks ahead of need;
- promoted: read back by the tier (``read_into``: read, header and checksum checks), one
  block after another, after the same page-cache drop;
- promoted in batches: the same after ``DiskTier.prefetch`` of each batch of
  :data:`ACQUIRE_BATCH` blocks;
- promoted in parallel batches: after the same hints, the batch's reads split as the store
  splits a batch acquire's or get's cold blocks to bring them into DRAM
  (``TieredStore.prefetch``: up to ``PREFETCH_PARALLEL`` threads, each reading a run of
  the blocks one after another, see ``split_batches``).

The raw read and the tiers' promotions land in page-aligned buffers, as a promotion lands in
the arena (the kernel's copy into a buffer 16 bytes into a page, a bytearray's, ran at half
speed here, which had slowed the raw read and not the tiers: a tier's payload follows its
header). The raw write and read run before and after the tiers, and the faster run of each is the
baseline. All on the filesystem of ``path``, in the same run, for the segment layout (the rows and
ratios without a prefix) and for the one-file-per-block layout (``files_``). GB/s is 1e9
bytes per second; ratios are the tier's rate over the raw rate.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpool_bench.services import page_aligned
from kvpool_client.integrity import checksum
from kvpool_sidecar.config import DiskSettings
from kvpool_sidecar.store import PREFETCH_PARALLEL, WRITE_AHEAD_BATCH_BYTES, split_batches
from kvpool_sidecar.tiers.base import BlockRecord
from kvpool_sidecar.tiers.disk import DiskTier
from kvpool_sidecar.tiers.segments import SegmentDiskTier


#: Blocks per prefetched batch (the vLLM connector's loads are batches of this order).
ACQUIRE_BATCH = 16


@dataclass(frozen=True)
class DiskBenchOptions:
    sizes: tuple[int, ...] = (64 << 10, 2 << 20)
    #: Bytes moved per size and path.
    total_bytes: int = 256 << 20
    fsync: str = "always"
    #: Where the files go (a temporary directory under it, removed at the end).
    path: str | None = None


def drop_cache(path: Path) -> None:
    """Make ``path``'s pages clean, then ask the kernel to forget them (untimed)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else 0.0


def _raw(where: Path, blocks: list[memoryview], fsync: bool) -> tuple[float, float]:
    path = where / "raw.bin"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    t0 = time.perf_counter()
    try:
        for b in blocks:
            view = b
            while view.nbytes:
                view = view[os.write(fd, view):]
            if fsync:
                os.fdatasync(fd)
    finally:
        os.close(fd)
    wrote = time.perf_counter() - t0
    drop_cache(path)
    size = blocks[0].nbytes
    buf = page_aligned(size)
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass
    read = time.perf_counter() - t0
    path.unlink()
    return wrote, read


def _tier(where: Path, blocks: list[memoryview], records: list[BlockRecord], fsync: str, layout: str
          ) -> tuple[float, float, float, float, float]:
    total = sum(b.nbytes for b in blocks)
    settings = DiskSettings(path=str(where / "tier"), size_bytes=2 * total + (64 << 20), fsync=fsync, layout=layout)
    tier = SegmentDiskTier(settings) if layout == "segments" else DiskTier(settings)
    tier.open()
    t0 = time.perf_counter()
    for rec, b in zip(records, blocks):
        tier.write(rec, [b])
    wrote = time.perf_counter() - t0
    for rec in records:
        tier.delete(rec.key)
    per_batch = max(1, WRITE_AHEAD_BATCH_BYTES // blocks[0].nbytes)
    t0 = time.perf_counter()
    for i in range(0, len(blocks), per_batch):
        done = tier.write_many([(rec, [b]) for rec, b in zip(records[i:i + per_batch], blocks[i:i + per_batch])])
        if not all(isinstance(r, int) for r in done):
            raise RuntimeError("a batched write failed: {}".format([r for r in done if not isinstance(r, int)][:1]))
    batched = time.perf_counter() - t0
    dests = [page_aligned(blocks[0].nbytes) for _ in range(ACQUIRE_BATCH)]  # one per block in flight
    reads = []
    with ThreadPoolExecutor(PREFETCH_PARALLEL) as pool:
        for mode in ("one by one", "hinted", "parallel"):
            for f in (where / "tier").rglob("*.kv?"):
                drop_cache(f)
            t0 = time.perf_counter()
            for i in range(0, len(records), ACQUIRE_BATCH):
                batch = records[i:i + ACQUIRE_BATCH]
                if mode != "one by one":
                    tier.prefetch([r.key for r in batch])
                if mode == "parallel":
                    runs = split_batches(range(len(batch)), PREFETCH_PARALLEL)
                    list(pool.map(lambda run: [tier.read_into(batch[j].key, dests[j]) for j in run], runs))
                else:
                    for rec in batch:
                        tier.read_into(rec.key, dests[0])
            reads.append(time.perf_counter() - t0)
    tier.close()
    shutil.rmtree(where / "tier")
    return wrote, batched, reads[0], reads[1], reads[2]


def run_disk_bench(opts: DiskBenchOptions) -> dict[str, Any]:
    if opts.fsync not in ("always", "never"):
        raise ValueError("fsync must be always or never")
    out: dict[str, Any] = {"fsync": opts.fsync, "total_bytes_per_size": opts.total_bytes, "blocks": {},
                           "ratios": {}}
    rng = random.Random(7)
    with tempfile.TemporaryDirectory(prefix="kvpool-bench-disk-", dir=opts.path) as tmp:
        where = Path(tmp)
        out["path"] = str(where)
        for size in opts.sizes:
            n = max(1, opts.total_bytes // size)
            pattern = memoryview(rng.randbytes(size + 4096))
            # distinct bytes per block (a shifted window of one random buffer), each checksummed
            blocks = [pattern[i % 4096: i % 4096 + size] for i in range(n)]
            records = [BlockRecord(rng.randbytes(48), size, checksum(b), "default") for b in blocks]
            label = "{}KiB".format(size >> 10) if size < (1 << 20) else "{}MiB".format(size >> 20)
            moved = n * size
            # the raw disk before and after the tiers, the faster run as the baseline (the
            # disk may still be flushing what ran before the first)
            raw_w, raw_r = _raw(where, blocks, opts.fsync == "always")
            timed = {layout: _tier(where, blocks, records, opts.fsync, layout) for layout in ("segments", "files")}
            again_w, again_r = _raw(where, blocks, opts.fsync == "always")
            raw_w, raw_r = min(raw_w, again_w), min(raw_r, again_r)
            row: dict[str, float] = {"blocks": n, "raw_write_gbps": _gbps(moved, raw_w),
                                     "raw_read_gbps": _gbps(moved, raw_r)}
            for layout, prefix in (("segments", ""), ("files", "files_")):
                tier_w, tier_wb, tier_r, tier_rb, tier_rp = timed[layout]
                row.update({prefix + "demote_gbps": _gbps(moved, tier_w),
                            prefix + "demote_batched_gbps": _gbps(moved, tier_wb),
                            prefix + "promote_gbps": _gbps(moved, tier_r),
                            prefix + "promote_batched_gbps": _gbps(moved, tier_rb),
                            prefix + "promote_parallel_gbps": _gbps(moved, tier_rp),
                            prefix + "demote_blocks_per_s": n / tier_w if tier_w else 0.0,
                            prefix + "promote_blocks_per_s": n / tier_r if tier_r else 0.0})
                ratios = out["ratios"]
                ratios[prefix + "demote_vs_raw_write_" + label] = raw_w / tier_w if tier_w else 0.0
                ratios[prefix + "demote_batched_vs_raw_write_" + label] = raw_w / tier_wb if tier_wb else 0.0
                ratios[prefix + "promote_vs_raw_read_" + label] = raw_r / tier_r if tier_r else 0.0
                ratios[prefix + "promote_batched_vs_raw_read_" + label] = raw_r / tier_rb if tier_rb else 0.0
                ratios[prefix + "promote_parallel_vs_raw_read_" + label] = raw_r / tier_rp if tier_rp else 0.0
            out["blocks"][label] = row
    return out
