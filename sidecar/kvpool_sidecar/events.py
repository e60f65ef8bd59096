"""Index events: what the store tells the index after a block enters or leaves a tier."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class IndexEvent:
    """``publish``: the block at ``key`` is now readable in ``tier``; else it left it."""

    publish: bool
    tier: str
    key: bytes


@dataclass(frozen=True, slots=True)
class EngineRef:
    """The engine's own identity for a block, as its writer stated it (protocol 3).

    Kept with the block so that KV events can announce, in the engine's terms, when it
    enters or leaves the pool. It is the writer's word: the pool never serves a block by
    it (blocks are found by their pool key), so a wrong one misleads only event consumers
    of the writer's own tenant.
    """

    hash: int | bytes
    parent: int | bytes | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    lora_name: str | None = None
    extra_keys: tuple[str | int | bytes, ...] = ()
