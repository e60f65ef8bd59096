"""Block identity: model fingerprints, chained prefix hashes and the key codec.

A block is the KV of ``block_tokens`` consecutive tokens for every layer of one model
shard. Its key is a chained hash seeded with a :class:`ModelFingerprint`::

    seed = H("seed", fingerprint)
    h_i  = H("block", h_{i-1}, tokens_i, extras_i)

so two blocks share a key only if the model, revision, dtype, KV layout, parallel rank and
size, block size, LoRA adapter, namespace *and* every token before and in the block agree.
``H`` is BLAKE2b-256 over canonical, length-prefixed bytes with a per-purpose
personalisation string; Python's ``hash()`` is never used.

Keys have a versioned text form ``v1:<fingerprint hex>:<digest hex>`` and a 48-byte binary
form (16-byte fingerprint digest + 32-byte chain digest) used on the wire.
"""

from __future__ import annotations

import hashlib
import struct
from array import array
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from kvpool_client.errors import KeyFormatError

KEY_VERSION = "v1"
FINGERPRINT_BYTES = 16
DIGEST_BYTES = 32
RAW_KEY_BYTES = FINGERPRINT_BYTES + DIGEST_BYTES

_PERSON_FP = b"kvpool-fp-v1"
_PERSON_SEED = b"kvpool-seed-v1"
_PERSON_BLOCK = b"kvpool-blk-v1"
_PERSON_EXT = b"kvpool-ext-v1"
_U32 = struct.Struct("<I")
_MAX_TOKEN = 2**32 - 1

#: What may appear in a block's ``extras`` (multimodal input hashes, cache salts, ...).
Extra = str | bytes | int


def _lp(data: bytes) -> bytes:
    """Length-prefix ``data`` so concatenations are unambiguous."""
    return _U32.pack(len(data)) + data


#: A block's extras when it has none, length-prefixed.
_NO_EXTRAS = _lp(b"")


def _canonical_extras(extras: Iterable[Extra]) -> bytes:
    if isinstance(extras, (str, bytes, bytearray, memoryview)):
        # iterating would split one value into many: "ab" would key like ["a", "b"]
        raise KeyFormatError("a block's extras must be a list of values, not a single str or bytes")
    out = bytearray()
    for item in extras:
        if isinstance(item, bool):
            raise KeyFormatError("block extras must be str, bytes or int, not bool")
        if isinstance(item, bytes):
            out += b"b" + _lp(item)
        elif isinstance(item, str):
            out += b"s" + _lp(item.encode("utf-8"))
        elif isinstance(item, int):
            out += b"i" + _lp(str(item).encode("ascii"))
        else:
            raise KeyFormatError(f"block extras must be str, bytes or int, not {type(item).__name__}")
    return bytes(out)


