"""What the store tells others after a block enters or leaves a tier.

:class:`IndexEvent` s go to the pool's index (every block). :class:`EngineEvent` s, for
blocks whose writer named them in the engine's terms, go through an
:class:`EngineEventQueue` to the KV-event publisher (:mod:`kvpool_sidecar.kvevents`).
"""

from __future__ import annotations

import asyncio
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class IndexEvent:
    """``publish``: the block at ``key`` is now readable in ``tier``; else it left it."""

    publish: bool
    tier: str
    key: bytes


class IndexQueue:
    """Index events on their way to the index, in order; :attr:`ready` wakes the publisher.

    Unbounded here: the publisher drops the backlog and re-publishes the whole inventory
    when it grows past its limit (``membership.MAX_BACKLOG``).
    """

    def __init__(self) -> None:
        self.items: list[IndexEvent] = []
        self.ready = asyncio.Event()

    def __len__(self) -> int:
        return len(self.items)

    def put(self, event: IndexEvent) -> None:
        self.items.append(event)
        self.ready.set()

    def take(self) -> list[IndexEvent]:
        """Every event queued, oldest first; the queue is empty after."""
        items, self.items = self.items, []
        self.ready.clear()
        return items

    def put_back(self, events: Sequence[IndexEvent]) -> None:
        """Events that could not be sent go back in front of the newer ones."""
        self.items[:0] = events
        if self.items:
            self.ready.set()

    def clear(self) -> None:
        self.items.clear()
        self.ready.clear()


@dataclass(frozen=True, slots=True)
class EngineRef:
    """The engine's own identity for a block, as its writer stated it (protocol 3).

    Kept with the block so that KV events can announce, in the engine's terms, when it
    enters or leaves the pool. It is the writer's word: the pool never serves a block by
    it (blocks are found by their pool key), so a wrong one misleads only event consumers
    of the writer's own tenant.
    """

    hash: int | bytes
    parent: int | bytes | None
    #: A tuple, or (from a client) an ``array("I")``: 4 bytes a token.
    token_ids: Sequence[int]
    block_size: int
    lora_id: int | None = None
    lora_name: str | None = None
    extra_keys: tuple[str | int | bytes, ...] = ()


@dataclass(frozen=True, slots=True)
class EngineEvent:
    """A block with an engine identity entered (``stored``) or left ``tier``."""

    stored: bool
    tier: str
    tenant: str
    engine: EngineRef


class EngineEventQueue:
    """The bounded hand-off from the store to the KV-event publisher.

    :meth:`put` never blocks and never fails, so the store never waits on a subscriber:
    past ``capacity`` an event is dropped, counted (``kvevents_dropped`` in ``counts``) and
    :attr:`lost` is set, which tells the publisher to announce the whole state again (a
    consumer would otherwise never learn of the dropped event). ``tenants``: the tenants
    whose blocks are announced (``None``: all).
    """

    def __init__(self, capacity: int, counts: Counter[str], tenants: frozenset[str] | None = None) -> None:
        self.capacity = capacity
        self.counts = counts
        self.tenants = tenants
        self.items: deque[EngineEvent] = deque()
        self.lost = False
        #: Set whenever an event arrives or is lost: wakes the publisher.
        self.ready = asyncio.Event()

    def admits(self, tenant: str) -> bool:
        return self.tenants is None or tenant in self.tenants

    def put(self, stored: bool, tier: str, tenant: str, engine: EngineRef) -> None:
        if not self.admits(tenant):
            return
        if len(self.items) >= self.capacity:
            self.counts["kvevents_dropped"] += 1
            self.lost = True
        else:
            self.items.append(EngineEvent(stored, tier, tenant, engine))
        self.ready.set()
