"""Which blocks to admit and which to evict: the policy interface and its implementations.

A policy sees each tier's resident blocks through four notifications (``inserted``,
``accessed``, ``removed``, ``admit``) and answers one question, ``victims(tier)``: the
resident blocks of that tier in the order they should go. The store skips victims it may
not evict (pinned or being read) and stops iterating before it changes anything, so a
policy may yield straight from its live structures.

Priorities come first in every policy here: a block of a lower-priority tenant goes before
any block of a higher-priority one. ``victims(tier, tenant)`` restricts the order to one
tenant's blocks, which the store uses when that tenant is over its quota.

Tiers are named by strings (``"dram"``, ``"disk"``, ``"gpu"``) so that this module
depends on nothing else in the sidecar; the trace replay drives the same classes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Protocol

from kvpool_sidecar.errors import ConfigError


@dataclass(slots=True, eq=False)
class BlockMeta:
    """What a policy may know about a block."""

    key: bytes
    size: int
    tenant: str = "default"
    priority: int = 0
    #: Position in its prefix chain (0 = first block); -1 when unknown.
    depth: int = -1
    parent: bytes | None = None
    hits: int = 0


class EvictionPolicy(Protocol):
    """The interface every policy implements."""

    name: str

    def admit(self, tier: str, meta: BlockMeta) -> bool:
        """Whether a new block is worth a place in ``tier`` at all."""

    def inserted(self, tier: str, meta: BlockMeta) -> None:
        """``meta`` became resident in ``tier``."""

    def accessed(self, tier: str, meta: BlockMeta) -> None:
        """``meta`` was read from ``tier`` (a hit)."""

    def removed(self, tier: str, meta: BlockMeta) -> None:
        """``meta`` left ``tier`` (evicted, demoted or deleted)."""

    def victims(self, tier: str, tenant: str | None = None) -> Iterator[BlockMeta]:
        """Resident blocks of ``tier`` (of ``tenant`` only, if given), first to go first."""


class LRUPolicy:
    """Least recently used within each priority level; lower priorities go first.

    Admits everything. Each (tier, priority) and each (tier, tenant) keeps an ordered
    dict, so every notification is O(1) and ``victims`` yields from the cold end.
    """

    name = "lru"

    def __init__(self) -> None:
        self._levels: dict[str, dict[int, OrderedDict[bytes, BlockMeta]]] = {}
        self._tenants: dict[str, dict[str, OrderedDict[bytes, BlockMeta]]] = {}

    def _level(self, tier: str, meta: BlockMeta) -> OrderedDict[bytes, BlockMeta]:
        return self._levels.setdefault(tier, {}).setdefault(meta.priority, OrderedDict())

    def _tenant(self, tier: str, meta: BlockMeta) -> OrderedDict[bytes, BlockMeta]:
        return self._tenants.setdefault(tier, {}).setdefault(meta.tenant, OrderedDict())

    def admit(self, tier: str, meta: BlockMeta) -> bool:
        return True

    def inserted(self, tier: str, meta: BlockMeta) -> None:
        self._level(tier, meta)[meta.key] = meta
        self._tenant(tier, meta)[meta.key] = meta

    def accessed(self, tier: str, meta: BlockMeta) -> None:
        level = self._level(tier, meta)
        if meta.key in level:
            level.move_to_end(meta.key)
            self._tenant(tier, meta).move_to_end(meta.key)

    def removed(self, tier: str, meta: BlockMeta) -> None:
        self._level(tier, meta).pop(meta.key, None)
        self._tenant(tier, meta).pop(meta.key, None)

    def victims(self, tier: str, tenant: str | None = None) -> Iterator[BlockMeta]:
        if tenant is not None:
            yield from self._tenants.get(tier, {}).get(tenant, OrderedDict()).values()
            return
        levels = self._levels.get(tier, {})
        for priority in sorted(levels):
            yield from levels[priority].values()


POLICIES: Mapping[str, type[EvictionPolicy]] = {"lru": LRUPolicy}


def make_policy(name: str) -> EvictionPolicy:
    """The policy called ``name``; raises ConfigError for an unknown name."""
    try:
        return POLICIES[name]()
    except KeyError:
        raise ConfigError(f"policy.name: unknown policy {name!r}; known: {sorted(POLICIES)}") from None
