"""The least-recently-used policy: the plain baseline the others are measured against."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterator

from kvpool_sidecar.policy.base import BlockMeta


class LRUPolicy:
    """Least recently used within each priority level; lower priorities go first.

    Admits everything. Each (tier, priority) and each (tier, tenant) keeps an ordered
    dict, so every notification is O(1) and ``victims`` yields from the cold end. Blocks
    the store walked past (``skipped``) wait in one more per tier, after every priority,
    until they are ``restored``: back at the cold end, where the walk found them, or at the
    recent end if they were read or put again meanwhile.
    """

    name = "lru"
    #: ``admit`` is always True (the store may then apply it later: :mod:`kvpool_sidecar.store.accounting`).
    admits_all = True

    def __init__(self) -> None:
        self._levels: dict[str, dict[int, OrderedDict[bytes, BlockMeta]]] = {}
        self._tenants: dict[str, dict[str, OrderedDict[bytes, BlockMeta]]] = {}
        #: Each tier's skipped blocks, in the order they were skipped (or read since), and
        #: those of them read or put again since they were skipped.
        self._held: dict[str, OrderedDict[bytes, BlockMeta]] = {}
        self._touched: dict[str, set[bytes]] = {}

    def _level(self, tier: str, meta: BlockMeta) -> OrderedDict[bytes, BlockMeta]:
        return self._levels.setdefault(tier, {}).setdefault(meta.priority, OrderedDict())

    def _tenant(self, tier: str, meta: BlockMeta) -> OrderedDict[bytes, BlockMeta]:
        return self._tenants.setdefault(tier, {}).setdefault(meta.tenant, OrderedDict())

    def admit(self, tier: str, meta: BlockMeta) -> bool:
        return True

    def inserted(self, tier: str, meta: BlockMeta) -> None:
        held = self._held.get(tier)
        if held is not None and meta.key in held:  # put again while held back: still held
            held[meta.key] = meta
            held.move_to_end(meta.key)
            self._touched.setdefault(tier, set()).add(meta.key)
            return
        self._level(tier, meta)[meta.key] = meta
        self._tenant(tier, meta)[meta.key] = meta

    def accessed(self, tier: str, meta: BlockMeta, *, again: bool = False) -> None:
        level = self._level(tier, meta)
        if meta.key in level:
            level.move_to_end(meta.key)
            self._tenant(tier, meta).move_to_end(meta.key)
            return
        held = self._held.get(tier)
        if held is not None and meta.key in held:
            held.move_to_end(meta.key)
            self._touched.setdefault(tier, set()).add(meta.key)

    def bypassed(self, tier: str, meta: BlockMeta) -> None:
        pass

    def skipped(self, tier: str, meta: BlockMeta) -> None:
        level = self._level(tier, meta)
        m = level.pop(meta.key, None)
        if m is not None:
            self._tenant(tier, meta).pop(meta.key, None)
            self._held.setdefault(tier, OrderedDict())[meta.key] = m

    def restored(self, tier: str, meta: BlockMeta) -> None:
        held = self._held.get(tier)
        m = held.pop(meta.key, None) if held is not None else None
        if m is None:
            return
        level, own = self._level(tier, m), self._tenant(tier, m)
        level[m.key] = own[m.key] = m
        touched = self._touched.get(tier)
        if touched is not None and m.key in touched:
            touched.discard(m.key)  # read meanwhile: the recent end
        else:  # where the walk found it, at the cold end
            level.move_to_end(m.key, last=False)
            own.move_to_end(m.key, last=False)

    def sized(self, capacity: int) -> None:
        pass

    def bounded(self, tenants: frozenset[str]) -> None:
        pass  # (nothing shared to learn)

    def removed(self, tier: str, meta: BlockMeta, *, evicted: bool = True) -> None:
        self._level(tier, meta).pop(meta.key, None)
        self._tenant(tier, meta).pop(meta.key, None)
        held = self._held.get(tier)
        if held is not None and held.pop(meta.key, None) is not None:
            self._touched.get(tier, set()).discard(meta.key)

    def resident(self, tier: str, key: bytes) -> BlockMeta | None:
        for level in self._levels.get(tier, {}).values():
            m = level.get(key)
            if m is not None:
                return m
        held = self._held.get(tier)
        return held.get(key) if held is not None else None

    def resident_keys(self, tier: str) -> Collection[bytes]:
        out = [k for level in self._levels.get(tier, {}).values() for k in level]
        out.extend(self._held.get(tier, ()))
        return out

    def victims(self, tier: str, tenant: str | None = None) -> Iterator[BlockMeta]:
        held = self._held.get(tier, OrderedDict())
        if tenant is not None:
            yield from self._tenants.get(tier, {}).get(tenant, OrderedDict()).values()
            yield from (m for m in held.values() if m.tenant == tenant)
            return
        levels = self._levels.get(tier, {})
        for priority in sorted(levels):
            yield from levels[priority].values()
        yield from held.values()
