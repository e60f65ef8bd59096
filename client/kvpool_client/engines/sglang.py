"""kvpool as an SGLang HiCache storage backend (SGLang's ``dynamic`` backend).

Tested with SGLang 0.5.23 (its host pools, storage config and backend factory on the CPU)::

    python -m sglang.launch_server --model-path MODEL --page-size 64 \\
      --enable-hierarchical-cache --hicache-mem-layout page_first \\
      --hicache-storage-backend dynamic --hicache-storage-backend-extra-config '{
        "backend_name": "kvpool", "module_path": "kvpool_client.engines.sglang",
        "class_name": "KVPoolHiCacheStorage", "interface_v1": 1,
        "hicache_storage_pass_prefix_keys": true,
        "socket_path": "/run/kvpool/kvpool.sock"}'

``hicache_storage_pass_prefix_keys`` (read by SGLang, which takes it out of the config)
makes SGLang pass each backup's prefix: without it the pool stores pages unchained (the
backend warns at attach where the launch's config says so).

``interface_v1`` makes SGLang call the zero-copy :meth:`KVPoolHiCacheStorage.batch_get_v1`
and :meth:`KVPoolHiCacheStorage.batch_set_v1` with host pool indices: a page moves between
the host pool's own memory and the sidecar's shared arena in one copy (fused with its
checksum). Where a page is one run of host memory (MLA ``page_first`` and
``page_first_direct``) the pool client reads and writes it in place; an MHA page (a K and a
V run, or one of each per layer) is read straight from the arena into its runs, and
gathered into a staging buffer before a put. Without ``interface_v1`` SGLang uses the older
calls (``batch_get``/``batch_set`` of flat page tensors, SGLang's own copies); those pages
are keyed apart from the v1 ones (their byte order differs under ``layer_first``).

One pool block is one SGLang page of this rank's shard. Its key is SGLang's page hash
under a fingerprint of the model, shard, dtype and page format
(:mod:`kvpool_client.engines.sglang_keys`), read from SGLang's runtime context where the
storage config does not say (:mod:`kvpool_client.engines.sglang_runtime`): what changes the
model's KV under one name (:data:`~kvpool_client.engines.sglang_runtime.WEIGHT_ARGS`), what
an fp8 or fp4 page's bytes mean (its resolved ``--kv-cache-dtype`` and the platform's fp8
type: SGLang stores every fp8 variant as ``uint8``), the draft model whose layers a host
pool packs into its pages (MTP, EAGLE: :data:`~kvpool_client.engines.sglang_runtime.DRAFT_ARGS`
and its files) and, with LoRA on, the files of the ``--lora-paths`` adapters. The model is
named by its ``--model-path``, keyed by its files: a local path's, or a hub name's snapshot
in SGLang's ``--download-dir`` (else the hub cache); a model path whose files cannot be found
is refused unless ``model_id`` names the weights. LoRA is refused unless
``lora_no_extra_key`` says no request sets ``extra_key`` (SGLang joins a request's
``extra_key`` and LoRA id into one string before hashing, and the backend sees page
hashes, not requests: see :mod:`~kvpool_client.engines.sglang_keys`). ``batch_exists``
is the pool's longest-prefix lookup (pages peers hold count: a get fetches them).
Settings in the same extra config: see
:class:`~kvpool_client.engines.sglang_keys.StorageSettings`.

Nothing here raises into SGLang for a slow or dead sidecar: every call has a deadline
(``lookup_timeout_s`` for ``batch_exists``, ``timeout_s`` for a get or a set, from its
first pool call to its last answer, its commits' included) and its failure is a miss (0,
False); for 2 s afterwards calls fail at once without trying the sidecar. Both are at most
5 s: SGLang's flush waits 10 s for its storage threads, and a backup is several puts.
When the sidecar restarts, the next call after that pause connects to the new one; the
pages the old one held in DRAM are gone (misses: SGLang computes them again), those on
its disk tier are found again. Bad input (indices that do not match the keys, a host pool
kvpool cannot read) raises :class:`~kvpool_client.errors.KVPoolError` subclasses, which
SGLang's storage threads log.

Once SGLang's weights may have changed, the backend reads and writes no pages until the
engine restarts (the pages' keys name the weights it attached with): when the weight version
its runtime context holds moves, when SGLang flushes its cache (``/flush_cache``, and every
weight update unless it passes ``flush_cache=False``: an update names a new weight version
only where its caller gives one), and when SGLang clears its storage backend. An update with
neither a flush nor a new weight version is not seen: restart the engine, or change
``model_id`` or ``namespace`` with the weights.

Only SGLang's KV pool is stored: models whose HiCache needs more host pools (Mamba, SWA
and DSA indexer pools, speculative draft pools: the ``*_v2`` calls) are refused at attach.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo

from kvpool_client.client import PoolClient
from kvpool_client.engines.hostpages import HostPages, HostPagesError, copy_runs
from kvpool_client.engines.prefix import Reconnecting
from kvpool_client.engines.sglang_keys import (
    PageFormat,
    SGLangConfigError,
    ShardIdentity,
    StorageSettings,
    page_fingerprint,
    page_keys,
)
from kvpool_client.engines.sglang_runtime import (
    engine_adapters,
    engine_draft,
    engine_kv,
    engine_version,
    engine_weights,
    model_source,
    prefix_keys_passed,
    weight_version,
)
from kvpool_client.errors import KVPoolError
from kvpool_client.keys import BlockKey, ModelFingerprint
from kvpool_client.protocol import PutStatus
from kvpool_client.tensors import tensor_bytes

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

#: A put that ends in one of these leaves the page in the pool (or about to be).
_STORED = (PutStatus.STORED, PutStatus.EXISTS, PutStatus.PENDING)
#: Seconds between two warnings about the sidecar (the rest are logged at debug).
_WARN_EVERY_S = 10.0
#: The attribute of a host pool that lists the backends its flushes fence (:func:`_fence_on_clear`).
_FENCES = "_kvpool_fences"

T = TypeVar("T")


class KVPoolHiCacheStorage(HiCacheStorage):  # type: ignore[misc]
    """SGLang's view of the node's kvpool sidecar (see the module's docstring)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Any = None) -> None:
        """SGLang's ``dynamic`` factory passes the storage config and a dict of extra
        arguments; the host pool comes later, through :meth:`register_mem_pool_host`."""
        extra = dict(storage_config.extra_config or {})
        self.storage_config = storage_config
        self.settings = StorageSettings.from_extra(extra)
        path, revision, download_dir = model_source()
        self.shard = ShardIdentity.from_storage_config(storage_config, self.settings, model_path=path,
                                                       revision=revision, cache_dir=download_dir)
        self._adapters = engine_adapters(self.settings)
        #: the page format SGLang's controller reads and writes: v1 with interface_v1, else flat
        self.interface = "v1" if extra.get("interface_v1") else "flat"
        self._pages: HostPages | None = None
        self._fingerprints: dict[str, ModelFingerprint] = {}
        self._staging = bytearray()
        self._warned_at = 0.0
        #: The weights' version at attach, and whether the backend is fenced off the pool since
        #: (:meth:`_fenced`: the version moved, SGLang flushed its cache, or cleared its storage).
        self._version = weight_version()
        self._moved = False
        s = self.settings
        if prefix_keys_passed() is False:
            logger.warning("kvpool HiCache backend: hicache_storage_pass_prefix_keys is not true in "
                           "--hicache-storage-backend-extra-config: SGLang passes no page's prefix with its backups, "
                           "so the pool stores pages unchained (its policy cannot keep a prefix's head before its "
                           "tail, and peers cannot tell where a prefix begins); add "
                           "\"hicache_storage_pass_prefix_keys\": true")

        def connect(timeout: float, prefault: bool) -> Callable[[], PoolClient]:
            return lambda: PoolClient(s.socket_path, tenant=s.tenant, timeout=timeout, prefault=prefault)

        # one connection per SGLang thread that calls in: prefetch lookups, loads, backups
        self._lookups = Reconnecting(connect(s.lookup_timeout_s, False))
        self._reads = Reconnecting(connect(s.timeout_s, False))
        self._writes = Reconnecting(connect(s.timeout_s, True))
        if kwargs is not None and not isinstance(kwargs, dict):  # a built-in style (config, host pool)
            self.register_mem_pool_host(kwargs)

    # ------------------------------------------------------------ set-up
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        pages = HostPages(mem_pool_host)
        super().register_mem_pool_host(mem_pool_host)
        formats = {"v1": PageFormat.of_pool(mem_pool_host, "v1", pages.pieces),
                   "flat": PageFormat.of_pool(mem_pool_host, "flat", (pages.page_bytes,))}
        kv = engine_kv(formats["v1"].dtype)
        version, weights = engine_version(), engine_weights(self.settings)
        if self._version is not None:  # (the version it runs, which an update moves past --weight-version)
            weights += f";running={self._version!r}"
        draft = engine_draft(mem_pool_host, self.settings)
        if draft:
            weights += ";" + draft
        _fence_on_clear(mem_pool_host, self)
        self._fingerprints = {name: page_fingerprint(self.shard, fmt, self.settings, version, weights, kv,
                                                     self._adapters) for name, fmt in formats.items()}
        self._pages = pages
        logger.info("kvpool HiCache backend: %s, rank %d/%d, %d-byte pages in %d piece(s), %s interface, "
                    "sidecar %s", self.shard.model, self.shard.tp_rank, self.shard.tp_size, pages.page_bytes,
                    len(pages.pieces), self.interface, self.settings.socket_path)

    def on_host_pools_registered(self) -> None:
        """Refuse the host pools kvpool does not store (SGLang then fails the attach)."""
        others = sorted(str(name) for name in getattr(self, "registered_pools", {}) if str(name) != "kv")
        if others:
            raise SGLangConfigError(f"kvpool stores SGLang's KV pool only; this model also needs host pools {others} "
                                    "(hybrid, DSA or speculative-draft caches), which kvpool does not store")

    def _fenced(self) -> bool:
        """Whether the backend is off the pool: SGLang's weights may have changed since it
        attached (an update moved their version, or SGLang flushed its cache, as every weight
        update does unless told not to: :func:`_fence_on_clear`), or SGLang cleared its storage
        (:meth:`clear`). From then on it reads and writes no pages, until the engine restarts:
        the keys name the weights it attached with, and other engines may still run those."""
        if not self._moved and self._version is not None and weight_version() != self._version:
            self._fence("SGLang's weights moved from version %r", self._version)
        return self._moved

    def _fence(self, why: str, *args: Any) -> None:
        """Turn the backend off the pool for the engine's life (:meth:`_fenced`)."""
        if not self._moved:
            self._moved = True
            logger.warning("kvpool HiCache backend: " + why + ": no pool pages are read or written until the "
                           "engine restarts", *args)

    def _bounded(self, conn: Reconnecting[PoolClient], fn: Callable[[PoolClient], T]) -> T:
        """``fn`` on ``conn``'s client, its pool calls ending by one deadline, ``timeout_s``
        from now, a reconnect's handshake included (a put in several pieces or staging rounds,
        and its commits' answers: each had waited a timeout of its own, and a put twice
        ``timeout_s``, after a handshake that may take a third)."""
        until = time.monotonic() + self.settings.timeout_s

        def run(client: PoolClient) -> T:
            with client.within(until - time.monotonic()):
                return fn(client)

        return conn.call(run)

    def _require(self, interface: str) -> tuple[HostPages, ModelFingerprint]:
        if self._pages is None:
            raise SGLangConfigError("no host pool registered with the kvpool backend yet")
        return self._pages, self._fingerprints[interface]

    def _warn(self, what: str, n: int, e: KVPoolError) -> None:
        now = time.monotonic()
        if now - self._warned_at >= _WARN_EVERY_S:
            self._warned_at = now
            logger.warning("kvpool %s of %d pages failed, counted as misses: %s", what, n, e)
        else:
            logger.debug("kvpool %s of %d pages failed: %s", what, n, e)

    # ------------------------------------------------------------ lookups
    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """How many leading pages of ``keys`` the pool holds (on this node or its peers)."""
        if not keys:
            return 0
        _, fp = self._require(self.interface)
        if self._fenced():
            return 0
        pool_keys = page_keys(fp, keys)
        try:
            held = self._lookups.call(lambda c: c.lookup(pool_keys).prefix)
        except KVPoolError as e:
            self._warn("lookup", len(keys), e)
            return 0
        return max(0, min(int(held), len(keys)))

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # ------------------------------------------------------------ zero-copy (v1) calls
    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Store the pages at ``host_indices`` (``page_size`` indices per key)."""
        pages, fp = self._require("v1")
        if not keys:
            return []
        if self._fenced():
            return [False] * len(keys)
        pool_keys = page_keys(fp, keys)
        views = pages.views(host_indices, len(keys))
        depth, parent = self._chain(fp, extra_info)
        try:
            statuses = self._bounded(self._writes, lambda c: self._put_pages(c, pool_keys, views, depth, parent))
        except KVPoolError as e:
            self._warn("put", len(keys), e)
            return [False] * len(keys)
        return [s in _STORED for s in statuses]

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Load pages into the host pool at ``host_indices``; True for each page loaded."""
        pages, fp = self._require("v1")
        if not keys:
            return []
        if self._fenced():
            return [False] * len(keys)
        pool_keys = page_keys(fp, keys)
        views = pages.views(host_indices, len(keys))
        try:
            return self._bounded(self._reads, lambda c: self._get_pages(c, pool_keys, views, pages.page_bytes))
        except KVPoolError as e:
            self._warn("get", len(keys), e)
            return [False] * len(keys)

    @staticmethod
    def _chain(fp: ModelFingerprint, extra_info: HiCacheStorageExtraInfo | None) -> tuple[int | None, BlockKey | None]:
        """The depth of a batch's first page and its parent's key, when SGLang passes the prefix."""
        prefix = getattr(extra_info, "prefix_keys", None) if extra_info is not None else None
        if prefix is None:
            return None, None
        return len(prefix), (page_keys(fp, [prefix[-1]])[0] if prefix else None)

    def _put_pages(self, client: PoolClient, keys: list[BlockKey], views: list[list[memoryview]],
                   depth: int | None, parent: BlockKey | None) -> list[PutStatus]:
        chained = depth is not None
        if all(len(v) == 1 for v in views):  # each page is one run of host memory: put from it
            return client.put(keys, [v[0] for v in views], chain=chained, depth=depth or 0, parent=parent)
        page_bytes = sum(p.nbytes for p in views[0])
        per_put = max(1, self.settings.max_staging_bytes // page_bytes)
        out: list[PutStatus] = []
        for start in range(0, len(keys), per_put):
            batch = views[start : start + per_put]
            need = len(batch) * page_bytes
            if len(self._staging) < need:
                self._staging = bytearray(need)
            staging = memoryview(self._staging)
            payloads = [staging[i * page_bytes : (i + 1) * page_bytes] for i in range(len(batch))]
            for dst, src in zip(payloads, batch):
                copy_runs([dst], src)
            out += client.put(keys[start : start + per_put], payloads, chain=chained, depth=(depth or 0) + start,
                              parent=keys[start - 1] if start else parent)
        return out

    @staticmethod
    def _get_pages(client: PoolClient, keys: list[BlockKey], views: list[list[memoryview]],
                   page_bytes: int) -> list[bool]:
        if all(len(v) == 1 for v in views):  # each page is one run: the client reads into it
            got = client.get(keys, into=[v[0] for v in views])
            return [g is not None and g.nbytes == page_bytes for g in got]
        ok: list[bool] = []
        if client.shm:  # the pieces straight from the arena (verified in place)
            with client.acquire(keys, [page_bytes] * len(keys)) as held:
                for src, dst in zip(held.views, views):
                    good = src is not None and sum(v.nbytes for v in src) == page_bytes
                    if good and src is not None:
                        copy_runs(dst, src)
                    ok.append(good)
            return ok
        for blob, dst in zip(client.get(keys), views):  # no arena mapped: the bytes came inline
            good = blob is not None and blob.nbytes == page_bytes
            if good and blob is not None:
                copy_runs(dst, [blob])
            ok.append(good)
        return ok

    # ------------------------------------------------------------ older calls (flat page tensors)
    def batch_get(self, keys: list[str], target_locations: Sequence[torch.Tensor] | None = None,
                  target_sizes: Any = None) -> list[torch.Tensor | None]:
        """Read pages into flat page tensors (new ones from the host pool when none given)."""
        pages, fp = self._require("flat")
        if not keys:
            return []
        targets = (list(target_locations) if target_locations is not None
                   else [pages.pool.get_dummy_flat_data_page() for _ in keys])
        if len(targets) != len(keys):
            raise HostPagesError(f"{len(keys)} keys need as many target tensors, got {len(targets)}")
        if self._fenced():
            return [None] * len(keys)
        outs = [tensor_bytes(t) for t in targets]
        pool_keys = page_keys(fp, keys)
        try:
            got = self._bounded(self._reads, lambda c: c.get(pool_keys, into=outs))
        except KVPoolError as e:
            self._warn("get", len(keys), e)
            return [None] * len(keys)
        return [t if g is not None and g.nbytes == out.nbytes else None for t, g, out in zip(targets, got, outs)]

    def get(self, key: str, target_location: torch.Tensor | None = None,
            target_sizes: Any = None) -> torch.Tensor | None:
        return self.batch_get([key], [target_location] if target_location is not None else None)[0]

    def batch_set(self, keys: list[str], values: Sequence[torch.Tensor] | None = None,
                  target_locations: Any = None, target_sizes: Any = None) -> bool:
        """Store flat page tensors; True when every page is in the pool."""
        _, fp = self._require("flat")
        if values is None or len(values) != len(keys):
            raise HostPagesError(f"{len(keys)} keys need as many page tensors")
        if not keys:
            return True
        if self._fenced():
            return False
        payloads = [tensor_bytes(v) for v in values]
        pool_keys = page_keys(fp, keys)
        try:
            statuses = self._bounded(self._writes, lambda c: c.put(pool_keys, payloads))
        except KVPoolError as e:
            self._warn("put", len(keys), e)
            return False
        return all(s in _STORED for s in statuses)

    def set(self, key: str, value: torch.Tensor | None = None, target_location: Any = None,
            target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value] if value is not None else None)

    # ------------------------------------------------------------ lifecycle
    def clear(self) -> None:
        """SGLang's ``/clear_hicache_storage_backend``: the pool's pages stay (every engine of
        the pool shares them), and this backend reads and writes none from now on, until the
        engine restarts (:meth:`_fenced`): what asks for the storage to be forgotten (a weight
        update, say) is answered, for this engine, as it would be by an empty storage."""
        self._fence("SGLang cleared its storage backend (the pool keeps its pages: other engines share them)")

    def close(self) -> None:
        for conn in (self._lookups, self._reads, self._writes):
            conn.close()


def _fence_on_clear(pool: Any, backend: KVPoolHiCacheStorage) -> None:
    """Fence ``backend`` (:meth:`KVPoolHiCacheStorage._fenced`) when SGLang clears ``pool``,
    which every flush of its cache does (``/flush_cache``, and each weight update's unless it
    passes ``flush_cache=False``): an update names a new weight version only where the caller
    gives one, and without it the backend had gone on loading the old weights' pages and
    storing the new weights' KV under the old weights' keys. (An update with neither a flush
    nor a weight version is not seen.) Backends are held weakly: a closed one that SGLang
    dropped leaves nothing behind on the pool."""
    fences: weakref.WeakSet[KVPoolHiCacheStorage] | None = getattr(pool, _FENCES, None)
    if fences is None:
        fences = weakref.WeakSet()
        clear = pool.clear
        watched = fences

        def flushed(*args: Any, **kwargs: Any) -> Any:
            for b in list(watched):
                b._fence("SGLang flushed its cache (a weight update may have changed the weights)")
            return clear(*args, **kwargs)

        try:
            pool.clear = flushed
            setattr(pool, _FENCES, fences)
        except AttributeError as e:
            raise SGLangConfigError(f"kvpool cannot watch the flushes of SGLang's host pool "
                                    f"{type(pool).__name__} ({e}), which may follow a weight update") from e
    fences.add(backend)


__all__ = ["KVPoolHiCacheStorage"]
