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
storage config does not say: what changes the model's KV under one name
(:data:`WEIGHT_ARGS`), what an fp8 or fp4 page's bytes mean (its resolved
``--kv-cache-dtype`` and the platform's fp8 type: SGLang stores every fp8 variant as
``uint8``), the draft model whose layers a host pool packs into its pages (MTP, EAGLE:
:data:`DRAFT_ARGS` and its files) and, with LoRA on, the files of the ``--lora-paths``
adapters. The model is named by its ``--model-path``, keyed by its files: a local path's,
or a hub name's snapshot in SGLang's ``--download-dir`` (else the hub cache); a model path
whose files cannot be found is refused unless ``model_id`` names the weights. LoRA is refused
unless ``lora_no_extra_key`` says no request sets ``extra_key`` (SGLang joins a request's
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

import json
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
    adapters_identity,
    kv_values,
    page_fingerprint,
    page_keys,
    start_adapters,
)
from kvpool_client.engines.weights import load_format_tag, weights_identity
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


def _engine_version() -> str:
    from sglang.version import __version__

    return str(__version__)


#: The server arguments that change a model's KV under the same name: its weights'
#: quantization (and ModelOpt's, applied as it loads, or restored from a checkpoint of its
#: own, and FlashRL's profile), its KV scales, its config overrides (rope scaling among them,
#: and a decrypted config in place of the model's), its weights' revision, a loader of the
#: user's own and its loader's settings, the dtype it computes in (which the page dtype does
#: not say where ``--kv-cache-dtype`` is set apart), the implementation of the model it runs,
#: and the version of the weights it starts with.
WEIGHT_ARGS = ("quantization", "modelopt_quant", "modelopt_checkpoint_restore_path", "quantization_param_path",
               "json_model_override_args", "revision", "custom_weight_loader", "weight_version", "dtype",
               "rl_quant_profile", "model_impl", "model_loader_extra_config", "decrypted_config_file")
#: What names a speculative draft model whose layers the host pool packs into its pages (an
#: MTP or EAGLE draft's KV is stored beside the target's): its algorithm, the draft's path
#: (its files key it, as the target's), revision, quantization, load format and config.
DRAFT_ARGS = ("speculative_algorithm", "speculative_draft_model_path", "speculative_draft_model_revision",
              "speculative_draft_model_quantization", "speculative_draft_load_format", "decrypted_draft_config_file")
#: Settings that are JSON text: compared by their content, not their spelling.
_JSON_ARGS = ("json_model_override_args", "model_loader_extra_config")


def _weight_version() -> str | None:
    """The version of the weights SGLang runs now, as its runtime context says (a weight
    update moves it); None where it cannot be read."""
    try:
        from sglang.srt.runtime_context import get_serving

        return str(get_serving().weight_version)
    except (ImportError, AttributeError, LookupError, ValueError, RuntimeError):
        return None


def _server_args() -> Any | None:
    """SGLang's server arguments, as its runtime context holds them in a scheduler process
    (None where the context is not set in this process)."""
    try:
        from sglang.srt.runtime_context import get_server_args

        return get_server_args()
    except (ImportError, AttributeError, LookupError, ValueError, RuntimeError):
        return None


def _resolved(args: Any, bag: str, name: str) -> Any:
    """What SGLang resolved for the server argument ``name``: the published config bag
    ``bag`` it runs with (a model's hooks may change ``--kv-cache-dtype``, and parsing turns
    ``--lora-paths`` into records), else the resolution recorded on ``args``, else the raw
    argument."""
    try:
        from sglang.srt import runtime_context

        return getattr(getattr(runtime_context, "get_" + bag)(), name)
    except (ImportError, AttributeError, LookupError, ValueError, RuntimeError):
        pass
    try:
        from sglang.srt.arg_groups.overrides import resolution_result

        return resolution_result(args, name, getattr(args, name, None))
    except (ImportError, AttributeError, LookupError, ValueError, TypeError):
        return getattr(args, name, None)


