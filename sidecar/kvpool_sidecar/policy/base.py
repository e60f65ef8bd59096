"""What every policy sees and answers: a block's metadata (:class:`BlockMeta`), its writer's
hints (:class:`Hints`), and the interface every policy implements (:class:`EvictionPolicy`;
see :mod:`kvpool_sidecar.policy`)."""

from __future__ import annotations

from collections.abc import Collection, Iterator
from dataclasses import dataclass
from typing import Protocol, runtime_checkable


@dataclass(frozen=True, slots=True)
class Hints:
    """What the writer said about the request that produced a block (all optional)."""

    #: The request's prompt length in blocks; -1 when not given.
    prompt_blocks: int = -1
    #: The conversation (or agent run) the request belongs to.
    session: str | None = None
    #: A class chosen by the engine or router ("system", "document", "turn", ...).
    label: str | None = None


@dataclass(slots=True, eq=False)
class BlockMeta:
    """What a policy may know about a block."""

    key: bytes
    size: int
    tenant: str = "default"
    priority: int = 0
    #: Position in its prefix chain (0 = first block); -1 when unknown.
    depth: int = -1
    parent: bytes | None = None
    hits: int = 0
    #: The writer's hints, when it gave any (never part of the key).
    hints: Hints | None = None


class EvictionPolicy(Protocol):
    """The interface every policy implements."""

    name: str

    def admit(self, tier: str, meta: BlockMeta) -> bool:
        """Whether a new block is worth a place in ``tier`` at all."""

    def inserted(self, tier: str, meta: BlockMeta) -> None:
        """``meta`` became resident in ``tier``."""

    def accessed(self, tier: str, meta: BlockMeta, *, again: bool = False) -> None:
        """``meta`` was read from ``tier`` (a hit); ``again``: the same read, told for
        another tier's copy (a GPU-tier copy's, after the DRAM copy's that was read): its
        place in that tier's order moves, but it is not another read."""

    def bypassed(self, tier: str, meta: BlockMeta) -> None:
        """A request wrote ``meta`` again while ``tier`` holds it: it came after a block the
        request missed, so the request could not use it (no hit)."""

    def removed(self, tier: str, meta: BlockMeta, *, evicted: bool = True) -> None:
        """``meta`` left ``tier``: evicted or demoted, or (``evicted`` False) lost: found
        corrupt or unreadable, which says nothing about its worth."""

    def skipped(self, tier: str, meta: BlockMeta) -> None:
        """The store passed ``meta`` over while it looked for a victim in ``tier`` (a client
        pinned it): it goes after every block that may be evicted, without counting as an
        access, so that the next search does not walk past it again."""

    def restored(self, tier: str, meta: BlockMeta) -> None:
        """``meta``, skipped before, may be evicted again (its last pin went): it takes back
        the place it would have had."""

    def victims(self, tier: str, tenant: str | None = None) -> Iterator[BlockMeta]:
        """Resident blocks of ``tier`` (of ``tenant`` only, if given), first to go first: a
        tenant's, in the tier's order for a tenant without a quota, in an order of their own
        for one with a quota (:meth:`bounded`)."""

    def sized(self, capacity: int) -> None:
        """The tiers this policy orders can hold ``capacity`` bytes together (the store says
        so once, before its first block); a policy may size what it keeps by it."""

    def bounded(self, tenants: frozenset[str]) -> None:
        """A quota bounds the room of ``tenants`` (the store says so once, before its first
        block): what a policy learns for all tenants together must not follow their traffic,
        which its quota, not the policy, keeps within a share of the tier (a tenant of 16
        pages re-putting what its own quota evicted had turned the node's scan resistance
        against every other tenant)."""


@runtime_checkable
class ShadowPolicy(EvictionPolicy, Protocol):
    """A policy that can run a duel's shadow cache (:mod:`kvpool_sidecar.duel`): it says what
    it holds, so that the shadow keeps no table of its own beside the policy's."""

    def resident(self, tier: str, key: bytes) -> BlockMeta | None:
        """The block of ``key`` resident in ``tier`` (as it was last inserted), or None."""

    def resident_keys(self, tier: str) -> Collection[bytes]:
        """The keys of the blocks resident in ``tier``: a view where it can be (a shadow asks
        how many on every eviction; ``LRUPolicy``, which no policy here runs as a shadow,
        builds a list)."""
