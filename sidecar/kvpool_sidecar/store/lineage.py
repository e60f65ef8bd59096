"""A put's own ancestors: the blocks its room must not be made from.

A block of a prefix chain is only ever read after every block before it. A put that makes
room by evicting the last copy of one of its own ancestors stores a block no lookup can
reach again, and so does every later put of the same chain (an engine saves a long prefix
a round at a time). The policy cannot see that: it ranks the blocks of the chain by their
own worth, and a chain being written for the first time looks cold. So where the policy's
first victim is such an ancestor, and evicting it would lose it (no copy in another tier,
none made by demotion), the put is refused (FULL) rather than stored unreachable.

The ancestors are found only when a put has to evict (:class:`Ancestors` is lazy): one
:class:`Lineage` per request follows the chain its items form (a block whose parent is the
request's previous block adds one key) and walks up through the blocks still pending (another
request's, not committed yet) and the store's entries from where the request starts, for the
nearest :data:`MAX_WALK` ancestors. A request spends at most
:data:`WALK_BUDGET` steps walking, so a hostile client that names deep chains or cycles
item after item costs a bounded amount per request; past the budget a block's ancestors
are its parent alone. Nothing outlives the request.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Set
from typing import Any

from kvpool_sidecar.policy import BlockMeta

#: The most ancestors a walk collects: the nearest ones (a chain of 2,048 blocks is 32k
#: tokens at 16 tokens a block).
MAX_WALK = 2048
#: The most steps one request's walks take in all.
WALK_BUDGET = 2 * MAX_WALK


class Lineage:
    """The chains the blocks of one request belong to."""

    def __init__(self, entries: Mapping[bytes, BlockMeta], pending: Mapping[bytes, bytes | None] | None = None) -> None:
        self._entries = entries
        #: Blocks allocated and not committed yet, by any request: their parents. A chain put
        #: in pieces (several ALLOCs in flight: kvpool_client.pipeline) has its earlier
        #: pieces pending when a later one is allocated; the walk had stopped at them, and the
        #: put evicted its own committed head (a chain of 128 blocks stored 120 that no
        #: lookup reached).
        self._pending: Mapping[bytes, bytes | None] = pending if pending is not None else {}
        #: This request's blocks so far: key -> parent (some are not committed yet).
        self._parents: dict[bytes, bytes | None] = {}
        self._budget = WALK_BUDGET
        #: The block whose ancestors were found last, and those ancestors.
        self._last: bytes | None = None
        self._last_keys: set[bytes] = set()

    @property
    def blocks(self) -> int:
        """How many blocks it has followed."""
        return len(self._parents)

    def ancestors(self, key: bytes, parent: bytes | None) -> Ancestors:
        """``key``'s ancestors (``parent`` and up), found when first asked."""
        self._parents[key] = parent
        return Ancestors(self, key, parent)

    def _resolve(self, key: bytes, parent: bytes | None) -> set[bytes]:
        if parent is None:
            keys: set[bytes] = set()
        elif parent == self._last:  # the next block of the chain found last: one more key
            keys = self._last_keys
            keys.add(parent)
        else:
            keys = self._walk(parent)
        self._last, self._last_keys = key, keys
        return keys

    def _walk(self, parent: bytes) -> set[bytes]:
        out: set[bytes] = set()
        k: bytes | None = parent
        while k is not None and k not in out and len(out) < MAX_WALK:
            out.add(k)
            if self._budget <= 0:
                break
            self._budget -= 1
            if k in self._parents:
                k = self._parents[k]
            elif k in self._pending:
                k = self._pending[k]
            else:
                meta = self._entries.get(k)
                k = meta.parent if meta is not None else None
        return out


class Ancestors(Set[bytes]):
    """A block's ancestors as a set, found on first use. The set is shared with the next
    block of the same chain, which adds this block's key to it: harmless, since a block
    being put is never a victim."""

    __slots__ = ("_key", "_keys", "_lineage", "_parent")

    def __init__(self, lineage: Lineage, key: bytes, parent: bytes | None) -> None:
        self._lineage = lineage
        self._key = key
        self._parent = parent
        self._keys: set[bytes] | None = None

    def _found(self) -> set[bytes]:
        if self._keys is None:
            self._keys = self._lineage._resolve(self._key, self._parent)  # noqa: SLF001 - its own lineage
        return self._keys

    def __bool__(self) -> bool:  # without finding them: a block with a parent has ancestors
        return self._parent is not None

    def __contains__(self, key: Any) -> bool:
        if self._parent is None:
            return False
        return key == self._parent or key in self._found()

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._found())

    def __len__(self) -> int:
        return len(self._found())
