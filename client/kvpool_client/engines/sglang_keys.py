"""What the SGLang HiCache backend keys pages on, and its settings; no SGLang import.

SGLang names a page of ``page_size`` tokens by a string: the hex SHA-256 of the page's
tokens chained on the previous page's hash. kvpool keeps those strings (the engine routes
on them) and turns each into a :class:`~kvpool_client.keys.BlockKey` with
:func:`~kvpool_client.keys.key_from_engine_hash`: BLAKE2b-256 over the string's bytes,
the scheme's name and the digest of a :class:`~kvpool_client.keys.ModelFingerprint` built
here from

- what SGLang's storage config says about the shard (:class:`ShardIdentity`): the model
  name, TP rank and size (an MLA latent cache is the same on every TP rank, so MLA keys
  leave the TP rank out and ranks share pages, as SGLang's own backends do), PP rank and
  size, attention context-parallel rank and size;
- what the host pool says about a page's bytes (:class:`PageFormat`): MHA or MLA, the host
  pool's class and memory layout, dtype, page size in tokens, the model's geometry, the
  size of each piece of a page and which interface wrote it (the zero-copy ``v1`` calls
  store a page's pieces in ``get_page_buffer_meta`` order, the older calls SGLang's flat
  page, whose byte order differs under ``layer_first``);
- the settings (:class:`StorageSettings`): the namespace and an optional model id, and
  the SGLang version the pages were written by;
- what a page's bytes mean where its dtype does not say (:func:`kv_values`): SGLang stores
  every fp8 KV cache (``fp8_e4m3``, ``fp8_e5m2``, ``mxfp8``) as ``uint8`` bytes, in which one
  byte reads 1.5 as e4m3 and 1.0 as e5m2, and both fp4 recipes as one ``float4`` type: such
  pages carry the KV cache dtype SGLang resolved and the platform's fp8 type (``e4m3fnuz``
  on ROCm MI300, ``e4m3fn`` elsewhere); pages of bfloat16, float16 and float32 need neither;
- with LoRA on, the adapters SGLang loaded at start (:func:`adapters_identity`). SGLang
  seeds a request's page chain with ``extra_key + lora_id`` (strings joined), and the id of
  a ``--lora-paths`` adapter is a hash of its name and path alone: two deployments with
  other bytes under one adapter path made the same page hashes, and so does a request
  with no adapter whose ``extra_key`` ends with an adapter's (computable) id. The backend
  sees page hashes only, never a request, so the fingerprint carries the files of every
  start adapter (keyed as the base model's files are) and the backend refuses LoRA unless
  the operator vouches, with ``lora_no_extra_key``, that no request reaching the engine
  sets ``extra_key``. Adapters loaded after start (``/load_lora_adapter``, or an evicted
  one loaded again) get a random id from SGLang for each load: their pages are keyed
  apart from every other load's, on every node, and are not shared.

So pages of two models, ranks, dtypes, layouts, page sizes or adapter sets never share a key.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvpool_client.errors import KeyFormatError, KVPoolError
from kvpool_client.keys import BlockKey, ModelFingerprint, key_from_engine_hash
from kvpool_client.engines.weights import weights_identity

#: The engine hash scheme's name inside every key.
SCHEME = "sglang-page"

#: Keys of ``--hicache-storage-backend-extra-config`` that SGLang itself reads from the same
#: map and leaves in it; every other key must be one of :class:`StorageSettings`'.
SGLANG_KEYS = frozenset({"backend_name", "module_path", "class_name", "interface_v1", "file_storage_path"})

_SOCKET = "/run/kvpool/kvpool.sock"
_TIMEOUT_S = 4.0
_LOOKUP_TIMEOUT_S = 1.0
#: The most seconds ``timeout_s`` and ``lookup_timeout_s`` may be: a flush (``/flush_cache``, a
#: weight update's) waits 10 s for SGLang's storage threads, one backup among them, which loops
#: over several batches, each a put of this backend that may take ``timeout_s`` (and a second
#: more for its commit's answer): past that, SGLang reports that its storage threads did not
#: stop, and a later attach fails.
MAX_TIMEOUT_S = 5.0
_STAGING_BYTES = 64 << 20
_SETTINGS = ("socket_path", "tenant", "namespace", "model_id", "revision", "timeout_s", "lookup_timeout_s",
             "max_staging_bytes", "lora_no_extra_key")

#: Host pool attributes that describe the model's KV geometry (those a pool has go in the key).
_GEOMETRY = ("layer_num", "start_layer", "end_layer", "head_num", "head_dim", "v_head_dim", "kv_lora_rank",
             "qk_rope_head_dim", "kv_cache_dim")


class SGLangConfigError(KVPoolError, ValueError):
    """SGLang's configuration cannot share pages safely through the pool, or a setting is bad."""


