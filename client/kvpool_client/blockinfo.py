"""What a writer may say about the blocks it puts, besides their bytes.

Two kinds of optional information travel with a put (protocol version 3; a version-2
client sends neither and is served as before). Neither is ever part of a block's key: two
writers that disagree about a hint still write and read the same block.

- :class:`PutHints`, one per request: what the engine or router knows about the request
  that produced the blocks (the prompt's length in blocks, its conversation, a class
  label). The sidecar's retention policy learns from them which blocks are read again.
- :class:`EngineBlock`, one per block: the engine's own identity for the block (its block
  hash, its parent's hash, the block's token ids, the block size and LoRA adapter). The
  sidecar keeps it with the block so that KV-event consumers (KV-aware routers) can be
  told, in the engine's terms, when the block enters or leaves the pool.

The bounds below are the sidecar's: a put that exceeds one is refused whole with
``BAD_REQUEST``, and the client checks them first so that the caller gets the error at
the call.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvpool_client.errors import KVPoolError

#: Longest session id or label, in UTF-8 bytes.
MAX_HINT_TEXT = 128
#: Longest engine block hash given as bytes.
MAX_ENGINE_HASH_BYTES = 64
#: Most token ids one block may carry.
MAX_BLOCK_TOKENS = 4096
#: Largest prompt length in blocks a hint may state.
MAX_PROMPT_BLOCKS = 1 << 24
_U64 = (1 << 64) - 1
_TOKEN_MAX = (1 << 32) - 1


def _text(value: str | None, what: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or len(value.encode("utf-8")) > MAX_HINT_TEXT:
        raise KVPoolError(f"{what} must be a str of at most {MAX_HINT_TEXT} UTF-8 bytes")
    return value


def _engine_hash(value: int | bytes | None, what: str, *, optional: bool) -> int | bytes | None:
    if value is None and optional:
        return None
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= _U64:
        return value
    if isinstance(value, (bytes, bytearray)) and 0 < len(value) <= MAX_ENGINE_HASH_BYTES:
        return bytes(value)
    raise KVPoolError(f"{what} must be an int in [0, 2**64) or 1 to {MAX_ENGINE_HASH_BYTES} bytes")


@dataclass(frozen=True, slots=True)
class PutHints:
    """What the writer knows about the request that produced a put's blocks."""

    #: The request's prompt length, in blocks (all of it, not only the blocks put).
    prompt_blocks: int | None = None
    #: The conversation (or agent run) the request belongs to.
    session: str | None = None
    #: A class chosen by the engine or router, such as "system", "document" or "turn".
    label: str | None = None

    def __post_init__(self) -> None:
        n = self.prompt_blocks
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= MAX_PROMPT_BLOCKS):
            raise KVPoolError(f"prompt_blocks must be an int in [0, {MAX_PROMPT_BLOCKS}]")
        _text(self.session, "session")
        _text(self.label, "label")

    def wire(self) -> dict[str, Any] | None:
        """The map sent on the wire; ``None`` when no hint is set."""
        out: dict[str, Any] = {}
        if self.prompt_blocks is not None:
            out["prompt_blocks"] = self.prompt_blocks
        if self.session is not None:
            out["session"] = self.session
        if self.label is not None:
            out["label"] = self.label
        return out or None


@dataclass(frozen=True, slots=True)
class EngineBlock:
    """The engine's identity for one block (vLLM's block hash and what it hashes)."""

    hash: int | bytes
    token_ids: Sequence[int]
    block_size: int
    parent: int | bytes | None = None
    lora_id: int | None = None
    lora_name: str | None = None
    #: Extra keys the engine hashed with the tokens (multimodal hashes, cache salt), if any.
    extra_keys: Sequence[str | int | bytes] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        _engine_hash(self.hash, "an engine block hash", optional=False)
        _engine_hash(self.parent, "an engine parent hash", optional=True)
        if not isinstance(self.block_size, int) or not 0 < self.block_size <= MAX_BLOCK_TOKENS:
            raise KVPoolError(f"block_size must be an int in [1, {MAX_BLOCK_TOKENS}]")
        if len(self.token_ids) > MAX_BLOCK_TOKENS or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= _TOKEN_MAX for t in self.token_ids
        ):
            raise KVPoolError(f"token_ids must be at most {MAX_BLOCK_TOKENS} ints in [0, 2**32)")
        if self.lora_id is not None and (not isinstance(self.lora_id, int) or not 0 <= self.lora_id <= _U64):
            raise KVPoolError("lora_id must be an int in [0, 2**64) or None")
        _text(self.lora_name, "lora_name")
        if len(self.extra_keys) > 16 or not all(
            isinstance(x, (str, int, bytes)) and not isinstance(x, bool)
            and (not isinstance(x, (str, bytes)) or len(x) <= MAX_HINT_TEXT)
            for x in self.extra_keys
        ):
            raise KVPoolError(f"extra_keys must be at most 16 str, int or bytes of at most {MAX_HINT_TEXT}")

    def wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {"hash": self.hash, "tokens": list(self.token_ids), "block_size": self.block_size}
        if self.parent is not None:
            out["parent"] = self.parent
        if self.lora_id is not None:
            out["lora_id"] = self.lora_id
        if self.lora_name is not None:
            out["lora_name"] = self.lora_name
        if self.extra_keys:
            out["extra_keys"] = list(self.extra_keys)
        return out


def engine_wire(engine: Sequence[EngineBlock | None] | None, count: int) -> list[dict[str, Any] | None] | None:
    """Per-block engine maps for a put of ``count`` blocks (``None`` where none was given)."""
    if engine is None:
        return None
    if len(engine) != count:
        raise KVPoolError("put needs one engine block (or None) per key")
    return [None if e is None else e.wire() for e in engine]
