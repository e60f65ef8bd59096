"""What a vLLM deployment's blocks are keyed under, and the deployments the connector refuses.

A pool block's key is vLLM's own block hash (over the tokens, a cache salt, a LoRA adapter's
name, multimodal inputs) under a :class:`~kvpool_client.keys.ModelFingerprint` of everything
else that changes the bytes of a block for the same tokens: the model and its weights
(:mod:`~kvpool_client.engines.weights`), what overrides its config (``hf_overrides``, another
config path, the model code's revision, another class for its architecture, the multimodal
processor's server defaults, the rope factors a LongRoPE model runs with), the weights'
quantization (and which layers an online one leaves alone) and load format, the
cache dtype, the KV cache spec whole (every field: the geometry, how a backend packs heads
into slots, a KV quantization mode), the resolved layout, the attention backend asked for,
the platform (one that stores ``fp8`` as ``e4m3fnuz`` keys apart from one that stores
``e4m3fn``: the same byte is another number), a speculative decoding drafter whose layers
share the group (its method and weights), the TP/PP rank, the hash algorithm and its seed, and
vLLM's minor version.

Refused, because their blocks cannot be shared by prefix: KV in more than one group
(hybrid models), layers that are not full attention or MLA, layers that attend both ways
(a Prefix-LM's non-causal prefill: a prefix's KV depends on what follows it, which vLLM's
own prefix caching refuses too), decode context parallelism, a per-process hash seed, and a
model loaded from a URI (``s3://...``, as the model or as its weights) without ``model_id``:
nothing on the node tells which weights the URI held when it was read; a LongRoPE model whose
length vLLM fits to the GPU (``max_model_len=-1``) and whose config does not say its original
context at its top (:func:`long_rope`).

Weights changed under a running engine (an RL trainer's weight sync): vLLM's
``reset_prefix_cache(reset_connector=True)`` (``reset_cache``, which sleep and pauses call
too) stops the connector's loads and saves until the engine restarts, unless
``weights_fixed`` says the weights never change in place (see
:mod:`~kvpool_client.engines.vllm`); a trainer that updates weights without it must give
each version its own ``model_id``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import TYPE_CHECKING, Any, Protocol

from kvpool_client.engines.hf import rope_parameters
from kvpool_client.engines.weights import load_format_tag, weights_identity
from kvpool_client.errors import KVPoolError
from kvpool_client.keys import ModelFingerprint

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

#: vLLM hash algorithms whose block hashes agree across processes by default.
DETERMINISTIC_HASHES = ("sha256", "sha256_cbor")

#: Fields of a KV cache group that are not what its blocks hold (the spec is taken whole).
_GROUP_NAMES = ("layer_names", "kv_cache_spec")


class ConnectorConfigError(KVPoolError, ValueError):
    """The vLLM configuration cannot share blocks safely through the pool."""


class Naming(Protocol):
    """What the connector's settings add to a key."""

    @property
    def model_id(self) -> str: ...

    @property
    def namespace(self) -> str: ...


def hash_scheme(vllm_config: VllmConfig) -> tuple[str, str]:
    """The block hash algorithm and a digest of its seed; refuses per-process seeds."""
    from vllm.v1.core.kv_cache_utils import get_none_hash_seed

    algo = str(vllm_config.cache_config.prefix_caching_hash_algo)
    if algo not in DETERMINISTIC_HASHES and os.environ.get("PYTHONHASHSEED") is None:
        raise ConnectorConfigError(
            f"prefix_caching_hash_algo={algo!r} seeds its block hashes at random in every process, so no two "
            "vLLM processes would ever share a block: use sha256 or sha256_cbor, or set PYTHONHASHSEED to the "
            "same value on every instance")
    seed = hashlib.sha256(get_none_hash_seed().encode()).hexdigest()[:32]
    return algo, seed


