"""A put's own ancestors: the blocks its room must not be made from.

A block of a prefix chain is only ever read after every block before it. A put that makes
room in the coldest tier by evicting one of its own ancestors stores a block no lookup
can reach again, and so does every later put of the same chain (an engine saves a long
prefix a round at a time). The policy cannot see that: it ranks the blocks of the chain
by their own worth, and a chain being written for the first time looks cold. So a put's
room comes from anything but its ancestors; where nothing else can go, the put is
refused (FULL) rather than stored unreachable.

One :class:`Lineage` per session follows the chain that session is writing: a block whose
parent is the session's previous block (stored, already held, or refused) adds one key,
up to :data:`MAX_KEEP` (the head of a chain is what matters most: without it nothing after
it is reachable). Only a block that starts elsewhere walks up through the store's entries,
for its nearest :data:`MAX_WALK` ancestors, so that a cycle or a deep chain named by a
hostile client costs a bounded amount per block.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from kvpool_sidecar.policy import BlockMeta

#: The most ancestors a session's lineage keeps (a chain of 4096 blocks is 64k tokens at
#: 16 tokens a block).
MAX_KEEP = 4096
#: The most ancestors a walk through the store's entries collects.
MAX_WALK = 512


@dataclass(slots=True)
class Lineage:
    """The ancestors of the block a session allocated last."""

    #: The key allocated last (None before the first, or after a block with no parent).
    tip: bytes | None = None
    keys: set[bytes] = field(default_factory=set)

    def ancestors(self, key: bytes, parent: bytes | None, entries: Mapping[bytes, BlockMeta]) -> set[bytes]:
        """The ancestors of ``key`` whose parent is ``parent``; ``key`` becomes the tip.

        The set returned is the lineage's own and changes with the next call."""
        if parent is None:
            self.keys = set()
        elif parent == self.tip:
            if len(self.keys) < MAX_KEEP:
                self.keys.add(parent)
        else:
            self.keys = walk(parent, entries)
        self.tip = key
        return self.keys


def walk(parent: bytes, entries: Mapping[bytes, BlockMeta]) -> set[bytes]:
    """``parent`` and its ancestors known to ``entries``, following parent links until a
    block without one, one the store does not hold, a key seen already, or
    :data:`MAX_WALK` keys."""
    out: set[bytes] = set()
    k: bytes | None = parent
    while k is not None and k not in out and len(out) < MAX_WALK:
        out.add(k)
        meta = entries.get(k)
        k = meta.parent if meta is not None else None
    return out
