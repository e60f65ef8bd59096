"""Saves held until the loads they may depend on are known to have gone well.

An engine step loads some blocks before its forward and saves the blocks it computed after
it. When a load fails (a timeout, a block evicted or damaged since the lookup), the engine
still runs the forward, over slots that hold whatever was there before, and vLLM recomputes
afterwards; but the blocks that step computed attend to the slots that did not load, in
every request of the step (they may share slots through the engine's own prefix cache) and
on every rank (attention's output is reduced across tensor-parallel ranks). Saved, they
would put wrong KV under right keys, for every other engine to load.

A block whose load failed also stays in the engine's own prefix cache (vLLM evicts it only
under its other failure policy), holding whatever bytes were there, until a forward writes
it again: until then, a request that reads it (a local prefix hit) computes wrong KV. So do
the blocks the failed request computed after it, until vLLM has recomputed them (a chunk a
step, for a long prompt). Those blocks are tainted (:meth:`HeldSteps.taint`) until a step
computes them again (:meth:`HeldSteps.computed`). A request that computes over a tainted
block (:meth:`HeldSteps.poisoned`) computes wrong KV that vLLM never computes again (it is
not the request that failed) and keeps in its prefix cache: its blocks are tainted in turn,
and no save reaches a tainted block (:meth:`HeldSteps.clean_run`).

So the workers hold the saves of a step with loads, and of every step after it, until the
scheduler has heard from every worker how that step's loads went (:meth:`HeldSteps.reported`,
from the workers' per-step metadata); the next step's metadata then tells them to put or
drop each held step (:meth:`HeldSteps.decide`). A failed step, and every held step after
it, is dropped, and the planner forgets those saves and loads (:meth:`PrefixPlanner.unsaved`)
so the blocks are saved once the engine has computed them again. An outcome that never comes
(``patience`` steps) counts as a failure.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from kvpool_client.engines.prefix import LoadSpec, PrefixPlanner, SaveSpec

logger = logging.getLogger(__name__)

#: Steps a held step waits for its outcome before it counts as failed.
PATIENCE = 64


class HeldSteps:
    """The scheduler's side: which steps' saves the workers hold, and their outcomes."""

    def __init__(self, planner: PrefixPlanner, *, patience: int = PATIENCE) -> None:
        self._planner = planner
        self._patience = patience
        self._next = 0
        #: held steps, in order: their loads and saves (to forget them if dropped)
        self._held: OrderedDict[int, tuple[list[LoadSpec], list[SaveSpec]]] = OrderedDict()
        #: held steps with loads whose outcome has not come back yet
        self._waiting: set[int] = set()
        #: the first step (of those held) whose loads failed
        self._bad_since: int | None = None
        self._warned = False
        #: engine blocks whose load failed and that no forward has computed since
        self._tainted: set[int] = set()
        #: engine blocks the step planned last computes (no longer tainted once it ran)
        self._rewritten: set[int] = set()

    def decide(self) -> dict[int, bool]:
        """The held steps whose fate is now known, in order: True to put their saves, False
        to drop them. Call before planning the next step (dropped saves are planned again)."""
        self._tainted -= self._rewritten  # the step planned last has run: it wrote these again
        self._rewritten = set()
        out: dict[int, bool] = {}
        for step in list(self._held):
            if step in self._waiting:
                if self._next - step <= self._patience:
                    break  # this one and all after it wait
                self._waiting.discard(step)
                self._failed(step)
                if not self._warned:
                    self._warned = True
                    logger.warning("kvpool: the outcome of step %d's loads never came back; its saves and those "
                                   "after it are dropped", step)
            loads, saves = self._held.pop(step)
            ok = self._bad_since is None or step < self._bad_since
            if not ok:
                for save in saves:
                    self._planner.unsaved(save.req_id, save.start, save.hashes)
                for load in loads:
                    self._planner.unsaved(load.req_id, load.start)
            out[step] = ok
        if not self._held:
            self._bad_since = None
        return out

    def begin(self, loads: Sequence[LoadSpec], saves: Sequence[SaveSpec]) -> tuple[int, bool]:
        """A new step with ``loads`` and ``saves``: its number, and whether its saves are held."""
        step = self._next
        self._next += 1
        hold = bool(loads) or bool(self._held)
        if hold:
            self._held[step] = (list(loads), list(saves))
            if loads:
                self._waiting.add(step)
        return step, hold

    def reported(self, steps: Iterable[int], failed: Iterable[int]) -> None:
        """Every worker has said how the loads of ``steps`` went; those of ``failed`` did not."""
        for step in failed:
            if step in self._held:
                self._failed(step)
        self._waiting.difference_update(steps)

    def taint(self, block_ids: Iterable[int]) -> None:
        """Engine blocks whose load failed (vLLM's ``invalid_block_ids``): wrong bytes until
        a forward computes them again (a step that wrote them before they were found wrong does
        not count)."""
        ids = set(block_ids)
        self._tainted |= ids
        self._rewritten -= ids

    def poisoned(self, read: Iterable[int]) -> bool:
        """Whether blocks computed over ``read`` (the engine blocks before them) may be wrong."""
        return bool(self._tainted) and any(b in self._tainted for b in read)

    def clean_run(self, block_ids: Sequence[int]) -> int:
        """How many of ``block_ids`` come before the first tainted one that the step being
        planned does not compute again."""
        if self._tainted:
            for i, b in enumerate(block_ids):
                if b in self._tainted and b not in self._rewritten:
                    return i
        return len(block_ids)

    def computed(self, written: Iterable[int]) -> None:
        """The step being planned computes ``written``: no longer tainted once it has run."""
        self._rewritten.update(written)

    def _failed(self, step: int) -> None:
        self._bad_since = step if self._bad_since is None else min(self._bad_since, step)


__all__ = ["PATIENCE", "HeldSteps"]
