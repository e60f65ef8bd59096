"""Real vLLM objects with no model: a scheduler, its KV cache config, KV caches allocated on the
CPU with vLLM's own view builder, and a stand-in forward that writes each token's KV as a
function of the tokens up to it (the same prefix gives the same KV in any engine).

``python -m tests.integration.vllm_harness keys SOCKET`` prints, as JSON, the pool keys one
process derives for a fixed prompt (the test runs it in two processes and compares).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch
from vllm import SamplingParams
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.lora.request import LoRARequest
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheLayout,
    create_kv_cache_views,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from kvpool_client.engines.vllm import KVPoolConnector

BLOCK = 16
LAYERS = 2
KV_HEADS = 2
HEAD = 8
DTYPE = torch.float16
EOS = 7

_ids = itertools.count(1)


def model_dir() -> str:
    """A local Llama-shaped config.json (no weights, nothing from a hub)."""
    d = Path(tempfile.gettempdir()) / "kvpool-vllm-tiny-llama"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": KV_HEADS * HEAD * 2,
        "intermediate_size": 64, "num_attention_heads": KV_HEADS * 2, "num_key_value_heads": KV_HEADS,
        "num_hidden_layers": LAYERS, "vocab_size": 1000, "max_position_embeddings": 4096,
        "torch_dtype": "float16", "rms_norm_eps": 1e-5, "bos_token_id": 1, "eos_token_id": EOS}))
    return str(d)


def vllm_config(socket_path: str, layout: str = "BLNHC", *, hash_algo: str = "sha256",
                extra: dict[str, Any] | None = None, max_batched_tokens: int = 256,
                prefix_caching: bool = True, hf_overrides: dict[str, Any] | None = None) -> VllmConfig:
    mc = ModelConfig(model=model_dir(), skip_tokenizer_init=True, dtype="float16", seed=0, max_model_len=2048,
                     **({"hf_overrides": hf_overrides} if hf_overrides else {}))
    cache = CacheConfig(block_size=BLOCK, enable_prefix_caching=prefix_caching, prefix_caching_hash_algo=hash_algo)
    cache.kv_cache_layout = layout  # vLLM builds connectors after it resolves the layout
    sched = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=max_batched_tokens, max_model_len=2048,
                            enable_chunked_prefill=True, is_encoder_decoder=False)
    kv = KVTransferConfig(kv_connector="KVPoolConnector", kv_connector_module_path="kvpool_client.engines.vllm",
                          kv_role="kv_both", kv_load_failure_policy="recompute",
                          kv_connector_extra_config={"socket_path": socket_path, "lookup_timeout_s": 2.0,
                                                     **(extra or {})})
    return VllmConfig(model_config=mc, cache_config=cache, scheduler_config=sched, kv_transfer_config=kv,
                      device_config=DeviceConfig("cpu"))


def kv_cache_config(cfg: VllmConfig, num_blocks: int = 64) -> KVCacheConfig:
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD, dtype=DTYPE)
    groups = [KVCacheGroupSpec([f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)], spec)]
    kcc = get_kv_cache_config_from_groups(cfg, groups, spec.page_size_bytes * LAYERS * num_blocks)
    cfg.cache_config.num_gpu_blocks = kcc.num_blocks
    return kcc


def kv_caches(cfg: VllmConfig, kcc: KVCacheConfig) -> dict[str, torch.Tensor]:
    """Per-layer views exactly as vLLM's allocation builds them, in the resolved layout."""
    spec = kcc.kv_cache_groups[0].kv_cache_spec
    layout = KVCacheLayout[str(cfg.cache_config.kv_cache_layout)]
    out: dict[str, torch.Tensor] = {}
    for t in kcc.kv_cache_tensors:
        raw = torch.zeros(t.size, dtype=torch.int8)
        out.update(zip(t.layers, create_kv_cache_views(raw, spec, kcc.num_blocks, layout, t)))
    return out


