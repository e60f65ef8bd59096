"""What an eviction policy could reach if it knew a little of the future: reference points.

LRU and Belady bracket a policy. These oracles sit between them and say which knowledge
the missing hits need: each is LRU with an admission oracle that sees one fact about the
block's next use, counted like the replay (prefix hits only while the prefix is unbroken).

- ``ever``: admit a missed block, and keep a hit one, only if it is used again at all. What a perfect
  "one-shot or not" predictor (admission control, frequency, request shape) could add.
- ``within``: admit a missed block, and keep a hit one, only if its next use comes within
  ``horizon`` block accesses. What knowing *when* a block returns adds.

If ``ever`` stays far below a target while ``within`` reaches it, the target needs
knowledge of reuse timing, which no online policy has.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol


class _Request(Protocol):
    @property
    def ids(self) -> tuple[int, ...]: ...


def next_uses(requests: Sequence[_Request]) -> list[int]:
    """For each block access in order, the position of the next access to that block.

    Blocks never used again get ``len(accesses)``.
    """
    seq = [d for r in requests for d in r.ids]
    never = len(seq)
    out = [never] * never
    last: dict[int, int] = {}
    for pos in range(never - 1, -1, -1):
        out[pos] = last.get(seq[pos], never)
        last[seq[pos]] = pos
    return out


def oracle_lru_hits(requests: Sequence[_Request], capacity: int, horizon: int | None = None) -> int:
    """Prefix hits of LRU on ``capacity`` blocks with an admission oracle.

    ``horizon`` None: admit (and keep on a hit) a block iff it is used again. Otherwise iff
    its next use is at most ``horizon`` accesses ahead.
    """
    if capacity <= 0:
        return 0
    nxt = next_uses(requests)
    never = len(nxt)
    cache: OrderedDict[int, None] = OrderedDict()
    hits = pos = 0
    for r in requests:
        broken = False
        for d in r.ids:
            ahead = nxt[pos] - pos
            wanted = nxt[pos] < never and (horizon is None or ahead <= horizon)
            pos += 1
            if d in cache:
                if not broken:
                    hits += 1
                if wanted:
                    cache.move_to_end(d)
                else:
                    del cache[d]  # not needed (soon enough): its room serves better
                continue
            broken = True
            if not wanted:
                continue
            cache[d] = None
            if len(cache) > capacity:
                cache.popitem(last=False)
    return hits


def oracle_rates(requests: Sequence[_Request], capacity: int, horizons: Sequence[int] = (3,)) -> dict[str, float]:
    """Hit rates of the ``ever`` oracle and of ``within`` oracles at ``horizons`` x capacity."""
    total = sum(len(r.ids) for r in requests)
    if not total:
        return {}
    out = {"oracle_ever_reused": oracle_lru_hits(requests, capacity) / total}
    for h in horizons:
        out[f"oracle_reused_within_{h}x_capacity"] = oracle_lru_hits(requests, capacity, h * capacity) / total
    return out
