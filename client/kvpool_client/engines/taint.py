"""Engine blocks that may hold wrong KV, and which of a step's saves may go to the pool.

A block whose load failed stays in vLLM's own prefix cache (under its ``recompute`` policy),
holding whatever bytes were there, until a forward writes it again; so do the blocks the
failed step computed after it, until vLLM has recomputed them (a chunk a step, for a long
prompt). Those blocks are *tainted* (:meth:`Taint.taint`, with :func:`blocks_from` the blocks
after a failed one in every request's table). A request that computes over a tainted block
(a local prefix hit) computes wrong KV that vLLM never computes again (it is not the request
that failed) and keeps in its prefix cache: what it writes is tainted in turn, and so is all
it computes later, which reads it. A save never reaches a tainted block
(:meth:`Taint.clean_run`).

A block is clean again only once one clean computation has written it whole, from its first
token to its last (:meth:`Taint.judge`): a step that ends part way through a block leaves it
tainted, half old. A request's own *clean run* (the tokens it has computed cleanly, step
after step, up to now) is what it reads of itself, so a long prompt recomputed a chunk a step
is not judged by the half-written block it is finishing. Within one step, a request may read
a block another request of the same step rewrites whole and clean: vLLM writes every token's
KV of a layer before any attention of that layer reads the cache, as its own recovery from
failed loads assumes (an execution that splits a step's batch into micro-batches run in turn
would not, and is not handled). A block vLLM gives a request afresh is loaded or computed
before anything reads it: its taint goes (:meth:`Taint.fresh`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Computed:
    """What one request computes in a step: tokens ``[start, done)`` over its ``table``."""

    req_id: str
    table: Sequence[int]
    start: int
    done: int


def blocks_from(tables: Iterable[Sequence[int]], failed: set[int]) -> set[int]:
    """The blocks of every table from its first one in ``failed`` on."""
    out: set[int] = set()
    for table in tables:
        for i, b in enumerate(table):
            if b in failed:
                out.update(table[i:])
                break
    return out


class Taint:
    """The scheduler's record of the engine blocks that may hold wrong KV."""

    def __init__(self, block_tokens: int) -> None:
        self.block_tokens = block_tokens
        self._tainted: set[int] = set()
        #: blocks the step planned last writes whole and clean: no longer tainted once it ran
        self._rewritten: set[int] = set()
        #: per request, the first token of its clean run (computed cleanly from there to now)
        self._clean_from: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._tainted)

    def step_ran(self) -> None:
        """The step planned last has run (call before planning the next one)."""
        self._tainted -= self._rewritten
        self._rewritten = set()

    def taint(self, block_ids: Iterable[int]) -> None:
        """``block_ids`` may hold wrong KV (a failed load, or computed after or over one): until
        a clean computation writes them whole again; a step that wrote them before they were
        found wrong does not count."""
        ids = set(block_ids)
        self._tainted |= ids
        self._rewritten -= ids

    def restart(self, req_id: str) -> None:
        """The request starts afresh (new, resumed after a preemption, or finished)."""
        self._clean_from.pop(req_id, None)

    def fresh(self, block_ids: Iterable[int]) -> None:
        """``block_ids`` were just given to a request that will load or compute them before
        anything reads them (vLLM took them from its free blocks): whatever they held before
        is gone. (A taint that stayed on a reused block had poisoned every request that then
        loaded into it, and what it computed, for good.)"""
        self._tainted.difference_update(block_ids)

    def judge(self, step: Sequence[Computed]) -> set[str]:
        """The requests of the step being planned that compute over a tainted block (what
        they write is tainted from now on), and what the others rewrite whole and clean."""
        bs = self.block_tokens
        runs: dict[str, int | None] = {}
        for c in step:
            run = self._clean_from.get(c.req_id)
            if run is not None and run > c.start:  # it went back (a recompute): a new run
                run = None
            runs[c.req_id] = run
        if not self._tainted:  # (the usual step: nothing to read wrong, nothing to clean)
            for c in step:
                run = runs[c.req_id]
                self._clean_from[c.req_id] = c.start if run is None else run
            return set()
        reads: dict[str, Sequence[int]] = {}
        for c in step:
            run = runs[c.req_id]
            own = -(-run // bs) if run is not None else len(c.table)  # its own clean run's blocks
            reads[c.req_id] = c.table[: min(-(-c.start // bs), own)]
        now: set[int] = set()  # blocks this step rewrites whole and clean
        clean: set[str] = set()
        grew = True
        while grew:  # (a request may read what another of the step rewrites)
            grew = False
            for c in step:
                if c.req_id in clean:
                    continue
                read = reads[c.req_id]
                if not self._tainted.isdisjoint(read) and any(b in self._tainted and b not in now for b in read):
                    continue
                clean.add(c.req_id)
                grew = True
                run = runs[c.req_id]
                start = c.start if run is None else run
                runs[c.req_id] = start
                now.update(c.table[max(-(-start // bs), c.start // bs) : min(c.done // bs, len(c.table))])
        poisoned: set[str] = set()
        for c in step:
            run = runs[c.req_id]
            if c.req_id in clean and run is not None:
                self._clean_from[c.req_id] = run
                continue
            poisoned.add(c.req_id)
            self._clean_from.pop(c.req_id, None)
            self._tainted.update(c.table[c.start // bs : -(-c.done // bs)])
        self._rewritten |= now
        return poisoned

    def clean_run(self, block_ids: Sequence[int]) -> int:
        """How many of ``block_ids`` come before the first tainted one that the step being
        planned does not rewrite whole and clean."""
        if self._tainted:
            for i, b in enumerate(block_ids):
                if b in self._tainted and b not in self._rewritten:
                    return i
        return len(block_ids)


__all__ = ["Computed", "Taint", "blocks_from"]
