"""Calls in threads on the tiers' bytes, which the store waits for before its tiers close.

A copy between tiers runs in a thread where either tier blocks
(:class:`~kvpool_sidecar.store.mover.Mover`), and so does the release of a copy in a tier
whose releases block (a disk's holes and files: :class:`~kvpool_sidecar.store.ledger.Ledger`).
A stopping sidecar cancels the tasks that asked for them, but a thread cannot be cancelled:
:meth:`Threads.settle` waits for every call :meth:`Threads.in_thread` started, for the copies
that run to their end whoever waited for them (:meth:`Threads.finishing`), and for the
releases still to run (:meth:`Threads.free_soon`), so that no tier closes under a thread
that still reads or writes it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar

from kvpool_sidecar.errors import TierIOError
from kvpool_sidecar.ratelog import warn_once

logger = logging.getLogger(__name__)

T = TypeVar("T")


def _thread_done(fut: asyncio.Future[Any]) -> None:
    """Take the outcome of a call in a thread whose caller was cancelled, so that its error
    is not reported as never retrieved (the caller, when there is one, gets it too)."""
    if not fut.cancelled():
        fut.exception()


def _finished(task: asyncio.Future[Any]) -> None:
    """Log the error of a copy that runs to its end whoever waits for it (:meth:`Threads.finishing`)."""
    if not task.cancelled() and task.exception() is not None:
        warn_once(logger, "copy-task", "a copy between tiers failed: %r", task.exception())


def _free_all(frees: Sequence[tuple[str, Callable[[], None]]]) -> None:
    """Run each ``(tier name, release)`` (in a thread); one that fails leaves its bytes
    behind, not the others."""
    for tier, free in frees:
        try:
            free()
        except (TierIOError, OSError) as err:  # forgotten by the tier; only its bytes linger
            logger.warning("could not free a block's room in the %s tier: %s", tier, err)
        except Exception:  # noqa: BLE001 - task guard: the other releases of the batch still run
            logger.exception("freeing a block's room in the %s tier failed", tier)


class Threads:
    """The store's calls in threads, and its copies that run to their end (see the module docstring)."""

    def __init__(self) -> None:
        #: Calls running in threads on the tiers' bytes (:meth:`in_thread`).
        self._threads: set[asyncio.Future[Any]] = set()
        #: Releases of blocks that left every tier, still to run in a thread (:meth:`free_soon`).
        self._frees: list[tuple[str, Callable[[], None]]] = []
        #: Copies that run to their end whoever waited for them (:meth:`finishing`).
        self._finishing: set[asyncio.Future[Any]] = set()

    def _start(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        fut = asyncio.ensure_future(asyncio.to_thread(fn, *args))
        self._threads.add(fut)
        fut.add_done_callback(_thread_done)
        fut.add_done_callback(self._threads.discard)
        return fut

    async def in_thread(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in a thread, which :meth:`settle` waits for even when its caller is
        cancelled (a stopping sidecar cancels the write-ahead): the tiers must not close under
        a copy that still reads or writes them."""
        return await asyncio.shield(self._start(fn, *args))

    def finishing(self, coro: Coroutine[Any, Any, T]) -> asyncio.Future[T]:
        """``coro`` in a task of its own, which :meth:`settle` waits for: a copy whose bytes
        were written must also land (be placed, or forgotten by the tier where its block was
        removed meanwhile) when the put that waited for it is cancelled (its client went away,
        the sidecar stops). Await it shielded; its error is logged here too (its caller may be
        gone)."""
        task = asyncio.ensure_future(coro)
        self._finishing.add(task)
        task.add_done_callback(_finished)
        task.add_done_callback(self._finishing.discard)
        return task

    async def free(self, frees: Sequence[tuple[str, Callable[[], None]]]) -> None:
        """Run each ``(tier name, release)`` of ``frees`` in one hop to a thread (:meth:`in_thread`)."""
        await self.in_thread(_free_all, frees)

    def free_soon(self, tier: str, free: Callable[[], None]) -> None:
        """Run ``free`` (a release in tier ``tier``) in a thread that the releases of one turn of
        the event loop share (:meth:`~kvpool_sidecar.store.ledger.Ledger.release_soon`)."""
        self._frees.append((tier, free))
        if len(self._frees) == 1:
            try:
                asyncio.get_running_loop().call_soon(self._flush_frees)
            except RuntimeError:  # no event loop (a store driven without one): here
                self._flush_frees()

    def _flush_frees(self) -> None:
        frees, self._frees = self._frees, []
        if not frees:
            return
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            _free_all(frees)
            return
        self._start(_free_all, frees)

    async def settle(self) -> None:
        """Wait for every call :meth:`in_thread` started, the copies :meth:`finishing` runs,
        and the releases still to run."""
        while self._threads or self._frees or self._finishing:
            self._flush_frees()
            await asyncio.wait(self._threads | self._finishing)
