"""Index events: what the store tells the index after a block enters or leaves a tier."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class IndexEvent:
    """``publish``: the block at ``key`` is now readable in ``tier``; else it left it."""

    publish: bool
    tier: str
    key: bytes
