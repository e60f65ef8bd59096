"""What an eviction policy could reach if it knew a little of the future: reference points.

LRU and Belady bracket a policy. These oracles sit between them and say which knowledge
the missing hits need: each is LRU with an admission oracle that sees one fact about the
block's next use, counted like the replay (prefix hits only while the prefix is unbroken).

- ``ever``: admit a missed block, and keep a hit one, only if it is used again at all. What a perfect
  "one-shot or not" predictor (admission control, frequency, request shape) could add.
- ``within``: admit a missed block, and keep a hit one, only if its next use comes within
  ``horizon`` block accesses. What knowing *when* a block returns adds.
- ``ever, new blocks only``: ``ever``'s admission for blocks never seen before, plain LRU
  for the rest. What a perfect reading of a new block at its first put (all that hints given
  at put time can say of it) could add; the rest of ``ever``'s gain is knowing when a
  block already read is read for the last time.

- ``rate``: not LRU. Knows each block's access rate over its active life (first to last
  use) and the moment of its last use: keeps the blocks of highest rate, drops a block at
  its last use, never admits one whose rate is below every resident's. The best an online
  policy could do if it estimated rates perfectly and knew when a prefix stops being asked
  for (it can only estimate both from the past).

- ``class``: LRU admitting (and keeping) only blocks of the classes whose accesses Belady,
  at this capacity, kept to their next use often enough (the best threshold in hindsight).
  A class is what a policy knows of a block when it is put or read: the prompt's length
  (the ``prompt_blocks`` hint), the block's depth, its uses so far, its chain root's uses so
  far (the conversation's turns) and whether it ends the prompt. What learning per class
  could reach, with estimates exact from the start (:func:`oracle_class_hits`).

If ``ever`` stays far below a target while ``within`` reaches it, the target needs
knowledge of reuse timing, which no online policy has. If ``class`` stays below it, no
policy that ranks blocks by these classes reaches it however well it learns them.

``live_choice_deciles`` says whether the past predicts that timing at all. A prefix (named by
its first block) is *live* once seen and while it has uses to come. For each request that
reuses a prefix, it ranks that prefix among all live ones by the time since its last use and
by its uses so far, and counts the ranks in deciles. Flat deciles (about 0.1 each) mean the
next live prefix to be asked for is a fair draw whatever its recency and frequency: then no
policy that learns from the past beats ``ever``, which is told which prefixes are live.
"""

from __future__ import annotations

import bisect
import heapq
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


def oracle_lru_hits(requests: Sequence[_Request], capacity: int, horizon: int | None = None, *,
                    new_only: bool = False) -> int:
    """Prefix hits of LRU on ``capacity`` blocks with an admission oracle.

    ``horizon`` None: admit (and keep on a hit) a block iff it is used again. Otherwise iff
    its next use is at most ``horizon`` accesses ahead. ``new_only``: ask the oracle about
    blocks never seen before only (the others are admitted and kept as LRU would).
    """
    nxt = next_uses(requests)
    never = len(nxt)
    wanted = [n < never and (horizon is None or n - pos <= horizon) for pos, n in enumerate(nxt)]
    if new_only:
        seen: set[int] = set()
        pos = 0
        for r in requests:
            for d in r.ids:
                wanted[pos] = wanted[pos] or d in seen
                seen.add(d)
                pos += 1
    return lru_admitting(requests, capacity, wanted)


def lru_admitting(requests: Sequence[_Request], capacity: int, wanted: Sequence[bool]) -> int:
    """Prefix hits of LRU on ``capacity`` blocks that admits a missed block, and keeps a hit
    one, only where ``wanted`` says so (one flag per block access, in order)."""
    if capacity <= 0:
        return 0
    cache: OrderedDict[int, None] = OrderedDict()
    hits = pos = 0
    for r in requests:
        broken = False
        for d in r.ids:
            keep = wanted[pos]
            pos += 1
            if d in cache:
                if not broken:
                    hits += 1
                if keep:
                    cache.move_to_end(d)
                else:
                    del cache[d]  # not needed (soon enough): its room serves better
                continue
            broken = True
            if not keep:
                continue
            cache[d] = None
            if len(cache) > capacity:
                cache.popitem(last=False)
    return hits