def _env(env: Mapping[str, str], name: str, default: str) -> str:
    return env.get(name) or default


@dataclass(frozen=True, slots=True)
class StorageSettings:
    """The backend's own keys in ``--hicache-storage-backend-extra-config``.

    ``socket_path`` (else ``$KVPOOL_SOCKET_PATH``, else ``/run/kvpool/kvpool.sock``),
    ``tenant`` (else ``$KVPOOL_TENANT``, else ``default``; proved by the sidecar, see
    docs/security.md), ``namespace`` (else ``$KVPOOL_NAMESPACE``; pages of two namespaces
    never meet), ``model_id`` (overrides SGLang's model name; set it when nodes load one
    model from different paths; needed where nothing on the node names the model's weights),
    ``revision``, ``timeout_s`` (4: a get, or a set, from its first call to its last answer),
    ``lookup_timeout_s`` (1: ``batch_exists``; both finite seconds above 0 and at most
    :data:`MAX_TIMEOUT_S`, 5, which keeps a backup in the backend shorter than the 10 s
    SGLang's flush waits for it), ``max_staging_bytes`` (64 MiB, a whole number of bytes:
    the buffer MHA pages are gathered in before a put) and ``lora_no_extra_key`` (false: with
    LoRA on, the backend refuses to attach unless it is true; set it only where no request
    that reaches the engine sets ``extra_key``, a gateway in front dropping the field: see
    the module).
    """

    socket_path: str = _SOCKET
    tenant: str = "default"
    namespace: str = ""
    model_id: str = ""
    revision: str = ""
    timeout_s: float = _TIMEOUT_S
    lookup_timeout_s: float = _LOOKUP_TIMEOUT_S
    max_staging_bytes: int = _STAGING_BYTES
    lora_no_extra_key: bool = False

    def __post_init__(self) -> None:
        if not self.socket_path or not self.tenant:
            raise SGLangConfigError("socket_path and tenant must not be empty")
        for name in ("timeout_s", "lookup_timeout_s"):  # (inf or 1e300 had failed every call with OverflowError)
            seconds = getattr(self, name)
            if not (math.isfinite(seconds) and 0 < seconds <= MAX_TIMEOUT_S):
                raise SGLangConfigError(f"{name} must be a finite number of seconds above 0 and at most "
                                        f"{MAX_TIMEOUT_S:g} (SGLang's flush waits 10 s for a backup of several "
                                        f"puts), got {seconds!r}")
        if isinstance(self.max_staging_bytes, bool) or not isinstance(self.max_staging_bytes, int) \
                or self.max_staging_bytes <= 0:
            raise SGLangConfigError(f"max_staging_bytes must be a whole number of bytes above 0, "
                                    f"got {self.max_staging_bytes!r}")

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None, env: Mapping[str, str] | None = None) -> StorageSettings:
        """Settings from SGLang's extra config (``None``: none given) and the environment."""
        extra = dict(extra or {})
        env = os.environ if env is None else env
        unknown = sorted(set(extra) - set(_SETTINGS) - SGLANG_KEYS)
        if unknown:
            raise SGLangConfigError(f"unknown keys in --hicache-storage-backend-extra-config for kvpool: {unknown} "
                                    f"(kvpool reads {list(_SETTINGS)})")
        for name in ("socket_path", "tenant", "namespace", "model_id", "revision"):
            if name in extra and not isinstance(extra[name], str):
                raise SGLangConfigError(f"{name} must be a string, got {type(extra[name]).__name__}")
        if not isinstance(extra.get("lora_no_extra_key", False), bool):
            raise SGLangConfigError(f"lora_no_extra_key must be true or false, got {extra['lora_no_extra_key']!r}")
        try:
            return cls(
                socket_path=extra.get("socket_path") or _env(env, "KVPOOL_SOCKET_PATH", _SOCKET),
                tenant=extra.get("tenant") or _env(env, "KVPOOL_TENANT", "default"),
                namespace=extra["namespace"] if "namespace" in extra else _env(env, "KVPOOL_NAMESPACE", ""),
                model_id=extra.get("model_id", ""),
                revision=extra.get("revision", ""),
                timeout_s=_number(extra, "timeout_s", _TIMEOUT_S),
                lookup_timeout_s=_number(extra, "lookup_timeout_s", _LOOKUP_TIMEOUT_S),
                max_staging_bytes=_whole(extra, "max_staging_bytes", _STAGING_BYTES),
                lora_no_extra_key=extra.get("lora_no_extra_key", False),
            )
        except (TypeError, ValueError, OverflowError) as e:
            if isinstance(e, SGLangConfigError):
                raise
            raise SGLangConfigError(f"bad --hicache-storage-backend-extra-config for kvpool: {e}") from e


