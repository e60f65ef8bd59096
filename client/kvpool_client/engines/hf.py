"""PyTorch (transformers) engines on the pool: restore a prefix's KV, compute only the suffix.

:class:`HFPoolAdapter` wraps a Llama-shaped transformers causal LM (every layer full
attention, K and V of shape ``[batch, kv_heads, tokens, head_dim]`` in its ``DynamicCache``)
and a :class:`~kvpool_client.client.PoolClient`:

- :meth:`HFPoolAdapter.store` writes the KV of a computed prefix as one pool block per
  ``block_tokens`` tokens. A block is block-outermost, layout ``hf-llama-block-LKHNC``: all
  layers (L), then K and V (K), kv heads (H), the block's tokens (N) and head_dim (C), one
  contiguous run of the model's dtype. Blocks the pool already holds (one batched lookup)
  are not sent again. From a GPU, with the client's arena registered with CUDA, the blocks
  go by DMA straight into the arena and are checksummed there
  (:func:`~kvpool_client.tensors.put_tensors_in_place`); otherwise through two page-locked
  buffers.
- :meth:`HFPoolAdapter.load` finds the longest cached prefix (one lookup), reads it (one
  get) and rebuilds a ``DynamicCache`` from it. At least one prompt token is always left to
  compute (its logits give the first output token). A block that is missing or fails its
  checksum ends the prefix there: a shorter prefix, never wrong KV.
- :func:`prefill` runs the model over tokens in block-aligned chunks. A block's KV then
  depends only on the tokens up to it, not on the length of the request that computed it
  (one forward over 640 tokens and one over 320 give K and V that differ in the last bits:
  other GEMM shapes sum in another order), so KV restored from the pool is bit-identical to
  KV the reader would have computed itself.

torch and transformers are imported lazily, when an adapter is built.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvpool_client.engines.weights import weights_identity
from kvpool_client.errors import ConnectionLostError, DeadlineError, KVPoolError, RemoteError
from kvpool_client.keys import BlockKey, ModelFingerprint, block_keys
from kvpool_client.protocol import PutStatus
from kvpool_client import tensors
from kvpool_client.tensors import get_tensors, get_tensors_in_place, tensor_bytes

if TYPE_CHECKING:
    from kvpool_client.client import PoolClient

logger = logging.getLogger(__name__)

#: The block layout this adapter reads and writes (part of every key's fingerprint).
KV_LAYOUT = "hf-llama-block-LKHNC"

#: Errors of a pool that cannot answer now: a miss on load, a skipped store. Anything else
#: (a block of the wrong size: a fingerprint that leaves out part of the layout) is raised.
_UNREACHABLE = (ConnectionLostError, DeadlineError, RemoteError)


class HFEngineError(KVPoolError):
    """The model, its cache or the fingerprint does not fit the adapter."""


class HFUnavailableError(HFEngineError, ImportError):
    """torch or transformers is not installed (``pip install kvpool[hf]``)."""


def _modules() -> tuple[Any, Any]:
    try:
        import torch
        import transformers
    except ImportError as e:
        raise HFUnavailableError("the transformers adapter needs torch and transformers") from e
    return torch, transformers


#: Sub-configs of text-only models (DBRX's and MPT's attention and feed-forward settings).
_TEXT_SUB_CONFIGS = frozenset({"text_config", "attn_config", "ffn_config"})

#: Rope scalings whose factors transformers picks by the length of each forward.
_LENGTH_ROPES = frozenset({"longrope", "dynamic", "su"})


def rope_parameters(config: Any) -> list[dict[str, Any]]:
    """A text config's rope parameters, as transformers spells them (one dict, or one per
    layer type)."""
    raw = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if not isinstance(raw, dict):
        return []
    nested = [v for v in raw.values() if isinstance(v, dict)]
    return nested if nested and len(nested) == len(raw) else [raw]


def _layer_type(cfg: Any) -> str:
    """The kind of every layer of a config without ``layer_types``, as transformers infers it
    (a Mistral-style ``sliding_window`` makes every layer's cache a sliding one)."""
    if getattr(cfg, "sliding_window", None) is not None:
        return "sliding_attention"
    if getattr(cfg, "attention_chunk_size", None) is not None:
        return "chunked_attention"
    return "full_attention"


@dataclass(frozen=True, slots=True)
class KVGeometry:
    """The shape of a model's KV: what a block of ``block_tokens`` tokens holds."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: str  # torch's name, e.g. "bfloat16"

    @classmethod
    def of(cls, model: Any) -> KVGeometry:
        others = [name for name in getattr(model.config, "sub_configs", None) or {}
                  if name not in _TEXT_SUB_CONFIGS and getattr(model.config, name, None) is not None]
        if others:
            raise HFEngineError(f"a model with {', '.join(sorted(others))} (an encoder of images, audio...) is not "
                                "supported: the KV of its placeholder tokens depends on inputs its token ids do not carry")
        cfg = model.config.get_text_config(decoder=True)
        for params in rope_parameters(cfg):
            kind = str(params.get("rope_type") or params.get("type") or "")
            if kind in _LENGTH_ROPES:
                raise HFEngineError(f"a model with {kind} rope scaling is not supported: transformers picks its "
                                    "factors by the length of each forward, so a prefix's KV depends on what follows")
        types = getattr(cfg, "layer_types", None) or [_layer_type(cfg)]
        if any(t != "full_attention" for t in types):
            raise HFEngineError("only models whose layers are all full attention are supported (a sliding window's "
                                "cache drops the oldest tokens: what is left is not a prefix's KV)")
        heads = int(cfg.num_attention_heads)
        head_dim = getattr(cfg, "head_dim", None) or int(cfg.hidden_size) // heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
        return cls(int(cfg.num_hidden_layers), int(kv_heads), int(head_dim), str(model.dtype).removeprefix("torch."))

    def extra(self) -> dict[str, str]:
        return {"num_layers": str(self.layers), "num_kv_heads": str(self.kv_heads), "head_dim": str(self.head_dim)}


#: Config fields that say where a model came from or how it is called, not what its KV is.
_CONFIG_NAMES = frozenset({"_name_or_path", "_commit_hash", "transformers_version", "use_cache", "return_dict",
                           "output_attentions", "output_hidden_states", "pad_token_id", "bos_token_id",
                           "eos_token_id", "sep_token_id", "decoder_start_token_id", "id2label", "label2id",
                           "task_specific_params", "finetuning_task", "problem_type", "architectures"})


def config_digest(config: Any) -> str:
    """A digest of every field of ``config`` that differs from its class's defaults but those
    of :data:`_CONFIG_NAMES`: an override given at load (``from_pretrained(path,
    rms_norm_eps=...)``) changes the KV of the same files and name."""
    fields = {k: v for k, v in config.to_diff_dict().items() if k not in _CONFIG_NAMES}
    blob = json.dumps(fields, sort_keys=True, default=repr)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


#: A hub repository's name (``org/name`` or ``name``); anything else is a path.
_HUB_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?")


def fingerprint_for(model: Any, block_tokens: int, *, model_name: str | None = None, revision: str = "",
                    namespace: str = "", adapter: str | None = None) -> ModelFingerprint:
    """The fingerprint of ``model``'s KV blocks, derived from its config.

    ``model_name`` defaults to the config's ``_name_or_path``; a model built from a config
    (random weights) has none and must be named, with whatever identifies its weights. A
    ``_name_or_path`` that is a local directory also keys by its files' names, sizes and
    bytes (:mod:`~kvpool_client.engines.weights`): one path may hold any fine-tune. A path
    whose files cannot be read now (a temporary directory removed since the load, a mount
    gone) is refused unless ``model_name`` names the weights; a hub name's files are those
    of the commit it was loaded at (``revision`` may name a branch that has moved on since).
    Quantized weights (the config's ``quantization_config``) compute other KV than the
    same model's full weights, and so key apart. A model with PEFT (LoRA) adapters loaded
    keeps its base model's name, so it is refused unless ``adapter`` names what is loaded.
    Every other field of the config that is not its default (:func:`config_digest`) keys
    too, and ``revision`` defaults to the hub commit the model was loaded at. Models that
    read images or audio, and ropes whose factors follow each forward's length, are refused
    (:meth:`KVGeometry.of`).
    """
    geo = KVGeometry.of(model)
    cfg = model.config.get_text_config(decoder=True)
    name = model_name or getattr(cfg, "_name_or_path", "") or ""
    loaded = str(getattr(model.config, "_commit_hash", None) or "")  # the hub commit it was loaded at
    revision = revision or loaded
    if not name:
        raise HFEngineError("the model has no name in its config: pass model_name")
    if getattr(model, "peft_config", None) and not adapter:
        raise HFEngineError("the model has PEFT adapters loaded, which change its KV but not its name: pass "
                            "adapter (what identifies the adapters' weights)")
    extra = geo.extra()
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_theta", None)
    if rope is not None:  # positions are rotated into K: a rope change changes every block
        extra["rope"] = repr(sorted(rope.items()) if isinstance(rope, dict) else rope)
    quant = getattr(model.config, "quantization_config", None) or getattr(cfg, "quantization_config", None)
    if quant is not None:
        quant = quant.to_dict() if hasattr(quant, "to_dict") else quant
        extra["quantization"] = repr(sorted(quant.items()) if isinstance(quant, dict) else quant)
    extra["config"] = config_digest(model.config)
    if adapter:
        extra["adapter"] = adapter
    if not model_name:  # a name is no weights: its files are
        # (at the commit it was loaded at: a branch's ref may have moved on since)
        if files := weights_identity(name, loaded or revision):
            extra["files"] = files
        elif not _HUB_NAME.fullmatch(name):
            raise HFEngineError(f"the model was loaded from {name!r}, whose weight files cannot be read now: "
                                "pass model_name (what identifies its weights)")
    return ModelFingerprint(model=name, revision=revision, dtype=geo.dtype, block_tokens=block_tokens,
                            kv_layout=KV_LAYOUT, namespace=namespace, extra=extra)


@dataclass(frozen=True, slots=True)
class StoreResult:
    """What :meth:`HFPoolAdapter.store` did: blocks already held, sent, and stored."""

    blocks: int
    held: int
    sent: int
    stored: int


@dataclass(slots=True)
class LoadedPrefix:
    """A restored prefix: ``cache`` holds the KV of the first ``tokens`` tokens."""

    cache: Any  # transformers.DynamicCache
    tokens: int
    blocks: int
    #: Blocks the pool's lookup reported (before the cap and any block lost on the way).
    found: int


def prefill(model: Any, token_ids: Sequence[int], cache: Any, chunk_tokens: int) -> Any:
    """Run ``model`` over ``token_ids`` after what ``cache`` holds; the last token's logits.

    Chunks end on multiples of ``chunk_tokens`` counted from the start of the sequence, so a
    block's KV is computed the same way whichever request computes it.
    """
    torch, _ = _modules()
    if chunk_tokens <= 0:
        raise HFEngineError("chunk_tokens must be positive")
    if not token_ids:
        raise HFEngineError("prefill needs at least one token")
    pos = int(cache.get_seq_length())
    ids = torch.tensor([list(token_ids)], dtype=torch.long, device=model.device)
    done, logits = 0, None
    with torch.inference_mode():
        while done < len(token_ids):
            step = chunk_tokens - (pos + done) % chunk_tokens
            out = model(input_ids=ids[:, done:done + step], past_key_values=cache, use_cache=True, logits_to_keep=1)
            logits, done = out.logits[0, -1], done + step
    return logits


class BlockCodec:
    """A model's KV cache to and from pool blocks (``[n, L, 2, H, N, C]``, block-outermost)."""

    def __init__(self, model: Any, block_tokens: int) -> None:
        self.torch, self.transformers = _modules()
        if block_tokens <= 0:
            raise HFEngineError("block_tokens must be positive")
        self.model = model
        self.geo = KVGeometry.of(model)
        self.block_tokens = block_tokens
        self.block_shape = (self.geo.layers, 2, self.geo.kv_heads, block_tokens, self.geo.head_dim)
        self.dtype = getattr(self.torch, self.geo.dtype)
        layers = list(self.new_cache().layers)
        full = self.transformers.DynamicLayer
        if len(layers) != self.geo.layers or any(type(layer) is not full for layer in layers):
            kinds = sorted({type(layer).__name__ for layer in layers})
            raise HFEngineError(f"the model's cache has {len(layers)} layers of {', '.join(kinds)}; the adapter "
                                f"reads {self.geo.layers} of {full.__name__} (every token's K and V kept)")

    @property
    def block_bytes(self) -> int:
        n = int(self.torch.empty((), dtype=self.dtype).element_size())
        for d in self.block_shape:
            n *= d
        return n

    def new_cache(self) -> Any:
        return self.transformers.DynamicCache(config=self.model.config)

    def empty_blocks(self, n: int) -> Any:
        return self.torch.empty((n, *self.block_shape), dtype=self.dtype, device=self.model.device)

    def blocks_of(self, cache: Any, start: int, stop: int) -> Any:
        """Blocks ``[start, stop)`` of ``cache`` as one ``[n, L, 2, H, N, C]`` contiguous tensor."""
        bt = self.block_tokens
        layers = list(cache.layers)
        if len(layers) != self.geo.layers:
            raise HFEngineError(f"the cache has {len(layers)} layers, the model {self.geo.layers}")
        if not 0 <= start <= stop:
            raise HFEngineError(f"no blocks [{start}, {stop})")
        seq = int(cache.get_seq_length())
        device = getattr(getattr(layers[0], "keys", None), "device", None) if layers else None
        kv = []
        for i, layer in enumerate(layers):
            k: Any = getattr(layer, "keys", None)
            v: Any = getattr(layer, "values", None)
            if seq < stop * bt or not self._whole(k, seq, device) or not self._whole(v, seq, device):
                raise HFEngineError(
                    f"cache layer {i} does not hold K and V of shape [1, {self.geo.kv_heads}, {seq}, "
                    f"{self.geo.head_dim}] ({self.dtype}, on one device) covering {stop * bt} tokens: "
                    f"{_shape(k)} and {_shape(v)}")
            kv.append(self.torch.stack((k[0, :, start * bt:stop * bt], v[0, :, start * bt:stop * bt])))
        x = self.torch.stack(kv)  # [L, 2, H, n*N, C]
        x = x.reshape(self.geo.layers, 2, self.geo.kv_heads, stop - start, bt, self.geo.head_dim)
        return x.permute(3, 0, 1, 2, 4, 5).contiguous()

    def _whole(self, t: Any, seq: int, device: Any) -> bool:
        """Whether ``t`` is one sequence's K (or V) of every token the cache holds, as the
        geometry says (a cache that kept fewer, of a sliding window, or of other heads or
        head size, as MLA's, is not these blocks)."""
        return (isinstance(t, self.torch.Tensor) and t.dtype == self.dtype and t.device == device
                and tuple(t.shape) == (1, self.geo.kv_heads, seq, self.geo.head_dim))

    def cache_from_blocks(self, blocks: Any) -> Any:
        """A ``DynamicCache`` holding ``[n, L, 2, H, N, C]`` blocks as one prefix."""
        n = blocks.shape[0]
        x = blocks.permute(1, 2, 3, 0, 4, 5).reshape(
            self.geo.layers, 2, self.geo.kv_heads, n * self.block_tokens, self.geo.head_dim)
        data = [(x[i, 0].unsqueeze(0).contiguous(), x[i, 1].unsqueeze(0).contiguous()) for i in range(self.geo.layers)]
        return self.transformers.DynamicCache(data, config=self.model.config)


def _one_sequence(token_ids: Sequence[int]) -> Sequence[int]:
    """``token_ids`` if it is one sequence of ids; HFEngineError for a tensor or array of
    another rank (a tokenizer's ``input_ids`` is ``[1, n]``: its length, 1, made no block,
    and store and load did nothing without a word)."""
    dims = getattr(token_ids, "ndim", 1)
    if dims != 1:
        raise HFEngineError(f"token_ids must be one sequence of token ids, not of {dims} dimensions "
                            "(pass input_ids[0] for a batch of one)")
    return token_ids


def _shape(t: Any) -> str:
    return f"{list(t.shape)} {t.dtype} on {t.device}" if hasattr(t, "shape") else repr(t)


class HFPoolAdapter:
    """Store and restore a transformers model's KV cache in the pool (batch size 1)."""

    def __init__(self, model: Any, client: PoolClient, fingerprint: ModelFingerprint) -> None:
        self.codec = BlockCodec(model, fingerprint.block_tokens)
        self.model = model
        self.client = client
        self.fp = fingerprint
        geo = self.codec.geo
        if fingerprint.kv_layout != KV_LAYOUT:
            raise HFEngineError(f"the fingerprint names layout {fingerprint.kv_layout!r}, the adapter writes "
                                f"{KV_LAYOUT!r}")
        if fingerprint.dtype != geo.dtype:
            raise HFEngineError(f"the fingerprint says {fingerprint.dtype}, the model runs in {geo.dtype}")
        for k, v in geo.extra().items():
            if fingerprint.extra.get(k) != v:
                raise HFEngineError(f"the fingerprint's {k} is {fingerprint.extra.get(k)!r}, the model's is {v}")
        self.block_tokens = fingerprint.block_tokens
        #: Two page-locked buffers of a round of blocks each, for stores from a GPU (made at the
        #: first such store, kept for the next).
        self._staging: tuple[Any, ...] | None = None

    def keys(self, token_ids: Sequence[int]) -> list[BlockKey]:
        return block_keys(self.fp, _one_sequence(token_ids))

    def store(self, cache: Any, token_ids: Sequence[int], *, held: int | None = None) -> StoreResult:
        """Store every full block of ``token_ids`` whose KV ``cache`` holds (one lookup, one put).

        ``held``: the prefix the pool is known to hold (e.g. :attr:`LoadedPrefix.found`), which
        saves the lookup; a block stored since is answered ``EXISTS`` and not written twice.
        """
        token_ids = _one_sequence(token_ids)
        n = min(len(token_ids), int(cache.get_seq_length())) // self.block_tokens
        keys = self.keys(token_ids[:n * self.block_tokens])
        if not keys:
            return StoreResult(0, 0, 0, 0)
        try:
            with self.client.within():  # the lookup and every round of the put end by one timeout in all
                if held is None or not 0 <= held <= n:
                    held = self.client.lookup(keys).prefix
                if held >= n:
                    return StoreResult(n, held, 0, 0)
                blocks = self.codec.blocks_of(cache, held, n)
                if blocks.device.type != "cuda":  # (another accelerator's: through a host copy)
                    statuses = self._put(keys, held, [tensor_bytes(blocks[i]) for i in range(n - held)])
                elif tensors.arena_registered(self.client):  # by DMA straight into the arena, checksummed there
                    rows = [blocks[i] for i in range(n - held)]
                    statuses = tensors.put_tensors_in_place(self.client, keys[held:n], rows, chain=True,
                                                            depth=held, parent=keys[held - 1] if held else None)
                else:  # the copies and their events on the model's device, whichever is current
                    with self.codec.torch.cuda.device(blocks.device):
                        statuses = self._put_from_device(blocks, keys, held)
        except _UNREACHABLE as e:  # storing is best effort: the answer is already computed
            logger.warning("kvpool: storing %d blocks failed: %s", n, e)
            return StoreResult(n, 0, 0, 0)
        stored = sum(1 for s in statuses if s in (PutStatus.STORED, PutStatus.EXISTS))
        if stored < n - held:
            logger.debug("kvpool: %d of %d blocks were not stored", n - held - stored, n - held)
        return StoreResult(n, held, n - held, stored)

    def _put(self, keys: list[BlockKey], at: int, payloads: list[memoryview]) -> list[PutStatus]:
        """Put blocks ``at, at + 1, ...`` of the chain ``keys``."""
        return self.client.put(keys[at:at + len(payloads)], payloads, chain=True, depth=at,
                               parent=keys[at - 1] if at else None)

    def _put_from_device(self, blocks: Any, keys: list[BlockKey], held: int) -> list[PutStatus]:
        """Put device ``blocks`` (chain positions ``held...``) in rounds of about
        :data:`~kvpool_client.tensors.ROUND_BYTES` through two page-locked buffers kept by the
        adapter: the DMA of a round to the host runs while the round before it is put."""
        tc = self.codec.torch
        if not len(blocks):
            return []
        per = max(1, tensors.ROUND_BYTES // self.codec.block_bytes)
        if self._staging is None or self._staging[0].shape[0] < min(per, len(blocks)):
            rows = min(per, len(blocks))
            self._staging = tuple(tc.empty((rows, *self.codec.block_shape), dtype=blocks.dtype, pin_memory=True)
                                  for _ in range(2))
        bufs = self._staging
        rounds = [(lo, min(lo + per, len(blocks))) for lo in range(0, len(blocks), per)]

        def fetch(r: int) -> Any:
            lo, hi = rounds[r]
            bufs[r % 2][: hi - lo].copy_(blocks[lo:hi], non_blocking=True)
            done = tc.cuda.Event()
            done.record()
            return done

        statuses: list[PutStatus] = []
        ready = fetch(0)
        for r, (lo, hi) in enumerate(rounds):
            after = fetch(r + 1) if r + 1 < len(rounds) else None  # its buffer's last put is done
            ready.synchronize()
            statuses += self._put(keys, held + lo, [tensor_bytes(bufs[r % 2][i]) for i in range(hi - lo)])
            ready = after
        return statuses

    def load(self, token_ids: Sequence[int], *, in_place: bool = True) -> LoadedPrefix:
        """The longest prefix of ``token_ids`` the pool holds, as a fresh ``DynamicCache``.

        The prefix leaves at least one token of ``token_ids`` to compute. A model on a GPU
        whose client registered the arena (:func:`~kvpool_client.tensors.register_arena_pinned`)
        reads the blocks by DMA straight from the arena unless ``in_place`` is False; otherwise
        through pinned staging (:func:`~kvpool_client.tensors.get_tensors`). A pool that
        cannot answer, or that holds a block of another size under one of the prefix's keys
        (a writer with a layout the fingerprint does not name), is a miss: nothing is restored.
        """
        token_ids = _one_sequence(token_ids)
        keys = self.keys(token_ids)
        try:
            with self.client.within():  # the lookup and the read's rounds end by one timeout in all
                found = self.client.lookup(keys).prefix if keys else 0
                want = min(found, (len(token_ids) - 1) // self.block_tokens)
                if want <= 0:
                    return LoadedPrefix(self.codec.new_cache(), 0, 0, found)
                buf = self.codec.empty_blocks(want)
                read = get_tensors_in_place if in_place else get_tensors
                got = read(self.client, keys[:want], [buf[i] for i in range(want)])
        except _UNREACHABLE as e:  # a pool that cannot answer is a miss: the model computes it all
            logger.warning("kvpool: loading a prefix failed, computing it: %s", e)
            return LoadedPrefix(self.codec.new_cache(), 0, 0, 0)
        except KVPoolError as e:  # a block of another size under one of these keys: never KV for this model
            logger.warning("kvpool: the pool holds a block of the wrong size in this prefix, computing it: %s", e)
            return LoadedPrefix(self.codec.new_cache(), 0, 0, found)
        n = next((i for i, g in enumerate(got) if g is None), want)
        if n < want:
            logger.info("kvpool: block %d of a %d-block prefix was lost; restoring %d", n, want, n)
        if n == 0:
            return LoadedPrefix(self.codec.new_cache(), 0, 0, found)
        return LoadedPrefix(self.codec.cache_from_blocks(buf[:n]), n * self.block_tokens, n, found)