def belady_hits(requests: Sequence[_Request], capacity: int, kept: list[bool] | None = None) -> int:
    """Prefix hits of Belady's MIN with bypass on one cache of ``capacity`` blocks.

    On a miss the block is admitted only if it is used again and sooner than the resident
    block used furthest in the future, which it then replaces. Blocks a request finds behind
    a missing one count as uses but not as hits, as in the replay. ``kept`` (one flag per
    block access, False on the way in): set where the block stayed from that access to its
    next one.
    """
    if capacity <= 0:
        return 0
    nxt = next_uses(requests)
    never = len(nxt)
    resident: dict[int, int] = {}  # block -> its next use
    since: dict[int, int] = {}  # block -> its last access (only to fill ``kept``)
    heap: list[tuple[int, int]] = []  # (-next use, block); stale entries are skipped
    hits = pos = 0
    for r in requests:
        broken = False
        for d in r.ids:
            use = nxt[pos]
            pos += 1
            if d in resident:
                if not broken:
                    hits += 1
                if kept is not None:
                    kept[since[d]] = True
                    since[d] = pos - 1
                resident[d] = use
                heapq.heappush(heap, (-use, d))
                continue
            broken = True
            if use == never:
                continue
            if len(resident) >= capacity:
                while -heap[0][0] != resident.get(heap[0][1]):
                    heapq.heappop(heap)
                if -heap[0][0] <= use:
                    continue  # bypass: every resident block is needed sooner
                del resident[heapq.heappop(heap)[1]]
            resident[d] = use
            if kept is not None:
                since[d] = pos - 1
            heapq.heappush(heap, (-use, d))
    return hits


def oracle_rate_hits(requests: Sequence[_Request], capacity: int) -> int:
    """Prefix hits of the ``rate`` oracle on ``capacity`` blocks.

    A block's rate is (uses - 1) / (last use - first use), in block accesses; ties go
    deepest first, then oldest first.
    """
    if capacity <= 0:
        return 0
    nxt = next_uses(requests)
    never = len(nxt)
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    uses: dict[int, int] = {}
    pos = 0
    for r in requests:
        for d in r.ids:
            first.setdefault(d, pos)
            last[d] = pos
            uses[d] = uses.get(d, 0) + 1
            pos += 1
    resident: dict[int, tuple[float, int, int]] = {}
    heap: list[tuple[tuple[float, int, int], int]] = []  # (rate, -depth, seq), block
    hits = pos = 0
    for r in requests:
        broken = False
        for depth, d in enumerate(r.ids):
            dies = nxt[pos] >= never
            pos += 1
            if d in resident:
                if not broken:
                    hits += 1
                if dies:
                    del resident[d]
                continue
            broken = True
            if dies:
                continue
            score = ((uses[d] - 1) / max(1, last[d] - first[d]), -depth, pos)
            while heap and resident.get(heap[0][1]) != heap[0][0]:
                heapq.heappop(heap)  # stale: dropped at its last use
            if len(resident) >= capacity and heap and score < heap[0][0]:
                continue  # worth less than every resident block
            resident[d] = score
            heapq.heappush(heap, (score, d))
            while len(resident) > capacity:
                old, victim = heapq.heappop(heap)
                if resident.get(victim) == old:
                    del resident[victim]
    return hits


#: The thresholds :func:`oracle_class_hits` tries (it reports the best).
CLASS_THRESHOLDS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7)


def _bucket(n: int) -> int:
    return n.bit_length()  # 0 for 0, then one bucket per power of two


