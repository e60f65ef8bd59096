"""Parsing what a writer says about its blocks (protocol 3): request hints, engine identity.

Both are optional and bounded. Anything malformed refuses the whole request with
``BAD_REQUEST`` before a key is reserved, like every other field of a put. The bounds
match ``kvpool_client.blockinfo``.
"""

from __future__ import annotations

from array import array
from typing import Any

from kvpool_sidecar.errors import RequestError
from kvpool_sidecar.events import EngineRef
from kvpool_sidecar.policy import Hints

MAX_HINT_TEXT = 128
MAX_ENGINE_HASH_BYTES = 64
MAX_BLOCK_TOKENS = 4096
MAX_PROMPT_BLOCKS = 1 << 24
MAX_EXTRA_KEYS = 16
_U64 = (1 << 64) - 1
#: msgpack's least integer: a smaller extra key could not be announced (KV events).
_I64_MIN = -(1 << 63)
_TOKEN_MAX = (1 << 32) - 1
_INT = frozenset({int})
_HINT_FIELDS = frozenset({"prompt_blocks", "session", "label"})
_ENGINE_FIELDS = frozenset({"hash", "parent", "tokens", "block_size", "lora_id", "lora_name", "extra_keys"})


def _map(value: object, fields: frozenset[str], what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise RequestError(f"{what} must be a map or nil")
    unknown = set(value) - fields
    if unknown:
        raise RequestError(f"{what} has unknown fields {sorted(map(str, unknown))}")
    return value


def _text(value: object, what: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or len(value.encode("utf-8")) > MAX_HINT_TEXT:
        raise RequestError(f"{what} must be a string of at most {MAX_HINT_TEXT} UTF-8 bytes")
    return value


def _uint(value: object, top: int, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= top:
        raise RequestError(f"{what} must be an integer in [0, {top}]")
    return value


def _hash(value: object, what: str) -> int | bytes:
    if isinstance(value, bytes) and 0 < len(value) <= MAX_ENGINE_HASH_BYTES:
        return value
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= _U64:
        return value
    raise RequestError(f"{what} must be an integer in [0, 2**64) or 1 to {MAX_ENGINE_HASH_BYTES} bytes")


def _extra(value: object) -> str | int | bytes:
    if isinstance(value, (str, bytes)) and len(value) <= MAX_HINT_TEXT:
        return value
    if isinstance(value, int) and not isinstance(value, bool) and _I64_MIN <= value <= _U64:
        return value
    raise RequestError(f"an extra key must be an integer, or a string or bytes of at most {MAX_HINT_TEXT}")


def parse_hints(value: object) -> Hints | None:
    """A request's hints; ``None`` for nil or an empty map."""
    if value is None:
        return None
    m = _map(value, _HINT_FIELDS, "hints")
    if not m:
        return None
    n = m.get("prompt_blocks")
    return Hints(
        prompt_blocks=-1 if n is None else _uint(n, MAX_PROMPT_BLOCKS, "hints.prompt_blocks"),
        session=_text(m.get("session"), "hints.session"),
        label=_text(m.get("label"), "hints.label"),
    )


def parse_engine(value: object) -> EngineRef | None:
    """One block's engine identity; ``None`` for nil."""
    if value is None:
        return None
    m = _map(value, _ENGINE_FIELDS, "an engine block")
    if "hash" not in m or "tokens" not in m or "block_size" not in m:
        raise RequestError("an engine block needs hash, tokens and block_size")
    token_ids = _token_ids(m["tokens"])
    extra = m.get("extra_keys") or []
    if not isinstance(extra, list) or len(extra) > MAX_EXTRA_KEYS:
        raise RequestError(f"engine extra_keys must be a list of at most {MAX_EXTRA_KEYS} values")
    parent = m.get("parent")
    lora_id = m.get("lora_id")
    return EngineRef(
        hash=_hash(m["hash"], "engine hash"),
        parent=None if parent is None else _hash(parent, "engine parent hash"),
        token_ids=token_ids,
        block_size=_uint(m["block_size"], MAX_BLOCK_TOKENS, "engine block_size") or _bad_block_size(),
        lora_id=None if lora_id is None else _uint(lora_id, _U64, "engine lora_id"),
        lora_name=_text(m.get("lora_name"), "engine lora_name"),
        extra_keys=tuple(_extra(x) for x in extra),
    )


def _token_ids(tokens: object) -> array[int]:
    """A block's token ids, 4 bytes each rather than a Python int each: every one an integer
    (not a bool) in ``[0, 2**32)``. Checked in bulk, in C (the set of the ids' types, then
    the array, which refuses a number out of range): a Python-level check per id had held
    the event loop 85 to 98 ms for a put of 256 blocks of 4,096 ids, 22 ms now."""
    if not isinstance(tokens, list) or len(tokens) > MAX_BLOCK_TOKENS:
        raise RequestError(f"engine tokens must be a list of at most {MAX_BLOCK_TOKENS} token ids")
    kinds = set(map(type, tokens))
    if kinds - _INT and not all(issubclass(k, int) and not issubclass(k, bool) for k in kinds):
        raise _bad_token()
    try:
        return array("I", tokens)
    except (OverflowError, TypeError):  # a negative id, or one past 2**32 - 1 (OverflowError)
        raise _bad_token() from None


def _bad_token() -> RequestError:
    return RequestError(f"a token id must be an integer in [0, {_TOKEN_MAX}]")


def _bad_block_size() -> int:
    raise RequestError("engine block_size must be at least 1")