@dataclass(frozen=True, slots=True)
class ModelFingerprint:
    """Everything that must agree for two engines to share KV blocks.

    ``namespace`` isolates tenants: blocks of different namespaces never share keys.
    ``extra`` holds any further engine-specific setting that changes the KV bytes
    (for example a quantisation scheme or a rope-scaling override).
    """

    model: str
    dtype: str
    block_tokens: int
    #: How the engine lays out K and V in a block's bytes. Required: two engines whose
    #: layouts differ but take the same bytes must never share keys.
    kv_layout: str
    revision: str = ""
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    lora_id: str = ""
    namespace: str = ""
    extra: Mapping[str, str] = field(default_factory=dict)
    #: :meth:`digest`, once computed, with the ``extra`` it was computed from (an engine
    #: derives a key per block per rank from it: computing it for each took a vLLM scheduler
    #: 190 ms of a 32k-token request at TP=8).
    _digest: tuple[tuple[tuple[str, str], ...], bytes] | None = field(default=None, init=False, repr=False,
                                                                      compare=False)

    def __post_init__(self) -> None:
        if not self.model:
            raise KeyFormatError("fingerprint needs a model name")
        if not self.dtype:
            raise KeyFormatError("fingerprint needs a dtype")
        if not self.kv_layout:
            raise KeyFormatError("fingerprint needs a kv_layout (how K and V sit in a block's bytes)")
        if self.block_tokens <= 0:
            raise KeyFormatError(f"block_tokens must be positive, got {self.block_tokens}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise KeyFormatError(f"tp_rank {self.tp_rank} out of range for tp_size {self.tp_size}")
        if not 0 <= self.pp_rank < self.pp_size:
            raise KeyFormatError(f"pp_rank {self.pp_rank} out of range for pp_size {self.pp_size}")
        for k, v in self.extra.items():
            if not isinstance(k, str) or not isinstance(v, str):
                raise KeyFormatError("fingerprint extra must map str to str")

    def canonical_bytes(self) -> bytes:
        """A canonical, versioned encoding of every field (the input of :meth:`digest`)."""
        fields: list[tuple[str, str]] = [
            ("model", self.model),
            ("revision", self.revision),
            ("dtype", self.dtype),
            ("kv_layout", self.kv_layout),
            ("tp_rank", str(self.tp_rank)),
            ("tp_size", str(self.tp_size)),
            ("pp_rank", str(self.pp_rank)),
            ("pp_size", str(self.pp_size)),
            ("block_tokens", str(self.block_tokens)),
            ("lora_id", self.lora_id),
            ("namespace", self.namespace),
        ]
        fields += [("extra." + k, v) for k, v in sorted(self.extra.items())]
        out = bytearray(b"kvpool-fingerprint-v1")
        for name, value in fields:
            out += _lp(name.encode()) + _lp(value.encode("utf-8"))
        return bytes(out)

    def digest(self) -> bytes:
        """The 16-byte fingerprint digest that prefixes every key of this model shard
        (computed at the first call, then kept; computed again should ``extra``, a mapping
        its caller may still hold, have changed since: a stale digest would give two models
        one key)."""
        extra = tuple(self.extra.items())
        kept = self._digest
        if kept is not None and kept[0] == extra:
            return kept[1]
        d = hashlib.blake2b(self.canonical_bytes(), digest_size=FINGERPRINT_BYTES, person=_PERSON_FP).digest()
        object.__setattr__(self, "_digest", (extra, d))
        return d


@dataclass(frozen=True, slots=True)
class BlockKey:
    """The identity of one block: fingerprint digest + chained prefix digest."""

    fingerprint: bytes
    digest: bytes
    #: The 48-byte binary form used on the wire and in the sidecar (derived).
    raw: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if len(self.fingerprint) != FINGERPRINT_BYTES or len(self.digest) != DIGEST_BYTES:
            raise KeyFormatError("block key needs a 16-byte fingerprint and a 32-byte digest")
        object.__setattr__(self, "raw", self.fingerprint + self.digest)

    @property
    def text(self) -> str:
        return f"{KEY_VERSION}:{self.fingerprint.hex()}:{self.digest.hex()}"

    def __str__(self) -> str:
        return self.text

    @classmethod
    def from_raw(cls, raw: bytes) -> BlockKey:
        if len(raw) != RAW_KEY_BYTES:
            raise KeyFormatError(f"raw block key must be {RAW_KEY_BYTES} bytes, got {len(raw)}")
        return cls(bytes(raw[:FINGERPRINT_BYTES]), bytes(raw[FINGERPRINT_BYTES:]))

    @classmethod
    def parse(cls, text: str) -> BlockKey:
        """Parse the text form; raises :class:`KeyFormatError` on anything else."""
        parts = text.split(":")
        if len(parts) != 3:
            raise KeyFormatError(f"block key must look like v1:<fp>:<digest>, got {text!r}")
        version, fp_hex, dg_hex = parts
        if version != KEY_VERSION:
            raise KeyFormatError(f"unsupported block key version {version!r}")
        if len(fp_hex) != 2 * FINGERPRINT_BYTES or len(dg_hex) != 2 * DIGEST_BYTES:
            raise KeyFormatError(f"block key has wrong digest lengths: {text!r}")
        try:
            return cls(bytes.fromhex(fp_hex), bytes.fromhex(dg_hex))
        except ValueError as e:
            raise KeyFormatError(f"block key is not hex: {text!r}") from e


def _token_bytes(tokens: Sequence[int]) -> bytes:
    try:
        return array("I", tokens).tobytes() if array("I").itemsize == 4 else array("L", tokens).tobytes()
    except OverflowError as e:
        raise KeyFormatError(f"token ids must be in [0, {_MAX_TOKEN}]") from e
    except TypeError as e:
        raise KeyFormatError("token ids must be integers") from e


def chain_seed(fingerprint: ModelFingerprint | bytes) -> bytes:
    """``h_{-1}``: the 32-byte seed of every chain of this fingerprint."""
    fp = fingerprint if isinstance(fingerprint, bytes) else fingerprint.digest()
    return hashlib.blake2b(_lp(fp), digest_size=DIGEST_BYTES, person=_PERSON_SEED).digest()


def next_digest(parent: bytes, tokens: Sequence[int], extras: Iterable[Extra] = ()) -> bytes:
    """``h_i = H(h_{i-1}, tokens_i, extras_i)``."""
    if len(parent) != DIGEST_BYTES:
        raise KeyFormatError("parent digest must be 32 bytes")
    tb = _token_bytes(tokens)
    return _digest(parent, _U32.pack(len(tb)), tb, _lp(_canonical_extras(extras)))


def _digest(parent: bytes, length: bytes, token_bytes: bytes | memoryview, extras: bytes) -> bytes:
    """:func:`next_digest` from its pieces: ``length`` (of ``token_bytes``, packed) and
    ``extras`` (length-prefixed) already encoded."""
    h = hashlib.blake2b(parent, digest_size=DIGEST_BYTES, person=_PERSON_BLOCK)
    h.update(length)
    h.update(token_bytes)
    h.update(extras)
    return h.digest()


def block_keys(
    fingerprint: ModelFingerprint,
    tokens: Sequence[int],
    extras: Sequence[Iterable[Extra]] | None = None,
    *,
    parent: BlockKey | None = None,
) -> list[BlockKey]:
    """Keys of every *full* block of ``tokens`` (a trailing partial block has no key).

    ``extras[i]`` (optional) are inputs other than token ids that change block ``i``'s KV,
    such as the hashes of images whose placeholder tokens fall in it. ``parent`` continues
    a chain whose earlier blocks were hashed before (``tokens`` then starts at a block
    boundary after it).
    """
    if isinstance(tokens, (str, bytes, bytearray, memoryview)):
        # (an array built from bytes takes them as machine integers, not as token ids)
        raise KeyFormatError("token ids must be integers, not a str or bytes")
    fp = fingerprint.digest()
    bt = fingerprint.block_tokens
    n = len(tokens) // bt
    if extras is not None and len(extras) < n:
        raise KeyFormatError(f"extras cover {len(extras)} blocks, tokens make {n}")
    if parent is not None and parent.fingerprint != fp:
        raise KeyFormatError("parent key belongs to another fingerprint")
    h = parent.digest if parent is not None else chain_seed(fp)
    keys: list[BlockKey] = []
    if not n:
        return keys
    # the token ids of all the full blocks converted at once, each block's bytes a slice
    raw = memoryview(_token_bytes(tokens if len(tokens) == n * bt else tokens[: n * bt]))
    width = raw.nbytes // n
    length = _U32.pack(width)
    for i in range(n):
        h = _digest(h, length, raw[i * width : (i + 1) * width],
                    _lp(_canonical_extras(extras[i])) if extras is not None else _NO_EXTRAS)
        keys.append(BlockKey(fp, h))
    return keys


#: Fewer bits than this and distinct blocks of one fingerprint collide too easily (a pool of
#: 10^9 blocks under a 64-bit hash has about a 3% chance of one collision, which no
#: checksum can catch: the bytes are right, they belong to another block).
MIN_ENGINE_HASH_BITS = 128


def key_from_engine_hash(fingerprint: ModelFingerprint, scheme: str, engine_hash: bytes | int, *,
                         allow_64bit: bool = False) -> BlockKey:
    """Translate an engine's own block hash into a kvpool key.

    Engines that route on their own chained hashes (vLLM's ``sha256_cbor`` block hashes,
    SGLang's radix-tree hashes) keep them; kvpool namespaces them under the fingerprint and
    the scheme's name, so hashes of different models or schemes never collide.

    ``engine_hash`` is bytes (at least 16) or a non-negative int. An int below 2**64, or a
    negative one of at least -2**63 (a signed 64-bit hash, folded to its unsigned form),
    comes from a 64-bit hash function and is refused unless ``allow_64bit``.
    """
    if not scheme:
        raise KeyFormatError("engine hash scheme needs a name")
    # Tag the type so that an int and the bytes of its big-endian form never share a key.
    if isinstance(engine_hash, int) and not isinstance(engine_hash, bool):
        if engine_hash < 0:
            if engine_hash < -(1 << 63):
                raise KeyFormatError("a negative engine hash must be a signed 64-bit value")
            engine_hash &= (1 << 64) - 1  # the same 64 bits, read unsigned
        if engine_hash < 1 << 64 and not allow_64bit:
            raise KeyFormatError("a 64-bit engine hash collides too easily; use a hash of at least "
                                 f"{MIN_ENGINE_HASH_BITS} bits or pass allow_64bit=True")
        raw = b"i" + str(engine_hash).encode("ascii")
    elif isinstance(engine_hash, (bytes, bytearray, memoryview)):
        data = bytes(engine_hash)
        if len(data) * 8 < MIN_ENGINE_HASH_BITS and not (allow_64bit and len(data) >= 8):
            raise KeyFormatError(f"an engine hash of {len(data)} bytes is too short")
        raw = b"b" + data
    else:
        raise KeyFormatError(f"an engine hash is bytes or int, not {type(engine_hash).__name__}")
    fp = fingerprint.digest()
    data = _lp(fp) + _lp(scheme.encode()) + _lp(raw)
    return BlockKey(fp, hashlib.blake2b(data, digest_size=DIGEST_BYTES, person=_PERSON_EXT).digest())