def access_classes(requests: Sequence[_Request]) -> list[tuple[int, int, int, int, bool]]:
    """Each block access's class, from what a policy knows when the block is put or read:
    its prompt's length and its depth (power-of-two buckets), its own uses so far (up to 4),
    its chain root's uses so far (up to 6: the conversation's turns) and whether it is the
    prompt's last block."""
    uses: dict[int, int] = {}
    out: list[tuple[int, int, int, int, bool]] = []
    for r in requests:
        ids = r.ids
        n = len(ids)
        turns = min(uses.get(ids[0], 0), 6) if ids else 0
        out.extend((_bucket(n), _bucket(depth), min(uses.get(d, 0), 4), turns, depth == n - 1)
                   for depth, d in enumerate(ids))
        for d in ids:
            uses[d] = uses.get(d, 0) + 1
    return out


def oracle_class_hits(requests: Sequence[_Request], capacity: int,
                      thresholds: Sequence[float] = CLASS_THRESHOLDS) -> int:
    """Prefix hits of the ``class`` oracle: LRU that admits a missed block, and keeps a hit
    one, only where Belady (with bypass, at this capacity, over the whole trace) kept at least
    ``t`` of its class's accesses to their next use, at the best ``t`` of ``thresholds``.

    What a policy that learns per class which blocks are worth keeping (as Hawkeye learns
    from Belady's past choices) could reach at best with these classes, its estimates exact
    from the first request: an online learner sees only the past, so it stays below.
    """
    classes = access_classes(requests)
    kept = [False] * len(classes)
    belady_hits(requests, capacity, kept)
    seen: dict[tuple[int, int, int, int, bool], list[int]] = {}
    for c, k in zip(classes, kept):
        tally = seen.setdefault(c, [0, 0])
        tally[0] += 1
        tally[1] += k
    share = [seen[c][1] / seen[c][0] for c in classes]
    return max((lru_admitting(requests, capacity, [x >= t for x in share]) for t in thresholds), default=0)


def oracle_rates(requests: Sequence[_Request], capacity: int, horizons: Sequence[int] = (3,)) -> dict[str, float]:
    """Hit rates of the ``ever``, ``within`` (at ``horizons`` x capacity), ``rate`` and
    ``class`` oracles."""
    total = sum(len(r.ids) for r in requests)
    if not total:
        return {}
    out = {"oracle_ever_reused": oracle_lru_hits(requests, capacity) / total,
           "oracle_ever_reused_new_blocks_only": oracle_lru_hits(requests, capacity, new_only=True) / total,
           "oracle_rate_and_last_use": oracle_rate_hits(requests, capacity) / total,
           "oracle_class": oracle_class_hits(requests, capacity) / total}
    for h in horizons:
        out[f"oracle_reused_within_{h}x_capacity"] = oracle_lru_hits(requests, capacity, h * capacity) / total
    return out


def live_choice_deciles(requests: Sequence[_Request]) -> dict[str, list[float]]:
    """Where each reused prefix ranks among the live ones (see the module's docstring).

    ``age``: decile 0 holds the requests that reused the most recently used live prefix.
    ``uses``: decile 0 holds those that reused the least used one. Tied ranks count at
    their middle.
    """
    roots = [r.ids[0] for r in requests if r.ids]
    final: dict[int, int] = {}
    for i, root in enumerate(roots):
        final[root] = i
    last: dict[int, int] = {}
    uses: dict[int, int] = {}
    live: set[int] = set()  # seen, and asked for again later (or now)
    counts = {"age": [0] * 10, "uses": [0] * 10}
    for i, root in enumerate(roots):
        if root in last:
            for name, value, values in (
                ("age", i - last[root], [i - last[x] for x in live]),
                ("uses", uses[root], [uses[x] for x in live]),
            ):
                values.sort()
                mid = (bisect.bisect_left(values, value) + bisect.bisect_right(values, value)) / 2
                counts[name][min(9, int(10 * mid / len(values)))] += 1
        last[root] = i
        uses[root] = uses.get(root, 0) + 1
        if final[root] > i:
            live.add(root)
        else:
            live.discard(root)
    n = sum(counts["age"])
    return {name: [c / n if n else 0.0 for c in row] for name, row in counts.items()}