def model_digest(model_config: Any) -> str:
    """A digest of what changes the model's KV under the same name and revision: vLLM's
    ``hf_overrides`` (rope scaling, another theta, fewer layers...), a config read from
    another path (``hf_config_path``: by its files where it is local, by the commit the hub
    cache holds where it is a hub name), the model code's
    revision (``code_revision``, for code from the hub) and the weights' quantization
    (``--quantization``, or the checkpoint's, as vLLM resolved it when it built the config).
    The same name served with fp8 weights, or with a rope override, computes other KV for
    the same tokens, and vLLM's block hashes do not tell them apart.

    It is taken from those inputs, not from the model config they produce: a model's own code
    changes that object in the worker processes, after it is loaded (several of vLLM's model
    classes set fields of it), while the scheduler keys its lookups with it unchanged; both
    must derive the same keys."""
    overrides = getattr(model_config, "hf_overrides", None) or {}
    if callable(overrides):  # (a function given through the Python API: known by its name)
        overrides = f"{getattr(overrides, '__module__', '')}.{getattr(overrides, '__qualname__', repr(overrides))}"
    parts: list[Any] = [_canonical(overrides), str(getattr(model_config, "quantization", None) or "")]
    # the rest of what changes the weights or the model's code under the same name and
    # quantization: which layers an online quantization leaves alone, another class for the
    # architecture, the server's defaults for the multimodal processor (vLLM's multimodal
    # hashes hold the request's own arguments, not these), and the rope a LongRoPE model runs
    mm = getattr(model_config, "multimodal_config", None)
    for name, value in (("quantization_config", getattr(model_config, "quantization_config", None)),
                        ("class_overrides", getattr(model_config, "model_class_overrides", None)),
                        ("mm_processor", getattr(mm, "mm_processor_kwargs", None) if mm is not None else None),
                        ("rope", long_rope(model_config))):
        if value:
            parts += [name, _canonical(value)]
    config_path = str(getattr(model_config, "hf_config_path", None) or "")
    code_revision = str(getattr(model_config, "code_revision", None) or "")
    if config_path and config_path != str(getattr(model_config, "model", "")):
        revision = str(getattr(model_config, "_hf_config_revision", None) or getattr(model_config, "revision", None) or "")
        parts += ["config", config_path, weights_identity(config_path, revision)]
    if code_revision:
        parts += ["code", code_revision]
    blob = json.dumps(parts, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def long_rope(model_config: Any) -> str:
    """Which factors a LongRoPE model (Phi-3 and its kin) rotates keys with: vLLM takes the
    long ones where ``max_model_len`` exceeds the model's original context, the short ones
    otherwise, so the same tokens get other keys; ``""`` for any other rope. A length vLLM
    fits to the GPU's memory (``max_model_len=-1``) is chosen after the model is built: vLLM
    starts such a model at its original context, where the config says it, and fits no
    further (the short factors, as the rule gives); refused where the config does not say it."""
    hf = getattr(model_config, "hf_text_config", None) or getattr(model_config, "hf_config", None)
    for params in rope_parameters(hf):
        if str(params.get("rope_type") or params.get("type") or "") not in ("longrope", "su"):
            continue
        original = params.get("original_max_position_embeddings") or getattr(hf, "original_max_position_embeddings", None)
        if getattr(model_config, "original_max_model_len", None) == -1 \
                and not isinstance(getattr(hf, "original_max_position_embeddings", None), int):
            raise ConnectorConfigError("a LongRoPE model's keys depend on which rope factors it runs, fixed by "
                                       "max_model_len before vLLM fits it to the GPU (-1): set max_model_len")
        if not isinstance(original, int):
            raise ConnectorConfigError("a LongRoPE model without original_max_position_embeddings: which rope "
                                       "factors it runs cannot be told")
        return "long" if int(model_config.max_model_len) > original else "short"
    return ""


def _canonical(value: Any) -> Any:
    """``value`` as JSON with one spelling: maps keyed by strings, sets sorted, the rest by repr."""
    if isinstance(value, dict):
        return {str(k): _canonical(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted(repr(_canonical(v)) for v in value)
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return repr(value)


def _fields(obj: Any, skip: tuple[str, ...] = ()) -> dict[str, str]:
    """Every dataclass field of ``obj`` but ``skip``, by its repr."""
    return {f.name: repr(getattr(obj, f.name, None)) for f in dataclasses.fields(obj) if f.name not in skip}


def spec_digest(group: Any) -> str:
    """A digest of a KV cache group's spec, every field of it (how a backend packs heads
    into slots, a KV quantization mode, the bytes per state...), and of the group's own
    fields but its layers: a pipeline stage's block holds that stage's layers, and the
    scheduler, which keys every stage's blocks, knows only the first stage's (stages of
    unequal layer counts had never hit); the model's files and overrides name its layers."""
    spec = group.kv_cache_spec
    blob = json.dumps([type(spec).__name__, _fields(spec), _fields(group, _GROUP_NAMES)], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def platform_tag() -> str:
    """The platform vLLM runs on and the fp8 format it stores (``e4m3fn``, or ``e4m3fnuz``
    on some AMD GPUs: one byte, two numbers)."""
    from vllm.platforms import current_platform

    try:
        fp8 = str(current_platform.fp8_dtype())
    except (NotImplementedError, AttributeError, RuntimeError):  # a platform without fp8
        fp8 = "none"
    # the platform's kind (CUDA, ROCM, CPU...), not its class: one kind has several classes
    # (CUDA with and without NVML), which would key the same GPUs apart
    kind = getattr(getattr(current_platform, "_enum", None), "name", None) or type(current_platform).__name__
    return f"{kind}:{fp8}"


def drafter_digest(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> str:
    """A digest of the speculative decoding drafter whose layers share the KV group (EAGLE
    and MTP heads of the target's shape): its method and its weights; ``""`` where no
    drafter's layers are in the group (none, or an n-gram or suffix method, which keeps no KV)."""
    sc = getattr(vllm_config, "speculative_config", None)
    if sc is None or not drafter_shares_blocks(kv_cache_config):
        return ""
    model = str(getattr(sc, "model", None) or "")
    revision = str(getattr(sc, "revision", None) or "")
    parts = [str(getattr(sc, "method", None) or ""), model, revision, str(getattr(sc, "code_revision", None) or ""),
             str(getattr(sc, "quantization", None) or ""), str(getattr(sc, "kv_cache_dtype", None) or ""),
             weights_identity(model, revision) if model else ""]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:32]


def drafter_shares_blocks(kv_cache_config: KVCacheConfig) -> bool:
    """Whether a drafter's layers share the pool's blocks (an EAGLE group): the drafter's KV
    at a block's last token depends on the next token, which a block's hash does not cover,
    so the last block of a prefix found in the pool is computed again, as vLLM's own prefix
    cache does for these groups."""
    return any(getattr(g, "is_eagle_group", False) for g in kv_cache_config.kv_cache_groups)


def _checked_spec(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> Any:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1 or type(groups[0].kv_cache_spec) not in (FullAttentionSpec, MLAAttentionSpec):
        raise ConnectorConfigError("KVPoolConnector supports models whose KV is one group of full-attention (or "
                                   "MLA) layers; "
                                   f"this one has {[type(g.kv_cache_spec).__name__ for g in groups]}")
    spec = groups[0].kv_cache_spec
    if getattr(spec, "non_causal", False):
        raise ConnectorConfigError("KVPoolConnector cannot share the KV of layers that attend both ways (a "
                                   "Prefix-LM's non-causal prefill): a prefix's KV depends on what follows it")
    if getattr(vllm_config.parallel_config, "decode_context_parallel_size", 1) != 1:
        raise ConnectorConfigError("KVPoolConnector does not support decode context parallelism")
    return spec


def fingerprints(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig,
                 settings: Naming) -> list[ModelFingerprint]:
    """The fingerprint of every rank, in rank order ``pp_rank * tp_size + tp_rank``."""
    import vllm

    spec = _checked_spec(vllm_config, kv_cache_config)
    group = kv_cache_config.kv_cache_groups[0]
    mc, cc, pc = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    layout = cc.kv_cache_layout
    if not layout:
        raise ConnectorConfigError("the KV cache layout is not resolved yet")
    # (an object store's model is read into a local directory of its config files, the URI
    # kept as model_weights: that directory names no weights)
    source = next((str(u) for u in (mc.model, getattr(mc, "model_weights", None)) if u and "://" in str(u)), "")
    if not settings.model_id and source:
        raise ConnectorConfigError(f"the model is loaded from {source!r}: nothing on the node tells which "
                                   "weights it held when read, so set model_id (kv_connector_extra_config) to a "
                                   "name that changes whenever they do")
    algo, seed = hash_scheme(vllm_config)
    geometry = (f"{type(spec).__name__}:bs={spec.block_size}:heads={spec.num_kv_heads}:hd={spec.head_size}"
                f":hdv={getattr(spec, 'head_size_v', spec.head_size)}:dt={spec.dtype}:page={spec.page_size_bytes}")
    version = ".".join(vllm.__version__.split(".")[:2])
    # a local path names no weights (one mount, any fine-tune): its files do, unless model_id vouches
    load_config = getattr(vllm_config, "load_config", None)
    files = "" if settings.model_id else weights_identity(
        str(mc.model), str(mc.revision or ""), getattr(load_config, "download_dir", None))
    load = load_format_tag(getattr(load_config, "load_format", None))
    backend = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
    drafter = drafter_digest(vllm_config, kv_cache_config)
    extra: dict[str, str] = {
        "kv_cache_dtype": str(cc.cache_dtype), "hash": algo, "hash_seed": seed, "vllm": version,
        "model": model_digest(mc), "spec": spec_digest(group), "platform": platform_tag(),
        **({"files": files} if files else {}), **({"load": load} if load else {}),
        **({"backend": str(getattr(backend, "name", backend))} if backend is not None else {}),
        **({"drafter": drafter} if drafter else {}),
    }
    tp, pp = pc.tensor_parallel_size, pc.pipeline_parallel_size
    return [
        ModelFingerprint(
            model=settings.model_id or str(mc.model), revision=str(mc.revision or ""), dtype=str(mc.dtype),
            kv_layout=f"vllm:{layout}:{geometry}", block_tokens=cc.block_size, tp_rank=r % tp, tp_size=tp,
            pp_rank=r // tp, pp_size=pp, namespace=settings.namespace, extra=dict(extra),
        )
        for r in range(tp * pp)
    ]


__all__ = ["ConnectorConfigError", "DETERMINISTIC_HASHES", "Naming", "drafter_digest", "drafter_shares_blocks",
           "fingerprints", "hash_scheme", "long_rope", "model_digest", "platform_tag", "spec_digest"]