def _platform_fp8() -> str:
    """The platform's fp8 e4m3 type as SGLang picks it (``float8_e4m3fnuz`` on ROCm MI300)."""
    try:
        from sglang.kernels.ops.quantization.fp8_kernel import fp8_dtype

        return str(fp8_dtype)
    except (ImportError, AttributeError, RuntimeError, OSError):
        import torch

        hip = getattr(torch.version, "hip", None)
        return f"rocm-{hip}-unknown" if hip else str(torch.float8_e4m3fn)


def _engine_kv(page_dtype: str) -> str:
    """What the fingerprint says of a page's values where its dtype does not
    (:func:`~kvpool_client.engines.sglang_keys.kv_values`)."""
    args = _server_args()
    kv = None if args is None else _resolved(args, "model", "kv_cache_dtype")
    return kv_values(page_dtype, str(kv) if kv else None, _platform_fp8)


def _engine_adapters(settings: StorageSettings) -> str:
    """The fingerprint's ``lora`` entry: "" with LoRA off (or the runtime context not set,
    which :func:`_engine_weights` warns of), else the identity of the adapters SGLang loads
    at start; refuses LoRA kvpool cannot key safely
    (:func:`~kvpool_client.engines.sglang_keys.adapters_identity`)."""
    args = _server_args()
    if args is None:
        return ""
    enabled, paths = _resolved(args, "lora", "enable_lora"), _resolved(args, "lora", "lora_paths")
    # as SGLang reads them: --lora-paths turn LoRA on unless --enable-lora says false
    if not (enabled or (enabled is None and paths)):
        return ""
    return adapters_identity(start_adapters(paths), settings)


def _engine_weights(settings: StorageSettings) -> str:
    """What SGLang runs the model with that changes its KV (:data:`WEIGHT_ARGS`, and a load
    format that does not read the checkpoint's own weights), as its runtime context says.
    Where the context is not set in this process, refused unless ``model_id`` names the
    weights: the name SGLang gives the backend is its served name, which two fine-tunes
    often share, and quantized weights, overrides and adapters would not be seen."""
    args = _server_args()
    if args is None:
        if not settings.model_id:
            raise SGLangConfigError("kvpool HiCache backend: SGLang's server arguments cannot be read in this process, "
                                    "so nothing tells which weights, quantization, overrides or LoRA adapters the "
                                    "model runs with: set model_id in --hicache-storage-backend-extra-config to a name "
                                    "that changes whenever any of them does (and do not enable LoRA)")
        logger.warning("kvpool HiCache backend: SGLang's server arguments cannot be read here: the model is keyed "
                       "by model_id alone; quantized weights, config overrides and LoRA adapters are not seen")
        return ""
    weights = ";".join(f"{name}={_spelled(name, getattr(args, name, None))!r}" for name in WEIGHT_ARGS)
    load = load_format_tag(getattr(args, "load_format", None))
    return f"{weights};load_format={load!r}" if load else weights


def _model_source() -> tuple[str, str, str | None]:
    """The path (or hub name) SGLang loaded the model from, its ``--revision`` and its
    ``--download-dir`` (the hub cache a hub name's snapshot is in; None: the hub library's
    default). SGLang names the model to its storage backend by ``--served-model-name`` where
    one is given, and two deployments of different fine-tunes are often served under one
    name: the path's files tell them apart."""
    args = _server_args()
    if args is None:
        return "", "", None
    return (str(getattr(args, "model_path", None) or ""), str(getattr(args, "revision", None) or ""),
            _download_dir(args))


def _download_dir(args: Any) -> str | None:
    return str(getattr(args, "download_dir", None) or "") or None


