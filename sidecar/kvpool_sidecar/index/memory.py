"""The in-memory index: the embedded default of a single-node pool (and the tests' fake)."""

from __future__ import annotations

from collections.abc import Sequence

from kvpool_sidecar.events import IndexEvent


class MemoryIndex:
    """``key -> {node@tier}`` in a dict; every operation is O(batch)."""

    def __init__(self) -> None:
        self._holders: dict[bytes, set[str]] = {}
        self._by_node: dict[str, set[bytes]] = {}

    async def apply(self, node: str, events: Sequence[IndexEvent]) -> None:
        mine = self._by_node.setdefault(node, set())
        for ev in events:
            holder = f"{node}@{ev.tier}"
            if ev.publish:
                self._holders.setdefault(ev.key, set()).add(holder)
                mine.add(ev.key)
                continue
            held = self._holders.get(ev.key)
            if held is None:
                continue
            held.discard(holder)
            if not held:
                del self._holders[ev.key]
            if not any(h.startswith(node + "@") for h in held):
                mine.discard(ev.key)

    async def lookup(self, keys: Sequence[bytes]) -> list[list[str]]:
        out: list[list[str]] = []
        for k in keys:
            held = self._holders.get(k)
            if not held:
                break
            out.append(sorted(held))
        return out

    async def drop_node(self, node: str) -> None:
        prefix = node + "@"
        for key in self._by_node.pop(node, set()):
            held = self._holders.get(key)
            if held is None:
                continue
            held -= {h for h in held if h.startswith(prefix)}
            if not held:
                del self._holders[key]

    async def close(self) -> None:
        return None
