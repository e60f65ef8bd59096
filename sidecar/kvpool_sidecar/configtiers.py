"""The sidecar's settings of its tiers and of what evicts from them: the DRAM arena
(``dram``), the disk tier (``disk``), the GPU tier (``gpu``) and the eviction policy
(``policy``), each a section of :class:`~kvpool_sidecar.config.SidecarSettings` (loaded,
and documented with the rest of the settings' names, in :mod:`kvpool_sidecar.config`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DramSettings:
    """The shared-memory arena that local clients map."""

    #: Arena size in bytes (the DRAM tier's capacity).
    size_bytes: int = 1 << 30
    #: Allocation granule; a block takes whole pages, possibly in several extents.
    page_bytes: int = 64 << 10
    #: Touch every page at start-up so that the first puts do not pay page faults.
    populate: bool = True
    #: With a disk tier: the share of DRAM a background writer keeps free or already on
    #: disk (the coldest blocks are written ahead of need and stay in DRAM), so a put that
    #: needs room drops one of them at once instead of waiting for a disk write (and, for
    #: the next puts, the clean ones right after it in the eviction order, up to eight times
    #: its own room in all; a clean block past one not yet written stays).
    #: The writer wakes once puts took a quarter of that share (at most 16 MiB) since its last
    #: pass, or when a put is about to wait for a disk write. 0: write blocks to disk only
    #: when they are evicted.
    clean_share: float = 0.1
    #: With ``clean_share`` above 0 and a disk tier: false (the default), a put that finds
    #: no room free or already on disk (puts came faster than the disk writes) is answered
    #: FULL for that block and the rest of its chain at once, and the writer is woken; its
    #: blocks stored before that stay. An engine never waits on a disk write: it recomputes
    #: or puts again later. true: the put waits for the coldest block's copy to disk. While
    #: the writer's last pass could write nothing (a failing disk, or one with no room it
    #: can make) puts wait, as with true; so do a block larger than the clean share, a
    #: tenant at its quota (for its own block's copy) and a block fetched from a peer for a
    #: reader.
    put_waits_for_disk: bool = False


@dataclass(frozen=True)
class DiskSettings:
    """The NVMe tier; survives sidecar restarts."""

    #: Directory for block files; ``None`` disables the tier.
    path: str | None = None
    size_bytes: int = 0
    #: ``always``: fsync every file and its directory before it counts as written;
    #: ``never``: leave flushing to the kernel (a crash may lose, never tear, blocks).
    fsync: str = "never"
    #: ``none`` or ``zstd`` (lossless; a byte-shuffle filter helps 16-bit KV).
    compression: str = "none"
    #: The zstd level with ``compression: zstd``, 1..22 (higher: more CPU per write for
    #: smaller records); default 1.
    compression_level: int = 1
    #: ``segments``: blocks appended to a few large files, freed by punching holes
    #: (tiers/segments.py); ``files``: one file per block (tiers/disk.py), the layout of
    #: earlier versions. A tier reads only its own layout's blocks.
    layout: str = "segments"
    #: The least of the tier's size a block is charged (its tenant's share of the tier
    #: included), and so at most ``size_bytes`` over it blocks held: the sidecar keeps about
    #: 2 KB of memory for each block it holds, and a block of a few bytes takes a 4 KiB
    #: record, so a tenant putting tiny blocks could make it keep 40-50% of the tier's size
    #: in memory. ``None`` (the default): the DRAM tier's page (``dram.page_bytes``), as
    #: the DRAM tier charges; 0: no least (what a record takes).
    min_block_bytes: int | None = None


@dataclass(frozen=True)
class GpuSettings:
    """The GPU tier (needs torch with CUDA); sized from pynvml when ``size_bytes`` is 0.

    On by default where the node has an NVIDIA GPU the sidecar can see and torch with CUDA:
    elsewhere it stays off without a word beyond one log line.
    """

    enabled: bool = True
    #: The CUDA device index (``cuda:N``) that holds the tier; default 0. A device the
    #: sidecar cannot see leaves the tier off, with a warning.
    device: int = 0
    size_bytes: int = 0
    #: Fraction of the device's free memory to take when ``size_bytes`` is 0 (the rest is
    #: the engine's).
    fraction: float = 0.1
    #: Reads of a DRAM block after which it is copied up into the GPU tier.
    promote_after_hits: int = 2
    #: The share of the device's total memory the tier always leaves free for engines:
    #: vLLM takes 0.9 of it by default (``gpu_memory_utilization``) and needs its CUDA
    #: context on top. The tier shrinks to fit, or stays off; ``size_bytes`` too is capped.
    engine_reserve: float = 0.95


@dataclass(frozen=True)
class PolicySettings:
    """Which eviction policy runs, and its knobs."""

    #: ``prefix`` (prefix-aware; follows ARC's order, plain recency or an order learned from
    #: the blocks' classes and the writers' hints, whichever has had more hits lately on
    #: shadow caches that follow a sample of the blocks: with the learning state, about 250
    #: bytes per resident block; see the policy package, duel.py and reuse.py), ``prefix-arc``,
    #: ``prefix-recency`` or ``prefix-learned`` (one order, no shadows: for very many small
    #: blocks), ``prefix-nolearn`` (the duel of ARC and recency without learning, on shadows
    #: of every block: about 2 KB per resident block), or ``lru``.
    name: str = "prefix"
    #: Demote DRAM victims to disk instead of dropping them (when a disk tier exists).
    #: Disk hits are always promoted back into DRAM (clients read from the arena).
    demote: bool = True