def _engine_draft(pool: Any, settings: StorageSettings) -> str:
    """What the fingerprint adds where the host pool packs a speculative draft model's layers
    into its pages (``layer_num`` past ``target_layer_num``): the draft's :data:`DRAFT_ARGS`
    and its files (a local path's, or a hub name's snapshot), "" where it packs none. Two
    engines of one target with other drafts had shared those pages. Refused where the
    draft's files cannot be found, unless ``model_id`` names the weights."""
    layers, target = getattr(pool, "layer_num", None), getattr(pool, "target_layer_num", None)
    if not (isinstance(layers, int) and isinstance(target, int) and layers > target):
        return ""
    args = _server_args()
    if args is None:  # (refused unless model_id names the weights: _engine_weights)
        return ""
    spec = {name: _resolved(args, "spec", name) for name in DRAFT_ARGS}
    path = str(spec["speculative_draft_model_path"] or "")
    revision = str(spec["speculative_draft_model_revision"] or "")
    files = "" if settings.model_id or not path else weights_identity(path, revision, _download_dir(args))
    if not files and not settings.model_id:
        raise SGLangConfigError(f"the host pool stores the layers of a speculative draft model ({layers - target} of "
                                f"{layers}) in every page, and kvpool cannot tell which weights the draft "
                                f"{path or '(no --speculative-draft-model-path)'!r} holds (no local path, no "
                                "snapshot of it in the hub cache): set model_id in "
                                "--hicache-storage-backend-extra-config to a name that changes whenever the target's "
                                "or the draft's weights do")
    named = ";".join(f"{name}={value if value is None else str(value)!r}" for name, value in spec.items())
    return f"draft=({named};files={files!r})"


def _prefix_keys_passed(args: Any) -> bool | None:
    """Whether the launch's ``--hicache-storage-backend-extra-config`` turns on
    ``hicache_storage_pass_prefix_keys`` (SGLang takes it out of the config before the
    backend sees it); None where that cannot be told (no such config, or a file)."""
    raw = _resolved(args, "memory", "hicache_storage_backend_extra_config")
    if not isinstance(raw, str) or not raw or raw.startswith("@"):
        return None
    try:
        config = json.loads(raw)
    except ValueError:
        return None
    return config.get("hicache_storage_pass_prefix_keys") is True if isinstance(config, dict) else None


def _spelled(name: str, value: Any) -> Any:
    """One spelling of an argument: a JSON setting's keys sorted (two nodes that write the
    same overrides in another order, or spacing, derive the same keys)."""
    if name not in _JSON_ARGS or not isinstance(value, str):
        return value
    try:
        return json.dumps(json.loads(value or "{}"), sort_keys=True)
    except ValueError:
        return value


class KVPoolHiCacheStorage(HiCacheStorage):  # type: ignore[misc]
    """SGLang's view of the node's kvpool sidecar (see the module's docstring)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Any = None) -> None:
        """SGLang's ``dynamic`` factory passes the storage config and a dict of extra
        arguments; the host pool comes later, through :meth:`register_mem_pool_host`."""
        extra = dict(storage_config.extra_config or {})
        self.storage_config = storage_config
        self.settings = StorageSettings.from_extra(extra)
        path, revision, download_dir = _model_source()
        self.shard = ShardIdentity.from_storage_config(storage_config, self.settings, model_path=path,
                                                       revision=revision, cache_dir=download_dir)
        self._adapters = _engine_adapters(self.settings)
        #: the page format SGLang's controller reads and writes: v1 with interface_v1, else flat
        self.interface = "v1" if extra.get("interface_v1") else "flat"
        self._pages: HostPages | None = None
        self._fingerprints: dict[str, ModelFingerprint] = {}
        self._staging = bytearray()
        self._warned_at = 0.0
        #: The weights' version at attach, and whether the backend is fenced off the pool since
        #: (:meth:`_fenced`: the version moved, SGLang flushed its cache, or cleared its storage).
        self._version = _weight_version()
        self._moved = False
        s = self.settings
        args = _server_args()
        if args is not None and _prefix_keys_passed(args) is False:
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
        kv = _engine_kv(formats["v1"].dtype)
        version, weights = _engine_version(), _engine_weights(self.settings)
        if self._version is not None:  # (the version it runs, which an update moves past --weight-version)
            weights += f";running={self._version!r}"
        draft = _engine_draft(mem_pool_host, self.settings)
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
        if not self._moved and self._version is not None and _weight_version() != self._version:
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
