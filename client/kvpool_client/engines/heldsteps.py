"""Saves held until the loads they may depend on are known to have gone well.

An engine step loads some blocks before its forward and saves the blocks it computed after
it. When a load fails (a timeout, a block evicted or damaged since the lookup), the engine
still runs the forward, over slots that hold whatever was there before, and vLLM recomputes
afterwards; but the blocks that step computed attend to the slots that did not load, in
every request of the step (they may share slots through the engine's own prefix cache) and
on every rank (attention's output is reduced across tensor-parallel ranks). Saved, they
would put wrong KV under right keys, for every other engine to load.

What the failed step computed also stays wrong in the engine's own prefix cache: see
:mod:`kvpool_client.engines.taint`, which reads the tables of the requests of the held steps
(:meth:`HeldSteps.tables`: under asynchronous scheduling a request may have finished or been
preempted before its step's outcome came back).

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
        #: held steps, in order: their loads and saves (to forget them if dropped), and the
        #: block tables of the requests they computed
        self._held: OrderedDict[int, tuple[list[LoadSpec], list[SaveSpec], list[Sequence[int]]]] = OrderedDict()
        #: held steps with loads whose outcome has not come back yet
        self._waiting: set[int] = set()
        #: the first step (of those held) whose loads failed
        self._bad_since: int | None = None
        self._warned = False

    def decide(self) -> dict[int, bool]:
        """The held steps whose fate is now known, in order: True to put their saves, False
        to drop them. Call before planning the next step (dropped saves are planned again)."""
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
            loads, saves, _ = self._held.pop(step)
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

    def begin(self, loads: Sequence[LoadSpec], saves: Sequence[SaveSpec],
              tables: Sequence[Sequence[int]] = ()) -> tuple[int, bool]:
        """A new step with ``loads`` and ``saves``, computing over ``tables``: its number, and
        whether its saves are held."""
        step = self._next
        self._next += 1
        hold = bool(loads) or bool(self._held)
        if hold:
            self._held[step] = (list(loads), list(saves), list(tables))
            if loads:
                self._waiting.add(step)
        return step, hold

    def reported(self, steps: Iterable[int], failed: Iterable[int]) -> None:
        """Every worker has said how the loads of ``steps`` went; those of ``failed`` did not."""
        for step in failed:
            if step in self._held:
                self._failed(step)
        self._waiting.difference_update(steps)

    def tables(self) -> Iterable[Sequence[int]]:
        """The block tables of the requests the held steps computed."""
        for _, _, tables in self._held.values():
            yield from tables

    def _failed(self, step: int) -> None:
        self._bad_since = step if self._bad_since is None else min(self._bad_since, step)


__all__ = ["PATIENCE", "HeldSteps"]
