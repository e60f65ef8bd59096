"""What a vLLM connector's save tells the pool of the blocks and of their request: vLLM's
identity of each block, in the form vLLM's own KV events give it (so the sidecar can announce
the pool's blocks as the engine names them), and the request's hints for the policy.

:func:`engine_blocks` (each block's hash, parent, token ids, block size, LoRA adapter and
flat extra keys: :func:`external_hash`, :func:`event_extra_keys`) and :func:`put_hints`
(the prompt's length in blocks, the ``session_id``). The connector is
:class:`~kvpool_client.engines.vllm.KVPoolConnector`.
"""

from __future__ import annotations

import hashlib
import logging
from typing import TYPE_CHECKING

from kvpool_client.blockinfo import MAX_HINT_TEXT, MAX_PROMPT_BLOCKS, EngineBlock, PutHints
from kvpool_client.errors import KVPoolError

if TYPE_CHECKING:
    from vllm.v1.request import Request

#: The connector's logger (these are its messages).
logger = logging.getLogger("kvpool_client.engines.vllm")


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


def engine_blocks(request: Request, start: int, count: int, block_size: int,
                  hash_ratio: int) -> list[EngineBlock | None]:
    """vLLM's identity of the request's pool blocks ``[start, start + count)`` (``block_size``
    tokens each, ``hash_ratio`` of vLLM's hash blocks)."""
    r, bs = hash_ratio, block_size
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


def put_hints(request: Request, block_size: int) -> PutHints:
    """What vLLM knows of the request: its prompt's length in blocks and its session."""
    session = getattr(request, "session_id", None)
    if not isinstance(session, str) or not session:
        session = None
    elif len(session.encode()) > MAX_HINT_TEXT:  # the same session, in fewer bytes
        session = hashlib.sha256(session.encode()).hexdigest()
    blocks = -(-int(request.num_prompt_tokens) // block_size)
    return PutHints(prompt_blocks=min(blocks, MAX_PROMPT_BLOCKS), session=session)


__all__ = ["engine_blocks", "event_extra_keys", "external_hash", "put_hints"]