def token_kv(tokens: list[int], layer: int) -> torch.Tensor:
    """The stand-in KV of the last of ``tokens`` at ``layer``: [heads, K|V content]."""
    seed = int.from_bytes(hashlib.blake2b(repr((tokens, layer)).encode(), digest_size=8).digest(), "little")
    g = torch.Generator().manual_seed(seed & ((1 << 63) - 1))
    return torch.randn(KV_HEADS, 2 * HEAD, generator=g).to(DTYPE)


def make_request(tokens: list[int], *, hash_algo: str = "sha256", max_tokens: int = 2,
                 cache_salt: str | None = None, lora: LoRARequest | None = None) -> Request:
    fn = get_hash_fn_by_name(hash_algo)
    init_none_hash(fn)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    params.update_from_generation_config({}, EOS)
    return Request(request_id=f"req-{next(_ids)}", prompt_token_ids=list(tokens), sampling_params=params,
                   pooling_params=None, block_hasher=get_request_block_hasher(BLOCK, fn), cache_salt=cache_salt,
                   lora_request=lora)


@dataclass
class Engine:
    """One vLLM instance's scheduler and worker connector over CPU KV caches."""

    cfg: VllmConfig
    kcc: KVCacheConfig
    scheduler: Scheduler
    worker: KVPoolConnector
    caches: dict[str, torch.Tensor]
    computed: dict[str, int] = field(default_factory=dict)  # tokens the stand-in forward computed
    load_errors: set[int] = field(default_factory=set)
    #: blocks each request loaded from the pool, and requests vLLM preempted
    loaded: dict[str, int] = field(default_factory=dict)
    preempted: set[str] = field(default_factory=set)
    #: wait for each step's saves before the next step (deterministic tests)
    sync_saves: bool = True
    #: called between scheduling and loading (a test's chance to break the pool)
    before_load: Callable[[SchedulerOutput], None] | None = None
    #: called after the forward and the saves, before vLLM hears how the step went (what
    #: vLLM's asynchronous scheduling lets happen there: an abort, the next step planned)
    before_report: Callable[[SchedulerOutput], None] | None = None

    @classmethod
    def start(cls, socket_path: str, layout: str = "BLNHC", num_blocks: int = 64, long_prefill: int = 0,
              **kw: Any) -> Engine:
        """``long_prefill``: vLLM's ``long_prefill_token_threshold`` (a long prompt computed a
        chunk of that many tokens a step, beside other requests)."""
        cfg = vllm_config(socket_path, layout, **kw)
        if long_prefill:
            cfg.scheduler_config.long_prefill_token_threshold = long_prefill
        kcc = kv_cache_config(cfg, num_blocks)
        sched = Scheduler(vllm_config=cfg, kv_cache_config=kcc, structured_output_manager=StructuredOutputManager(cfg),
                          block_size=BLOCK)
        worker = KVPoolConnector(cfg, KVConnectorRole.WORKER, kcc)
        caches = kv_caches(cfg, kcc)
        worker.register_kv_caches(caches)
        return cls(cfg, kcc, sched, worker, caches)

    @property
    def connector(self) -> KVPoolConnector:
        c = self.scheduler.connector
        assert isinstance(c, KVPoolConnector)
        return c

    def layer_views(self) -> list[torch.Tensor]:
        return [self.caches[n] for n in self.kcc.kv_cache_groups[0].layer_names]

    def step(self) -> SchedulerOutput:
        """One engine step: schedule, load, forward (stand-in), save, and report back."""
        out = self.scheduler.schedule()
        meta = out.kv_connector_metadata
        if self.before_load is not None:
            self.before_load(out)
        self.preempted |= set(out.preempted_req_ids or ())
        for spec in getattr(meta, "loads", ()):
            self.loaded[spec.req_id] = self.loaded.get(spec.req_id, 0) + len(spec.block_ids)
        self.worker.bind_connector_metadata(meta)
        self.worker.start_load_kv(None)  # type: ignore[arg-type]
        errors = self.worker.get_block_ids_with_load_errors()
        self.load_errors |= errors
        for rid, n in out.num_scheduled_tokens.items():
            req = self.scheduler.requests[rid]
            self._forward(req, req.num_computed_tokens - n, n)  # schedule() already counted them
        self.worker.wait_for_save()
        report = self.worker.build_connector_worker_meta()  # (vLLM asks after the save, as here)
        self.worker.clear_connector_metadata()
        if self.sync_saves:  # saves land before the next step looks the pool up
            self.worker.flush_saves()
        if self.before_report is not None:
            self.before_report(out)
        req_ids = list(out.num_scheduled_tokens)
        sampled = []
        for rid in req_ids:
            req = self.scheduler.requests.get(rid)
            done = req is not None and req.num_computed_tokens >= req.num_tokens
            sampled.append([100 + len(req.output_token_ids)] if req is not None and done else [])
        mro = ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                sampled_token_ids=sampled,
                                kv_connector_output=KVConnectorOutput(invalid_block_ids=errors,
                                                                      kv_connector_worker_meta=report)
                                if errors or report is not None else None)
        self.scheduler.update_from_output(out, mro)
        return out

    #: How much each layer's KV past the first takes from the cache slots of the positions
    #: before it, as attention does (0: none; then KV computed over slots that hold the wrong
    #: bytes is still right, and a test of what a failed load leaves behind could not fail).
    ATTENTION: ClassVar[float] = 0.0

    def _forward(self, req: Request, start: int, n: int) -> None:
        blocks = self.scheduler.kv_cache_manager.get_block_ids(req.request_id)[0]
        tokens = req.all_token_ids
        layers = self.layer_views()
        for pos in range(start, start + n):
            b, off = blocks[pos // BLOCK], pos % BLOCK
            for li, view in enumerate(layers):
                kv = token_kv(list(tokens[: pos + 1]), li)
                if li and self.ATTENTION:
                    before = layers[li - 1]
                    seen = sum(before[blocks[p // BLOCK], :, p % BLOCK, :].float() for p in range(pos))
                    kv = (kv.float() + self.ATTENTION * seen).to(DTYPE)
                view[b, :, off, :] = kv
        self.computed[req.request_id] = self.computed.get(req.request_id, 0) + n

    def run(self, req: Request, max_steps: int = 50) -> list[SchedulerOutput]:
        """Add ``req`` and step until it finishes; every step's output."""
        self.scheduler.add_request(req)
        outs = []
        for _ in range(max_steps):
            if req.request_id not in self.scheduler.requests:
                break
            outs.append(self.step())
        return outs

    def block_kv(self, block_id: int) -> list[torch.Tensor]:
        return [view[block_id].clone() for view in self.layer_views()]

    def expected_block_kv(self, tokens: list[int], index: int) -> list[torch.Tensor]:
        """What block ``index`` of a prompt must hold at each layer, whoever computed it."""
        out = []
        for li, view in enumerate(self.layer_views()):
            blk = torch.zeros_like(view[0])
            for off in range(BLOCK):
                blk[:, off, :] = token_kv(tokens[: index * BLOCK + off + 1], li)
            out.append(blk)
        return out

    def close(self) -> None:
        self.worker.flush_saves()
        self.worker.shutdown()
        if self.scheduler.connector is not None:
            self.scheduler.connector.shutdown()


def _print_keys(socket_path: str) -> None:
    cfg = vllm_config(socket_path)
    conn = KVPoolConnector(cfg, KVConnectorRole.SCHEDULER, kv_cache_config(cfg))
    req = make_request(list(range(1, 3 * BLOCK + 2)))
    print(json.dumps([k.hex() for k in conn._rank_keys(0, conn._hashes(req))]))
    conn.shutdown()


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "keys":
        _print_keys(sys.argv[2])
    else:
        sys.exit("usage: python -m tests.integration.vllm_harness keys SOCKET")