def _number(extra: Mapping[str, Any], name: str, default: float) -> float:
    value = extra.get(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SGLangConfigError(f"{name} must be a number, got {value!r}")
    return float(value)


def _whole(extra: Mapping[str, Any], name: str, default: int) -> int:
    """A whole number setting (JSON may spell it ``1e9``; ``1.5`` or ``Infinity`` is refused)."""
    value = _number(extra, name, default)
    if not (math.isfinite(value) and value.is_integer()):
        raise SGLangConfigError(f"{name} must be a whole number, got {extra.get(name)!r}")
    return int(value)


def _int_attr(obj: Any, name: str, default: int) -> int:
    value = getattr(obj, name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise SGLangConfigError(f"SGLang's storage config has a non-integer {name}: {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class ShardIdentity:
    """Which shard of which model this engine rank holds (from ``HiCacheStorageConfig``)."""

    model: str
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    cp_rank: int = 0
    cp_size: int = 1
    #: MLA (and SGLang's other rank-replicated caches): every TP rank holds the same bytes.
    rank_replicated: bool = False
    #: The model directory's files where the model is a local path and no ``model_id``
    #: vouches for its weights (:func:`~kvpool_client.engines.weights.weights_identity`).
    files: str = ""

    @classmethod
    def from_storage_config(cls, config: Any, settings: StorageSettings, model_path: str = "",
                            revision: str = "", cache_dir: str | None = None) -> ShardIdentity:
        """Read SGLang's ``HiCacheStorageConfig``; refuses what kvpool cannot key safely.

        ``model_path``: where SGLang loaded the model from, when its server arguments say so.
        The storage config names the model by its served name, which says nothing of the
        weights (two fine-tunes served as ``chat`` shared every key): the path names the model
        instead, and its files key it (unless ``model_id`` vouches for the weights): a local
        path's, or a hub name's snapshot at ``revision`` in the hub cache SGLang downloaded it
        to (``cache_dir``, its ``--download-dir``; else the hub library's default). A
        ``model_path`` whose files cannot be found is refused without ``model_id``: keyed by
        its name alone, nodes that downloaded the name at two commits shared every key."""
        model = settings.model_id or model_path or str(getattr(config, "model_name", None) or "")
        if not model:
            raise SGLangConfigError("SGLang gave no model name to the storage backend: set model_id in "
                                    "--hicache-storage-backend-extra-config")
        if getattr(config, "should_split_heads", False):
            raise SGLangConfigError("kvpool does not store pages split by head for heterogeneous TP (tp_lcm_size); "
                                    "remove tp_lcm_size from the extra config")
        if _int_attr(config, "dcp_size", 1) != 1:
            raise SGLangConfigError("kvpool does not support decode context parallelism (dcp_size > 1)")
        files = "" if settings.model_id else weights_identity(model, revision, cache_dir)
        if model_path and not settings.model_id and not files:
            where = f"the hub cache {cache_dir}" if cache_dir else "the node's Hugging Face cache"
            raise SGLangConfigError(f"kvpool cannot tell which weights {model_path!r} holds: it is no local path "
                                    f"kvpool can read, and {where} holds no snapshot of it at revision "
                                    f"{revision or 'main'!r} (downloaded from elsewhere: ModelScope, a custom "
                                    "loader), so engines holding other commits of it would share keys: set "
                                    "model_id in --hicache-storage-backend-extra-config to a name that changes "
                                    "whenever the weights do")
        replicated = bool(getattr(config, "is_mla_model", False))
        tp_rank, tp_size = _int_attr(config, "tp_rank", 0), _int_attr(config, "tp_size", 1)
        if not 0 <= tp_rank < tp_size:
            raise SGLangConfigError(f"tp_rank {tp_rank} out of range for tp_size {tp_size}")
        return cls(
            model=model,
            tp_rank=0 if replicated else tp_rank,
            tp_size=1 if replicated else tp_size,
            pp_rank=_int_attr(config, "pp_rank", 0),
            pp_size=_int_attr(config, "pp_size", 1),
            cp_rank=_int_attr(config, "attn_cp_rank", 0),
            cp_size=_int_attr(config, "attn_cp_size", 1),
            rank_replicated=replicated,
            files=files,
        )


@dataclass(frozen=True, slots=True)
class PageFormat:
    """What one page's bytes are, as the host pool lays them out."""

    #: ``v1`` (pieces in ``get_page_buffer_meta`` order) or ``flat`` (SGLang's flat data page)
    interface: str
    pool_class: str
    layout: str
    dtype: str
    page_tokens: int
    #: Bytes of each piece of a page, in order (their sum is the block's size).
    pieces: tuple[int, ...]
    #: The pool's geometry attributes (layers, heads, head dims, ...), sorted by name.
    geometry: tuple[tuple[str, int], ...] = ()

    @classmethod
    def of_pool(cls, pool: Any, interface: str, pieces: Sequence[int]) -> PageFormat:
        """The format of ``pool``'s pages (any object with SGLang's host pool attributes)."""
        geometry = []
        for name in _GEOMETRY:
            value = getattr(pool, name, None)
            if isinstance(value, int) and not isinstance(value, bool):
                geometry.append((name, value))
        return cls(interface=interface, pool_class=type(pool).__name__, layout=str(getattr(pool, "layout", "")),
                   dtype=str(getattr(pool, "dtype", "")), page_tokens=_int_attr(pool, "page_size", 0),
                   pieces=tuple(int(n) for n in pieces), geometry=tuple(sorted(geometry)))

    @property
    def page_bytes(self) -> int:
        return sum(self.pieces)

    def describe(self) -> str:
        """The format as the fingerprint's ``kv_layout``."""
        geo = ",".join(f"{k}={v}" for k, v in self.geometry)
        sizes = "+".join(str(n) for n in self.pieces)
        return f"sglang:{self.interface}:{self.pool_class}:{self.layout}:pieces={sizes}:{geo}"


#: Page dtypes (as the host pool names them) whose name says what their bytes mean.
SELF_DESCRIBED = frozenset({"torch.bfloat16", "torch.float16", "torch.float32"})


def kv_values(page_dtype: str, kv_cache_dtype: str | None, platform_fp8: Callable[[], str]) -> str:
    """What the fingerprint adds to say what a page's bytes mean: nothing for the dtypes of
    :data:`SELF_DESCRIBED`; else the KV cache dtype SGLang resolved (``kv_cache_dtype``, None
    where its server arguments cannot be read: refused, as e4m3 and e5m2 pages could not be
    told apart) and ``platform_fp8()``, the platform's fp8 type (SGLang's ``fp8_e4m3`` is
    ``e4m3fnuz`` on ROCm MI300, ``e4m3fn`` elsewhere, and ``auto`` may resolve to either)."""
    if page_dtype in SELF_DESCRIBED:
        return ""
    if not kv_cache_dtype:
        raise SGLangConfigError(f"the host pool stores {page_dtype or 'untyped'} pages (SGLang's fp8 and fp4 KV "
                                "caches), whose values depend on --kv-cache-dtype, and SGLang's server arguments "
                                "cannot be read here: kvpool cannot tell fp8_e4m3 pages from fp8_e5m2 ones")
    return f"kv_cache_dtype={kv_cache_dtype};fp8={platform_fp8()}"


def start_adapters(lora_paths: Any) -> list[tuple[str, str]]:
    """``(name, path)`` of the adapters ``--lora-paths`` loads at start, sorted, in any form
    SGLang takes it: ``NAME=PATH`` or ``PATH`` strings, ``{"lora_name", "lora_path"}`` dicts,
    a name-to-path dict, or the ``LoRARef`` records SGLang turns them into."""
    if not lora_paths:
        return []
    if isinstance(lora_paths, Mapping):
        return sorted((str(k), str(v)) for k, v in lora_paths.items())
    if isinstance(lora_paths, (str, bytes)) or not isinstance(lora_paths, Sequence):
        raise SGLangConfigError(f"cannot read SGLang's --lora-paths: {lora_paths!r}")
    out = []
    name: object
    path: object
    for item in lora_paths:
        if isinstance(item, str):
            name, _, path = item.partition("=") if "=" in item else (item, "", item)
        elif isinstance(item, Mapping):
            name, path = item.get("lora_name"), item.get("lora_path")
        else:
            name, path = getattr(item, "lora_name", None), getattr(item, "lora_path", None)
        if not isinstance(name, str) or not isinstance(path, str) or not path:
            raise SGLangConfigError(f"cannot read an adapter of SGLang's --lora-paths: {item!r}")
        out.append((name, path))
    return sorted(out)


def adapters_identity(adapters: Sequence[tuple[str, str]], settings: StorageSettings) -> str:
    """The fingerprint's ``lora`` entry of an engine with LoRA on: a digest (hex) of the name,
    path and files (:func:`~kvpool_client.engines.weights.weights_identity`) of each adapter
    loaded at start (none: the digest of none, which still keys a LoRA engine's pages apart
    from those of engines without LoRA). Refuses LoRA unless ``lora_no_extra_key`` vouches
    that no request sets ``extra_key``, and adapters whose files kvpool cannot find."""
    if not settings.lora_no_extra_key:
        raise SGLangConfigError(
            "kvpool cannot key SGLang's pages safely with LoRA on: SGLang seeds a request's pages with its extra_key "
            "and LoRA id joined, so a request that sets extra_key can make the page hashes of another adapter's (or "
            "the base model's) requests, and the storage backend sees page hashes only. Set lora_no_extra_key: true "
            "in --hicache-storage-backend-extra-config only if no request that reaches this engine sets extra_key "
            "(a gateway drops it), or run without LoRA or without the kvpool backend")
    h = hashlib.blake2b(digest_size=16, person=b"kvpool-sglora")
    for name, path in sorted(adapters):
        files = weights_identity(path)
        if not files:
            raise SGLangConfigError(f"LoRA adapter {name!r} ({path}): kvpool finds no files of it (no local path, "
                                    "no snapshot in the node's Hugging Face cache), and its name and path do not "
                                    "say which weights it is: give --lora-paths a local directory")
        h.update(json.dumps([name, path, files]).encode() + b"\n")
    return h.hexdigest()


def page_fingerprint(shard: ShardIdentity, fmt: PageFormat, settings: StorageSettings,
                     engine_version: str, weights: str = "", kv: str = "", adapters: str = "") -> ModelFingerprint:
    """The fingerprint every page key of this shard, in this format, lies under; ``weights``
    says what the engine runs the model with that changes its KV under the same name (its
    quantization, its config overrides), ``kv`` what a page's bytes mean where its dtype
    does not say (:func:`kv_values`), ``adapters`` the LoRA adapters loaded at start
    (:func:`adapters_identity`; "" with LoRA off)."""
    if not fmt.dtype or not fmt.layout or fmt.page_tokens <= 0 or not fmt.pieces or min(fmt.pieces) <= 0:
        raise SGLangConfigError(f"the host pool does not describe its pages: {fmt}")
    return ModelFingerprint(
        model=shard.model, revision=settings.revision, dtype=fmt.dtype, kv_layout=fmt.describe(),
        block_tokens=fmt.page_tokens, tp_rank=shard.tp_rank, tp_size=shard.tp_size, pp_rank=shard.pp_rank,
        pp_size=shard.pp_size, namespace=settings.namespace,
        extra={"engine": "sglang", "sglang": engine_version, "cp": f"{shard.cp_rank}/{shard.cp_size}",
               "tp": "replicated" if shard.rank_replicated else "sharded",
               **({"weights": weights} if weights else {}), **({"files": shard.files} if shard.files else {}),
               **({"kv": kv} if kv else {}), **({"lora": adapters} if adapters else {})},
    )


def page_keys(fingerprint: ModelFingerprint, hashes: Sequence[str]) -> list[BlockKey]:
    """The pool keys of SGLang page hashes (strings of at least 16 bytes, as SGLang's are)."""
    out = []
    for h in hashes:
        if not isinstance(h, str):
            raise KeyFormatError(f"an SGLang page hash is a str, not {type(h).__name__}")
        out.append(key_from_engine_hash(fingerprint, SCHEME, h.encode("utf-8")))
    return out


__all__ = ["SCHEME", "SELF_DESCRIBED", "SGLANG_KEYS", "PageFormat", "SGLangConfigError", "ShardIdentity",
           "StorageSettings", "adapters_identity", "kv_values", "page_fingerprint", "page_keys", "start_adapters"]
